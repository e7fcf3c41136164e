"""The steps every backend test writes: ints, floats, a name MLflow rejects, NaN and +-inf."""

import math
import types

from nemo_memlog.config import resolve

SECRET = "SECRET-TOKEN-123"
STEPS = {
    10: {
        "memory/peak_allocated_gb": 3.5,
        "memory/alloc_retries": 7,
        "loss": 2.25,
        "memory/pp_stage_0/peak_host_rss_gb": 1.5,
        "memory/weird key*(1)": 0.5,
        "memory/nan_gb": math.nan,
        "memory/inf_gb": math.inf,
        "memory/neg_inf_gb": -math.inf,
    },
    20: {
        "memory/peak_allocated_gb": 4.0,
        "memory/alloc_retries": 8,
        "loss": 2.0,
        "memory/pp_stage_0/peak_host_rss_gb": 1.75,
        "memory/weird key*(1)": 0.25,
        "memory/nan_gb": math.nan,
        "memory/inf_gb": math.inf,
        "memory/neg_inf_gb": -math.inf,
    },
}

#: The settings of a config object that has none of the backends' fields (Megatron-Bridge's
#: LoggerConfig may lack some): each backend field takes our default, None.
LACKING_FIELDS = resolve(types.SimpleNamespace(log_memory_to_tensorboard=True))


def write_steps(backend) -> None:
    """Log STEPS through ``backend``, checking that log never mutates what it is given."""
    for step, metrics in STEPS.items():
        before = repr(metrics)
        backend.log(metrics, step)
        assert repr(metrics) == before  # log never mutates
    backend.flush()
