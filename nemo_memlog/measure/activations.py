"""Retained activations, measured: the bytes autograd keeps for backward, per microbatch and per
layer, on any device.

``ActivationMeter.arm(model)`` installs, until ``finish()``:

- on each chunk of the stage's model (a module, or Megatron's list of chunks): a forward pre-hook
  and a forward hook that bracket one *microbatch* (one forward of one chunk, with grad enabled,
  outside a backward) with ``torch.autograd.graph.saved_tensors_hooks``;
- on each layer (``find_layers``): a pre-hook and a hook that say which layer a saved tensor
  belongs to, and record the layer's input (what full recompute would keep);
- on each parameter: a post-accumulate-grad hook that notes its gradient, so gradients that
  ``zero_grad(set_to_none=True)`` frees before the logging call still count (the iteration's most).

The pack hook counts each storage once per microbatch at its whole size
(``untyped_storage().nbytes()``), leaves out the model's parameters and buffers (model state, not
activations), and hands autograd a holder of a detached view (a holder of the tensor itself would
tie an op's saved output to its own graph in a cycle); the holder's release is the moment autograd
lets the bytes go. So the meter sees, exactly, what is held at each instant: ``activations_gb`` is
the most held at once over the iteration, ``microbatches_in_flight`` the most microbatches holding
bytes at once, ``activations_per_microbatch_gb`` the mean of what one microbatch keeps.

Hooks nest: a pair already installed outside the chunk's forward (the user's own, ``save_on_cpu``)
is chained, ours counting and theirs packing; a pair installed inside (``torch.utils.checkpoint``'s
non-reentrant region) wins for its region, whose recomputed tensors are indeed not held, while
the region's inputs, saved outside it, are seen. Megatron's reentrant recompute saves only its
inputs, and they are seen. Nothing here is a collective; nothing raises into training: a tensor
whose storage cannot be read, for any reason (a wrapper subclass raising whatever it raises), is
counted at its nominal size (numel x element size), or skipped where even that cannot be read;
a hook that fails counts nothing more and leaves training as it was; either is said once per
kind, through the run's once-only notices.

Known limitations:

- CPU offload contexts inside a layer (Megatron's / Transformer Engine's CPU offloading
  context): the innermost saved-tensor hooks win, so the tensors saved under them are not seen.
- Tensors saved outside a chunk's forward are not counted: a loss computed on the model's
  output outside it (Megatron's loss_func). The optimizer saves nothing for backward; its
  working memory is in ``temporaries_gb``.
- CUDA graphs: tensors a replayed graph keeps for its backward stay in the graph's memory pool,
  not in autograd's saved tensors, so no hook sees them (on a GPU: in ``temporaries_gb``).
- Delayed weight gradients (Megatron's ``delay_wgrad_compute``, overlapped wgrad): what a layer
  keeps past the backward for a later weight-gradient GEMM is counted only until autograd releases it.
- FP8 wrapper tensors (Transformer Engine's Float8Tensor and kin): counted by the storage
  ``untyped_storage()`` returns (TE's row-wise FP8 data where it returns one: not the transpose /
  column-wise copy or the scales); without one, at the wrapper's nominal size (numel x its
  high-precision dtype), once per wrapper. Parameters without one: nothing measured, a warning.
- A forward with saved-tensor hooks disabled (``disable_saved_tensors_hooks``) is not measured.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..warn import WarnOnce
from . import host_idle
from .composition import storage_of
from .layers import Layer, chunks_of, find_layers

GB = 1e9


@dataclass(frozen=True)
class Measurement:
    """One logging iteration's activations on this rank (GB; see the module docstring)."""

    activations_gb: float
    microbatches_in_flight: int
    activations_per_microbatch_gb: float
    microbatches: int
    layers: tuple[Layer, ...]
    layer_activations_gb: tuple[float, ...]  # per layer: mean kept per microbatch it ran in
    layer_inputs_gb: tuple[float, ...]  # per layer: mean input per microbatch it ran in
    grads: dict  # id(param) -> (storage key, storage bytes, element bytes): the iteration's gradients
    host_idle_rss_gb: float | None = None  # CPU: the resident size before the first microbatch (host_idle.py)


