"""What a rank's memory is made of: parameters, gradients, optimizer state; and, from the
allocator's peaks, activations and allocator slack.

``report_model_state(model, optimizer)`` counts the bytes this rank holds, in GB (1e9 bytes):

- ``params_gb``: every parameter of the model (a module, or a list of chunks as Megatron and
  Megatron-Bridge pass them);
- ``grads_gb``: ``param.grad`` and Megatron's ``param.main_grad`` (views into the DDP grad
  buffers), and the gradients of the optimizer's own fp32 master copies;
- ``optimizer_state_gb``: every tensor in the optimizer's state (Adam's ``exp_avg``,
  ``exp_avg_sq`` and ``step``, momentum buffers) and the fp32 master copies of the parameters
  where they are separate tensors (Megatron's mixed-precision and distributed optimizers);
- ``model_state_gb``: their sum.

Without an optimizer (``model=`` given, ``optimizer=`` not) ``optimizer_state_gb`` is NaN, the
"missing" marker (payload.py): it is not known, so it is not logged as 0, and ``model_state_gb``
is then parameters + gradients only.

Each storage is counted once, at its whole size (``untyped_storage().nbytes()``: the padding of a
flat buffer is memory held), however many views share it, in the first category that reaches it
(parameters, then gradients, then optimizer state). Only storages on the device where the
parameters live are counted (a CPU-offloaded optimizer state is host memory: see host RSS).
The optimizer can be a torch optimizer, or Megatron's MegatronOptimizer, ChainedOptimizer,
mixed-precision or distributed optimizer (their ``.optimizer`` and ``.chained_optimizers``).

``ModelState`` caches the count and recounts only when a figure can change: the optimizer's
state entries (created lazily at its first step) or whether gradients exist (``zero_grad(
set_to_none=True)`` frees them). ``breakdown(report, state, measured)`` adds the derived names to
a memory report, with ``measured`` (measure/activations.py's Measurement of the logging iteration):
``activations_gb`` (the retained activations, measured on every device),
``activations_per_microbatch_gb``, ``microbatches_in_flight``, and from the allocator's peaks
``temporaries_gb`` = peak allocated - model state - activations (workspaces and transient
buffers; never below 0: the parts' maxima need not coincide) and ``allocator_slack_gb`` = peak
reserved - peak allocated, so that on a GPU

    peak_reserved_gb = model_state_gb + activations_gb + temporaries_gb + allocator_slack_gb

Without CUDA statistics (CPU) the last two are NaN; without a measurement the first three are.
``layer_state`` splits the model state by layer (layers.find_layers).

Known limitations:

- Only storages on the device of the first tensor found count: parameters or optimizer state
  on another device (CPU offload) are not model state here; host memory shows in host RSS.
- Buffers (``register_buffer``) are in no part: not model state, and left out of the
  activations; on a GPU they fall in ``temporaries_gb``.
- An optimizer object it does not recognise counts 0 optimizer state, not NaN; state values
  that are not tensors (nested lists or dicts of tensors) are not counted.
- FP8 wrapper tensors (Transformer Engine's Float8Tensor and kin): counted by the storage
  ``untyped_storage()`` returns, the FP8 data only where TE returns it (not the transpose /
  column-wise copy or the scales); a wrapper without a readable storage at its nominal size
  (numel x element size), once per wrapper.
- ``temporaries_gb`` is what is left of the peak: it takes in whatever the activation meter
  does not see (CPU offload contexts, CUDA graph pools, delayed weight gradients, saves outside
  the forward: measure/activations.py) and is floored at 0 where the parts' maxima do not coincide.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .. import parts
from ..keys import PEAK_ALLOCATED, PEAK_RESERVED

if TYPE_CHECKING:
    from torch import nn

GB = 1e9
NAMES = parts.MODEL_STATE_KEYS
DERIVED = parts.STEP_KEYS


#: What ``model=`` takes, for the TypeError that names it.
MODEL_TAKES = "a torch.nn.Module, or a list (or tuple) of them, as Megatron passes its model chunks"
#: What ``optimizer=`` takes, for the TypeError that names it.
OPTIMIZER_TAKES = (
    "a torch optimizer, Megatron's MegatronOptimizer or ChainedOptimizer, or a list of optimizers (as "
    "Lightning's trainer.optimizers): anything with param_groups, .optimizer, .optim or .chained_optimizers"
)
_OPTIMIZER_PARTS = ("param_groups", "optimizer", "optim", "chained_optimizers")


def check_model_and_optimizer(model: nn.Module | Sequence[nn.Module] | None, optimizer: Any) -> None:
    """Raise TypeError naming the argument (``model``, ``optimizer``) and what it takes, for a value
    that cannot be counted (a state_dict, a string...). None passes. Cheap (isinstance and hasattr,
    no walk of the model): callers run it on logging iterations only. Mutates nothing."""
    from torch import nn

    if model is not None:
        chunks = model if isinstance(model, (list, tuple)) else (model,)
        if not all(isinstance(chunk, nn.Module) for chunk in chunks):
            raise TypeError(f"model= must be {MODEL_TAKES}; got {_described(model)}")
    if optimizer is not None:
        each = optimizer if isinstance(optimizer, (list, tuple)) else (optimizer,)
        if not all(any(hasattr(one, part) for part in _OPTIMIZER_PARTS) for one in each):
            raise TypeError(f"optimizer= must be {OPTIMIZER_TAKES}; got {_described(optimizer)}")


def _described(value) -> str:
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(each).__name__ for each in value})
        return f"a {type(value).__name__} of {', '.join(kinds) or 'nothing'}"
    hint = " (a state_dict? pass the object itself)" if isinstance(value, dict) else ""
    return f"{type(value).__name__} {value!r:.60}{hint}"


def report_model_state(model: nn.Module | Sequence[nn.Module] | None, optimizer: Any = None) -> dict[str, float]:
    """Return this rank's model state now, in GB (1e9 bytes): parameters, gradients, optimizer state.

    Each storage counts once, at its whole size, in the first category that reaches it;
    only storages on the device of the model's first parameter count. Mutates nothing; no
    collective. Known limitations: see the module docstring.

    Args:
        model: a module, or a list (or tuple) of model chunks as Megatron passes them; None
            counts nothing.
        optimizer: a torch optimizer, Megatron's MegatronOptimizer, ChainedOptimizer,
            mixed-precision or distributed optimizer, or a list of optimizers. None: the
            optimizer state is unknown.

    Returns:
        ``params_gb``, ``grads_gb``, ``optimizer_state_gb`` and ``model_state_gb`` (their
        sum), floats. Without an optimizer ``optimizer_state_gb`` is NaN and
        ``model_state_gb`` is parameters + gradients.

    Raises:
        AttributeError: ``model`` is not a module or a list of modules (this function does
            not check its arguments; training_log does, raising TypeError).
    """
    return _count(modules_of(model), optimizer)


class ModelState:
    """``report_model_state`` for one (model, optimizer), counted again only when it can change."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._values: dict[str, float] = {}
        self._first: tuple = (None, None)  # (the modules' ids, their first parameter): found once per model

    def report(self, model: nn.Module | Sequence[nn.Module] | None, optimizer: Any = None) -> dict[str, float]:
        modules = modules_of(model)
        ids = tuple(map(id, modules))
        if self._first[0] != ids:  # Module.parameters() walks the module tree: once, not every step
            self._first = (ids, next((p for m in modules for p in _parameters(m)), None))
        key = (ids, id(optimizer), _fingerprint(self._first[1], optimizer))
        if key != self._key:
            self._values, self._key = _count(modules, optimizer), key
        return dict(self._values)


