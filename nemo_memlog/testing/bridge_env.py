"""Megatron-Bridge (0.3.1, 0.6.2) on a CPU-only machine: what stands in for the GPU it
assumes, and for the Python 3.12 that 0.4+ declare.

Three things, all for Megatron-Bridge's assumptions, never for nemo_memlog's code:

0. ``load()`` sets ``typing.override = typing_extensions.override`` on Python 3.11: the
   one 3.12-only feature on Bridge 0.6's import path (``from typing import override`` in
   megatron-core 0.19's ``megatron/training/models``). Anyone installing Bridge 0.6 on
   Python 3.11 needs the same two lines before importing it (docs/bridge.md). It also imports
   comet_ml without its import hooks first: on Bridge 0.6's import path transformers
   imports comet_ml, whose hooks would mirror Bridge's MLflow run into a Comet offline
   experiment in the working directory (``.cometml-runs``).

1. ``load()`` puts stand-ins for ``megatron.bridge.peft.lora_layers`` and
   ``megatron.bridge.peft.lora`` into ``sys.modules`` before importing
   ``megatron.bridge``. Its package ``__init__`` imports them unconditionally, and they
   import transformer_engine (a CUDA-only library) at import time. Nothing the tests
   run uses LoRA. transformer_engine itself is NOT stood in for: megatron-core probes
   for it and must see that it is absent. Every process that imports
   ``megatron.bridge`` (or ``nemo_memlog.bridge``, which imports its callbacks) calls
   ``load()`` first.

2. ``cpu_redirects()`` points the CUDA calls of Megatron-Bridge's ``training_log`` at the
   CPU, by replacing the name ``torch`` as seen from two modules only:
   ``megatron.bridge.training.utils.train_utils`` and ``megatron.core.timers``. The
   replacement passes every attribute through to torch except:
   - ``torch.cuda.current_device()`` -> ``"cpu"`` (used as a tensor's device);
   - ``torch.tensor(..., device="cuda")`` -> on the CPU (``total_loss_dict``);
   - ``torch.cuda.synchronize()`` -> nothing to wait for (the timers);
   - ``torch.cuda.memory_stats()`` -> this process's host memory in the allocator's
     statistic names (current = VmRSS, peak = VmHWM, counters 0). Without it
     Bridge's own memory report is empty on a CPU, and the tests could not see which
     stage Bridge logs (its last) or that the callback switched it off.
   torch itself, torch.distributed, and every other module (nemo_memlog included)
   see the real torch. The context manager restores both names on exit.
"""

from __future__ import annotations

import contextlib
import sys
import types

STAND_IN_MODULES = ("megatron.bridge.peft.lora_layers", "megatron.bridge.peft.lora")
REDIRECTED_MODULES = ("megatron.bridge.training.utils.train_utils", "megatron.core.timers")


def _stand_in(name: str) -> None:
    module = types.ModuleType(name)
    module.__file__ = "<stand-in>"

    def attribute(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {})  # a class per name: enough for imports and annotations

    module.__getattr__ = attribute
    sys.modules[name] = module


def load() -> None:
    """Import Megatron-Bridge's training modules (idempotent)."""
    from nemo_memlog.writers.comet import import_comet_ml

    typing_override()
    import_comet_ml()
    for name in STAND_IN_MODULES:
        if name not in sys.modules:
            _stand_in(name)
    import megatron.bridge.training.callbacks  # noqa: F401
    import megatron.bridge.training.config  # noqa: F401
    import megatron.bridge.training.state  # noqa: F401
    import megatron.bridge.training.utils.pg_utils  # noqa: F401
    import megatron.bridge.training.utils.train_utils  # noqa: F401


def typing_override() -> None:
    import typing

    if not hasattr(typing, "override"):  # Python < 3.12
        import typing_extensions

        typing.override = typing_extensions.override


def bridge_version() -> tuple[int, int]:
    """The installed Megatron-Bridge's (major, minor), for version-dependent expectations."""
    from importlib.metadata import version

    return tuple(int(part) for part in version("megatron-bridge").split(".")[:2])


def host_memory_stats() -> dict[str, int]:
    """torch.cuda.memory_stats()'s shape, filled with this process's host memory."""
    from nemo_memlog.rank.memory import host_rss_bytes

    rss, peak = host_rss_bytes()
    stats = {"num_alloc_retries": 0, "num_ooms": 0, "allocation.all.current": 0, "allocation.all.allocated": 0}
    for kind in ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes"):
        stats[f"{kind}.all.current"] = 0 if kind == "inactive_split_bytes" else rss
        stats[f"{kind}.all.peak"] = 0 if kind == "inactive_split_bytes" else peak
    return stats


def cpu_torch():
    import torch

    cuda = types.SimpleNamespace(
        current_device=lambda: "cpu",
        synchronize=lambda device=None: None,
        memory_stats=lambda device=None: host_memory_stats(),
    )

    class CpuCuda(types.ModuleType):
        def __getattr__(self, name):
            return getattr(cuda, name) if hasattr(cuda, name) else getattr(torch.cuda, name)

    class CpuTorch(types.ModuleType):
        cuda = CpuCuda("torch.cuda")

        @staticmethod
        def tensor(data, *args, device=None, **kwargs):
            if device is not None and str(device).startswith("cuda"):
                device = "cpu"
            return torch.tensor(data, *args, device=device, **kwargs)

        def __getattr__(self, name):
            return getattr(torch, name)

    return CpuTorch("torch")


@contextlib.contextmanager
def cpu_redirects():
    """Within the block, Bridge's training_log and megatron-core's timers run on the CPU."""
    load()
    modules = [sys.modules[name] for name in REDIRECTED_MODULES]
    originals = [module.torch for module in modules]
    replacement = cpu_torch()
    for module in modules:
        module.torch = replacement
    try:
        yield
    finally:
        for module, original in zip(modules, originals):
            module.torch = original