class ActivationMeter:
    """Arms on one iteration and measures it (module docstring). One per run."""

    def __init__(self, warn: Callable[..., object] | None = None) -> None:
        """``warn(key, text)``: the run's once-only notices (default: the meter's own)."""
        self.warn = warn if warn is not None else WarnOnce()
        self._handles: list = []
        self._session: _Session | None = None
        self.armed = False
        self.error: str | None = None  # why the last arm() could not measure (the run warns once)

    def arm(self, model: nn.Module | Sequence[nn.Module] | None) -> None:
        """Begin measuring: hooks on ``model``'s chunks, layers and parameters. Idempotent while armed.
        Where the installed torch lacks what the meter needs (``unsupported()``), nothing is installed
        and ``error`` says why."""
        if self.armed:
            return
        chunks = chunks_of(model)
        if not chunks:
            return
        add = self._handles.append
        self.error = unsupported()
        if self.error is not None:
            return
        try:
            layers = find_layers(chunks)
            session = _Session(layers, _model_storages(chunks), self.warn)
            self._session = session
            guarded = session.guarded
            for chunk in chunks:
                add(nn.Module.register_forward_pre_hook(chunk, guarded(session.begin)))
                add(nn.Module.register_forward_hook(chunk, guarded(session.end), always_call=True))
            for index, layer in enumerate(layers):
                if layer.module is not None:
                    entered = guarded(session.layer_entered(index))
                    add(nn.Module.register_forward_pre_hook(layer.module, entered, with_kwargs=True))
                    add(nn.Module.register_forward_hook(layer.module, guarded(session.layer_left), always_call=True))
            for param in {id(p): p for chunk in chunks for p in nn.Module.parameters(chunk)}.values():
                if param.requires_grad:
                    add(param.register_post_accumulate_grad_hook(guarded(session.grad_accumulated)))
        except Exception as error:  # a module that refuses hooks, a parameter without storage: never a failed step
            self._remove()
            self._session = None
            self.error = f"{type(error).__name__}: {error}"
            return
        self.armed = True

    def open_microbatch(self) -> None:
        """Begin a microbatch here, for a framework whose step is not a module's forward (Lightning's
        ``training_step``): as a chunk's forward pre-hook would. A chunk forward inside it is nested."""
        if self._session is not None:
            self._session.begin(None, ())

    def close_microbatch(self) -> None:
        """End the microbatch ``open_microbatch`` began (before its backward). No-op if none is open."""
        if self._session is not None and self._session.opened:
            self._session.end(None, (), None)

    def finish(self) -> Measurement | None:
        """Stop measuring and return what was seen (None: not armed, or no microbatch ran)."""
        session, self._session = self._session, None
        self._remove()
        self.armed = False
        return None if session is None else session.measurement()

    def _remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()


def _outer_hooks_binding():
    """torch's reader of the saved-tensor hooks installed now (private: present since about torch
    2.8, its signature has changed before), or None where this torch has none."""
    autograd = getattr(torch._C, "_autograd", None)
    return getattr(autograd, "_top_saved_tensors_default_hooks", None)


def unsupported() -> str | None:
    """Why this torch cannot be measured, or None. The meter chains the user's own saved-tensor hooks
    (``save_on_cpu``...) and must read them; without the reader it would silently override them, so
    it measures nothing instead. Checked at every arm (cheap: one call)."""
    binding = _outer_hooks_binding()
    if binding is None:
        return f"torch {torch.__version__} has no torch._C._autograd._top_saved_tensors_default_hooks"
    try:
        found = binding(False)
    except Exception as error:  # a changed signature: TypeError, or anything else
        return f"torch {torch.__version__}'s _top_saved_tensors_default_hooks(False) failed ({error!r})"
    if found is not None and not (isinstance(found, tuple) and len(found) == 2 and all(map(callable, found))):
        return f"torch {torch.__version__}'s _top_saved_tensors_default_hooks returned {type(found).__name__}"
    return None


def _model_storages(chunks) -> set:
    """The storage addresses of the model's parameters and buffers: model state, never activations."""
    keys = set()
    for chunk in chunks:
        for tensor in (*nn.Module.parameters(chunk), *nn.Module.buffers(chunk)):
            if tensor.device.type != "meta":
                keys.add(storage_of(tensor)[0])
    return keys


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _Micro:
    """One microbatch: the storages it holds (key -> [holders, bytes]) and its totals."""

    __slots__ = ("session", "refs", "total", "live", "layer_bytes", "layer_inputs", "layers_run", "inputs_seen")

    def __init__(self, session, layers: int):
        self.session = session
        self.refs: dict = {}
        self.total = 0
        self.live = 0
        self.layer_bytes = [0] * layers
        self.layer_inputs = [0] * layers
        self.layers_run: set = set()
        self.inputs_seen: set = set()  # storages some layer took as input (each counted once)


