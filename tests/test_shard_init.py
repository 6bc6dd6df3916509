"""Deferred initialisation (issue 43, ``runtime.shard_init``): a model built on the meta device is
initialised by its own code where its shards live, and the full state does not depend on the plan
or the world size (bitwise), with no broadcast of weights from rank 0."""
from __future__ import annotations

import math
import os
import sys
import warnings

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


@pytest.mark.slow
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


# ----------------------------------------------------------------------------- init="skip": buffers only


def _poisoned(empty_shard):
    """``ParamStore``'s shard allocator, filling each new shard with NaN (-1 for integers): a shard
    the init writes no longer holds it, one it skips still does."""
    def allocate(*args):
        t = empty_shard(*args)
        return t.fill_(float("nan")) if t.is_floating_point() or t.is_complex() else t.fill_(-1)
    return allocate


def _untouched(t: torch.Tensor) -> bool:
    local = t.to_local() if isinstance(t, DTensor) else t
    return bool(local.isnan().all()) if local.is_floating_point() or local.is_complex() else bool((local == -1).all())


def _activations(monkeypatch) -> list[str]:
    """The tensors whose full value the init makes, in order (``_ShardInitMode.activate``)."""
    from autopar.runtime import shard_init

    made, activate = [], shard_init._ShardInitMode.activate

    def spy(mode, e):
        if mode.active is not e:
            made.append(e.fqn)
        return activate(mode, e)

    monkeypatch.setattr(shard_init._ShardInitMode, "activate", spy)
    return made


def test_skip_initialises_only_the_buffers_no_checkpoint_holds(world1, monkeypatch):
    """init="skip": Hugging Face's rotary ``inv_freq`` (``_init_weights``' ``init.copy_``) and
    torchtitan's ``freqs_cis`` (reassigned in ``init_weights``) get the full init's values, while
    no parameter's full value is made and every parameter shard keeps its allocation's bytes; the
    state loaded after, the first loss is the eagerly built model's (no buffer filled by hand)."""
    from autopar.runtime import param_store

    monkeypatch.setattr(param_store, "_empty_shard", _poisoned(param_store._empty_shard))
    made = _activations(monkeypatch)
    x, t = batch()
    for name, unsaved in (("hf_llama", ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]),
                          ("titan", [])):  # titan's init reassigns freqs_cis: taken whole, no full value made
        full_init = _initialised(name, 1)["buffers"]  # the default path's buffers
        dist.destroy_process_group()
        torch.manual_seed(SEED)
        eager = MODELS[name]()
        with torch.no_grad():
            want = float(lm_loss(eager(x), t))
        made.clear()
        pm = autopar.compile(build_on_meta(name), world1, (x,), example_target=t, loss_fn=lm_loss, optimizer=sgd,
                             init="skip")
        assert made == unsaved, (name, made)
        state = pm.state_dict(keep_vars=True)
        assert state and all(_untouched(v) for v in state.values()), f"{name}: init='skip' wrote a parameter"
        buffers = {n: b.full_tensor() for n, b in pm._state.buffers.items()}
        assert buffers.keys() == full_init.keys() and set(buffers) - set(state), name
        for n, b in buffers.items():
            assert torch.equal(b, full_init[n]) and torch.equal(b, dict(eager.named_buffers())[n]), f"{name}: {n}"
        unsaved_phs = {ph for ph, n in pm._traced.buffer_fqns.items() if n not in state}
        assert unsaved_phs and not unsaved_phs & pm.store.deferred, f"{name}: a written buffer is still deferred"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no UninitialisedBufferWarning: nothing is left unwritten
            autopar.load_weights(pm, eager.state_dict())
        got = pm.train_step(x, target=t)
        assert math.isclose(got, want, rel_tol=1e-5), (name, got, want)
        pm.close()
        dist.destroy_process_group()


