"""megatron-core's own training stack on a CPU-only machine: ``GPTModel`` (local layer spec) in
Megatron's ``DistributedDataParallel``, Megatron's optimizer (plain or distributed) and
``get_forward_backward_func()``'s schedule (1F1B or interleaved), over gloo.

Nothing here imitates Megatron: it builds and drives Megatron's own classes. Only Megatron's GPU
assumptions are stood in for, each named in ``STAND_INS`` with why, all installed together by
``cpu_stand_ins()`` and removed on exit. They redirect what Megatron's modules see; torch itself,
torch.distributed and nemo_memlog see the real torch. On a GPU none is installed
(``cpu_stand_ins(on_cpu=False)`` is a null context).

A version that lacks a place a stand-in needs (a module, a function moved) fails at once with
``StandInError`` naming it; nothing falls back silently. Tested on megatron-core 0.19.2 (``.venv``)
and 0.16.1 (``.venv-bridge03``).

One job per call of ``build(spec)`` on every rank of a gloo group; ``job.train_iteration()`` runs one
iteration of Megatron's schedule and its optimizer step. ``SavedTensorCount`` is the count made apart
that the tests hold the product's activation figures against.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from dataclasses import dataclass, field
from typing import Any

#: Each stand-in and why it exists (the demo names them in one line at start).
STAND_INS = {
    "current_device": "torch.cuda.current_device() is 'cpu' (Megatron uses it as a tensor's device)",
    "cuda_tensors": (
        "tensors made with device='cuda' (torch.zeros/empty/tensor/ones/full/arange) go to the CPU, as seen from "
        "Megatron's schedules, p2p, utils, optimizer and distributed modules"
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
    "tensor_type": "Tensor.type() with no argument names a CPU tensor by its torch.cuda.* twin (the optimizers check it)",
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
)
_MAKERS = ("zeros", "empty", "tensor", "ones", "full", "arange")


class StandInError(RuntimeError):
    """This megatron-core lacks a place a stand-in needs: the message names it."""


def summary() -> str:
    """The stand-ins in one line."""
    return "megatron-core on CPU, with stand-ins for its GPU assumptions: " + "; ".join(STAND_INS.values())


def _cpu_device(device):
    return "cpu" if device is not None and str(device).startswith("cuda") else device


def _cpu_torch():
    import torch

    def maker(name):
        real = getattr(torch, name)

        def made(*args, device=None, **kwargs):
            return real(*args, device=_cpu_device(device), **kwargs)

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


def _need(module, name: str):
    if not hasattr(module, name):
        raise StandInError(f"{module.__name__} has no {name}: the CPU stand-ins need it (megatron-core moved it?)")
    return getattr(module, name)


@contextlib.contextmanager
def cpu_stand_ins(on_cpu: bool = True):
    """Within the block, Megatron's GPU assumptions point at the CPU (STAND_INS). Restores all on exit."""
    if not on_cpu:
        yield
        return
    import torch

    import megatron.core.tensor_parallel.random as rng

    _need(rng, "get_cuda_rng_tracker")
    for name in ("_set_cuda_rng_state",):
        _need(rng, name)
    undo: list = []

    def swap(owner, name, value):
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    replacement = _cpu_torch()
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


# ---- one job --------------------------------------------------------------------------------


@dataclass
class JobSpec:
    """One Megatron job's shape. ``pp``, ``tp``, ``vpp`` must match the world (dp = world / (pp * tp))."""

    pp: int = 2
    tp: int = 1
    vpp: int | None = None  # virtual pipeline size: the interleaved schedule
    layers: int = 4
    first_stage_layers: int | None = None  # uneven stages: num_layers_in_first_pipeline_stage
    last_stage_layers: int | None = None
    hidden: int = 64
    heads: int = 4
    seq: int = 64
    vocab: int = 256
    micro_batch_size: int = 2
    microbatches: int = 4
    distributed_optimizer: bool = False
    recompute: str | None = None  # "full" (uniform, 1 layer) or "selective"
    seed: int = 1234

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    def facts(self) -> dict:
        """What a training_log caller states of this job (``facts=``)."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "microbatches": self.microbatches,
            "distributed_optimizer": self.distributed_optimizer,
            "recompute": self.recompute or "none",
            "schedule": "interleaved" if self.vpp else "1f1b",
        }


def layout(spec: JobSpec) -> None:
    """Megatron's groups for ``spec`` (replacing any set up before) on the default process group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vpp,
    )


