"""A parameter-heavy MLP: wide Linear layers with GELU, trained with MSE."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"up": nn.Linear(dim, hidden), "down": nn.Linear(hidden, dim)}) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer["down"](F.gelu(layer["up"](x)))
        return x


def mlp_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def example_batch(dim: int = 64, batch: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, dim, generator=g), torch.randn(batch, dim, generator=g)