def breakdown(report: dict, state: dict, measured: Any = None) -> dict:
    """``report`` (report_memory's) with ``state`` and the derived names added (a new dict).
    ``measured``: the logging iteration's activations.Measurement, or None (not measured)."""
    out = {**report, **state}
    allocated, reserved = report.get(PEAK_ALLOCATED.key, math.nan), report.get(PEAK_RESERVED.key, math.nan)
    activations = math.nan if measured is None else measured.activations_gb
    out["activations_gb"] = activations
    out["activations_per_microbatch_gb"] = math.nan if measured is None else measured.activations_per_microbatch_gb
    out["microbatches_in_flight"] = math.nan if measured is None else measured.microbatches_in_flight
    temporaries = allocated - state["model_state_gb"] - activations
    out["temporaries_gb"] = max(temporaries, 0.0) if _number(allocated) and _number(activations) else math.nan
    out["allocator_slack_gb"] = reserved - allocated if _number(allocated) and _number(reserved) else math.nan
    return out


def with_iteration_grads(state: dict, grads: dict) -> dict:
    """``state`` with its gradients at least the iteration's: ``grads`` (id(param) -> (storage
    key, storage bytes, element bytes)) noted as they were accumulated, each storage once. A new dict."""
    seen = {}
    for key, nbytes, _ in grads.values():
        seen[key] = nbytes
    held = sum(seen.values()) / GB
    if held <= state["grads_gb"]:
        return dict(state)
    out = {**state, "grads_gb": held}
    out["model_state_gb"] = _model_state(out)
    return out


