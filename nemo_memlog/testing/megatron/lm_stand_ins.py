"""What stands in for the GPU assumptions of Megatron-LM's training loop (``megatron/training/``:
``pretrain`` -> ``train`` -> ``train_step`` -> ``training_log``, shipped in the megatron-core wheel
from 0.17) on a CPU-only machine, beside stand_ins.py's for megatron-core itself.

    from nemo_memlog.testing.megatron import lm_stand_ins
    lm_stand_ins.install()                 # every rank, before pretrain(...)
    pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step, ...)

with Megatron-LM's own flags ``--distributed-backend gloo --transformer-impl local
--no-persist-layer-norm --no-gradient-accumulation-fusion`` (its ``--mock-data --tokenizer-type
NullTokenizer --vocab-size N`` need no data). Each stand-in is listed in ``LM_STAND_INS`` with its
reason. ``install()`` is for a whole training process and is not undone: the process is the job.
It changes what Megatron's modules see, never what torch, torch.distributed or nemo_memlog see
(except ``Tensor.cuda()``/``Module.cuda()``, which return their object while CUDA is unavailable).
On a machine with CUDA it installs only the wheel's two (``typing_override``, ``compile_helpers``).
A megatron-core without the loop, or without a place a stand-in needs, fails with ``StandInError``
naming it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types

from .stand_ins import STAND_INS, StandInError, cpu_device, cpu_torch, need

#: Each stand-in beyond megatron_stand_ins.STAND_INS and why it exists.
LM_STAND_INS = {
    "typing_override": "typing.override on Python 3.11 (megatron-core 0.17+ imports it; it is 3.12's)",
    "compile_helpers": (
        "megatron.core.datasets.utils.compile_helpers does nothing: the wheel ships the compiled helper but no "
        "Makefile, so rank 0 exits at make (every wheel install, not only on CPU)"
    ),
    "allow_no_cuda": "initialize_megatron(allow_no_cuda=True): pretrain() does not pass it, and asserts CUDA",
    "model_parallel_groups": (
        "_initialize_distributed runs a second time while torch.cuda.device_count() reads 1: with no device it "
        "creates no tensor, pipeline or data-parallel group"
    ),
    "cuda_everywhere": (
        "in every loaded megatron.* module: device='cuda' tensors (also torch.rand/randn/randint) go to the CPU; "
        "torch.cuda's Stream/stream/empty_cache/set_device do nothing; the CUDA RNG state is the CPU's"
    ),
    "cuda_method": "Tensor.cuda() and Module.cuda() return their object while CUDA is unavailable",
    "memory_stats": (
        "torch.cuda.memory_stats(), as Megatron's modules see it, holds the four keys --log-memory-to-tensorboard "
        "reads, at 0 (on CPU it returns {} and the flag fails with KeyError); nemo_memlog reads the real one"
    ),
}

#: The keys Megatron-LM's training_log reads from torch.cuda.memory_stats() under its memory flag.
MEGATRON_LM_MEMORY_KEYS = (
    "reserved_bytes.all.current",
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "allocation.all.current",
)
#: Imported before the redirection, so that their name ``torch`` is redirected too (a module
#: first imported later keeps the real torch).
LOOP_MODULES = (
    "megatron.training.training",
    "megatron.training.initialize",
    "megatron.training.checkpointing",
    "megatron.training.utils",
    "megatron.training.global_vars",
    "megatron.core.datasets.gpt_dataset",
    "megatron.core.datasets.blended_megatron_dataset_builder",
    "megatron.core.rerun_state_machine",
    "megatron.core.num_microbatches_calculator",
)
_installed = False
_core = None  # megatron_stand_ins.cpu_stand_ins(), entered for the process


def has_loop() -> bool:
    """Whether this megatron-core ships Megatron-LM's loop (megatron/training/training.py), without importing it."""
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("megatron.core")
    except ImportError:  # no megatron at all
        return False
    return (
        spec is not None
        and spec.origin is not None
        and (Path(spec.origin).parents[1] / "training" / "training.py").is_file()
    )


