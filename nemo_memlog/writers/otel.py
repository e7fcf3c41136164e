"""OpenTelemetry metrics backend: every memory series, every stage, to an OTLP collector, a
Prometheus scrape or the console, configured by OpenTelemetry's own environment variables.

Enabled by ``otel_metrics``. Which exporters: ``OTEL_METRICS_EXPORTER`` (comma-separated:
``otlp`` (the default), ``prometheus``, ``console``); OTLP: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``..._METRICS_ENDPOINT``), ``_HEADERS``, ``_TIMEOUT``, ``_COMPRESSION``, ``_PROTOCOL`` (``http/protobuf``;
``grpc`` where opentelemetry-exporter-otlp-proto-grpc is installed); Prometheus:
``OTEL_EXPORTER_PROMETHEUS_HOST`` / ``_PORT`` (default localhost:9464); the resource:
``OTEL_SERVICE_NAME`` (default ``nemo_memlog``), ``OTEL_RESOURCE_ATTRIBUTES`` (win over ours).

Names (docs/writers.md has the table): ``memory/<name>`` is the instrument ``memory.<name>``
(``/`` -> ``.``, other characters outside ``[A-Za-z0-9_.-]`` -> ``_``), the pipeline's max, without
attributes; ``memory/pp_stage_{i}/<name>`` is a point of the same instrument with attribute
``dl.pipeline_parallel.rank=i``. ``*_gb`` -> bytes (x 1e9, unit ``By``, the suffix dropped: Prometheus
``memory_peak_reserved_bytes``); ``*_pct`` -> ``*_percent``, unit ``%``; ``seconds`` -> ``s``; the allocator's
cumulative counts (``alloc_retries``, ``num_ooms``, ``allocation_count``) are monotonic counters;
every other series is a gauge of its value, unitless (``memory.peak_stage.<name>``: the stage of
the max; ``memory.headroom_stage``). ``memory.iteration`` is the logged step. NaN and infinities are
left out (no value). The caller's other
metrics (a loss) are not exported here: the framework's own telemetry has them. The resource holds
``dl.run.name`` (mlflow_run_name, wandb_exp_name or comet_experiment_name), ``dl.world_size``
(WORLD_SIZE) and ``dl.pipeline_parallel.size`` (the stages of the first step).

Pushed exporters (OTLP, console) send each step synchronously from this backend's thread, with
the exporter's own timeout: a collector that is down or refuses makes ``log`` raise, so the fan-out
keeps the step buffered, says it once and replays every step when the collector is back
(fanout.py). Prometheus serves the latest step. The SDK's own log lines about a failed export are
kept off the log (said once through the fan-out instead). OTLP headers are secrets
(``environment_secrets``): scrubbed from every notice, kept off the writer process's environment.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import urllib.parse
from typing import TYPE_CHECKING, Any

from ..keys import COUNTER_KEYS
from .stages import stage_values

if TYPE_CHECKING:
    from ..config import Settings

#: The attribute of a stage's own point (NVIDIA's Lens conventions' name for the pipeline stage).
STAGE_ATTRIBUTE = "dl.pipeline_parallel.rank"
RUN_NAME, WORLD_SIZE, PP_SIZE = "dl.run.name", "dl.world_size", "dl.pipeline_parallel.size"
#: The instrument holding the logged step.
ITERATION = "memory.iteration"
#: The allocator's cumulative counts (memory.DEFAULT_MEMORY_KEYS): monotonic counters.
COUNTERS = frozenset(COUNTER_KEYS)
#: The series naming where a max is: their ``_gb`` names a metric, not a size.
LOCATIONS = ("peak_stage", "peak_rank", "peak_tp_rank", "peak_dp_rank")
EXPORTERS = ("otlp", "prometheus", "console")
HEADER_VARIABLES = ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_METRICS_HEADERS")
SERVICE_NAME = "nemo_memlog"
#: The SDK's loggers that speak of a failed export (a filter on a logger sees only its own records).
SDK_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.sdk.metrics._internal.export",
)
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9_.\-]")
GB = 1e9


def enabled(settings: Settings) -> bool:
    """``otel_metrics``; when on, the OTEL_* variables are checked here, where build_writers asks
    (the training process, at the first step): a wrong one raises ValueError naming it."""
    if not settings.otel_metrics:
        return False
    environ = dict(os.environ)
    exporter_names(environ)
    protocol = otlp_protocol(environ)
    if protocol not in ("http/protobuf", "grpc"):
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: nemo_memlog exports http/protobuf or grpc")
    return True


def otlp_protocol(environ: dict[str, str]) -> str:
    return environ.get(
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    )


def environment_secrets(environ: dict[str, str]) -> list[str]:
    """The OTLP headers' values (credentials: ``authorization=Bearer x``), raw and decoded, and
    each variable's whole value: scrubbed from every notice, kept off a command line."""
    found: list[str] = []
    for name in HEADER_VARIABLES:
        text = environ.get(name, "")
        if not text.strip():
            continue
        found.append(text)
        for pair in text.split(","):
            _, _, value = pair.partition("=")
            found += [value.strip(), urllib.parse.unquote(value.strip())]
    return [value for value in dict.fromkeys(found) if len(value) >= 4]


