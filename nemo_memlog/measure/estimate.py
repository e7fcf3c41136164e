"""The framework's estimate beside the measurement.

- ``bridge_estimate(config, num_microbatches)``: Megatron-Bridge 0.6+'s own formula,
  ``estimate_training_memory`` over the recipe's ConfigContainer, in GB: ``model_state_gb``
  (weights, gradients, optimizer state of the most-loaded shard) and ``activations_gb`` (the
  first pipeline stage's, which holds the most microbatches in flight). None where the installed
  Bridge has no estimator (0.3.1) or it cannot read the config. Computed once per run.
- ``derived(estimate, measured)``: pure, from the estimate and the estimated stage's measured
  figures of a logging step (the attribution hands them as data):
  ``memory/estimate/<part>`` and ``memory/estimate/gap/<part>`` (measured on stage 0 minus the
  estimate, GB) for the model state and, where measured, the activations. (Activations per
  microbatch are measured now, measure/activations.py: no schedule is assumed.)

- ``selective_share(config)``: the share of a transformer layer's activations that selective
  recompute keeps, by the formula Bridge 0.6+'s estimate uses (Korthikanti et al. 2022, Table 2):
  Bridge's per-layer ``18 + 4 * ffn_ratio`` (its own ffn ratio, MoE and gating included) over that
  plus the attention scores' ``5 * heads * seq / hidden``, which selective recompute drops. None
  before Bridge 0.6 (no estimator) or where the config lacks a field; ``nemo-memlog advise``
  applies it to the measured activations (advice/).

Megatron-LM's ``megatron/training/theoretical_memory_usage.py`` works on Megatron-LM's ``args``
and ships in Megatron-LM's training package, not in the megatron-core wheel: not offered here.
"""

from __future__ import annotations

import math
from typing import Any

from ..parts import ACTIVATIONS, MODEL_STATE_TOTAL

GB = 1e9
PREFIX = "memory/"
#: The stage Bridge's estimate describes: its activations are the first stage's.
ESTIMATED_STAGE = 0
#: The parts an estimate gives, as the measurement names them (measure/composition.py).
PARTS = (MODEL_STATE_TOTAL.key, ACTIVATIONS.key)


def bridge_estimate(config: Any, num_microbatches: int | None) -> dict[str, float] | None:
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
        MODEL_STATE_TOTAL.key: estimate.weight_and_optimizer_bytes / GB,
        ACTIVATIONS.key: math.nan if activation is None else activation.memory_bytes / GB,
    }


def selective_share(config: Any) -> float | None:
    """What selective recompute keeps of a layer's activations, by Bridge 0.6+'s formula (module docstring)."""
    try:
        from megatron.bridge.training.utils import theoretical_memory_utils as bridge_memory
    except ImportError:  # Bridge before 0.6
        return None
    try:
        model = config.model
        ffn_ratio = bridge_memory._ffn_activation_ratio(model, bridge_memory._get_layer_counts(model))
        kept = 18 + 4 * ffn_ratio
        scores = 5 * model.num_attention_heads * model.seq_length / model.hidden_size
        return kept / (kept + scores)
    except Exception:  # a model the formula does not know: no share, never a failed run
        return None


def derived(estimate: dict | None, measured: dict) -> dict:
    """The estimate and its gap (see the module docstring). ``measured``: the estimated stage's
    figures by part (None or NaN where not measured)."""
    out = {}
    for part in PARTS:
        guess = (estimate or {}).get(part)
        if guess is None or guess != guess:
            continue
        out[f"{PREFIX}estimate/{part}"] = guess
        value = measured.get(part)
        if value is not None and value == value:
            out[f"{PREFIX}estimate/gap/{part}"] = value - guess
    return out
