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
from dataclasses import dataclass, field
from typing import Any

from .stand_ins import STAND_INS, StandInError, cpu_stand_ins, summary

__all__ = ["STAND_INS", "StandInError", "cpu_stand_ins", "summary"]


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
    bf16: bool = False  # bf16 parameters (Megatron's Float16Module) and its mixed-precision optimizer
    rope: bool = False  # rotary position embeddings (each layer takes them by keyword), else learned
    seed: int = 1234
    device: str = "cpu"  # "cuda": on this rank's current GPU, as Megatron runs there, no stand-in

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

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
    if not spec.on_cpu:  # Megatron initialises its weights on the GPU through its CUDA RNG tracker
        from megatron.core.tensor_parallel import random as rng

        rng.model_parallel_cuda_manual_seed(spec.seed)


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
        use_cpu_initialization=spec.on_cpu,
        params_dtype=torch.bfloat16 if spec.bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if spec.bf16 else torch.float32,
        bf16=spec.bf16,
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
            batch = {
                "tokens": tokens,
                "labels": torch.roll(tokens, -1, dims=1),
                "position_ids": torch.arange(spec.seq).unsqueeze(0).expand(spec.micro_batch_size, -1),
                "loss_mask": torch.ones(spec.micro_batch_size, spec.seq),
                # Megatron's convention: True where attention is masked out (causal)
                "attention_mask": torch.triu(torch.ones(spec.seq, spec.seq, dtype=torch.bool), diagonal=1)[None, None],
            }
            yield {name: tensor.to(spec.device) for name, tensor in batch.items()}

    def train_iteration(self, around=contextlib.nullcontext) -> float | None:
        """One iteration of Megatron's schedule and optimizer step; ``around()``: a context the schedule
        runs in (a count made apart). Returns the mean loss on the last stage, else None."""
        spec = self.spec
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        iterators = [self.data(i) for i in range(spec.chunks)]
        with cpu_stand_ins(spec.on_cpu), around():
            losses = self.forward_backward(
                forward_step_func=forward_step,
                data_iterator=iterators if spec.vpp else iterators[0],
                model=self.model if spec.vpp else self.model[0],
                num_microbatches=spec.microbatches,
                seq_length=spec.seq,
                micro_batch_size=spec.micro_batch_size,
                forward_only=False,
            )
        with cpu_stand_ins(spec.on_cpu):
            self.optimizer.step()
        self.iteration += 1
        if not losses:
            return None
        loss = float(sum(float(entry["lm loss"]) for entry in losses) / len(losses))
        self.losses.append(loss)
        return loss


def forward_step(data_iterator, model):
    """Megatron's forward step contract: the model's output and the loss function over it."""
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
    from megatron.core.transformer.module import Float16Module

    layout(spec)
    torch.manual_seed(spec.seed)
    config = transformer_config(spec)
    chunks = []
    with cpu_stand_ins(spec.on_cpu):
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
                position_embedding_type="rope" if spec.rope else "learned_absolute",
                **kwargs,
            )
            if not spec.on_cpu:  # as Megatron-LM does, before its DDP wraps the chunk
                model = model.cuda(torch.cuda.current_device())
            chunks.append(Float16Module(config, model) if spec.bf16 else model)
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
            clip_grad=0.0,  # Megatron's clipping asserts CUDA gradients on CPU; off on a GPU too, so runs compare
            params_dtype=torch.bfloat16 if spec.bf16 else torch.float32,
            bf16=spec.bf16,
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
    torch optimizer steps, one 4-byte step each where torch keeps it beside the parameter, and the
    fp32 master copy where the parameter the torch optimizer steps is not the model's own) for the
    optimizer state."""
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
    model_storages = {p.untyped_storage().data_ptr() for chunk in job.model for p in nn.Module.parameters(chunk)}
    state = 0
    for optimizer in getattr(job.optimizer, "chained_optimizers", [job.optimizer]):
        for group in optimizer.optimizer.param_groups:
            for param in group["params"]:
                state += 2 * param.numel() * 4
                step = optimizer.optimizer.state.get(param, {}).get("step")
                if step is None or (hasattr(step, "device") and step.device == param.device):
                    state += 4  # Adam's step, where it lives beside the parameter (on a GPU torch keeps it on the CPU)
                if param.untyped_storage().data_ptr() not in model_storages:  # an fp32 master copy (bf16)
                    state += param.numel() * param.element_size()
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
        out = nemo_memlog.training_log(iteration, logger, model=job.model, optimizer=job.optimizer, facts=spec.facts())
        logged = out if out is not None else logged
    record_dir = os.path.join(root, "memory_records")
    with cpu_stand_ins(spec.on_cpu):
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


def recorded_stage_peaks(folder) -> dict[int, float]:
    """Per pipeline stage, the highest ``peak_host_rss_gb`` its ranks recorded in the per-layer
    records under ``folder`` (a ``memory_records`` folder): a run's peaks read apart from advice/,
    what its predictions are held against."""
    from nemo_memlog.measure import layer_record

    peaks: dict[int, float] = {}
    for record in layer_record.read_folder(folder):
        stage = int(record["pp_rank"])
        peaks[stage] = max(peaks.get(stage, 0.0), record["stage"]["peak_host_rss_gb"])
    return peaks