class _Held:
    """What autograd keeps in place of a saved tensor: the packed value, and who to tell at release."""

    __slots__ = ("packed", "unpack", "micro", "key")

    def __init__(self, packed, unpack, micro, key):
        self.packed, self.unpack, self.micro, self.key = packed, unpack, micro, key

    def __del__(self):
        if self.micro is not None:
            try:
                self.micro.session.release(self.micro, self.key)
            except Exception:  # noqa: S110 -- at interpreter exit, or a count already dropped: nothing to tell
                pass


class _Session:
    """One armed iteration's counts. Holders released after it ended update only it."""

    def __init__(self, layers: list[Layer], excluded: set, warn: Callable[..., object]):
        self.warn = warn
        self.layers = layers
        self.other = len(layers) - 1
        self.excluded = excluded
        self.micros: list[_Micro] = []
        self.micro: _Micro | None = None  # the microbatch whose forward is running
        self.outer: Any = None  # the saved-tensor hooks installed outside that forward, chained
        self.opened: list = []  # per chunk forward entered: its hooks context, or None
        self.layer_stack: list[int] = []
        self.live = self.peak = 0
        self.holders: dict = {}  # storage key -> how many microbatches hold it (the live total counts it once)
        self.live_micros = self.peak_micros = 0
        self.grads: dict = {}
        self.host_idle_rss_gb: float | None = None

    # -- never into training ------------------------------------------------------------------
    def guarded(self, hook: Callable) -> Callable:
        """``hook`` that returns None instead of raising: a failure is said once per kind of error."""

        @functools.wraps(hook)
        def run(*args, **kwargs):
            try:
                return hook(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 -- never into the forward or backward
                self.say(
                    ("hook", getattr(hook, "__name__", "hook"), type(error).__name__),
                    f"the activation meter's {getattr(hook, '__name__', 'hook')} hook failed "
                    f"({type(error).__name__}: {error}); training goes on, this iteration's activations may be "
                    f"undercounted",
                )
                return None

        return run

    def say(self, key, text: str) -> None:
        try:
            self.warn(("activations",) + key, text)
        except Exception:  # noqa: S110 -- a notice never fails training
            pass

    def sized(self, tensor) -> tuple[int, int] | None:
        """(key, bytes) of ``tensor``'s storage (composition.storage_of); where reading it raises
        anything, (id, nominal bytes), or None when even those cannot be read. Said once per class
        of tensor; never raises."""
        try:
            return storage_of(tensor)
        except Exception as error:  # noqa: BLE001 -- a subclass may raise anything from its storage
            try:
                found, how = (id(tensor), tensor.numel() * tensor.element_size()), "counted at their nominal size"
            except Exception:  # noqa: BLE001
                found, how = None, "not counted"
            self.say(
                ("unreadable", type(tensor).__qualname__),
                f"the storage of a tensor of class {type(tensor).__qualname__} cannot be read "
                f"({type(error).__name__}: {error}); such tensors are {how} (numel x element size)",
            )
            return found

    # -- microbatches: a chunk's forward ------------------------------------------------------
    def begin(self, module, args) -> None:
        if self.micro is not None or not torch.is_grad_enabled() or _in_backward():
            self.opened.append(None)  # nested, no grad, or a recompute: not a microbatch
            return
        try:  # hooks may be disabled here (torch.autograd.graph.disable_saved_tensors_hooks): not measured
            outer = _outer_hooks_binding()(False)
            hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)
            hooks.__enter__()
        except Exception:  # noqa: BLE001 -- never into the forward: this microbatch is not measured
            self.opened.append(None)
            return
        if not self.micros and not torch.cuda.is_initialized():  # CPU: the idle size, before any microbatch
            self.host_idle_rss_gb = host_idle.idle_rss_gb()
        micro = _Micro(self, len(self.layers))
        self.micros.append(micro)
        self.micro, self.outer = micro, outer
        self.opened.append(hooks)

    def end(self, module, args, output) -> None:
        hooks = self.opened.pop() if self.opened else None
        if hooks is not None:
            hooks.__exit__(None, None, None)
            self.micro = None
            self.layer_stack.clear()

    # -- layers -------------------------------------------------------------------------------
    def layer_entered(self, index: int):
        def entered(module, args, kwargs) -> None:
            micro = self.micro
            if micro is None or _in_backward():
                return
            self.layer_stack.append(index)
            if index not in micro.layers_run:
                micro.layers_run.add(index)
                micro.layer_inputs[index] += self.new_inputs(micro, (*args, *kwargs.values()))

        return entered

    def new_inputs(self, micro: _Micro, values) -> int:
        """The bytes of the tensor storages among ``values`` that no layer of ``micro`` took as input
        before (a mask or rotary embedding every layer takes counts once, at its first layer);
        parameters' storages left out."""
        added = 0
        for value in values:
            found = self.sized(value) if isinstance(value, torch.Tensor) else None
            if found is not None:
                key, nbytes = found
                if key not in micro.inputs_seen and key not in self.excluded:
                    micro.inputs_seen.add(key)
                    added += nbytes
        return added

    def layer_left(self, module, args, output) -> None:
        if self.micro is not None and self.layer_stack and not _in_backward():
            self.layer_stack.pop()

    # -- saved tensors ------------------------------------------------------------------------
    def pack(self, tensor):
        outer = self.outer
        packed = outer[0](tensor) if outer is not None else tensor.detach()
        unpack = outer[1] if outer is not None else None
        micro = self.micro
        if micro is None:
            return _Held(packed, unpack, None, None)
        try:  # the count never fails a forward: a tensor it cannot read is not counted
            found = self.sized(tensor)
            if found is None:
                return _Held(packed, unpack, None, None)
            key, nbytes = found
            if nbytes == 0 or key in self.excluded:
                return _Held(packed, unpack, None, None)
            self.hold(micro, key, nbytes)
        except Exception:
            return _Held(packed, unpack, None, None)
        return _Held(packed, unpack, micro, key)

    def hold(self, micro: _Micro, key, nbytes: int) -> None:
        entry = micro.refs.get(key)
        if entry is not None:
            entry[0] += 1
            return
        micro.refs[key] = [1, nbytes]
        micro.total += nbytes
        micro.layer_bytes[self.layer_stack[-1] if self.layer_stack else self.other] += nbytes
        if not micro.live:
            self.live_micros += 1
            self.peak_micros = max(self.peak_micros, self.live_micros)
        micro.live += nbytes
        holders = self.holders.get(key, 0)
        self.holders[key] = holders + 1
        if not holders:  # a storage several microbatches keep (a cached rotary embedding) is held once
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def release(self, micro: _Micro, key) -> None:
        entry = micro.refs[key]
        entry[0] -= 1
        if entry[0]:
            return
        del micro.refs[key]
        micro.live -= entry[1]
        holders = self.holders.pop(key) - 1
        if holders:
            self.holders[key] = holders
        else:
            self.live -= entry[1]
        if not micro.live:
            self.live_micros -= 1

    # -- gradients ----------------------------------------------------------------------------
    def grad_accumulated(self, param) -> None:
        grad = param.grad
        found = self.sized(grad) if grad is not None else None
        if found is not None:
            key, nbytes = found
            self.grads[id(param)] = (key, nbytes, grad.numel() * grad.element_size())

    def measurement(self) -> Measurement | None:
        counted = [m for m in self.micros if m.total]
        if not counted:
            return None
        layer_activations, layer_inputs = [], []
        for index in range(len(self.layers)):
            ran = [m for m in self.micros if index in m.layers_run] if index != self.other else counted
            layer_activations.append(sum(m.layer_bytes[index] for m in ran) / len(ran) / GB if ran else 0.0)
            layer_inputs.append(sum(m.layer_inputs[index] for m in ran) / len(ran) / GB if ran else 0.0)
        return Measurement(
            activations_gb=self.peak / GB,
            microbatches_in_flight=self.peak_micros,
            activations_per_microbatch_gb=sum(m.total for m in counted) / len(counted) / GB,
            microbatches=len(counted),
            layers=tuple(self.layers),
            layer_activations_gb=tuple(layer_activations),
            layer_inputs_gb=tuple(layer_inputs),
            grads=dict(self.grads),
            host_idle_rss_gb=self.host_idle_rss_gb,
        )


def _unpack(held: _Held):
    return held.packed if held.unpack is None else held.unpack(held.packed)
