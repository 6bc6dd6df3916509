"""Tiny models built on the meta device for the deferred-initialisation tests (``runtime.shard_init``):
a torchtitan-style Llama with ``init_weights(buffer_device)`` (trunc_normal_, a complex
``freqs_cis`` buffer computed in the init), a Hugging Face LlamaForCausalLM from a config, and a
module tree initialised by ``reset_parameters()``."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, BATCH, DIM, HEADS = 64, 8, 8, 32, 4


def _precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs).float())


def _rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3)
    return out.type_as(x)


class TitanAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def init_weights(self, init_std: float):
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x, freqs_cis):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, HEADS, DIM // HEADS) for w in (self.wq, self.wk, self.wv))
        q, k = _rotary(q, freqs_cis), _rotary(k, freqs_cis)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, DIM))


class TitanFeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def init_weights(self, init_std: float):
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, layer_id: int):
        super().__init__()
        self.attention, self.feed_forward = TitanAttention(), TitanFeedForward()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self):
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLM(nn.Module):
    """torchtitan's Llama 3 in miniature: build on meta, then ``init_weights(buffer_device=...)``."""

    def __init__(self, n_layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.register_buffer("freqs_cis", _precompute_freqs_cis(DIM // HEADS, 2 * SEQ), persistent=False)
        self.layers = nn.ModuleDict({str(i): TitanBlock(i) for i in range(n_layers)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def init_weights(self, buffer_device: torch.device | None = None):
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = _precompute_freqs_cis(DIM // HEADS, 2 * SEQ)
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        std = DIM ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


class ResetBlock(nn.Module):
    """A module with its own ``reset_parameters`` (kaiming, xavier, normal) beside torch's."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(DIM))
        self.mix = nn.Parameter(torch.empty(DIM, DIM))
        self.proj = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def reset_parameters(self):
        nn.init.normal_(self.scale, mean=1.0, std=0.1)
        nn.init.xavier_uniform_(self.mix)

    def forward(self, x):
        return x + self.proj(torch.tanh(self.norm(x) @ self.mix) * self.scale)


class ResetMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(ResetBlock() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def hf_llama() -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=2,
                                   num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                                   tie_word_embeddings=True, use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


MODELS = {"titan": TitanLM, "hf_llama": hf_llama, "reset": ResetMLP}


def build_on_meta(name: str) -> nn.Module:
    with torch.device("meta"):
        return MODELS[name]()


def lm_loss(out, target):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def sgd(ps):
    return torch.optim.SGD(ps, lr=0.1)


def expected_std(name: str) -> float:  # for reading failures
    return {"titan": 0.02, "hf_llama": 0.02, "reset": 1 / math.sqrt(DIM)}[name]
