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


#: Steps of a three-stage pipeline: two metrics logged per stage (one a name MLflow rejects),
#: the max of each beside them, and the rest of a unified dict (a peak stage, a loss).
STAGES = 3
STAGE_STEPS = {
    step: {
        "loss": 3.0 - step / 10,
        **{
            f"memory/{name}": max(base + stage * 0.5 + step / 100 for stage in range(STAGES))
            for name, base in (("peak_reserved_gb", 2.0), ("weird key*(1)", 1.0))
        },
        "memory/peak_stage/peak_reserved_gb": STAGES - 1,
        **{
            f"memory/pp_stage_{stage}/{name}": base + stage * 0.5 + step / 100
            for stage in range(STAGES)
            for name, base in (("peak_reserved_gb", 2.0), ("weird key*(1)", 1.0))
        },
    }
    for step in (5, 10, 15, 20)
}
#: The metrics logged per stage, by the tag their max and every stage's run share.
STAGE_TAGS = ("memory/peak_reserved_gb", "memory/weird key*(1)")


def stage_value(step: int, stage: int, tag: str) -> float:
    return STAGE_STEPS[step][tag.replace("memory/", f"memory/pp_stage_{stage}/")]
