"""The framework's estimate beside the measurement, and activations per in-flight microbatch.

- ``bridge_estimate(config, num_microbatches)``: Megatron-Bridge 0.6+'s own formula,
  ``estimate_training_memory`` over the recipe's ConfigContainer, in GB: ``model_state_gb``
  (weights, gradients, optimizer state of the most-loaded shard) and ``activations_gb`` (the
  first pipeline stage's, which holds the most microbatches in flight). None where the installed
  Bridge has no estimator (0.3.1) or it cannot read the config. Computed once per run.
- ``derived(unified, estimate, microbatches)``: pure, on the unified dict of a logging step:
  ``memory/estimate/<part>`` and ``memory/estimate/gap/<part>`` (measured on stage 0 minus the
  estimate, GB) for the model state and, where measured (CUDA), the activations; and, where the
  schedule is known (1F1B without interleaving: stage s holds min(PP - s, microbatches)
  microbatches in flight at its peak), ``memory/pp_stage_{s}/activations_per_microbatch_gb``: the
  figure that says whether one more microbatch fits.

Megatron-LM's ``megatron/training/theoretical_memory_usage.py`` works on Megatron-LM's ``args``
and ships in Megatron-LM's training package, not in the megatron-core wheel: not offered here.
"""

from __future__ import annotations

import math

GB = 1e9
PREFIX = "memory/"
#: The stage Bridge's estimate describes: its activations are the first stage's.
ESTIMATED_STAGE = 0


def bridge_estimate(config, num_microbatches: int | None) -> dict[str, float] | None:
    """Bridge's estimate for ``config`` (a ConfigContainer) in GB, or None (no estimator, or it failed)."""
    try:
        from megatron.bridge.training.utils.theoretical_memory_utils import estimate_training_memory
    except ImportError:  # Bridge before 0.6
        return None
    try:
        estimate = estimate_training_memory(config, num_microbatches)
    except Exception:  # a model the formula does not know: no estimate, never a failed run
        return None
    activation = estimate.activation
    return {
        "model_state_gb": estimate.weight_and_optimizer_bytes / GB,
        "activations_gb": math.nan if activation is None else activation.memory_bytes / GB,
    }


def in_flight(stage: int, stages: int, microbatches: int) -> int:
    """Microbatches stage ``stage`` holds at its peak under 1F1B without interleaving."""
    return max(1, min(stages - stage, microbatches))


def derived(unified: dict, estimate: dict | None, microbatches: int | None) -> dict:
    """The estimate, its gap and the per-microbatch activations for ``unified`` (see the module docstring)."""
    out = {}
    if estimate:
        for part in ("model_state_gb", "activations_gb"):
            guess = estimate.get(part)
            if guess is None or guess != guess:
                continue
            out[f"{PREFIX}estimate/{part}"] = guess
            measured = unified.get(f"{PREFIX}pp_stage_{ESTIMATED_STAGE}/{part}")
            if measured is not None and measured == measured:
                out[f"{PREFIX}estimate/gap/{part}"] = measured - guess
    if microbatches:
        stages = sorted(
            int(key[len(PREFIX) + len("pp_stage_") :].split("/")[0])
            for key in unified
            if key.startswith(PREFIX + "pp_stage_") and key.endswith("/activations_gb")
        )
        for stage in stages:
            value = unified[f"{PREFIX}pp_stage_{stage}/activations_gb"]
            held = in_flight(stage, len(stages), microbatches)
            out[f"{PREFIX}pp_stage_{stage}/activations_per_microbatch_gb"] = value / held
    return out