def exporter_names(environ: dict[str, str]) -> list[str]:
    """OTEL_METRICS_EXPORTER's exporters (default ``otlp``); ValueError naming it for an unknown one."""
    names = [name.strip() for name in environ.get("OTEL_METRICS_EXPORTER", "otlp").split(",") if name.strip()]
    unknown = [name for name in names if name not in EXPORTERS and name != "none"]
    if unknown:
        raise ValueError(
            f"OTEL_METRICS_EXPORTER={environ['OTEL_METRICS_EXPORTER']!r}: nemo_memlog exports to "
            f"{', '.join(EXPORTERS)} (comma-separated); not {', '.join(unknown)}"
        )
    return [name for name in names if name != "none"]


def destination(environ: dict[str, str]) -> str:
    """Where the metrics go, in words, for a person (no header is shown)."""
    places = []
    for name in exporter_names(environ):
        if name == "otlp":
            endpoint = environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or environ.get(
                "OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318"
            )
            places.append(f"OTLP to {endpoint}")
        elif name == "prometheus":
            host = environ.get("OTEL_EXPORTER_PROMETHEUS_HOST", "localhost")
            places.append(
                f"Prometheus scrapes http://{host}:{environ.get('OTEL_EXPORTER_PROMETHEUS_PORT', '9464')}/metrics"
            )
        else:
            places.append("the console (the writer process's stdout)")
    return "; ".join(places) or "nowhere (OTEL_METRICS_EXPORTER=none)"


def instrument(key: str) -> tuple[str, str, str, float, dict] | None:
    """(instrument name, kind "gauge"/"counter", unit, scale, attributes) of a unified-dict key;
    None for a key that is not a memory series."""
    attributes: dict[str, int] = {}
    for label, tag, _ in stage_values({key: 0}):
        attributes = {STAGE_ATTRIBUTE: int(label.removeprefix("pp_stage_").split("-")[0])}
        key = tag
    if not key.startswith("memory/"):
        return None
    name = key.removeprefix("memory/")
    first = name.split("/", 1)[0]
    kind, unit, scale = "gauge", "", 1.0
    if first in LOCATIONS or "/" in name and name.rsplit("/", 1)[1] == "seconds":
        unit = "" if first in LOCATIONS else "s"
    elif name.endswith("_gb"):
        name, unit, scale = name.removesuffix("_gb"), "By", GB
    elif name.endswith("_pct"):
        name, unit = name.removesuffix("_pct") + "_percent", "%"
    elif name in COUNTERS:
        kind = "counter"
    return _NOT_ALLOWED.sub("_", "memory." + name.replace("/", "."))[:255], kind, unit, scale, attributes


def open_backend(settings: Settings, params: dict, secrets: list[str]) -> OtelBackend:
    """The exporters OTEL_METRICS_EXPORTER names, built now (a bad variable raises here, at the
    first step, naming it); the meter provider at the first step (the resource holds its stages)."""
    environ = dict(os.environ)
    names = exporter_names(environ)
    run_name = settings.mlflow_run_name or settings.wandb_exp_name or settings.comet_experiment_name
    return OtelBackend(names, run_name=run_name, world_size=environ.get("WORLD_SIZE"), environ=environ)


def adopt(obj: object) -> None:
    """No open logger of OpenTelemetry's is adopted: a MeterProvider is the process's, not a run's."""
    return None


class _Quiet(logging.Filter):
    """Drops the SDK exporter's records made on the thread exporting now, keeping the first one's
    text (why the export failed); other threads' records pass."""

    def __init__(self):
        super().__init__()
        self.thread: int | None = None
        self.reason = ""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self.thread:
            return True
        self.reason = self.reason or record.getMessage()[:300]  # the first says why; the rest retry
        return False


