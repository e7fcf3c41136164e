"""Megatron-Bridge probes beside the training harness (bridge_harness.py): how Bridge spells
metric names for MLflow, which loggers it opens, and the off-interval cost of the callback
(scripts/bench_bridge_callback.py). Run on the cluster's ranks like ``bridge_harness.train``."""

from __future__ import annotations

from . import bridge_env
from .bridge_harness import RunSpec, recipe_config


def bridge_mlflow_names(keys: list[str]) -> dict[str, str]:
    """{key: name} as this Bridge's own ``_sanitize_mlflow_metrics`` spells its report
    dicts (memory included) for MLflow: the test's expected names."""
    bridge_env.load()
    from megatron.bridge.training.utils.mlflow_utils import _sanitize_mlflow_metrics

    return {key: next(iter(_sanitize_mlflow_metrics({key: 0.0}))) for key in keys}


def callback_mlflow_names(keys: list[str]) -> dict[str, dict[str, str]]:
    """{key: name} as the callback spells MLflow names: with Bridge's sanitiser
    ("importable"), and by the version's rule where it cannot be imported ("rule")."""
    import sys

    bridge_env.load()
    from nemo_memlog.bridge import bridge_mlflow_spelling

    module = "megatron.bridge.training.utils.mlflow_utils"
    spellings = {"importable": bridge_mlflow_spelling()}
    saved = sys.modules[module]
    sys.modules[module] = None  # import raises ImportError, as where Bridge moved or renamed it
    try:
        spellings["rule"] = bridge_mlflow_spelling()
    finally:
        sys.modules[module] = saved
    return {kind: {key: spell(key) for key in keys} for kind, spell in spellings.items()}


def bridge_logger_names() -> list[str]:
    """The ``*_logger`` properties of this Bridge's GlobalState: the loggers it can open."""
    bridge_env.load()
    from megatron.bridge.training.state import GlobalState

    return sorted(
        name
        for name in dir(GlobalState)
        if name.endswith("_logger") and isinstance(getattr(GlobalState, name), property)
    )


def bench_off_interval(calls: int, record_dir: str) -> dict:
    """Median microseconds of an off-interval ``on_train_step_end`` (the callback alone,
    called as Bridge's manager calls it) and of ``nemo_memlog.training_log`` off-interval,
    interleaved, alternating which goes first; and the collectives both issued (none).
    Both record their flight records in ``record_dir`` (not the working directory's)."""
    bridge_env.load()
    import statistics
    from time import perf_counter_ns

    import torch
    from megatron.bridge.training.callbacks import CallbackContext, normalize_callbacks
    from megatron.bridge.training.state import GlobalState
    from megatron.core import parallel_state as ps

    from nemo_memlog import LoggerConfig, training_log
    from nemo_memlog.bridge import MemoryLogCallback
    from nemo_memlog.testing.collectives import count_collectives

    spec = RunSpec(root="/nonexistent", backends=(), tensorboard_log_interval=1000)
    state = GlobalState()
    state.cfg = recipe_config(spec, ps.get_pipeline_model_parallel_world_size())
    model = [torch.nn.Linear(8, 8)]
    callback = MemoryLogCallback(memory_reduce_timeout_s=60, memory_record_dir=record_dir)
    manager = normalize_callbacks([callback])
    manager.fire("on_train_start", CallbackContext(state=state, model=model, user_state=manager.user_state))
    state.train_state.step = 1  # logged at step 2: off-interval
    context = CallbackContext(
        state=state, model=model, user_state=manager.user_state, loss_dict={}, grad_norm=1.0, skipped_iter=False
    )
    hook_config = LoggerConfig(
        log_memory_to_tensorboard=True, tensorboard_log_interval=1000, memory_record_dir=record_dir
    )
    step_end = callback.on_train_step_end
    timings = {"callback": [], "training_log": [], "empty": []}
    with count_collectives() as collectives:
        for i in range(calls):
            for name in ("callback", "training_log") if i % 2 else ("training_log", "callback"):
                start = perf_counter_ns()
                if name == "callback":
                    step_end(context)
                else:
                    training_log(2, hook_config)
                timings[name].append(perf_counter_ns() - start)
            start = perf_counter_ns()
            timings["empty"].append(perf_counter_ns() - start)
    manager.fire("on_train_end", CallbackContext(state=state, model=model, user_state=manager.user_state))
    result = {f"{name}_us": statistics.median(values) / 1e3 for name, values in timings.items()}
    result["collectives"] = list(collectives)
    return result
