"""Small models written the way other code bases write them, for parity checks beyond the examples.

``ManualAttentionGPT``: nanoGPT's original attention (a causal-mask buffer, masked_fill, softmax,
matmuls) with tied embeddings. ``TinyLlama``: RMSNorm, rotary embeddings from cos/sin buffers,
grouped-query attention (repeat_interleave of k/v heads), SwiGLU MLP, no biases. ``SmallCNN``:
convolutions, BatchNorm (its running statistics are buffers updated in place), pooling.
``OddMLP``: no parameter dim divisible by 2 or 4, one smaller than 4 (ZeRO-3 must shard unevenly).
``ResidualMLP``: parameter-dominated pre-norm residual MLP blocks over [batch, sequence, dim]
(a transformer without attention: sequence parallelism has a norm output to split).
``WideEmbeddingMLP``: a token embedding far larger than the rest, mean-pooled, then small residual
MLP layers (a recommendation-style model): splitting the table and splitting the batch each win in
one part of it, so a pipeline's stages use one submesh axis differently.
``WhereLoopMoE``: a mixture-of-experts layer written as many tutorials write it: top-2 routing,
each expert (an ``nn.ModuleList`` of MLPs) computing on the rows ``torch.where`` picks, its gated
output ``index_add``-ed back (sizes that depend on the routing; ``autopar.data_dependent``).
``TinyEncoder``: bidirectional (non-causal) attention through ``scaled_dot_product_attention``
with a key padding mask computed from the tokens (token 0 is padding), learned positions,
per-token classification (a BERT-style encoder).
``RoutedResidualMLP``: residual layers whose first one also picks, per token, an integer index and
a boolean mask (routing-like values, no gradient) that the last layer reads: a pipeline cut between
them sends an integer, a boolean and a detached float across.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ManualAttentionGPT", "TinyLlama", "TinyEncoder", "SmallCNN", "OddMLP", "ResidualMLP", "RoutedResidualMLP", "WideEmbeddingMLP", "WhereLoopMoE", "lm_loss"]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1))


class _ManualAttention(nn.Module):
    def __init__(self, d: int, heads: int, T: int):
        super().__init__()
        self.h = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.h, C // self.h).transpose(1, 2)
        k = k.view(B, T, self.h, C // self.h).transpose(1, 2)
        v = v.view(B, T, self.h, C // self.h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class _ManualBlock(nn.Module):
    def __init__(self, d, heads, T):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = _ManualAttention(d, heads, T)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ManualAttentionGPT(nn.Module):
    def __init__(self, vocab=128, T=16, d=32, heads=4, layers=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(T, d)
        self.h = nn.ModuleList(_ManualBlock(d, heads, T) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class _RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _LlamaAttention(nn.Module):
    def __init__(self, d, heads, kv_heads):
        super().__init__()
        self.h, self.kv, self.hd = heads, kv_heads, d // heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = self.h // self.kv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class _LlamaBlock(nn.Module):
    def __init__(self, d, heads, kv_heads, ff):
        super().__init__()
        self.input_layernorm = _RMSNorm(d)
        self.self_attn = _LlamaAttention(d, heads, kv_heads)
        self.post_attention_layernorm = _RMSNorm(d)
        self.gate_proj = nn.Linear(d, ff, bias=False)
        self.up_proj = nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab=128, T=16, d=32, heads=4, kv_heads=2, ff=64, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_LlamaBlock(d, heads, kv_heads, ff) for _ in range(layers))
        self.norm = _RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        hd = d // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(T).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos()[None, None], persistent=False)
        self.register_buffer("sin", emb.sin()[None, None], persistent=False)

    def forward(self, idx):
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.lm_head(self.norm(x))


class _EncoderBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.h = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x, keep):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyEncoder(nn.Module):
    def __init__(self, vocab=128, T=16, d=32, heads=4, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(T, d) * 0.02)
        self.blocks = nn.ModuleList(_EncoderBlock(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        keep = (idx != 0)[:, None, None, :]  # keys that are not padding
        x = self.tok(idx) + self.pos
        for block in self.blocks:
            x = block(x, keep)
        return self.head(self.norm(x))


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)  # BatchNorm follows: no bias
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.adaptive_avg_pool2d(F.relu(self.conv2(x)), 4)
        return self.fc(x.flatten(1))


class WriteThroughView(nn.Module):
    """An in-place write the tracer must keep (a view sees it), read afterwards through the base:
    the sharded program must write where every later reader reads."""

    def __init__(self, d: int = 16, hidden: int = 32, out: int = 4):
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.out = nn.Linear(hidden, out)

    def forward(self, x):
        h = self.fc(x)
        view = h[:, : h.shape[1] // 2]
        view.mul_(2)
        return self.out(torch.relu(h))


class OddMLP(nn.Module):
    """Widths 21 -> 77 -> 21 -> 3: every weight and bias dim is odd, the head's bias has 3 entries."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(21)
        self.up = nn.Linear(21, 77)
        self.down = nn.Linear(77, 21)
        self.head = nn.Linear(21, 3)

    def forward(self, x):
        return self.head(x + self.down(F.gelu(self.up(self.norm(x)))))


class _MLPBlock(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, d: int = 256, hidden: int = 1024, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(_MLPBlock(d, hidden) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class RoutedResidualMLP(nn.Module):
    """Residual MLP layers over [batch, dim]; the first layer's output also chooses, per row, one
    feature (``argmax``: int64), a sign mask (bool) and a detached scale, which the head uses."""

    def __init__(self, d: int = 16, hidden: int = 32, layers: int = 4, classes: int = 5):
        super().__init__()
        self.layers = nn.ModuleList(_MLPBlock(d, hidden) for _ in range(layers))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.layers[0](x)
        pick = h.argmax(-1, keepdim=True)  # integer, no gradient
        positive = h > 0  # boolean
        scale = h.abs().mean(-1, keepdim=True).detach() + 1.0  # floating, no gradient
        for layer in self.layers[1:]:
            h = layer(h)
        h = torch.where(positive, h, 0.5 * h) / scale + 0.1 * h.gather(-1, pick)
        return self.head(h)


class WideEmbeddingMLP(nn.Module):
    """Embedding [vocab, d] (most of the parameters), mean over the sequence, residual MLP layers, a head."""

    def __init__(self, vocab: int = 8192, d: int = 32, hidden: int = 64, layers: int = 3, classes: int = 5):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_MLPBlock(d, hidden) for _ in range(layers))
        self.head = nn.Linear(d, classes)

    def forward(self, idx):
        h = self.emb(idx).mean(1)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class _WhereMoE(nn.Module):
    def __init__(self, d: int, hidden: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
                                     for _ in range(experts))

    def forward(self, x):
        gate, choice = self.router(x).softmax(-1).topk(self.top_k, dim=-1)  # [tokens, k]
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(choice == e)
            out = out.index_add(0, token, expert(x[token]) * gate[token, slot, None])
        return out


class WhereLoopMoE(nn.Module):
    """[batch, d] -> a linear layer, a residual top-2 MoE layer of ``torch.where`` loops, a head."""

    def __init__(self, d: int = 16, hidden: int = 32, experts: int = 4, top_k: int = 2, classes: int = 5):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.moe = _WhereMoE(d, hidden, experts, top_k)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.inp(x)
        return self.head(h + self.moe(h))