def test_skip_refuses_a_buffer_computed_from_a_skipped_parameter(world1):
    class Derived(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(DIM, DIM))
            self.register_buffer("col_norm", torch.empty(DIM), persistent=False)

        def init_weights(self):
            nn.init.normal_(self.w)
            self.col_norm.copy_(self.w.norm(dim=0))  # needs w's value, which the loader brings later

        def forward(self, x):
            return x @ self.w / self.col_norm

    with torch.device("meta"):
        model = Derived()
    with pytest.raises(DeferredInitError, match=r"init='skip': the model's init computes col_norm .* from a value "
                                                r"computed from a parameter .* compute the buffer from constants"):
        autopar.compile(model, world1, (torch.randn(4, DIM),), init="skip")


def skip_then_load_worker(folder: str) -> dict:
    """dp=2 x tp=2: each model built on meta, compiled init="skip" over shards filled with NaN,
    then loaded (the Hugging Face Llama from the folder ``save_pretrained`` wrote, the torchtitan
    one from the eagerly built model's state dict); nothing filled by hand."""
    import transformers

    from autopar.runtime import param_store

    param_store._empty_shard = _poisoned(param_store._empty_shard)  # this process only
    x, t = batch()
    out = {}
    for name in ("hf_llama", "titan"):
        torch.manual_seed(SEED)
        eager = transformers.LlamaForCausalLM.from_pretrained(folder) if name == "hf_llama" else TitanLM()
        with torch.no_grad():
            want = float(lm_loss(eager(x), t))
        pm = autopar.compile(build_on_meta(name), autopar.Cluster.local(4), (x,), example_target=t, loss_fn=lm_loss,
                             optimizer=sgd, constraints=autopar.Constraints(dp=2, tp=2), init="skip")
        r = {"mesh": pm.plan.mesh, "sharded": sorted(f for f, p in pm.plan.params.items() if "S(" in p.layout),
             "untouched": all(_untouched(v) for v in pm.state_dict(keep_vars=True).values())}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            autopar.load_weights(pm, folder if name == "hf_llama" else eager.state_dict())
        r["warned"] = [str(w.message) for w in caught if type(w.message).__name__ == "UninitialisedBufferWarning"]
        full = pm.full_state_dict()
        r["state_equal"] = all(torch.equal(full[k], v) for k, v in eager.state_dict().items())
        eager_buffers = dict(eager.named_buffers())
        r["buffers_equal"] = {n: torch.equal(b.full_tensor(), eager_buffers[n]) for n, b in pm._state.buffers.items()}
        r["loss"], r["want"] = pm.train_step(x, target=t), want
        out[name] = r
        pm.close()
    return out


@pytest.mark.slow
def test_skip_then_load_gives_the_pretrained_first_loss_on_4_processes(tmp_path):
    """Issue 43: a meta-built Hugging Face Llama compiled init="skip" and loaded by load_weights
    starts from from_pretrained's first-step loss (within 1e-5) with its rotary buffers computed
    by its own _init_weights, under dp=2 x tp=2; a torchtitan-style model with freqs_cis equals
    the eagerly built one. No parameter shard was written by the init (still NaN after compile)."""
    import transformers

    torch.manual_seed(3)
    transformers.LlamaForCausalLM(MODELS["hf_llama"]().config).save_pretrained(tmp_path / "llama")
    ranks = autopar.launch(skip_then_load_worker, 4, str(tmp_path / "llama"), timeout_s=600)
    for rank, out in enumerate(ranks):
        for name, r in out.items():
            where = f"{name} rank {rank} on {r['mesh']}"
            assert r["mesh"].get("dp") == 2 and r["mesh"].get("tp") == 2 and r["sharded"], where
            assert r["untouched"], f"{where}: init='skip' wrote a parameter"
            assert r["warned"] == [], (where, r["warned"])
            assert r["state_equal"], where
            assert r["buffers_equal"] and all(r["buffers_equal"].values()), (where, r["buffers_equal"])
            assert math.isclose(r["loss"], r["want"], rel_tol=1e-5), (where, r["loss"], r["want"])
