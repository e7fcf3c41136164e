"""The demo's job: megatron-core's own GPTModel in its DistributedDataParallel, its optimizer and
its ``get_forward_backward_func()`` schedule (1F1B, or interleaved with a virtual pipeline), on
synthetic data that can be learnt.

On a GPU per process everything is Megatron's as it is: the model on this process's GPU, NCCL,
no stand-ins. On CPU the job is built and stepped by ``nemo_memlog.testing.megatron_cpu`` (its
``build``), inside its stand-ins for Megatron's GPU assumptions (``megatron_cpu.summary()`` names
them), over gloo. ``DemoJob`` adds what the demo needs and ``JobSpec`` lacks: the device, the
data-parallel rank the data is drawn for, and learnable data.

Why the first stage holds the most memory: under 1F1B, stage ``s`` of ``p`` runs ``p - s - 1``
warm-up forwards before its first backward, so it keeps the activations of up to ``p - s``
microbatches alive at once: ``p`` on the first stage, 1 on the last.

``Block`` and ``Stage`` (plain torch, at the end) are not the demo's: they are the model of
``scripts/bench_overhead.py``'s activation-meter benchmark (docs/performance.md), kept as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from nemo_memlog.testing import megatron_cpu
from nemo_memlog.testing.megatron_cpu import Job, JobSpec, cpu_stand_ins

#: Share of tokens drawn at random instead of following the pattern: the loss floor.
NOISE = 0.1


@dataclasses.dataclass
class DemoJob(Job):
    """megatron_cpu's Job, on ``device`` (a GPU: no stand-ins), fed ``synthetic_microbatch`` for ``dp_rank``."""

    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    dp_rank: int = 0

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def data(self, chunk: int):
        """This iteration's microbatches, the same for every chunk (the first uses the tokens, the last the labels)."""
        spec = self.spec
        causal = torch.triu(torch.ones(spec.seq, spec.seq, dtype=torch.bool), diagonal=1)[None, None]
        for index in range(spec.microbatches):
            tokens, labels = synthetic_microbatch(spec, self.iteration + 1, self.dp_rank, index)
            yield {
                "tokens": tokens.to(self.device),
                "labels": labels.to(self.device),
                "position_ids": torch.arange(spec.seq, device=self.device).expand(spec.micro_batch_size, -1),
                "loss_mask": torch.ones(spec.micro_batch_size, spec.seq, device=self.device),
                "attention_mask": causal.to(self.device),  # Megatron's convention: True where masked out
            }

    def train_iteration(self, around=contextlib.nullcontext) -> float | None:
        """One iteration of Megatron's schedule and optimizer step (the stand-ins on CPU only);
        the mean loss over the microbatches on a last stage, else None."""
        spec = self.spec
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        iterators = [self.data(i) for i in range(spec.chunks)]
        with cpu_stand_ins(on_cpu=self.on_cpu), around():
            losses = self.forward_backward(
                forward_step_func=forward_step,
                data_iterator=iterators if spec.vpp else iterators[0],
                model=self.model if spec.vpp else self.model[0],
                num_microbatches=spec.microbatches,
                seq_length=spec.seq,
                micro_batch_size=spec.micro_batch_size,
                forward_only=False,
            )
        with cpu_stand_ins(on_cpu=self.on_cpu):
            self.optimizer.step()
        self.iteration += 1
        if not losses:
            return None
        loss = sum(float(entry["lm loss"]) for entry in losses) / len(losses)
        self.losses.append(loss)
        return loss

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:  # what Megatron's OptimizerParamScheduler sets
            group["lr"] = lr

    def state_dict(self) -> dict:
        """This rank's model chunks and optimizer state, for a checkpoint."""
        return {
            "model": [chunk.state_dict() for chunk in self.model],
            "optimizer": self.optimizer.state_dict(),
            "iteration": self.iteration,
        }


