"""What stands in for megatron-core's GPU assumptions on a CPU-only machine, in one place, each with
the reason it exists (``STAND_INS``). ``cpu_stand_ins()`` installs them all and removes them on exit;
they redirect what Megatron's modules see, never what torch, torch.distributed or nemo_memlog see. A
megatron-core that lacks a place one needs fails with ``StandInError`` naming it: nothing falls back
silently."""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

#: Each stand-in and why it exists (the demo names them in one line at start).
STAND_INS = {
    "current_device": "torch.cuda.current_device() is 'cpu' (Megatron uses it as a tensor's device)",
    "cuda_tensors": (
        "tensors made with device='cuda' (torch.zeros/empty/tensor/ones/full/arange) go to the CPU, as seen from "
        "Megatron's schedules, p2p, utils, optimizer, distributed and embeddings modules"
    ),
    "autocast": "the schedule's torch.autocast('cuda', ...) is a null context",
    "synchronize": "torch.cuda.synchronize() does nothing (nothing to wait for)",
    "current_stream": (
        "torch.cuda.current_stream() is a stream whose waits do nothing (the DDP grad sync waits on it; "
        "CPU work is in order)"
    ),
    "rng_tracker": (
        "tensor_parallel.random: the CUDA RNG tracker's fork is a null context, the CUDA RNG state is the "
        "CPU's and setting it does nothing (full recompute saves and restores it)"
    ),
    "tensor_type": (
        "Tensor.type() with no argument names a CPU tensor by its torch.cuda.* twin (the optimizers check it)"
    ),
    "clip_grad": "OptimizerConfig(clip_grad=0.0): Megatron's clipping asserts CUDA gradients",
}

#: The modules whose name ``torch`` is replaced (see STAND_INS["cuda_tensors"]); packages include their modules.
REDIRECTED = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.utils",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.tensor_parallel.random",
    "megatron.core.models.common.embeddings",  # rotary embeddings are made on torch.cuda.current_device()
)
_MAKERS = ("zeros", "empty", "tensor", "ones", "full", "arange")


class StandInError(RuntimeError):
    """This megatron-core lacks a place a stand-in needs: the message names it."""


def summary() -> str:
    """The stand-ins in one line."""
    return "megatron-core on CPU, with stand-ins for its GPU assumptions: " + "; ".join(STAND_INS.values())


def cpu_device(device):
    return "cpu" if device is not None and str(device).startswith("cuda") else device


def cpu_torch():
    import torch

    def maker(name):
        real = getattr(torch, name)

        def made(*args, device=None, **kwargs):
            return real(*args, device=cpu_device(device), **kwargs)

        return made

    stream = types.SimpleNamespace(
        wait_event=lambda event: None, wait_stream=lambda other: None, synchronize=lambda: None
    )
    cuda = types.SimpleNamespace(
        current_device=lambda: "cpu", synchronize=lambda device=None: None, current_stream=lambda device=None: stream
    )

    class CpuCuda(types.ModuleType):
        def __getattr__(self, name):
            return getattr(cuda, name) if hasattr(cuda, name) else getattr(torch.cuda, name)

    def autocast(device_type, *args, **kwargs):
        if str(device_type).startswith("cuda"):
            return contextlib.nullcontext()
        return torch.autocast(device_type, *args, **kwargs)

    class CpuTorch(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

    replacement = CpuTorch("torch")
    replacement.cuda = CpuCuda("torch.cuda")
    replacement.autocast = autocast
    for name in _MAKERS:
        setattr(replacement, name, maker(name))
    return replacement


def _modules(prefixes) -> list:
    """Every loaded module at or under each prefix that has the name ``torch``; each prefix must exist."""
    found = []
    for prefix in prefixes:
        try:
            importlib.import_module(prefix)
        except ImportError as error:
            raise StandInError(f"megatron-core has no module {prefix} ({error}): the CPU stand-ins need it") from None
        for name, module in list(sys.modules.items()):
            if (name == prefix or name.startswith(prefix + ".")) and getattr(module, "torch", None) is not None:
                found.append(module)
    return found


def need(module, name: str):
    if not hasattr(module, name):
        raise StandInError(f"{module.__name__} has no {name}: the CPU stand-ins need it (megatron-core moved it?)")
    return getattr(module, name)


@contextlib.contextmanager
def cpu_stand_ins(on_cpu: bool = True):
    """Within the block, Megatron's GPU assumptions point at the CPU (STAND_INS). Restores all on exit."""
    if not on_cpu:
        yield
        return
    import megatron.core.tensor_parallel.random as rng
    import torch

    need(rng, "get_cuda_rng_tracker")
    for name in ("_set_cuda_rng_state",):
        need(rng, name)
    undo: list = []

    def swap(owner, name, value):
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    replacement = cpu_torch()
    for module in _modules(REDIRECTED):
        swap(module, "torch", replacement)
    tracker_class = type(rng.get_cuda_rng_tracker())
    swap(tracker_class, "fork", lambda self, name=None: contextlib.nullcontext())
    swap(rng, "_set_cuda_rng_state", lambda *args, **kwargs: None)
    if hasattr(rng, "_get_cuda_rng_state"):
        swap(rng, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state())
    real_type = torch.Tensor.type

    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return real_type(self).replace("torch.", "torch.cuda.", 1)
        return real_type(self, dtype, non_blocking, **kwargs)

    swap(torch.Tensor, "type", tensor_type)
    try:
        yield
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)
