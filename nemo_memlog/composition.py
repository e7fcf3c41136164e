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

Each storage is counted once, at its whole size (``untyped_storage().nbytes()``: the padding of a
flat buffer is memory held), however many views share it, in the first category that reaches it
(parameters, then gradients, then optimizer state). Only storages on the device where the
parameters live are counted (a CPU-offloaded optimizer state is host memory: see host RSS).
The optimizer can be a torch optimizer, or Megatron's MegatronOptimizer, ChainedOptimizer,
mixed-precision or distributed optimizer (their ``.optimizer`` and ``.chained_optimizers``).

``ModelState`` caches the count and recounts only when a figure can change: the optimizer's
state entries (created lazily at its first step) or whether gradients exist (``zero_grad(
set_to_none=True)`` frees them). ``breakdown(report, state)`` adds the derived names to a
memory report: ``activations_gb`` = peak allocated - model state ("activations and temporaries")
and ``allocator_slack_gb`` = peak reserved - peak allocated, so that on a GPU

    peak_reserved_gb = model_state_gb + activations_gb + allocator_slack_gb

Without CUDA statistics (CPU) both are NaN: there is no allocator peak to subtract from.
"""

from __future__ import annotations

import math

GB = 1e9
NAMES = ("params_gb", "grads_gb", "optimizer_state_gb", "model_state_gb")
DERIVED = ("activations_gb", "allocator_slack_gb")


def report_model_state(model, optimizer=None) -> dict[str, float]:
    """This rank's model state in GB (the module docstring), counted now. Floats; mutates nothing."""
    return _count(_modules(model), optimizer)


class ModelState:
    """``report_model_state`` for one (model, optimizer), counted again only when it can change."""

    def __init__(self):
        self._key = None
        self._values: dict[str, float] = {}
        self._first = (None, None)  # (the modules' ids, their first parameter): found once per model

    def report(self, model, optimizer=None) -> dict[str, float]:
        modules = _modules(model)
        ids = tuple(map(id, modules))
        if self._first[0] != ids:  # Module.parameters() walks the module tree: once, not every step
            self._first = (ids, next((p for m in modules for p in m.parameters()), None))
        key = (ids, id(optimizer), _fingerprint(self._first[1], optimizer))
        if key != self._key:
            self._values, self._key = _count(modules, optimizer), key
        return dict(self._values)


def breakdown(report: dict, state: dict) -> dict:
    """``report`` (report_memory's) with ``state`` and the derived names added (a new dict)."""
    out = {**report, **state}
    allocated, reserved = report.get("peak_allocated_gb", math.nan), report.get("peak_reserved_gb", math.nan)
    out["activations_gb"] = allocated - state["model_state_gb"] if _number(allocated) else math.nan
    out["allocator_slack_gb"] = reserved - allocated if _number(allocated) and _number(reserved) else math.nan
    return out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and value == value


def _modules(model) -> list:
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
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and inner is not optimizer and hasattr(inner, "param_groups"):
        return [optimizer, *_optimizers(inner)] if _master_groups(optimizer) else _optimizers(inner)
    return [optimizer]


def _master_groups(optimizer) -> list:
    """Megatron's fp32 master copies held by a wrapper (mixed-precision, distributed optimizer)."""
    groups = []
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
    totals = dict.fromkeys(("params_gb", "grads_gb", "optimizer_state_gb"), 0)

    def add(category: str, tensor) -> None:
        nonlocal device
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        if device is None:
            device = tensor.device
        if tensor.device != device:
            return  # elsewhere (offloaded): not this device's memory
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key in seen or storage.nbytes() == 0:
            return
        seen.add(key)
        totals[category] += storage.nbytes()

    params = [p for m in modules for p in m.parameters()]
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
    out["model_state_gb"] = sum(out.values())
    return out
