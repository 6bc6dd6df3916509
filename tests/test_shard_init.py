"""Deferred initialisation (issue 43, ``runtime.shard_init``): a model built on the meta device is
initialised by its own code where its shards live, and the full state does not depend on the plan
or the world size (bitwise), with no broadcast of weights from rank 0."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import autopar
from autopar.errors import DeferredInitError
from autopar.runtime.shard_init import derived_seed

sys.path.insert(0, os.path.dirname(__file__))
from shard_init_models import DIM, MODELS, ResetMLP, TitanLM, _precompute_freqs_cis, batch, build_on_meta, lm_loss, sgd  # noqa: E402

SEED = 1234  # rank 0's initial seed: the base every rank derives from
LAYOUTS = (("dp=4", {"dp": 4}), ("tp=4", {"tp": 4}), ("pp=2 x dp=2", {"pp": 2, "dp": 2}))


def _initialised(name: str, world: int, constraints: dict | None = None) -> dict:
    """Compile ``name`` built on meta; its full state (parameters and every buffer this rank's
    stage holds, gathered), the first step's loss and the plan's mesh."""
    model = build_on_meta(name)
    x, t = batch()
    pm = autopar.compile(model, autopar.Cluster.local(world), (x,), example_target=t, loss_fn=lm_loss, optimizer=sgd,
                         constraints=autopar.Constraints(**(constraints or {})))
    out = {"state": pm.full_state_dict(),
           "buffers": {n: b.full_tensor() for n, b in pm._state.buffers.items()},
           "mesh": pm.plan.mesh, "stages": len(pm.plan.stages),
           "sharded": sorted(f for f, p in pm.plan.params.items() if "S(" in p.layout)}
    out["loss"] = pm.train_step(x, target=t)
    pm.close()
    return out


def layouts_worker() -> dict:
    """Every model under every layout, in one world of 4 processes; each rank seeded apart (only
    rank 0's seed may matter)."""
    rank = int(os.environ["RANK"])
    torch.manual_seed(SEED if rank == 0 else 99 + rank)
    out = {(name, label): _initialised(name, 4, c) for name in MODELS for label, c in LAYOUTS}
    # FSDP1's sync_module_states habit: real weights on rank 0, meta elsewhere: rank 0's are broadcast
    if rank == 0:
        model = ResetMLP()
        for m in model.modules():
            if m is not model and hasattr(m, "reset_parameters"):
                m.reset_parameters()
    else:
        model = build_on_meta("reset")
    want = {k: v.clone() for k, v in model.state_dict().items()} if rank == 0 else None
    pm = autopar.compile(model, autopar.Cluster.local(4), (batch()[0],), constraints=autopar.Constraints(dp=4))
    out["rank0_real"] = (pm.full_state_dict(), want)
    pm.close()
    return out


@pytest.mark.slow
def test_full_state_is_bitwise_the_same_on_1_process_and_under_dp_tp_pp(world1):
    torch.manual_seed(SEED)
    one = {name: _initialised(name, 1) for name in MODELS}
    dist.destroy_process_group()
    ranks = autopar.launch(layouts_worker, 4, timeout_s=900)
    rank0_weights = ranks[0]["rank0_real"][1]
    for rank, got in enumerate(ranks):
        full, _ = got.pop("rank0_real")
        assert all(torch.equal(full[k], v) for k, v in rank0_weights.items()), f"rank {rank}: not rank 0's weights"
        for (name, label), r in got.items():
            ref = one[name]
            where = f"{name} under {label} (rank {rank})"
            assert r["state"].keys() == ref["state"].keys(), where
            for k, v in ref["state"].items():
                assert torch.equal(r["state"][k], v), f"{where}: {k} differs from 1 process"
            assert bool(r["buffers"]) == (name != "reset") or rank >= 2 and label.startswith("pp"), where  # stage 1 may hold none
            for k, v in r["buffers"].items():
                assert torch.equal(v, ref["buffers"][k]), f"{where}: buffer {k} differs from 1 process"
            assert math.isclose(r["loss"], ref["loss"], rel_tol=1e-5), f"{where}: first loss {r['loss']} vs {ref['loss']}"
    r0 = ranks[0]
    for name in MODELS:  # the layouts were what the test asks for
        assert r0[(name, "dp=4")]["mesh"].get("dp") == 4
        assert r0[(name, "tp=4")]["mesh"].get("tp") == 4 and r0[(name, "tp=4")]["sharded"], name
        assert r0[(name, "pp=2 x dp=2")]["stages"] == 2


def test_values_are_the_models_own_init_seeded_by_name(world1):
    """Each random op draws what the same op gives on the full tensor with a generator seeded
    from (base seed, the parameter's name, its count of random ops so far); deterministic parts
    (freqs_cis computed in init_weights, norms' ones) are the model's own, exactly."""
    torch.manual_seed(SEED)
    got = _initialised("reset", 1)["state"]
    g = lambda fqn, n=0: torch.Generator().manual_seed(derived_seed(SEED, fqn, n))  # noqa: E731
    w = torch.empty(DIM, DIM)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=g("blocks.0.proj.weight"))
    assert torch.equal(got["blocks.0.proj.weight"], w)
    b = torch.empty(DIM).uniform_(-1 / math.sqrt(DIM), 1 / math.sqrt(DIM), generator=g("blocks.0.proj.bias"))
    assert torch.equal(got["blocks.0.proj.bias"], b)
    assert torch.equal(got["blocks.1.mix"], nn.init.xavier_uniform_(torch.empty(DIM, DIM), generator=g("blocks.1.mix")))
    assert torch.equal(got["blocks.0.scale"], torch.empty(DIM).normal_(1.0, 0.1, generator=g("blocks.0.scale")))
    assert torch.equal(got["blocks.0.norm.weight"], torch.ones(DIM))
    dist.destroy_process_group()
    titan = _initialised("titan", 1)
    assert torch.equal(titan["buffers"]["freqs_cis"], _precompute_freqs_cis(DIM // 4, 16))
    std = DIM ** -0.5
    out = titan["state"]["output.weight"]
    assert out.abs().max() <= 3 * std and 0.8 * std < out.std() < std  # trunc_normal_(std, a=-3std, b=3std)


def test_stacked_experts_follow_the_seed_rule(world1):
    from examples.moe import MoEConfig, MoEGPT, example_batch, moe_loss

    torch.manual_seed(SEED)
    g = lambda fqn, n=0: torch.Generator().manual_seed(derived_seed(SEED, fqn, n))  # noqa: E731
    with torch.device("meta"):  # experts called in a loop: stacked into one parameter, each writes its rows
        moe = MoEGPT(MoEConfig(expert_modules=True))
    x, y = example_batch(MoEConfig(expert_modules=True), 8)
    pm = autopar.compile(moe, world1, (x,), example_target=y, loss_fn=moe_loss, optimizer=sgd)
    assert pm._traced.stacked
    name = "blocks.1.moe.experts.2.0.weight"
    want = nn.init.kaiming_uniform_(torch.empty(pm.full_state_dict()[name].shape), a=math.sqrt(5), generator=g(name))
    assert torch.equal(pm.full_state_dict()[name], want)
    pm.close()


def test_meta_parameter_without_init_is_refused_naming_it_and_the_fix(world1):
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(DIM, DIM))  # no reset_parameters, no init_weights

        def forward(self, x):
            return x @ self.w

    with torch.device("meta"):
        model = Bare()
    x = torch.randn(4, DIM)
    with pytest.raises(DeferredInitError, match=r"did not initialise 1 of its tensors: w\. .*init_weights\(\).*init=fn"):
        autopar.compile(model, world1, (x,))


def test_init_callable_and_skip(world1):
    calls = []

    def fill(model):
        calls.append(model)
        for p in model.parameters():
            nn.init.constant_(p, 0.5)
        model.freqs_cis = _precompute_freqs_cis(DIM // 4, 16)

    x, t = batch()
    with torch.device("meta"):
        model = TitanLM()
    pm = autopar.compile(model, world1, (x,), init=fill)
    # the user's own module (sharded in place, so of class Autopar<TitanLM>: ``runtime.in_place``), once
    assert len(calls) == 1 and calls[0] is model and isinstance(model, TitanLM)
    assert all(torch.equal(v, torch.full_like(v, 0.5)) for v in pm.full_state_dict().values())
    pm.close()
    with torch.device("meta"):
        model = ResetMLP()
    pm = autopar.compile(model, world1, (x,), init="skip")  # a loader fills the shards: nothing runs, nothing refused
    assert pm.store.deferred and pm.store.meta_fqns
    pm.close()
    with torch.device("meta"):
        model = ResetMLP()
    with pytest.raises(DeferredInitError, match="init= takes a callable"):
        autopar.compile(model, world1, (x,), init="none")
    with pytest.raises(DeferredInitError, match="holds no tensor on the meta device"):
        autopar.compile(ResetMLP(), world1, (x,), init=fill)


def test_real_model_is_broadcast_not_initialised(world1):
    """A model with real tensors (in rank 0's model) keeps DDP's convention: broadcast, no init."""
    torch.manual_seed(0)
    model = ResetMLP()
    for m in model.modules():
        if hasattr(m, "reset_parameters") and m is not model:
            m.reset_parameters()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    x, _ = batch()
    pm = autopar.compile(model, world1, (x,))
    assert not pm.store.deferred
    full = pm.full_state_dict()
    assert all(torch.equal(full[k], v) for k, v in want.items())


def test_start_up_peak_is_the_shards_plus_one_parameter(world1):
    """Counting every storage the init creates: the shards plus at most the largest parameter
    (one full value at a time; a kept full value per parameter would double the model)."""
    from autopar.runtime.memory import MemoryTracker
    from autopar.runtime.shard_init import initialise_deferred

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256), nn.LayerNorm(256), nn.Linear(256, 256))
    x = torch.randn(4, 256)
    pm = autopar.compile(model, world1, (x,), init="skip")
    shards = [s.local for s in pm.store.slots.values()]
    resident = sum(t.numel() * t.element_size() for t in shards)
    largest = max(t.numel() * t.element_size() for t in shards)
    tracker = MemoryTracker()
    tracker.register(shards, "params")
    with tracker:
        assert initialise_deferred(pm.store, pm._traced, model, pm.device_mesh) == "each module's reset_parameters()"
    peak = tracker.report().peak_bytes
    assert resident + largest / 2 < peak <= resident + largest, (peak, resident, largest)
    full = pm.full_state_dict()
    assert torch.equal(full["2.weight"], torch.ones(256)) and full["0.weight"].std() > 0
