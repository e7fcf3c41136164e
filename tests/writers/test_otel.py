"""OpenTelemetry metrics backend: one real PP 2 job (tests/trainer.py under torchrun, the writer
process), its OTLP requests received over HTTP on 127.0.0.1 and decoded with opentelemetry-proto's
own types, its Prometheus exporter scraped by a real Prometheus server queried through its HTTP
API. The collector is down when the job starts and comes up once the backend has said so: every
step must still arrive, in order."""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import threading
import urllib.parse
import urllib.request

import pytest

from nemo_memlog.config import LoggerConfig, resolve
from nemo_memlog.testing import torchrun
from nemo_memlog.testing.cluster import free_port
from nemo_memlog.testing.wait import wait_for
from nemo_memlog.writers import base, build_writers, otel

pytest.importorskip("opentelemetry.sdk.metrics")
pytest.importorskip("opentelemetry.proto.collector.metrics.v1.metrics_service_pb2")

TRAINER = torchrun.ROOT / "tests" / "trainer.py"
STEPS = 8
SECRET = "OTLP-SECRET-TOKEN-4711"
SERIES = "memory.peak_host_rss"  # logged per stage on CPU (peak_*), in bytes


def test_names_units_and_stages():
    assert otel.instrument("memory/peak_reserved_gb") == ("memory.peak_reserved", "gauge", "By", 1e9, {})
    assert otel.instrument("memory/pp_stage_3/peak_reserved_gb") == (
        "memory.peak_reserved",
        "gauge",
        "By",
        1e9,
        {otel.STAGE_ATTRIBUTE: 3},
    )
    assert otel.instrument("memory/peak_stage/peak_reserved_gb")[:3] == (
        "memory.peak_stage.peak_reserved_gb",
        "gauge",
        "",
    )
    assert otel.instrument("memory/peak_reserved_pct")[:3] == ("memory.peak_reserved_percent", "gauge", "%")
    assert otel.instrument("memory/alloc_retries")[:3] == ("memory.alloc_retries", "counter", "")
    assert otel.instrument("memory/phase/checkpoint_save/seconds")[:3] == (
        "memory.phase.checkpoint_save.seconds",
        "gauge",
        "s",
    )
    assert otel.instrument("memory/weird key*(1)")[0] == "memory.weird_key__1_"
    assert otel.instrument("loss") is None  # the framework's own telemetry exports it


def test_switched_by_otel_metrics_only():
    assert otel.enabled(resolve(LoggerConfig(otel_metrics=True)))
    assert not otel.enabled(resolve(LoggerConfig()))
    assert "otel" in base.enabled_backends(resolve(LoggerConfig(otel_metrics=True)))
    with pytest.raises(ValueError, match="logger.otel_metrics must be true or false"):
        LoggerConfig(otel_metrics="yes")


def test_the_standard_variables_are_read_and_a_wrong_exporter_named():
    assert otel.exporter_names({}) == ["otlp"]
    assert otel.exporter_names({"OTEL_METRICS_EXPORTER": "otlp, prometheus"}) == ["otlp", "prometheus"]
    assert otel.exporter_names({"OTEL_METRICS_EXPORTER": "none"}) == []
    with pytest.raises(ValueError, match="OTEL_METRICS_EXPORTER='zipkin'"):
        otel.exporter_names({"OTEL_METRICS_EXPORTER": "zipkin"})