def forward_step(data_iterator, model):
    """Megatron's forward step: the chunk's output, and a loss function for the last stage."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    mask = batch["loss_mask"]

    def loss_func(output_tensor):
        loss = (output_tensor.float() * mask).sum() / mask.sum()
        # A copy: the schedule divides the loss it is handed by the microbatch count in place.
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def build_job(spec: JobSpec, device: torch.device) -> DemoJob:
    """Megatron's groups, GPTModel chunks in its DDP, optimizer and schedule for ``spec`` on this rank:
    on CPU ``megatron_cpu.build``; on a GPU the same, on the GPU, with nothing stood in."""
    from megatron.core import parallel_state

    job = megatron_cpu.build(spec) if device.type == "cpu" else _build_on_gpu(spec, device)
    fields = {f.name: getattr(job, f.name) for f in dataclasses.fields(Job)}
    return DemoJob(**fields, device=device, dp_rank=parallel_state.get_data_parallel_rank())


def _build_on_gpu(spec: JobSpec, device: torch.device) -> Job:
    """``megatron_cpu.build`` without its stand-ins: each chunk moved to ``device`` before Megatron's DDP
    wraps it (as Megatron-LM does), and Megatron's CUDA RNG tracker seeded."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    megatron_cpu.layout(spec)
    torch.manual_seed(spec.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(spec.seed)
    config = megatron_cpu.transformer_config(spec)
    chunks = []
    for vp_stage in range(spec.chunks):
        kwargs = {"vp_stage": vp_stage} if spec.vpp else {}
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=get_gpt_layer_local_spec(),
                vocab_size=spec.vocab,
                max_sequence_length=spec.seq,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, **kwargs),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, **kwargs),
                share_embeddings_and_output_weights=False,
                **kwargs,
            ).to(device)
        )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=spec.distributed_optimizer, overlap_grad_reduce=False
    )
    model = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-4,
            clip_grad=0.0,  # as on CPU, where Megatron's clipping cannot run: the two runs stay alike
            params_dtype=torch.float32,
            use_distributed_optimizer=spec.distributed_optimizer,
        ),
        model,
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [chunk.no_sync for chunk in model] if spec.vpp else model[0].no_sync
    return Job(spec, model, optimizer, config, get_forward_backward_func())


def synthetic_microbatch(spec: JobSpec, iteration: int, dp_rank: int, index: int):
    """(tokens, labels), each (micro_batch_size, seq) token ids, made on the fly.

    Each sequence walks a fixed random permutation of the vocabulary (the pattern to learn: next
    token = successor[token]), with NOISE of the tokens random instead. Every stage builds the
    same batch from the same seeds, so tokens never travel down the pipeline.
    """
    successor = torch.randperm(spec.vocab, generator=torch.Generator().manual_seed(spec.seed))
    rng = torch.Generator().manual_seed(((spec.seed * 100_003 + iteration) * 1009 + dp_rank) * 1009 + index)
    size = (spec.micro_batch_size, spec.seq + 1)
    noise = torch.randint(spec.vocab, size, generator=rng)
    is_noise = torch.rand(size, generator=rng) < NOISE
    tokens = torch.empty(size, dtype=torch.long)
    tokens[:, 0] = noise[:, 0]
    for t in range(1, size[1]):
        tokens[:, t] = torch.where(is_noise[:, t], noise[:, t], successor[tokens[:, t - 1]])
    return tokens[:, :-1], tokens[:, 1:]


def learning_rate(iteration: int, iters: int, peak: float) -> float:
    """Linear warm-up over the first 10% of iterations, then cosine decay to 10% of peak."""
    warmup = max(1, iters // 10)
    if iteration <= warmup:
        return peak * iteration / warmup
    progress = (iteration - warmup) / max(1, iters - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


# ---- the benchmark's model (scripts/bench_overhead.py), not the demo's ----------------------------


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.mlp_in = nn.Linear(hidden, 4 * hidden)
        self.mlp_out = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(batch, seq, 3, self.heads, hidden // self.heads)
        q, k, v = qkv.transpose(1, 3).unbind(2)  # each (batch, heads, seq, head_dim)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(attended.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x))))


class Stage(nn.Module):
    """One pipeline stage. First stage: tokens in. Last stage: logits out. Else hidden -> hidden."""

    def __init__(self, model_cfg, seq_len: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed = nn.Embedding(model_cfg.vocab, model_cfg.hidden)
            self.position = nn.Parameter(0.02 * torch.randn(seq_len, model_cfg.hidden))
        self.blocks = nn.Sequential(
            *[Block(model_cfg.hidden, model_cfg.heads) for _ in range(model_cfg.layers_per_stage)]
        )
        if last:
            self.norm = nn.LayerNorm(model_cfg.hidden)
            self.head = nn.Linear(model_cfg.hidden, model_cfg.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x) + self.position
        x = self.blocks(x)
        return self.head(self.norm(x)) if self.last else x