def summary() -> str:
    """The stand-ins in one line."""
    return "Megatron-LM's loop on CPU, with stand-ins: " + "; ".join([*STAND_INS.values(), *LM_STAND_INS.values()])


def install() -> None:
    """Install the stand-ins for the rest of the process, once. The wheel's own two (``typing_override``,
    ``compile_helpers``) everywhere; the CPU ones (``STAND_INS`` and the rest of ``LM_STAND_INS``) only
    without CUDA."""
    global _installed
    import torch

    if _installed:
        return
    from ..bridge_env import typing_override

    typing_override()
    for name in LOOP_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise StandInError(f"megatron-core has no {name} ({error}): Megatron-LM's loop ships in 0.17+") from None
    import megatron.core.datasets.utils as dataset_utils

    need(dataset_utils, "compile_helpers")
    dataset_utils.compile_helpers = lambda: None
    if not torch.cuda.is_available():
        _on_cpu()
    _installed = True


def _on_cpu() -> None:
    import megatron.training.initialize as initialize
    import megatron.training.training as training
    import torch

    _core_stand_ins()
    replacement = _loop_torch()
    for module in _megatron_modules():
        module.torch = replacement
    no_cuda = functools.partial(need(initialize, "initialize_megatron"), allow_no_cuda=True)
    initialize.initialize_megatron = training.initialize_megatron = no_cuda
    initialize._initialize_distributed = _with_groups(need(initialize, "_initialize_distributed"), replacement)
    torch.Tensor.cuda = _self_without_cuda(torch.Tensor.cuda)
    torch.nn.Module.cuda = _self_without_cuda(torch.nn.Module.cuda)


def _loop_torch():
    """megatron_stand_ins's torch as Megatron's modules see it, with what the loop needs beyond it."""
    import torch

    replacement = cpu_torch()

    def maker(real):
        def made(*args, device=None, **kwargs):
            return real(*args, device=cpu_device(device), **kwargs)

        return made

    for name in ("rand", "randn", "randint", "zeros_like", "ones_like", "empty_like", "full_like"):
        setattr(replacement, name, maker(getattr(torch, name)))
    cuda = replacement.cuda

    class Stream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

        def synchronize(self):
            pass

    stats = dict.fromkeys(MEGATRON_LM_MEMORY_KEYS, 0)
    cuda.Stream = Stream
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.empty_cache = lambda: None
    cuda.set_device = lambda device: None
    cuda.device_count = lambda: 0
    cuda.memory_stats = lambda device=None: dict(stats)
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": None
    cuda.manual_seed = lambda seed: None
    return replacement


def _megatron_modules() -> list[types.ModuleType]:
    """Every loaded megatron.* module with the name ``torch`` (the real torch, or core's stand-in for it)."""
    return [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("megatron.") and getattr(getattr(module, "torch", None), "__name__", None) == "torch"
    ]


def _core_stand_ins() -> None:
    """megatron_stand_ins's stand-ins (the RNG tracker's fork, the CUDA RNG state, Tensor.type() and its
    torch for the modules it names), entered for the rest of the process: never exited."""
    global _core
    from .stand_ins import cpu_stand_ins

    _core = cpu_stand_ins()  # held: a generator context dropped unexited would run its restoring finally
    _core.__enter__()


def _with_groups(initialize_distributed, replacement):
    """``_initialize_distributed`` as Megatron calls it, then again while the device count reads 1, so
    it creates the model-parallel groups (with 0 devices it skips them)."""

    @functools.wraps(initialize_distributed)
    def initialized(*args, **kwargs):
        initialize_distributed(*args, **kwargs)
        replacement.cuda.device_count = lambda: 1
        try:
            initialize_distributed(*args, **kwargs)
        finally:
            replacement.cuda.device_count = lambda: 0

    return initialized


def _self_without_cuda(method):
    import torch

    @functools.wraps(method)
    def cuda(self, *args, **kwargs):
        if torch.cuda.is_available():
            return method(self, *args, **kwargs)
        return self

    return cuda


__all__ = ["LM_STAND_INS", "MEGATRON_LM_MEMORY_KEYS", "StandInError", "install", "summary"]
