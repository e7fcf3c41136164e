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

import warnings


class InlineFanOut:
    """``log(metrics, step)`` to every adopted backend, synchronously, failures isolated."""

    def __init__(self, backends: list[tuple[str, object]]):
        self.backends = backends
        self.sinks = [name for name, _ in backends]  # what "is any writer configured?" reads
        self.failures: dict[str, int] = {}
        self._warned: set = set()

    def log(self, metrics: dict, step: int) -> None:
        for name, backend in self.backends:
            self._call(name, "log", backend.log, metrics, step)

    def flush(self, timeout_s: float | None = None) -> bool:
        return all([self._call(name, "flush", backend.flush) for name, backend in self.backends])

    def close(self, timeout_s: float | None = None) -> None:
        self.flush()  # the framework that opened them closes them

    def _call(self, name: str, what: str, fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except Exception as error:  # isolation: a backend never raises into training
            self.failures[name] = self.failures.get(name, 0) + 1
            if (name, what, type(error).__name__) not in self._warned:
                self._warned.add((name, what, type(error).__name__))
                warnings.warn(f"nemo_memlog: {name} backend: {what} failed with {type(error).__name__}: "
                              f"{error}; this step is not in {name}", RuntimeWarning, stacklevel=3)
            return False
