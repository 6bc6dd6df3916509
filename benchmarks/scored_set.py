"""The scored set: plans drawn from a seed, on which nothing is fitted (issue 44, item 1).

``benchmarks/calibration.py`` times its fixed plans (``CONFIGS``: the example GPT and the wide MLP),
the ones the calibration probes and the cost model's terms were developed against: its error there
is a fit. This module draws *other* plans, from a seed, to score the prediction on:

* model families (``FAMILIES``): ``gpt`` (``examples.gpt``), ``llama`` (Hugging Face
  ``LlamaForCausalLM`` from a small ``LlamaConfig``, grouped-query attention: fewer key/value heads
  than query heads), ``mlp`` (``examples.mlp``, wide), ``cnn`` (``ConvNet`` below: residual
  conv-BatchNorm-ReLU blocks) and ``moe`` (``examples.moe.MoEGPT``: top-k routed experts with a
  capacity);
* each one's widths, depth, sequence length (or image size) and batch drawn from ranges that keep
  a training step at a few to a few hundred milliseconds on 4 gloo CPU processes;
* a plan constraint (``PLAN_KINDS``): ``free`` (the planner chooses), ``dp``, ``tp``,
  ``dpxtp`` (a 2-D mesh), ``zero1``/``zero2``/``zero3`` (data parallel, ZeRO stage k); the five
  kinds free, dp, tp, dpxtp and zero are equally likely, then the ZeRO stage.

Invariants: ``scored_set(seed, n, world)`` is a pure function of its arguments (its own
``random.Random(seed)``, no global state, no clock); families come round-robin in an order shuffled
per round, so any ``n >= len(FAMILIES)`` covers every family; every drawn size divides by the
degrees any plan kind can ask for (batch by ``world``, heads and widths by ``world``). No constant
of autopar is fitted on this set: ``autopar calibrate`` measures its own probes only
(``autopar.calibration`` imports nothing from ``benchmarks`` or ``examples``).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["FAMILIES", "PLAN_KINDS", "ScoredPlan", "ConvNet", "scored_set", "plan_kinds"]

FAMILIES = ("gpt", "llama", "mlp", "cnn", "moe")
PLAN_KINDS = ("free", "dp", "tp", "dpxtp", "zero1", "zero2", "zero3")


def plan_kinds(world: int) -> tuple[str, ...]:
    """The plan kinds ``world`` processes allow: ``dpxtp`` needs a world with a factor
    ``1 < f < world`` (4, 6, 8 ... ; not 2 or 3)."""
    return tuple(k for k in PLAN_KINDS if k != "dpxtp" or _split(world) is not None)


def _split(world: int) -> tuple[int, int] | None:
    """(dp, tp) of a 2-D mesh: the largest tp factor at most sqrt(world), or None."""
    tp = max((f for f in range(2, int(world**0.5) + 1) if world % f == 0), default=None)
    return None if tp is None else (world // tp, tp)


def _constraints(kind: str, world: int) -> tuple[tuple[str, int], ...]:
    if kind == "free":
        return ()
    if kind == "dp":
        return (("dp", world),)
    if kind == "tp":
        return (("tp", world),)
    if kind == "dpxtp":
        dp, tp = _split(world)
        return (("dp", dp), ("tp", tp))
    if kind.startswith("zero"):
        return (("dp", world), ("zero", int(kind[4:])))
    raise ValueError(f"unknown plan kind {kind!r}; known: {', '.join(PLAN_KINDS)}")


@dataclass(frozen=True)
class ScoredPlan:
    """One drawn configuration: a model family, its sizes (``dims``, sorted name/value pairs) and
    a plan kind; picklable, so that launched ranks build the same model from it."""

    family: str
    dims: tuple[tuple[str, int], ...]
    kind: str
    world: int

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; known: {', '.join(FAMILIES)}")
        if self.kind not in plan_kinds(self.world):
            raise ValueError(f"plan kind {self.kind!r} on {self.world} processes; known: "
                             f"{', '.join(plan_kinds(self.world))}")

    @property
    def constraints(self) -> dict[str, int]:
        return dict(_constraints(self.kind, self.world))

    @property
    def label(self) -> str:
        d = dict(self.dims)
        size = {
            "gpt": lambda: f"L{d['layers']} d{d['width']} h{d['heads']} s{d['seq']} b{d['batch']}",
            "llama": lambda: f"L{d['layers']} d{d['width']} h{d['heads']}/kv{d['kv_heads']} s{d['seq']} b{d['batch']}",
            "mlp": lambda: f"L{d['layers']} d{d['width']} f{d['hidden']} b{d['batch']}",
            "cnn": lambda: f"L{d['layers']} c{d['width']} {d['image']}px b{d['batch']}",
            "moe": lambda: f"L{d['layers']} d{d['width']} e{d['experts']}k{d['top_k']} s{d['seq']} b{d['batch']}",
        }[self.family]()
        plan = ",".join(f"{k}={v}" for k, v in _constraints(self.kind, self.world)) or "free"
        return f"{self.family}[{size}] {plan}"

    def build(self, seed: int = 0):
        """(model, example_inputs, loss_fn, target): the global batch, the same on every rank for
        the same ``seed``."""
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed + 1)
        d = dict(self.dims)
        if self.family == "mlp":
            from examples.mlp import MLP, mlp_loss

            x = torch.randn(d["batch"], d["width"], generator=g)
            return MLP(d["width"], d["hidden"], d["layers"]), (x,), mlp_loss, torch.randn(x.shape, generator=g)
        if self.family == "cnn":
            x = torch.randn(d["batch"], 3, d["image"], d["image"], generator=g)
            return ConvNet(d["width"], d["layers"]), (x,), F.cross_entropy, torch.randint(0, 10, (d["batch"],), generator=g)
        tokens = lambda: torch.randint(0, d["vocab"], (d["batch"], d["seq"]), generator=g)  # noqa: E731
        idx, tgt = tokens(), tokens()
        if self.family == "gpt":
            from examples.gpt import GPT, GPTConfig, gpt_loss

            cfg = GPTConfig(vocab_size=d["vocab"], block_size=d["seq"], n_layer=d["layers"], n_head=d["heads"],
                            n_embd=d["width"])
            return GPT(cfg), (idx,), gpt_loss, tgt
        if self.family == "moe":
            from examples.moe import MoEConfig, MoEGPT, moe_loss

            cfg = MoEConfig(vocab_size=d["vocab"], block_size=d["seq"], n_layer=d["layers"], n_head=d["heads"],
                            n_embd=d["width"], n_experts=d["experts"], top_k=d["top_k"], ff=d["ff"])
            return MoEGPT(cfg), (idx,), moe_loss, tgt
        if self.family == "llama":
            import transformers

            from examples.real_models import _lm_loss

            cfg = transformers.LlamaConfig(vocab_size=d["vocab"], hidden_size=d["width"], intermediate_size=d["ff"],
                                           num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                                           num_key_value_heads=d["kv_heads"], max_position_embeddings=d["seq"])
            return transformers.LlamaForCausalLM(cfg).train(), (idx,), _lm_loss, tgt
        raise AssertionError(self.family)  # __post_init__ checked it


class ConvNet(nn.Module):
    """A small residual CNN: a stem convolution to ``width`` channels, ``layers`` blocks of
    conv3x3-BatchNorm-ReLU with a residual add (the middle one halves the image and doubles the
    channels through a strided 1x1 shortcut), global average pooling and a 10-way classifier."""

    def __init__(self, width: int, layers: int, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.blocks = nn.ModuleList()
        self.shortcuts = nn.ModuleList()
        c = width
        for i in range(layers):
            down = i == layers // 2 and layers > 1
            out = 2 * c if down else c
            self.blocks.append(nn.Sequential(nn.Conv2d(c, out, 3, stride=2 if down else 1, padding=1, bias=False),
                                             nn.BatchNorm2d(out), nn.ReLU()))
            self.shortcuts.append(nn.Conv2d(c, out, 1, stride=2, bias=False) if down else nn.Identity())
            c = out
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        for block, shortcut in zip(self.blocks, self.shortcuts):
            x = block(x) + shortcut(x)
        return self.fc(x.mean(dim=(2, 3)))


def _draw_dims(family: str, rng: random.Random, world: int) -> dict[str, int]:
    """Sizes for one model of ``family``: ranges that keep a step at a few to a few hundred ms on
    4 CPU processes; heads, widths and batches multiples of ``world``."""
    batch = world * rng.choice((2, 4, 8))
    if family == "mlp":
        width = 128 * rng.randint(2, 6)
        return dict(width=width, hidden=width * rng.choice((2, 4)), layers=rng.randint(2, 6), batch=batch)
    if family == "cnn":
        return dict(width=world * rng.choice((2, 4, 8)), layers=rng.randint(2, 5), image=rng.choice((16, 24, 32)),
                    batch=batch)
    heads = world * rng.choice((1, 2))
    width = heads * rng.choice((8, 16, 32))
    seq = rng.choice((16, 32, 64))
    base = dict(width=width, heads=heads, layers=rng.randint(1, 4), seq=seq, batch=batch, vocab=rng.choice((256, 512, 1024)))
    if family == "gpt":
        return base
    if family == "llama":
        return dict(base, kv_heads=max(1, heads // rng.choice((2, 4))), ff=width * rng.choice((2, 3)))
    if family == "moe":
        return dict(base, experts=rng.choice((4, 8)), top_k=rng.choice((1, 2)), ff=width * rng.choice((1, 2)),
                    layers=rng.randint(1, 3))
    raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")


def scored_set(seed: int, n: int, world: int = 4) -> tuple[ScoredPlan, ...]:
    """``n`` configurations drawn from ``seed`` for ``world`` processes (see the module docstring)."""
    if n < 0 or world < 2:
        raise ValueError(f"scored_set needs n >= 0 and world >= 2, got n={n}, world={world}")
    rng = random.Random(f"autopar-scored-set/{seed}/{world}")
    kinds = plan_kinds(world)
    drawn, families = [], []
    for _ in range(n):
        if not families:
            families = list(FAMILIES)
            rng.shuffle(families)
        family = families.pop()
        dims = _draw_dims(family, rng, world)
        kind = rng.choice(sorted({k.rstrip("0123456789") for k in kinds}))  # free, dp, tp, dpxtp, zero alike
        if kind == "zero":
            kind += str(rng.choice((1, 2, 3)))
        drawn.append(ScoredPlan(family, tuple(sorted(dims.items())), kind, world))
    return tuple(drawn)
