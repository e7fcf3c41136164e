"""The demo's model, its synthetic data, and its 1F1B pipeline schedule. Plain torch.

One pipeline stage is ``layers_per_stage`` pre-LayerNorm transformer blocks. The first
stage also owns the token and position embeddings; the last owns the final LayerNorm,
the LM head and the loss. Stages exchange real activations (forward) and gradients
(backward) with torch.distributed point-to-point ops, so this runs on gloo (CPU) and
NCCL (GPU) alike. megatron-core's own schedules and p2p module are not used: they call
torch.cuda and do not run on CPU.

Why the first stage holds the most memory: under 1F1B, stage ``s`` of ``p`` runs
``p - s - 1`` warm-up forwards before its first backward, so it keeps the activations
of up to ``p - s`` microbatches alive at once: ``p`` on the first stage, 1 on the last.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

#: Share of tokens drawn at random instead of following the pattern: the loss floor.
NOISE = 0.1


@dataclass(frozen=True)
class Pipeline:
    """Where this process sits: its stage, and its neighbours' global ranks (None at the ends)."""

    stage: int
    stages: int
    prev_rank: int | None
    next_rank: int | None
    device: torch.device

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


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


def build_stage(model_cfg, seq_len: int, pipe: Pipeline, seed: int) -> Stage:
    """This stage's module, initialised from (seed, stage): data-parallel replicas start equal."""
    torch.manual_seed(seed * 1000 + pipe.stage)
    return Stage(model_cfg, seq_len, pipe.first, pipe.last).to(pipe.device)


def synthetic_microbatch(train_cfg, vocab: int, iteration: int, dp_rank: int, index: int):
    """(inputs, labels), each (micro_batch_size, seq_len) token ids, made on the fly.

    Each sequence walks a fixed random permutation of the vocabulary (the pattern to
    learn: next token = successor[token]), with NOISE of the tokens random instead. The
    first stage uses the inputs and the last the labels; both build the same batch from
    the same seeds, so tokens never travel down the pipeline.
    """
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(train_cfg.seed))
    rng = torch.Generator().manual_seed(((train_cfg.seed * 100_003 + iteration) * 1009 + dp_rank) * 1009 + index)
    size = (train_cfg.micro_batch_size, train_cfg.seq_len + 1)
    noise = torch.randint(vocab, size, generator=rng)
    is_noise = torch.rand(size, generator=rng) < NOISE
    tokens = torch.empty(size, dtype=torch.long)
    tokens[:, 0] = noise[:, 0]
    for t in range(1, size[1]):
        tokens[:, t] = torch.where(is_noise[:, t], noise[:, t], successor[tokens[:, t - 1]])
    return tokens[:, :-1], tokens[:, 1:]


def one_f_one_b(module: Stage, pipe: Pipeline, count: int, data, hidden_shape: tuple) -> float | None:
    """Run one iteration's forward and backward passes over ``count`` microbatches on the 1F1B schedule.

    ``data(i)`` gives microbatch i's (inputs, labels); only the first and last stages call
    it. Gradients accumulate in ``module``'s parameters (each loss is divided by
    ``count``). Returns the mean loss on the last stage, None elsewhere. Every stage of
    the pipeline must call it with the same ``count``.
    """
    warmup = min(pipe.stages - pipe.stage - 1, count)
    in_flight: deque = deque()  # (input, output) of each microbatch whose backward is pending
    losses = []

    def forward(index, received):
        inputs, labels = data(index) if pipe.first or pipe.last else (None, None)
        x = inputs.to(pipe.device) if pipe.first else received
        out = module(x)
        if pipe.last:
            out = F.cross_entropy(out.flatten(0, 1), labels.to(pipe.device).flatten()) / count
            losses.append(out.detach())
        in_flight.append((x, out))
        return None if pipe.last else out

    def backward(grad_output):
        x, out = in_flight.popleft()
        torch.autograd.backward(out, grad_tensors=grad_output)
        return None if pipe.first else x.grad

    p2p = _PointToPoint(pipe, hidden_shape)
    for index in range(warmup):
        p2p.send_forward(forward(index, p2p.recv_forward()))
    received = p2p.recv_forward() if warmup < count else None
    for index in range(warmup, count):
        grad_output = p2p.send_forward_recv_backward(forward(index, received))
        grad_input = backward(grad_output)
        if index == count - 1:
            p2p.send_backward(grad_input)
        else:
            received = p2p.send_backward_recv_forward(grad_input)
    for _ in range(warmup):  # cool-down: the backwards of the warm-up forwards
        p2p.send_backward(backward(p2p.recv_backward()))
    return float(torch.stack(losses).sum()) if pipe.last else None


class _PointToPoint:
    """The point-to-point moves of a 1F1B stage; a no-op toward a pipeline end. Sends and receives of
    one move are posted together (batch_isend_irecv) so facing neighbours never deadlock."""

    def __init__(self, pipe: Pipeline, hidden_shape: tuple):
        self.pipe = pipe
        self.shape = hidden_shape

    def recv_forward(self):
        return self._exchange(recv_from=self.pipe.prev_rank, wants_grad=True)

    def send_forward(self, output):
        self._exchange(send=output, send_to=self.pipe.next_rank)

    def recv_backward(self):
        return self._exchange(recv_from=self.pipe.next_rank)

    def send_backward(self, grad_input):
        self._exchange(send=grad_input, send_to=self.pipe.prev_rank)

    def send_forward_recv_backward(self, output):
        return self._exchange(send=output, send_to=self.pipe.next_rank, recv_from=self.pipe.next_rank)

    def send_backward_recv_forward(self, grad_input):
        return self._exchange(
            send=grad_input, send_to=self.pipe.prev_rank, recv_from=self.pipe.prev_rank, wants_grad=True
        )

    def _exchange(self, send=None, send_to=None, recv_from=None, wants_grad=False):
        ops = []
        if send_to is not None:
            ops.append(dist.P2POp(dist.isend, send.detach().contiguous(), send_to))
        received = None
        if recv_from is not None:
            received = torch.empty(self.shape, device=self.pipe.device)
            ops.append(dist.P2POp(dist.irecv, received, recv_from))
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
        return received.requires_grad_() if wants_grad and received is not None else received


def learning_rate(iteration: int, iters: int, peak: float) -> float:
    """Linear warm-up over the first 10% of iterations, then cosine decay to 10% of peak."""
    warmup = max(1, iters // 10)
    if iteration <= warmup:
        return peak * iteration / warmup
    progress = (iteration - warmup) / max(1, iters - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
