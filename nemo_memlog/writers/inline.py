"""Writing into loggers another framework already opened, on the calling thread.

A framework such as Megatron-Bridge opens its own TensorBoard writer, W&B run, MLflow
run and Comet experiment in the training process and writes to them from the training
thread. Writing into the same objects from another thread is unsafe or wrong: W&B
drops a row logged at a step it has already committed (so ours must land before the
framework commits that step), and MLflow's active run belongs to the thread that
started it. So ``InlineFanOut`` writes on the caller's thread, in the caller's order,
and never closes what it did not open. A backend that raises is isolated: the others
still get the step, and the failure is warned about once per backend and kind.
"""

from __future__ import annotations

from ..warn import WarnOnce


class InlineFanOut:
    """The writers over adopted open loggers: ``log(metrics, step)`` to every backend,
    synchronously, failures isolated. ``backends``: (name, backend) pairs."""

    def __init__(self, backends: list[tuple[str, object]]):
        self.backends = backends
        self.backend_names = [name for name, _ in backends]
        self.failures: dict[str, int] = {}
        self._written = dict.fromkeys(self.backend_names, 0)
        self._warn_once = WarnOnce()

    def log(self, metrics: dict, step: int) -> None:
        for name, backend in self.backends:
            if self._call(name, "log", backend.log, metrics, step):
                self._written[name] += 1

    def record_config(self, params: dict, secrets: list[str]) -> None:
        """``params`` recorded once by each backend that records a run's configuration (one with a
        ``record_config``: TensorBoard), secrets scrubbed; failures isolated, as a step's are."""
        for name, backend in self.backends:
            record = getattr(backend, "record_config", None)
            if record is not None:
                self._call(name, "record_config", record, params, secrets)

    def flush(self, timeout_s: float | None = None) -> bool:
        return all([self._call(name, "flush", backend.flush) for name, backend in self.backends])

    def close(self, timeout_s: float | None = None) -> None:
        self.flush()  # the framework that opened them closes them

    def stats(self) -> dict:
        """Per backend: written, and failures (nothing is buffered here: pending and dropped are 0)."""
        return {
            name: {"written": self._written[name], "pending": 0, "dropped": 0, "failures": self.failures.get(name, 0)}
            for name in self._written
        }

    def _call(self, name: str, what: str, fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except Exception as error:  # isolation: a backend never raises into training
            self.failures[name] = self.failures.get(name, 0) + 1
            self._warn_once(
                (name, what, type(error).__name__),
                f"{name} backend: {what} failed with {type(error).__name__}: {error}; this step is not in {name}",
                stacklevel=3,
            )
            return False
