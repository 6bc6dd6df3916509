"""A nanoGPT-like decoder in plain PyTorch: the main example autopar plans and trains.

Token and position embeddings, pre-LayerNorm blocks with causal self-attention through
``scaled_dot_product_attention`` and a GELU MLP, a final LayerNorm and an LM head, trained with
cross-entropy. No dropout (it would make single-device parity meaningless on CPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    # No bias on the q/k/v projection (as in LLaMA): a key bias has an exactly-zero gradient
    # (softmax is shift invariant), so Adam turns float noise in it into full-size updates.
    qkv_bias: bool = False
    # "sdpa": F.scaled_dot_product_attention (a fused, flash-style kernel on GPUs). "math": the
    # scores are materialised (q @ k^T, causal mask, softmax, @ v), as stacks without flash
    # attention ran it (Megatron-LM 2021-2022): its (heads x seq x seq) tensors cost memory
    # traffic that a fused kernel avoids.
    attention: str = "sdpa"


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.attention not in ("sdpa", "math"):
            raise ValueError(f"GPTConfig.attention must be 'sdpa' or 'math', got {cfg.attention!r}")
        self.n_head = cfg.n_head
        self.attention = cfg.attention
        if cfg.attention == "math":
            causal = torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool).tril()
            self.register_buffer("causal", causal.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q * (C // self.n_head) ** -0.5) @ k.transpose(-2, -1)
            scores = scores.masked_fill(~self.causal[:, :, :T, :T], float("-inf"))
            y = F.softmax(scores, dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """nanoGPT's loop, greedy: append the most likely next token ``max_new_tokens`` times
        (the context cropped to ``block_size``)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.block_size:])
            idx = torch.cat([idx, logits[:, -1, :].argmax(dim=-1, keepdim=True)], dim=1)
        return idx


def gpt_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def gpt_shape(name: str) -> GPTConfig:
    """Published GPT shapes (vocab padded to a multiple of 128 as Megatron does)."""
    shapes = {
        "gpt2-small": GPTConfig(50304, 1024, 12, 12, 768, True),
        "gpt3-1.3b": GPTConfig(50304, 2048, 24, 16, 2048, True),
        "gpt3-13b": GPTConfig(50304, 2048, 40, 40, 5120, True),
        "gpt3-175b": GPTConfig(50304, 2048, 96, 96, 12288, True),
    }
    return shapes[name]


def example_batch(cfg: GPTConfig, batch: int, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    return idx.to(device), tgt.to(device)


def gpt3_175b():
    """CLI factory: ``autopar plan examples.gpt:gpt3_175b --cluster dgx-a100 --nodes 128``."""
    cfg = gpt_shape("gpt3-175b")
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.empty(1536, cfg.block_size, dtype=torch.long, device="meta")
    return model, (idx,), gpt_loss, idx


def gpt_small():
    """CLI factory: the tiny demo GPT with a batch of 8."""
    cfg = GPTConfig()
    model = GPT(cfg)
    idx, tgt = example_batch(cfg, 8)
    return model, (idx,), gpt_loss, tgt