def layer_state(
    groups: list[list], optimizer: Any = None, grads: dict | None = None, stage: dict | None = None
) -> list[dict]:
    """Per group of parameters (a layer's; the last group is the rest of the stage): its
    ``params_gb``, ``grads_gb`` and ``optimizer_state_gb``, in element bytes (a flat buffer's
    padding belongs to no layer). Gradients: ``.grad``/``.main_grad`` now, or as ``grads`` noted
    them if more. Optimizer state: the torch optimizers' state of each parameter and of its fp32
    master copy (Megatron's mixed-precision optimizer maps them); what no parameter maps to (the
    distributed optimizer's shards) is spread over the groups by parameter bytes, when ``stage``
    (the stage's totals) says how much that is. Mutates nothing."""
    grads = grads or {}
    optimizers = _optimizers(optimizer)
    masters = _master_of(optimizers)
    # Once each: Megatron's wrappers expose their inner optimizer's state as their own ``state``.
    states = list({id(state): state for state in (getattr(each, "state", {}) for each in optimizers)}.values())
    out, mapped = [], 0.0
    for params in groups:
        params = list({id(p): p for p in params}.values())
        param_bytes = sum(_nbytes(p) for p in params)
        grad_bytes = 0
        for p in params:
            grad_bytes += max(_grad_bytes(p), grads.get(id(p), (0, 0, 0))[2])
        optimizer_bytes = 0
        for p in params:
            for owner in (p, masters.get(id(p))):
                if owner is None:
                    continue
                if owner is not p:
                    optimizer_bytes += _nbytes(owner)
                for state in states:
                    values = state.get(owner)
                    if isinstance(values, dict):
                        optimizer_bytes += sum(_nbytes(v) for v in values.values())
        mapped += optimizer_bytes / GB
        out.append(dict(zip(parts.MODEL_STATE_PARTS, (param_bytes / GB, grad_bytes / GB, optimizer_bytes / GB))))
    unmapped = (stage or {}).get("optimizer_state_gb", 0.0) - mapped
    total_params = sum(entry["params_gb"] for entry in out)
    if unmapped > 1e-12 and total_params:
        for entry in out:
            entry["optimizer_state_gb"] += unmapped * entry["params_gb"] / total_params
    return out


def _grad_bytes(param) -> int:
    """``param.grad`` and Megatron's ``param.main_grad``, once where they are the same memory (its
    optimizers set ``grad = main_grad`` for fp32 parameters)."""
    grads = {_address(t): _nbytes(t) for t in (param.grad, getattr(param, "main_grad", None)) if t is not None}
    return sum(grads.values())


def _parameters(module) -> list:
    """``module``'s parameters through nn.Module's own method: a wrapper's attribute may shadow it
    (Megatron's DDP keeps a list named ``buffers``)."""
    from torch import nn

    return list(nn.Module.parameters(module))