def test_a_wrong_variable_is_named_where_the_writers_are_built(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json'"):
        build_writers(LoggerConfig(otel_metrics=True))


def test_otlp_headers_are_secrets():
    environ = {"OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{SECRET},x-team=infra-one"}
    found = base.environment_secrets(["tensorboard", "otel"], environ)
    assert f"Bearer {SECRET}" in found and f"Bearer%20{SECRET}" in found and "infra-one" in found
    assert base.environment_secrets(["tensorboard"], environ) == []


class Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP collector on 127.0.0.1: each request's path, headers and body kept."""

    def __init__(self, port: int):
        self.requests: list[tuple[str, dict, bytes]] = []
        received = self.requests

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append((self.path, dict(self.headers), body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", port), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def start_prometheus(folder, target_port: int):
    """A Prometheus server on 127.0.0.1 scraping ``target_port`` every 500 ms; (process, its URL)."""
    web = free_port()
    config = folder / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 500ms, scrape_timeout: 400ms}\n"
        f"scrape_configs:\n  - job_name: memlog\n    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n"
    )
    process = subprocess.Popen(
        [
            shutil.which("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(folder / "prometheus.log", "wb"),  # noqa: SIM115 -- closed with the process
    )
    url = f"http://127.0.0.1:{web}"
    wait_for(lambda: _get(f"{url}/-/ready") is not None, 60, "Prometheus ready", proc=process)
    return process, url


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read()
    except OSError:
        return None


def prometheus_query(url: str, query: str) -> list[dict]:
    body = _get(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': query})}")
    return json.loads(body)["data"]["result"] if body else []


def _lines(stream, into: list[str]) -> None:
    for line in stream:
        into.append(line)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The PP 2 job, exporting to OTLP (down at first) and, where the binary is, to Prometheus."""
    root = tmp_path_factory.mktemp("otel")
    collector_port, exporter_port = free_port(), free_port()
    prometheus = shutil.which("prometheus")
    server = url = None
    if prometheus:
        server, url = start_prometheus(root, exporter_port)
    env = {
        "OTEL_METRICS_EXPORTER": "otlp,prometheus" if prometheus else "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector_port}",
        "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{SECRET}",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "1",  # a collector that is down fails an export in about a second
        "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
        "OTEL_EXPORTER_PROMETHEUS_PORT": str(exporter_port),
        "OTEL_SERVICE_NAME": "memlog-test",
        "OTEL_RESOURCE_ATTRIBUTES": "team=infra",
    }
    release = root / "release"
    args = (root / "run", "--backends", "otel", "--steps", STEPS, "--hold", release)
    out: list[str] = []
    err: list[str] = []
    proc = torchrun.start(TRAINER, *args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    receiver = None
    found = {"prometheus": {}, "writer": b""}
    try:
        for stream, into in ((proc.stdout, out), (proc.stderr, err)):
            threading.Thread(target=_lines, args=(stream, into), daemon=True).start()
        said = lambda: any("otel backend: log failed" in line for line in err)  # noqa: E731
        wait_for(
            said, 180, "the otel backend saying its collector is down", proc=proc, detail=lambda: "".join(err[-20:])
        )
        receiver = Receiver(collector_port)
        wait_for(lambda: any(line.startswith("{") for line in out), 180, "every step written", proc=proc)
        writer_pid = int(next(line.split()[3] for line in out if line.startswith("trainer ")))
        with open(f"/proc/{writer_pid}/environ", "rb") as environ, open(f"/proc/{writer_pid}/cmdline", "rb") as argv:
            found["writer"] = environ.read() + argv.read()
        if url:

            def every_stage():
                result = prometheus_query(url, "memory_peak_host_rss_bytes")
                ranks = {series["metric"].get("dl_pipeline_parallel_rank", "") for series in result}
                return result if {"", "0", "1"} <= ranks else None

            found["prometheus"] = {
                "series": wait_for(every_stage, 60, "Prometheus holding every stage's series"),
                "target_info": prometheus_query(url, "target_info"),
                "iteration": prometheus_query(url, "memory_iteration"),
            }
        release.touch()
        proc.wait(timeout=120)
    finally:
        torchrun.kill_group(proc)
        if server is not None:
            server.terminate()
            server.wait(30)
        if receiver is not None:
            receiver.shutdown()
    return {
        "rc": proc.returncode,
        "out": "".join(out),
        "err": "".join(err),
        "requests": receiver.requests if receiver else [],
        **found,
    }


def decoded(job) -> list:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    return [ExportMetricsServiceRequest.FromString(body) for _, _, body in job["requests"]]


def points(request) -> dict[str, list]:
    """{instrument: [(value, {attribute: value})]} of one request."""
    out: dict[str, list] = {}
    for scope in request.resource_metrics[0].scope_metrics:
        for metric in scope.metrics:
            data = getattr(metric, metric.WhichOneof("data"))
            for point in data.data_points:
                value = point.as_double if point.HasField("as_double") else point.as_int
                attributes = {a.key: a.value.int_value for a in point.attributes}
                out.setdefault(metric.name, []).append((value, attributes))
    return out


@pytest.mark.processes
def test_every_step_arrives_after_the_collector_comes_up(job):
    assert job["rc"] == 0, job["err"][-3000:]
    iterations = [points(request)[otel.ITERATION][0][0] for request in decoded(job)]
    assert iterations == list(range(1, STEPS + 1))  # each step once, in order, none lost while it was down
    assert {path for path, _, _ in job["requests"]} == {"/v1/metrics"}
    assert all(headers["authorization"] == f"Bearer {SECRET}" for _, headers, _ in job["requests"])
    assert job["err"].count("otel backend: log failed") == 1  # said once
    assert "nemo_memlog: otel is writing again" in job["err"]
    assert "did not store" not in job["err"]


@pytest.mark.processes
def test_every_series_every_stage_and_the_max(job):
    for request in decoded(job):
        found = points(request)
        series = found[SERIES]
        stages = {attributes.get(otel.STAGE_ATTRIBUTE): value for value, attributes in series}
        assert set(stages) == {None, 0, 1}
        assert stages[None] == max(stages[0], stages[1]) > 1e6  # bytes: the max over the stages
        assert found["memory.peak_stage.peak_host_rss_gb"] == [(0 if stages[0] >= stages[1] else 1, {})]
        assert "memory.host_rss" in found and "memory.host_headroom" in found
        resource = {a.key: a.value for a in request.resource_metrics[0].resource.attributes}
        assert resource[otel.WORLD_SIZE].int_value == 2 and resource[otel.PP_SIZE].int_value == 2
        assert resource["service.name"].string_value == "memlog-test"
        assert resource["team"].string_value == "infra"
        unit = {m.name: m.unit for s in request.resource_metrics[0].scope_metrics for m in s.metrics}
        assert unit[SERIES] == "By"


@pytest.mark.processes
def test_prometheus_scrapes_every_stage(job):
    if not shutil.which("prometheus"):
        pytest.skip("no prometheus binary (Debian: apt-get install prometheus; make setup does it as root)")
    series = job["prometheus"]["series"]
    values = {s["metric"].get("dl_pipeline_parallel_rank", ""): float(s["value"][1]) for s in series}
    assert values[""] == max(values["0"], values["1"]) > 1e6
    assert all(s["metric"]["job"] == "memlog" for s in series)
    info = job["prometheus"]["target_info"][0]["metric"]
    assert info["dl_pipeline_parallel_size"] == "2" and info["dl_world_size"] == "2"
    assert 1 <= float(job["prometheus"]["iteration"][0]["value"][1]) <= STEPS


@pytest.mark.processes
def test_the_headers_are_never_printed_nor_in_the_writer_process_environment(job):
    assert job["writer"] and SECRET.encode() not in job["writer"]
    assert SECRET not in job["out"] and SECRET not in job["err"]
