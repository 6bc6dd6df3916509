"""A mixture-of-experts GPT in plain PyTorch, in the two forms models use.

Every block's MLP is a layer of ``n_experts`` experts stored as stacked weights
(``[experts, d, ff]``), routed top-k per token. ``MoEConfig(dropless=True)``: no capacity, every
(token, choice) pair reaches its expert, sorted by expert through grouped matmuls
(``GroupedExperts``, as Mixtral and DeepSeek are written). Otherwise a fixed capacity per expert
(GShard / Switch Transformer):

* each sequence is a routing *group* (GShard): its tokens compete for ``capacity`` slots per
  expert, ``ceil(top_k * tokens * capacity_factor / experts)``; the first choices of every
  token are placed before the second choices, in token order; a token past an expert's capacity
  is dropped by that expert (its output there is zero, the residual carries it on);
* dispatch and combine are one-hot einsums (``[group, token, expert, slot]``), so every shape is
  static and the expert computation is two batched matmuls over the expert dimension;
* the Switch auxiliary load-balancing loss (``experts * sum_e f_e * P_e``: the share of first
  choices routed to expert ``e`` times its mean router probability) is returned beside the
  logits, summed over layers; ``moe_loss`` adds it to the cross-entropy.

``MoEConfig(expert_modules=True)``: the static form with its experts written as an
``nn.ModuleList`` of MLPs called in a loop over the expert dimension (as many models are written);
the trace merges the loop into one computation over the experts' weights stacked
(``autopar.stack_experts``), so it plans and splits experts as the stacked form does, while
checkpoints and ``full_state_dict`` keep each expert's own keys.

Nothing here names a parallel strategy: the planner sees einsums over a stacked expert dimension.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.gpt import CausalSelfAttention, GPTConfig


@dataclass(frozen=True)
class MoEConfig:
    vocab_size: int = 256
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    n_experts: int = 4
    top_k: int = 2
    ff: int = 128  # each expert's hidden size
    capacity_factor: float = 1.0  # < the routing's imbalance: some tokens are dropped
    aux_weight: float = 0.01
    dropless: bool = False  # True: no capacity, grouped matmuls over sorted tokens (GroupedExperts)
    expert_modules: bool = False  # True (static form): experts as an nn.ModuleList of MLPs, called in a loop

    def attention_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd)

    def capacity(self, tokens: int) -> int:
        """Slots per expert for a group of ``tokens``."""
        return max(1, math.ceil(self.top_k * tokens * self.capacity_factor / self.n_experts))


class MoELayer(nn.Module):
    """Top-k routing with capacity; returns (output, auxiliary load-balancing loss)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        e, d, f = cfg.n_experts, cfg.n_embd, cfg.ff
        self.router = nn.Linear(d, e, bias=False)
        if cfg.expert_modules:
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, f, bias=False), nn.GELU(), nn.Linear(f, d, bias=False))
                                         for _ in range(e))
        else:
            self.w_in = nn.Parameter(torch.randn(e, d, f) * d**-0.5)
            self.w_out = nn.Parameter(torch.randn(e, f, d) * f**-0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        groups, tokens, _ = x.shape
        e, k, cap = cfg.n_experts, cfg.top_k, cfg.capacity(x.shape[1])
        probs = self.router(x).softmax(dim=-1)  # [g, s, e]
        gate, choice = probs.topk(k, dim=-1)  # [g, s, k]
        gate = gate / gate.sum(dim=-1, keepdim=True)
        chosen = F.one_hot(choice, e).to(x.dtype)  # [g, s, k, e]
        # slot of each (token, choice) in its expert's buffer: first choices of all tokens first
        by_rank = chosen.transpose(1, 2).reshape(groups, k * tokens, e)  # [g, k*s, e]
        slot = torch.cumsum(by_rank, dim=1) * by_rank - 1  # -1 where not routed
        kept = by_rank * (slot < cap).to(x.dtype)  # past capacity: dropped
        slot_hot = F.one_hot(slot.clamp(0, cap - 1).long(), cap).to(x.dtype)  # [g, k*s, e, c]
        dispatch = (kept.unsqueeze(-1) * slot_hot).reshape(groups, k, tokens, e, cap).sum(dim=1)  # [g, s, e, c]
        gates = gate.transpose(1, 2).reshape(groups, k * tokens, 1)
        combine = ((kept * gates).unsqueeze(-1) * slot_hot).reshape(groups, k, tokens, e, cap).sum(dim=1)
        expert_in = torch.einsum("gsec,gsd->egcd", dispatch, x)
        if cfg.expert_modules:
            expert_out = torch.stack([expert(expert_in[i]) for i, expert in enumerate(self.experts)])
        else:
            hidden = F.gelu(torch.einsum("egcd,edf->egcf", expert_in, self.w_in))
            expert_out = torch.einsum("egcf,efd->egcd", hidden, self.w_out)
        y = torch.einsum("gsec,egcd->gsd", combine, expert_out)
        # Switch Transformer's auxiliary loss over the whole batch: first choices' share per expert
        share = chosen[:, :, 0, :].mean(dim=(0, 1))
        aux = e * (share * probs.mean(dim=(0, 1))).sum()
        return y, aux


class GroupedExperts(nn.Module):
    """Dropless experts (Mixtral / DeepSeek style): every (token, choice) pair goes to its expert,
    however many an expert gets. The pairs are sorted by expert and each expert multiplies its
    rows with one grouped matmul over the per-expert row counts; the results are weighted by the
    gates and summed back per token."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        e, d, f = cfg.n_experts, cfg.n_embd, cfg.ff
        self.n_experts = e  # (not w_in.shape[0]: split over experts, a rank holds its share of them)
        self.w_in = nn.Parameter(torch.randn(e, d, f) * d**-0.5)
        self.w_out = nn.Parameter(torch.randn(e, f, d) * f**-0.5)

    def forward(self, tokens: torch.Tensor, choice: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        experts, k = self.n_experts, choice.shape[1]
        flat = choice.reshape(-1)
        order = flat.argsort(stable=True)  # pairs sorted by expert
        token_of = order // k
        counts = F.one_hot(flat, experts).sum(dim=0)  # rows per expert (static shape, unlike bincount)
        offs = counts.cumsum(dim=0).to(torch.int32)
        hidden = F.gelu(F.grouped_mm(tokens[token_of], self.w_in, offs=offs))
        out = F.grouped_mm(hidden, self.w_out, offs=offs) * gate.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, token_of, out)


class DroplessMoELayer(nn.Module):
    """Top-k routing without capacity; returns (output, auxiliary load-balancing loss)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.router(tokens).softmax(dim=-1)
        gate, choice = probs.topk(self.cfg.top_k, dim=-1)
        y = self.experts(tokens, choice, gate / gate.sum(dim=-1, keepdim=True))
        share = F.one_hot(choice[:, 0], self.cfg.n_experts).to(x.dtype).mean(dim=0)
        aux = self.cfg.n_experts * (share * probs.mean(dim=0)).sum()
        return y.view(x.shape), aux


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg.attention_config())
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.moe = DroplessMoELayer(cfg) if cfg.dropless else MoELayer(cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln_1(x))
        y, aux = self.moe(self.ln_2(x))
        return x + y, aux


class MoEGPT(nn.Module):
    """GPT with an MoE layer in every block; ``forward`` returns (logits, auxiliary loss)."""

    def __init__(self, cfg: MoEConfig = MoEConfig()):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([MoEBlock(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        aux = x.new_zeros(())
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a
        return self.lm_head(self.ln_f(x)), aux


def moe_loss(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor, aux_weight: float = 0.01) -> torch.Tensor:
    logits, aux = out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1)) + aux_weight * aux


def example_batch(cfg: MoEConfig, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    return idx, tgt


def main() -> None:
    """Plan the MoE GPT on 4 local processes and print the plan (python -m examples.moe)."""
    import autopar

    cfg = MoEConfig()
    model = MoEGPT(cfg)
    x, y = example_batch(cfg, 8)
    plan = autopar.plan(model, autopar.Cluster.local(4), x, loss_fn=moe_loss, example_target=y)
    print(plan.summary())


if __name__ == "__main__":
    main()
