"""Writer isolation with real failures: a broken backend never reaches training or the others,
warns once per kind, and a backend that comes back gets every buffered step.

Each runs in the writer process (the default), and the cheap ones in thread mode too: the
same backends, in the training process."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request

import pytest

from nemo_memlog import LoggerConfig, build_writers
from nemo_memlog.testing.cluster import free_port
from nemo_memlog.testing.notices import said
from nemo_memlog.testing.wait import returns_within, wait_for


def _messages(caught, backend):
    return [w for w in caught if f"nemo_memlog: {backend} backend" in w]


@pytest.fixture
def fresh_wandb():
    """wandb caches its mode process-wide at first use: start and leave with a clean slate."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


@pytest.mark.parametrize("writer_mode", [pytest.param("process", marks=pytest.mark.processes), "thread"])
def test_failing_backends_do_not_stop_the_others(tmp_path, monkeypatch, fresh_wandb, writer_mode):
    # W&B online with no API key: wandb.init raises for real (no network needed to fail).
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("HOME", str(tmp_path))
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    db = tmp_path / "mlflow.db"
    cfg = LoggerConfig(
        log_memory_to_tensorboard=True,
        tensorboard_dir=str(blocker / "tb"),  # cannot be created: its parent is a file
        wandb_project="p",
        wandb_save_dir=str(tmp_path),
        mlflow_experiment="isolation",
        mlflow_run_name="r",
        mlflow_tracking_uri=f"sqlite:///{db}",
        writer_mode=writer_mode,
    )
    with said(warned=False) as caught:
        fanout = build_writers(cfg)

        def hand_off_5_steps() -> None:
            for step in range(1, 6):
                fanout.log({"memory/peak_host_rss_gb": 1.0 + step, "loss": 0.5}, step)  # never raises

        # The training thread must not wait on a failing backend: W&B and TensorBoard never write a
        # step here, so a log that waited for its step to be written would not return by this deadline.
        returns_within(hand_off_5_steps, 60, "five steps handed over")
        # MLflow's first open is slow on a loaded 2-core box
        wait_for(lambda: fanout.stats()["mlflow"]["written"] >= 5, 120, "MLflow's five steps", interval_s=0.2)
        assert fanout.flush(timeout_s=2) is False  # two backends could not drain
        stats = fanout.stats()
        fanout.close(timeout_s=2)
    assert stats["mlflow"]["written"] == 5 and stats["mlflow"]["pending"] == 0, (
        stats,
        [w for w in caught],
    )
    # W&B without a key: a failure a retry may cure (a key set, the network back): every step kept
    assert stats["wandb"]["written"] == 0 and stats["wandb"]["pending"] == 5
    assert len([m for m in _messages(caught, "wandb") if "open failed" in m]) == 1, "warned once per kind"
    # TensorBoard's folder cannot be made (its parent is a file): no retry cures that; it stops, said once
    assert stats["tensorboard"]["written"] == 0 and stats["tensorboard"]["pending"] == 0
    assert stats["tensorboard"]["dropped"] == 5
    stopped = [m for m in _messages(caught, "tensorboard") if "this backend stops" in m]
    assert len(stopped) == 1 and "tensorboard_dir=" in stopped[0], stopped
    assert any("tensorboard did not store 5 of the 5 logged steps" in w for w in caught)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name("isolation").experiment_id])
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "memory/peak_host_rss_gb")]
    assert sorted(steps) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("writer_mode", [pytest.param("process", marks=pytest.mark.processes), "thread"])
def test_full_buffer_drops_oldest_and_counts(tmp_path, monkeypatch, fresh_wandb, writer_mode):
    # W&B online with no API key: it fails for real, and a retry might cure it, so steps are kept
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = LoggerConfig(wandb_project="p", wandb_save_dir=str(tmp_path), writer_buffer_steps=3, writer_mode=writer_mode)
    with said(warned=False) as caught:
        fanout = build_writers(cfg)
        for step in range(10):
            fanout.log({"x": step}, step)
        stats = fanout.stats()["wandb"]
        fanout.close(timeout_s=1)
    assert stats["pending"] == 3 and stats["dropped"] == 7
    assert len([m for m in _messages(caught, "wandb") if "buffer of 3 steps is full" in m]) == 1


class MlflowServer:
    """A real `mlflow server` on 127.0.0.1, in its own process group so it can be killed whole."""

    def __init__(self, db, port):
        self.db, self.port = db, port
        self.proc = None

    def start(self, timeout=240):  # a 2-core box under load needs over a minute
        mlflow = os.path.join(os.path.dirname(sys.executable), "mlflow")
        self.proc = subprocess.Popen(
            [
                mlflow,
                "server",
                "--backend-store-uri",
                f"sqlite:///{self.db}",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

        def healthy() -> bool:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return True
            except OSError:
                return False

        try:
            wait_for(healthy, timeout, "the mlflow server's health", proc=self.proc, interval_s=0.5)
        except AssertionError:
            self.stop()
            raise

    def stop(self):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)


class Outage:
    """A TCP proxy on 127.0.0.1 in front of a server's ``port``: ``stop()`` closes its port and cuts
    every connection (a client sees what a server that died gives: refused, reset), ``start()`` serves
    again on the same port. One server start for an outage and a return, not two."""

    def __init__(self, port: int):
        self.target, self.port = port, free_port()
        self.listener: socket.socket | None = None
        self.open: set[socket.socket] = set()
        self.lock = threading.Lock()

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                if listener.fileno() == -1:
                    return  # stopped
                continue
            with self.lock:
                self.open.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes its accept()
            listener.close()
        with self.lock:
            cut, self.open = self.open, set()
        for end in cut:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()


@pytest.mark.processes
def test_mlflow_server_gone_and_back_loses_nothing(tmp_path, monkeypatch):
    # Fail fast per attempt: our BufferedBackend does the retrying, with backoff, from its buffer.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    server = MlflowServer(tmp_path / "server.db", free_port())
    outage = Outage(server.port)  # the tracking server as the client reaches it
    uri = f"http://127.0.0.1:{outage.port}"
    cfg = LoggerConfig(mlflow_experiment="outage", mlflow_run_name="r", mlflow_tracking_uri=uri)
    server.start()
    outage.start()
    try:
        with said(warned=False) as caught:
            fanout = build_writers(cfg)
            for step in (1, 2, 3):
                fanout.log({"memory/peak_reserved_gb": float(step), "memory/alloc_retries": step}, step)
            assert fanout.flush(timeout_s=60)
            outage.stop()  # the tracking server is gone mid-run
            for step in (4, 5, 6):
                fanout.log({"memory/peak_reserved_gb": float(step), "memory/alloc_retries": step}, step)
            assert fanout.flush(timeout_s=3) is False  # nowhere to write: steps stay buffered
            during = fanout.stats()["mlflow"]
            outage.start()  # ... and comes back
            assert fanout.flush(timeout_s=90), fanout.stats()
            final = fanout.stats()["mlflow"]
            fanout.close()
        assert during["pending"] == 3 and during["failures"] >= 1
        assert final == {**final, "written": 6, "pending": 0, "dropped": 0}
        failing = [m for m in _messages(caught, "mlflow") if "log failed" in m]
        assert 1 <= len(failing) <= 2, f"one warning per kind of failure, not per attempt: {failing}"
        assert any("mlflow is writing again" in w for w in caught)

        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)
        (run,) = client.search_runs([client.get_experiment_by_name("outage").experiment_id])
        history = client.get_metric_history(run.info.run_id, "memory/peak_reserved_gb")
        assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(1, 7)]
    finally:
        outage.stop()
        server.stop()