def storage_of(tensor: Any) -> tuple[int, int]:
    """(key, bytes) of the storage under ``tensor``: its address and whole size. A tensor whose
    storage cannot be read (sparse, a wrapper subclass such as FP8's) is keyed by itself, at its
    nominal size (numel x element size): counted, never raised into training."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return id(tensor), tensor.numel() * tensor.element_size()


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size() if tensor is not None and hasattr(tensor, "element_size") else 0


def _address(tensor) -> int:
    try:
        return tensor.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass: no data of its own
        return id(tensor)


def _master_of(optimizers: list) -> dict:
    """id(model param) -> its fp32 master copy, where a Megatron wrapper pairs them."""
    pairs = {}
    for each in optimizers:
        model_groups = getattr(each, "float16_groups", None) or []
        for model_group, master_group in zip(model_groups, getattr(each, "fp32_from_float16_groups", None) or []):
            for param, master in zip(model_group, master_group):
                pairs[id(param)] = master
    return pairs


def _number(value) -> bool:
    return isinstance(value, (int, float)) and value == value


def modules_of(model: nn.Module | Sequence[nn.Module] | None) -> list:
    """``model`` as a list of modules: itself, or the items of Megatron's (or Lightning's) list of chunks."""
    if model is None:
        return []
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _optimizers(optimizer) -> list:
    """The torch optimizers inside ``optimizer`` (Megatron's wrappers unwrapped, chains flattened)."""
    if optimizer is None:
        return []
    if isinstance(optimizer, (list, tuple)):  # Lightning's trainer.optimizers
        return [inner for each in optimizer for inner in _optimizers(each)]
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for each in chained for inner in _optimizers(each)]
    local = getattr(optimizer, "optim", None)  # torch's ZeroRedundancyOptimizer: this rank's shard
    if local is not None and local is not optimizer and hasattr(local, "param_groups"):
        return _optimizers(local)
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and inner is not optimizer and hasattr(inner, "param_groups"):
        return [optimizer, *_optimizers(inner)] if _master_groups(optimizer) else _optimizers(inner)
    return [optimizer]


def optimizer_facts(optimizer: Any) -> dict:
    """What the per-layer record says of the optimizer: its class (the innermost torch optimizer's
    name) and whether its state is already sharded over data parallelism (Megatron's distributed
    optimizer, torch's ZeroRedundancyOptimizer). {} without one."""
    if optimizer is None:
        return {}
    inner = _optimizers(optimizer)
    wrappers = [optimizer, *(optimizer if isinstance(optimizer, (list, tuple)) else [])]
    sharded = any(
        getattr(w, "optim", None) is not None or hasattr(w, "shard_fp32_from_float16_groups") for w in wrappers
    )
    sharded = sharded or any(hasattr(each, "shard_fp32_from_float16_groups") for each in inner)
    names = sorted({type(each).__name__ for each in inner if hasattr(each, "param_groups")})
    return {"optimizer": ",".join(names), "optimizer_sharded": sharded}


def _master_groups(optimizer) -> list:
    """Megatron's fp32 master copies held by a wrapper (mixed-precision, distributed optimizer)."""
    groups: list = []
    for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups", "shard_fp32_groups"):
        groups += getattr(optimizer, name, None) or []
    return groups


def _fingerprint(first, optimizer) -> tuple:
    """What can change the counts between steps, cheaply: the optimizers' state sizes, and whether
    the first parameter has a gradient now (set_to_none frees them all together)."""
    sizes = tuple(len(getattr(each, "state", ())) for each in _optimizers(optimizer))
    has_grad = first is not None and (first.grad is not None or getattr(first, "main_grad", None) is not None)
    return sizes, has_grad


def _count(modules: list, optimizer) -> dict[str, float]:
    import torch

    seen: set = set()
    device = None
    totals = dict.fromkeys(parts.MODEL_STATE_PARTS, 0)

    def add(category: str, tensor) -> None:
        nonlocal device
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        if device is None:
            device = tensor.device
        if tensor.device != device:
            return  # elsewhere (offloaded): not this device's memory
        key = storage_of(tensor)
        if key in seen or key[1] == 0:
            return
        seen.add(key)
        totals[category] += key[1]

    params = [p for m in modules for p in _parameters(m)]
    for param in params:
        add("params_gb", param)
    for param in params:
        add("grads_gb", param.grad)
        add("grads_gb", getattr(param, "main_grad", None))
    for each in _optimizers(optimizer):
        for group in _master_groups(each):
            for master in group:
                add("optimizer_state_gb", master)
                add("grads_gb", getattr(master, "grad", None))
        for group in getattr(each, "param_groups", ()):
            for param in group["params"]:
                add("optimizer_state_gb", param)  # a master copy: the model's own params were counted above
                add("grads_gb", param.grad)
        for values in getattr(each, "state", {}).values():
            for value in values.values() if isinstance(values, dict) else ():
                add("optimizer_state_gb", value)
    out = {name: value / GB for name, value in totals.items()}
    if optimizer is None:  # not known: missing, not 0 (the module docstring)
        out["optimizer_state_gb"] = math.nan
    out["model_state_gb"] = _model_state(out)
    return out


def _model_state(figures: dict) -> float:
    """params + grads + optimizer state, the optimizer state left out where it is missing (NaN)."""
    return sum(figures[name] for name in parts.MODEL_STATE_PARTS if figures[name] == figures[name])