def transformer_config(spec: JobSpec):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    recompute: dict[str, Any] = {}
    if spec.recompute == "full":
        recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    elif spec.recompute == "selective":
        recompute = {"recompute_granularity": "selective"}
    uneven = {}
    if spec.first_stage_layers is not None:
        uneven["num_layers_in_first_pipeline_stage"] = spec.first_stage_layers
    if spec.last_stage_layers is not None:
        uneven["num_layers_in_last_pipeline_stage"] = spec.last_stage_layers
    return TransformerConfig(
        num_layers=spec.layers,
        hidden_size=spec.hidden,
        num_attention_heads=spec.heads,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vpp,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        **recompute,
        **uneven,
    )


@dataclass
class Job:
    """A built job on this rank: the model chunks (each in Megatron's DDP), the optimizer, the config."""

    spec: JobSpec
    model: list
    optimizer: Any
    config: Any
    forward_backward: Any
    iteration: int = 0
    losses: list = field(default_factory=list)

    def data(self, chunk: int):
        """One iteration's microbatches for ``chunk``: a fixed synthetic batch, the same on every rank."""
        import torch

        spec = self.spec
        generator = torch.Generator().manual_seed(spec.seed + self.iteration)
        for _ in range(spec.microbatches):
            tokens = torch.randint(0, spec.vocab, (spec.micro_batch_size, spec.seq), generator=generator)
            yield {
                "tokens": tokens,
                "labels": torch.roll(tokens, -1, dims=1),
                "position_ids": torch.arange(spec.seq).unsqueeze(0).expand(spec.micro_batch_size, -1),
                "loss_mask": torch.ones(spec.micro_batch_size, spec.seq),
                # Megatron's convention: True where attention is masked out (causal)
                "attention_mask": torch.triu(torch.ones(spec.seq, spec.seq, dtype=torch.bool), diagonal=1)[None, None],
            }

    def train_iteration(self, around=contextlib.nullcontext) -> float | None:
        """One iteration of Megatron's schedule and optimizer step; ``around()``: a context the schedule
        runs in (a count made apart). Returns the mean loss on the last stage, else None."""
        spec = self.spec
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        iterators = [self.data(i) for i in range(spec.chunks)]
        with cpu_stand_ins(), around():
            losses = self.forward_backward(
                forward_step_func=_forward_step,
                data_iterator=iterators if spec.vpp else iterators[0],
                model=self.model if spec.vpp else self.model[0],
                num_microbatches=spec.microbatches,
                seq_length=spec.seq,
                micro_batch_size=spec.micro_batch_size,
                forward_only=False,
            )
        with cpu_stand_ins():
            self.optimizer.step()
        self.iteration += 1
        if not losses:
            return None
        loss = float(sum(float(entry["lm loss"]) for entry in losses) / len(losses))
        self.losses.append(loss)
        return loss


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    mask = batch["loss_mask"]

    def loss_func(output_tensor):
        loss = (output_tensor.float() * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides the loss in place

    return output, loss_func


def build(spec: JobSpec) -> Job:
    """Megatron's groups, its GPTModel chunks in its DDP, its optimizer and schedule, for ``spec``."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    layout(spec)
    torch.manual_seed(spec.seed)
    config = transformer_config(spec)
    chunks = []
    with cpu_stand_ins():
        for vp_stage in range(spec.chunks):
            vp = vp_stage if spec.vpp else None
            kwargs = {"vp_stage": vp} if spec.vpp else {}
            pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, **kwargs)
            post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, **kwargs)
            model = GPTModel(
                config=config,
                transformer_layer_spec=get_gpt_layer_local_spec(),
                vocab_size=spec.vocab,
                max_sequence_length=spec.seq,
                pre_process=pre,
                post_process=post,
                share_embeddings_and_output_weights=False,
                **kwargs,
            )
            chunks.append(model)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=spec.distributed_optimizer,
            overlap_grad_reduce=False,
        )
        model = [
            DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0)
            for index, chunk in enumerate(chunks)
        ]
        optimizer_config = OptimizerConfig(
            optimizer="adam",
            lr=1e-4,
            clip_grad=0.0,
            params_dtype=torch.float32,
            use_distributed_optimizer=spec.distributed_optimizer,
        )
        optimizer = get_megatron_optimizer(optimizer_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [chunk.no_sync for chunk in model] if spec.vpp else model[0].no_sync
    return Job(spec, model, optimizer, config, get_forward_backward_func())


# ---- the count made apart -------------------------------------------------------------------


class SavedTensorCount:
    """Every tensor autograd saves while installed (outermost saved-tensor hooks, around the whole
    schedule), each storage counted once while any holder of it lives, parameters' and buffers'
    storages left out: ``peak_bytes`` is the most held at once. What a recompute saves during the
    backward (full recompute's layer forward, run again) is that backward's working set, held for
    one layer at a time: not counted, as nemo_memlog does not count it among activations either (on a
    GPU it is among the temporaries). Independent of nemo_memlog's meter, which nests inside each
    chunk's forward and chains to it."""

    def __init__(self, model) -> None:
        from torch import nn

        self.excluded = {
            t.untyped_storage().data_ptr()
            for chunk in model
            for t in (*nn.Module.parameters(chunk), *nn.Module.buffers(chunk))
        }
        self.refs: dict = {}
        self.live = self.peak_bytes = 0

    def __call__(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor):
        import torch

        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        in_backward = torch._C._current_graph_task_id() != -1  # a recompute: its working set, not retained
        if key in self.excluded or storage.nbytes() == 0 or in_backward:
            return (tensor.detach(), None)
        entry = self.refs.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak_bytes = max(self.peak_bytes, self.live)
        entry[0] += 1
        return (tensor.detach(), _Release(self, key))

    @staticmethod
    def _unpack(packed):
        return packed[0]

    def release(self, key) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]


class _Release:
    __slots__ = ("count", "key")

    def __init__(self, count, key):
        self.count, self.key = count, key

    def __del__(self):
        self.count.release(self.key)


def expected_in_flight(spec: JobSpec) -> int:
    """The chunk-forwards this rank's stage holds at once under Megatron's schedule, from Megatron's
    own warm-up count (``get_pp_rank_microbatches``), plus the one forward of the steady state."""
    from megatron.core.pipeline_parallel import schedules

    total, all_warmup, warmup, _ = schedules.get_pp_rank_microbatches(
        spec.microbatches, spec.chunks, spec.pp if spec.vpp else 1
    )[:4]
    return total if all_warmup else warmup + 1


# ---- a logged run, and what it is held against ----------------------------------------------


def counted_apart(job: Job) -> dict:
    """This rank's model state in bytes, counted from Megatron's own structures, not by walking
    storages as nemo_memlog does: the DDP buffers' sizes (params where the buffer holds them, else
    each parameter), and Adam's rule (exp_avg and exp_avg_sq per element of each parameter the
    torch optimizer steps, one 4-byte step each) for the optimizer state."""
    from torch import nn

    params = grads = 0
    for chunk in job.model:
        for buffer in chunk.buffers:  # Megatron's DDP: its list of param-and-grad buffers
            grads += buffer.grad_data.numel() * buffer.grad_data.element_size()
            if buffer.param_data is not None:
                params += buffer.param_data.numel() * buffer.param_data.element_size()
            else:
                params += sum(p.numel() * p.element_size() for p in buffer.params)
        in_buffers = {id(p) for buffer in chunk.buffers for p in buffer.params}
        params += sum(p.numel() * p.element_size() for p in nn.Module.parameters(chunk) if id(p) not in in_buffers)
    state = 0
    for optimizer in getattr(job.optimizer, "chained_optimizers", [job.optimizer]):
        for group in optimizer.optimizer.param_groups:
            for param in group["params"]:
                state += 2 * param.numel() * 4 + 4
    return {"params": params, "grads": grads, "optimizer_state": state}


def logged_run(spec: JobSpec, root: str, iterations: int = 2, interval: int = 2, **settings) -> dict:
    """Train ``iterations`` iterations of ``spec``, calling ``nemo_memlog.training_log`` after each
    with the model, optimizer and facts (a logging step every ``interval``), with a
    ``SavedTensorCount`` around each logging iteration's schedule. Returns this rank's view: its
    coordinates, the last logged dict, its per-layer record, the count made apart, Megatron's own
    in-flight count and model-state counts. Every rank of the world calls it."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state

    import nemo_memlog
    from nemo_memlog.measure import layer_record

    job = build(spec)
    logger = nemo_memlog.LoggerConfig(
        log_memory_to_tensorboard=True,
        tensorboard_log_interval=interval,
        tensorboard_dir=os.path.join(root, "tb"),
        **settings,
    )
    logged, counts = None, []
    for iteration in range(1, iterations + 1):
        count = SavedTensorCount(job.model)
        job.train_iteration(count if iteration % interval == 0 else contextlib.nullcontext)
        if iteration % interval == 0:
            counts.append(count.peak_bytes)
        out = nemo_memlog.training_log(
            iteration, logger, model=job.model, optimizer=job.optimizer, facts=spec.facts()
        )
        logged = out if out is not None else logged
    record_dir = os.path.join(root, "memory_records")
    with cpu_stand_ins():
        expected = expected_in_flight(spec)
    result = {
        "rank": dist.get_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "logged": logged,
        "layers": layer_record.read_rank(record_dir, dist.get_rank()),
        "saved_peak_bytes": counts[-1] if counts else None,
        "expected_in_flight": expected,
        "apart": counted_apart(job),
        "losses": job.losses,
    }
    nemo_memlog.close_writers()
    return result
