"""A real Lightning DDP job on CPU (gloo) with MemoryLogCallback, for tests/test_lightning.py.

Run as ``python -m tests.lightning_job SPEC.json``, as a user runs a training script:
Lightning's own launcher (strategy="ddp", accelerator="cpu") starts the other ranks by
running this same command again. Every process runs the spec's fits one after another,
in the same process group (a fit after the first finds the processes already launched).

Each rank first holds a ballast of host memory of a known, rank-dependent size (touched:
resident; with ``cuda_ballast_mb``, device memory too). Around MemoryLogCallback, two
probe callbacks record, per hook and rank: the collectives issued in between
(tests/collectives.py's pass-through counter), the rank's own peaks just before and just
after (host VmHWM, and the CUDA allocator's when in use, read as the callback reads them), the
step Lightning logs that batch at, and the batch's loss. Each rank writes them to
``<out>/<fit>/records/rank<r>.json``. A fit may set up megatron-core's parallel_state
(``pp``), standing in for NeMo 2's MegatronStrategy, which needs CUDA.

The test side, ``run_job(spec, out)``, starts it and returns each fit's records (``Fit``).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from nemo_memlog.rank import memory
from nemo_memlog.testing.collectives import count_collectives

MB = 2**20
HOOKS = ("on_train_start", "on_train_batch_end", "on_train_end")


def peaks_gb(when: str) -> dict:
    """This rank's peaks as MemoryLogCallback reads them, named ``peak_<when>`` (the host's)
    and ``cuda_peak_<when>`` (the CUDA allocator's peak_allocated_gb, when CUDA is in use)."""
    report = memory.report_memory()
    peaks = {f"peak_{when}": report["peak_host_rss_gb"]}
    if "peak_allocated_gb" in report:
        peaks[f"cuda_peak_{when}"] = report["peak_allocated_gb"]
    return peaks


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("LOCAL_RANK", 0))  # one node: the launcher sets it on the ranks it starts
    ballast = np.ones(spec["ballast_mb"][rank] * MB // 8)  # touched: resident, not just reserved
    if spec.get("cuda_ballast_mb"):  # device memory this rank holds through every fit
        device_ballast = torch.ones(spec["cuda_ballast_mb"] * MB // 4, device="cuda")  # noqa: F841
    children = []  # the ranks the first fit's launcher started (on rank 0)
    for fit in spec["fits"]:
        start = time.monotonic()
        children += getattr(run_fit(spec, fit, rank), "procs", [])
        if rank == 0:
            print(f"lightning_job: fit {fit['name']!r} took {time.monotonic() - start:.1f} s", file=sys.stderr)
    del ballast
    for child in children:  # exit after them, so whoever started this job waits for every rank
        child.wait()


def run_fit(spec: dict, fit: dict, rank: int):
    """One fit; returns the strategy's launcher (which holds the processes it started)."""
    pl = importlib.import_module(fit.get("package", "lightning.pytorch"))
    from nemo_memlog.lightning import MemoryLogCallback

    out = Path(spec["out"]) / fit["name"]
    probe = Probe(pl)
    settings = dict(fit.get("callback", {}))
    if fit.get("records"):  # the flight records in the fit's folder (else ./memory_records)
        settings["memory_record_dir"] = str(out / "memory_records")
    callbacks = [probe.before, MemoryLogCallback(**settings), probe.after]
    if fit.get("pp"):
        callbacks.insert(0, MegatronGroups(pl, fit["pp"]))
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator=spec.get("accelerator", "cpu"),
        strategy=spec.get("strategy", "ddp"),
        devices=spec["world"],
        max_steps=fit.get("max_steps", 8),
        accumulate_grad_batches=fit.get("accumulate", 1),
        log_every_n_steps=fit.get("log_every_n_steps", 2),
        logger=make_loggers(pl, fit["loggers"], out),
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    trainer.fit(make_module(pl))
    gc.collect()  # whatever the garbage collector frees now, a clean end must have its record marker
    if trainer.global_rank == 0:
        for logger in trainer.loggers:
            if type(logger).__name__ == "CometLogger":
                logger.experiment.end()  # Lightning only flushes it; end() writes the offline archive
            elif type(logger).__name__ == "WandbLogger":
                logger.experiment.finish()  # else the next fit's WandbLogger reuses this run
    records = out / "records"
    records.mkdir(parents=True, exist_ok=True)
    (records / f"rank{trainer.global_rank}.json").write_text(
        json.dumps({"rank": trainer.global_rank, "events": probe.events})
    )
    trainer.strategy.barrier()  # every rank's record is written before the next fit or the exit
    return trainer.strategy.launcher


def make_loggers(pl, names: list[str], out: Path) -> list:
    """Every rank builds the loggers (only rank 0's write). From the second fit on, all ranks
    run this at once: rank 0 goes first, so that only one process creates the SQLite store."""
    import torch.distributed as dist

    ordered = dist.is_initialized()
    if ordered and dist.get_rank() != 0:
        dist.barrier()
    made = _loggers(pl, names, out)
    if ordered and dist.get_rank() == 0:
        dist.barrier()
    return made


def _loggers(pl, names: list[str], out: Path) -> list:
    loggers = importlib.import_module(f"{pl.__name__}.loggers")
    made = []
    for name in names:
        if name == "tensorboard":
            made.append(loggers.TensorBoardLogger(str(out), name="tb"))
        elif name == "csv":
            made.append(loggers.CSVLogger(str(out), name="csv"))
        elif name == "mlflow":
            made.append(
                loggers.MLFlowLogger(experiment_name="memlog-lightning", tracking_uri=f"sqlite:///{out}/mlflow.db")
            )
        elif name == "wandb":
            made.append(loggers.WandbLogger(project="memlog-lightning", save_dir=str(out), offline=True))
        elif name == "comet":
            # CometLogger(online=False) disables the experiment; COMET_START_ONLINE=false
            # (set by the test) gets comet_ml's offline experiment, which archives at end().
            (out / "comet").mkdir(parents=True, exist_ok=True)
            made.append(loggers.CometLogger(project="memlog-lightning", offline_directory=str(out / "comet")))
    return made


def make_module(pl):
    class TinyModel(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self):
            generator = torch.Generator().manual_seed(0)
            x = torch.randn(256, 8, generator=generator)
            dataset = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
            return torch.utils.data.DataLoader(dataset, batch_size=4)

    return TinyModel()


class Probe:
    """Two callbacks that bracket MemoryLogCallback in the callback list: ``before`` starts
    counting collectives and reads the host peak, ``after`` stops and reads it again."""

    def __init__(self, pl):
        self.events: list[dict] = []
        self._counting = None
        side = _side_class(pl)
        self.before, self.after = side(self, True), side(self, False)

    def hook(self, opening: bool, name: str, trainer, outputs=None) -> None:
        if opening:
            self._counting = count_collectives()
            self._calls = self._counting.__enter__()
            self._event = {
                "hook": name,
                "step": trainer.fit_loop.epoch_loop._batches_that_stepped,
                "global_step": trainer.global_step,
                **peaks_gb("before"),
            }
            if outputs is not None:
                self._event["loss"] = float(outputs["loss"])
            return
        self._counting.__exit__(None, None, None)
        self._event.update(peaks_gb("after"), collectives=list(self._calls))
        self.events.append(self._event)


def _side_class(pl):
    class Side(pl.Callback):
        def __init__(self, probe, opening):
            self.probe, self.opening = probe, opening

        @property
        def state_key(self):
            return f"Probe{'Before' if self.opening else 'After'}"

        def on_train_start(self, trainer, pl_module):
            self.probe.hook(self.opening, "on_train_start", trainer)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.probe.hook(self.opening, "on_train_batch_end", trainer, outputs)

        def on_train_end(self, trainer, pl_module):
            self.probe.hook(self.opening, "on_train_end", trainer)

    return Side


def MegatronGroups(pl, pp: int):
    """A callback that builds megatron-core's groups once Lightning has the process group
    (setup), as NeMo 2's MegatronStrategy does, and destroys them at teardown."""

    class Groups(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            from megatron.core import parallel_state

            parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)

        def teardown(self, trainer, pl_module, stage):
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()

    return Groups()


# --- the test side: start the job as a user starts a training script, read its records -----------

JOB_TIMEOUT_S = 900  # a loaded 2-core machine: 4 processes importing torch, Lightning and 3 backends' clients
REPO = Path(__file__).resolve().parent.parent


class Fit:
    """One fit's output directory and every rank's probe events."""

    def __init__(self, root: Path, world: int, loggers=()):
        self.root, self.world, self.loggers = root, world, list(loggers)
        self.ranks = [json.loads((root / "records" / f"rank{r}.json").read_text())["events"] for r in range(world)]

    def batch_ends(self, rank: int) -> list[dict]:
        return [e for e in self.ranks[rank] if e["hook"] == "on_train_batch_end"]

    def at(self, rank: int, step: int) -> dict:
        """The batch end of ``step`` that stepped the optimizer (with gradient accumulation,
        the last of its window): after it, ``global_step`` is ``step + 1``."""
        (event,) = [e for e in self.batch_ends(rank) if e["step"] == step and e["global_step"] == step + 1]
        return event

    def within_peak(self, rank: int, step: int, value: float) -> bool:
        """``value`` is the host peak ``rank`` had while MemoryLogCallback ran at ``step``."""
        event = self.at(rank, step)
        return event["peak_before"] <= value <= event["peak_after"]


class Job:
    """A started job: ``result()`` waits for it and returns each fit's Fit by name."""

    def __init__(self, spec: dict, out: Path):
        self.world, self.fits, self.out = spec["world"], spec["fits"], out
        spec = {**spec, "out": str(out)}
        spec_path = out / "spec.json"
        out.mkdir(parents=True, exist_ok=True)
        spec_path.write_text(json.dumps(spec))
        env = {
            **os.environ,
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "WANDB_MODE": "offline",
            "COMET_START_ONLINE": "false",
            "OMP_NUM_THREADS": "1",
            "WANDB_DIR": str(out),
            "WANDB_CACHE_DIR": str(out / "wandb_cache"),
            "WANDB_CONFIG_DIR": str(out / "wandb_config"),
        }
        self.start = time.monotonic()
        # Files, not pipes: a job nobody reads while another is awaited must not block on a full pipe.
        with open(out / "stdout.log", "w") as stdout, open(out / "stderr.log", "w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.lightning_job", str(spec_path)],
                cwd=out,
                env=env,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )

    def result(self) -> dict[str, Fit]:
        try:
            self.proc.wait(timeout=max(1.0, JOB_TIMEOUT_S - (time.monotonic() - self.start)))
        finally:
            self.stop()
        stdout, stderr = ((self.out / name).read_text(errors="replace") for name in ("stdout.log", "stderr.log"))
        assert self.proc.returncode == 0, f"world {self.world} job failed:\n{stdout[-5000:]}\n{stderr[-10000:]}"
        fits = [line for line in stderr.splitlines() if line.startswith("lightning_job:")]
        print(f"\nLightning job, world {self.world}: {time.monotonic() - self.start:.1f} s in all; {fits}")
        return {fit["name"]: Fit(self.out / fit["name"], self.world, fit["loggers"]) for fit in self.fits}

    def stop(self) -> None:
        """Kill the job's every process (its ranks too), if it still runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def run_job(spec: dict, out: Path) -> dict[str, Fit]:
    """Run tests/lightning_job.py on ``spec`` (its ``out`` set to ``out``); each fit's Fit by name."""
    return Job(spec, out).result()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
