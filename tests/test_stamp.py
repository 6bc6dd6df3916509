"""autopar.stamp: a repeated block traced once and stamped gives the full trace's graph, and
stamping stops (the full trace, unchanged) wherever an instance could trace differently."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.stamp import STAMPED_KEY, graph_signature
from autopar.trace import trace_model

from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss


def _both(model, x, loss_fn, target):
    """(full trace, regional trace, the regional trace's stamping stats, summed over groups)."""
    full = trace_model(model, (x,), loss_fn=loss_fn, example_target=target, regional=False)
    reg = trace_model(model, (x,), loss_fn=loss_fn, example_target=target)
    stats = list(reg.gm.meta[STAMPED_KEY].values())
    refused = [r for s in stats for r in s.refused.values()]
    return full, reg, sum(s.stamped for s in stats), refused


def _assert_same(full, reg):
    a, b = graph_signature(full.gm), graph_signature(reg.gm)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x == y
    assert full.param_fqns == reg.param_fqns and full.buffer_fqns == reg.buffer_fqns


def test_gpt_with_tied_head_stamps_its_blocks():
    cfg = GPTConfig(n_layer=5)
    model = GPT(cfg)
    model.lm_head.weight = model.wte.weight
    idx, tgt = example_batch(cfg, 4)
    full, reg, stamped, refused = _both(model, idx, gpt_loss, tgt)
    assert (stamped, refused) == (3, [])  # blocks 0 and 1 traced (template, check), 2-4 stamped
    _assert_same(full, reg)


def test_hugging_face_llama_stamps_without_kv_cache_and_refuses_with_it():
    transformers = pytest.importorskip("transformers")
    kw = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32)
    x, t = torch.randint(0, 128, (2, 8)), torch.randint(0, 128, (2, 8))

    def loss(out, target):
        return F.cross_entropy(out.logits.reshape(-1, 128), target.reshape(-1))

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw, use_cache=False))
    full, reg, stamped, refused = _both(model, x, loss, t)
    assert (stamped, refused) == (2, [])
    _assert_same(full, reg)
    # with its KV cache each layer writes its own entry: the layer reads layer_idx, which differs
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw, use_cache=True))
    full, reg, stamped, refused = _both(model, x, loss, t)
    assert stamped == 0 and "reads self_attn.layer_idx" in refused[0]
    _assert_same(full, reg)


class _Block(nn.Module):
    def __init__(self, d, index=0, p=0.0, in_place=False, shared=None):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.index, self.drop, self.in_place, self.shared = index, nn.Dropout(p), in_place, shared

    def forward(self, x):
        if self.in_place:
            x.mul_(2.0)
        if self.shared is not None:  # a side effect on an object all instances share
            self.shared["calls"] += 1
            if self.shared["calls"] == 1:
                x = x * 2.0
        return x + self.drop(F.gelu(self.lin(x)))


class _Stack(nn.Module):
    def __init__(self, blocks, d=8):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x


class _ReadsIndex(_Block):
    def forward(self, x):
        return super().forward(x) * (1.0 if self.index % 3 else 0.5)


def _mse(out, target):
    return F.mse_loss(out, target)


@pytest.mark.parametrize("case,stamped,refusal", [
    ("dropout", 3, None),
    ("unread index", 3, None),  # differs between instances, never read by forward
    ("reads index", 0, "reads index"),
    ("in place on input", 0, "writes in place"),
    ("first call differs", 0, "other ops"),  # caught by the second, checked instance
    ("two widths", 1, None),  # widths 16, 4, 16, 4, 16: the three of width 16 are one group
])
def test_stamping_or_falling_back_gives_the_full_trace(case, stamped, refusal):
    d, n = 8, 5
    x, t = torch.randn(4, d), torch.randn(4, d)
    shared = {"calls": 0}
    make = {
        "dropout": lambda i: _Block(d, p=0.1),
        "unread index": lambda i: _Block(d, index=i),
        "reads index": lambda i: _ReadsIndex(d, index=i),
        "in place on input": lambda i: _Block(d, in_place=True),
        "first call differs": lambda i: _Block(d, shared=shared),
    }
    if case == "two widths":
        blocks = [nn.Sequential(nn.Linear(d, w), nn.GELU(), nn.Linear(w, d)) for w in (16, 4, 16, 4, 16)]
    else:
        blocks = [make[case](i) for i in range(n)]
    model = _Stack(blocks, d)
    full = trace_model(model, (x,), loss_fn=_mse, example_target=t, regional=False)
    shared["calls"] = 0
    reg = trace_model(model, (x,), loss_fn=_mse, example_target=t)
    stats = list(reg.gm.meta[STAMPED_KEY].values())
    assert sum(s.stamped for s in stats) == stamped
    refused = [r for s in stats for r in s.refused.values()]
    assert (refusal is None and not refused) or (refusal is not None and refusal in refused[0])
    _assert_same(full, reg)
