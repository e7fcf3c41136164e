"""The demo's job: megatron-core's own GPTModel in its DistributedDataParallel, its optimizer and
its ``get_forward_backward_func()`` schedule (1F1B, or interleaved with a virtual pipeline), on
synthetic data that can be learnt.

The job is built and stepped by ``nemo_memlog.testing.megatron.cpu``: on a GPU per process
everything is Megatron's as it is (the model on this process's GPU, NCCL, no stand-ins); on CPU
inside its stand-ins for Megatron's GPU assumptions (``megatron_cpu.summary()`` names them), over
gloo. ``DemoJob`` adds what the demo needs: the data-parallel rank the data is drawn for, and
learnable data.

Why the first stage holds the most memory: under 1F1B, stage ``s`` of ``p`` runs ``p - s - 1``
warm-up forwards before its first backward, so it keeps the activations of up to ``p - s``
microbatches alive at once: ``p`` on the first stage, 1 on the last.

``Block`` and ``Stage`` (plain torch, at the end) are not the demo's: they are the model of
``scripts/bench_overhead.py``'s activation-meter benchmark (docs/performance.md), kept as it was.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from nemo_memlog.testing.megatron import cpu as megatron_cpu
from nemo_memlog.testing.megatron.cpu import Job, JobSpec

#: Share of tokens drawn at random instead of following the pattern: the loss floor.
NOISE = 0.1


@dataclasses.dataclass
class DemoJob(Job):
    """megatron_cpu's Job (built and stepped by it: on a GPU with no stand-in), fed
    ``synthetic_microbatch`` for ``dp_rank``."""

    dp_rank: int = 0

    @property
    def device(self) -> torch.device:
        return torch.device(self.spec.device)

    def data(self, chunk: int):
        """This iteration's microbatches, the same for every chunk (the first uses the tokens, the last the labels)."""
        spec = self.spec
        causal = torch.triu(torch.ones(spec.seq, spec.seq, dtype=torch.bool), diagonal=1)[None, None]
        for index in range(spec.microbatches):
            tokens, labels = synthetic_microbatch(spec, self.iteration + 1, self.dp_rank, index)
            batch = {
                "tokens": tokens,
                "labels": labels,
                "position_ids": torch.arange(spec.seq).expand(spec.micro_batch_size, -1),
                "loss_mask": torch.ones(spec.micro_batch_size, spec.seq),
                "attention_mask": causal,  # Megatron's convention: True where masked out
            }
            yield {name: tensor.to(spec.device) for name, tensor in batch.items()}

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


def build_job(spec: JobSpec, device: torch.device) -> DemoJob:
    """Megatron's groups, GPTModel chunks in its DDP, optimizer and schedule for ``spec`` on this rank
    (``megatron_cpu.build``: on CPU inside its stand-ins, on this process's GPU with none)."""
    from megatron.core import parallel_state

    job = megatron_cpu.build(dataclasses.replace(spec, device=device.type))
    fields = {f.name: getattr(job, f.name) for f in dataclasses.fields(Job)}
    return DemoJob(**fields, dp_rank=parallel_state.get_data_parallel_rank())


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
