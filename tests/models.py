"""The small torch models the measurement tests share: blocks of LayerNorm, Linear, GELU, Linear."""

import torch
from torch import nn

WIDTH, BATCH = 32, 16


def blocks(count: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *[
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(count)
        ]
    )