class OtelBackend:
    """One meter provider and its exporters. ``log`` sets every series of the step and sends it
    (pushed exporters), raising when one fails; the Prometheus reader serves the latest step."""

    def __init__(self, exporters: list[str], *, run_name: str | None, world_size: str | None, environ: dict):
        self.exporter_names = exporters
        self.run_name = run_name
        self.world_size = world_size
        self.environ = environ
        self.provider: Any = None
        self.reader: Any = None  # the pushed exporters' reader
        self.pushed: list[tuple[str, Any]] = []
        self.server: Any = None  # Prometheus's HTTP server
        self.instruments: dict[str, Any] = {}
        self.current: dict[str, list] = {}  # instrument name -> [(value, attributes)] of the latest step
        self._quiet = _Quiet()
        self.meter: Any = None
        self._loggers = [logging.getLogger(name) for name in SDK_LOGGERS]
        for logger in self._loggers:
            logger.addFilter(self._quiet)

    def _open(self, metrics: dict) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        readers = []
        if any(name != "prometheus" for name in self.exporter_names):
            self.reader = InMemoryMetricReader()
            readers.append(self.reader)
            self.pushed = [(name, self._pushed_exporter(name)) for name in self.exporter_names if name != "prometheus"]
        if "prometheus" in self.exporter_names:
            readers.append(self._prometheus_reader())
        self.provider = MeterProvider(resource=self._resource(metrics), metric_readers=readers)
        self.meter = self.provider.get_meter("nemo_memlog")

    def _pushed_exporter(self, name: str) -> Any:
        if name == "console":
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

            return ConsoleMetricExporter()
        if otlp_protocol(self.environ) == "grpc":
            try:
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            except ImportError as error:
                raise ValueError(
                    "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-otlp-proto-grpc installed "
                    "(or use http/protobuf, which nemo_memlog[otel] brings)"
                ) from error
            return OTLPMetricExporter()
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpExporter

        return HttpExporter()

    def _prometheus_reader(self) -> Any:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()  # ours, not the process's global one
        reader = PrometheusMetricReader(registry=registry)
        host = self.environ.get("OTEL_EXPORTER_PROMETHEUS_HOST", "localhost")
        port = int(self.environ.get("OTEL_EXPORTER_PROMETHEUS_PORT", "9464"))
        self.server, _ = start_http_server(port, addr=host, registry=registry)
        return reader

    def _resource(self, metrics: dict) -> Any:
        from opentelemetry.sdk.resources import Resource

        stages = {label for label, _, _ in stage_values(metrics)}
        ours: dict[str, Any] = {PP_SIZE: max(len(stages), 1)}
        if self.run_name:
            ours[RUN_NAME] = self.run_name
        if self.world_size and self.world_size.isdigit():
            ours[WORLD_SIZE] = int(self.world_size)
        given = dict(Resource.create().attributes)  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES: theirs win
        if str(given.get("service.name", "")).startswith("unknown_service"):
            given["service.name"] = SERVICE_NAME
        return Resource({**ours, **given})

    def _series(self, metrics: dict, step: int) -> dict[str, list]:
        current: dict[str, list] = {ITERATION: [(step, {})]}
        self._define(ITERATION, "gauge", "")
        for key, value in metrics.items():
            found = instrument(key)
            if found is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name, kind, unit, scale, attributes = found
            if not math.isfinite(value) or (kind == "counter" and value < 0):
                continue  # no value to show (the SDK drops non-finite ones, with a warning each time)
            self._define(name, kind, unit)
            current.setdefault(name, []).append((value * scale if scale != 1.0 else value, attributes))
        return current

    def _define(self, name: str, kind: str, unit: str) -> None:
        if name in self.instruments:
            return
        from opentelemetry.metrics import Observation

        def observe(options, name=name):
            return [Observation(value, attributes) for value, attributes in self.current.get(name, ())]

        create = self.meter.create_observable_counter if kind == "counter" else self.meter.create_observable_gauge
        self.instruments[name] = create(name, callbacks=[observe], unit=unit)

    def log(self, metrics: dict, step: int) -> None:
        """Set every memory series of ``metrics`` at ``step`` and send them; raises when an exporter
        fails (the fan-out keeps the step and retries). Reads ``metrics`` only."""
        if self.provider is None:
            self._open(metrics)
        self.current = self._series(metrics, step)
        if self.reader is None:
            return
        self._quiet.thread, self._quiet.reason = threading.get_ident(), ""
        try:
            data = self.reader.get_metrics_data()
            for name, exporter in self.pushed:
                result = exporter.export(data)
                if getattr(result, "name", "") != "SUCCESS":
                    reason = self._quiet.reason or "no reason given"
                    raise ConnectionError(f"the {name} exporter could not send step {step} ({reason})")
        finally:
            self._quiet.thread = None

    def flush(self) -> None:
        pass  # each step is sent by the log that takes it

    def close(self, deadline: float | None = None) -> None:
        """End the provider and its exporters, and Prometheus's server."""
        try:
            if self.provider is not None:
                self.provider.shutdown(timeout_millis=5_000)
            for _, exporter in self.pushed:
                exporter.shutdown()
        finally:
            if self.server is not None:
                self.server.shutdown()
                self.server.server_close()
            for logger in self._loggers:
                logger.removeFilter(self._quiet)
