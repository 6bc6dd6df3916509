"""HSDP (``Constraints(hsdp=S)``, ``planner.meshes.hsdp_mesh``): ZeRO-3 within groups of S data
ranks, replicated across the groups, on a ('dp', 'dp_shard') mesh.

Executed: 4 gloo ranks as 2 x 2 train 3 steps beside one device, in the torch-native loop (loss,
every gradient at every step, every parameter after the last, SGD with momentum and Adam; then
the evaluation program's outputs) and in
``train_step``; the parameters are DTensors placed (Replicate(), Shard(0)) on the 2-D mesh, and a
step's measured collectives are a reduce-scatter of each gradient within its group and an
all-reduce of only its shard across groups. Planned: on several nodes HSDP is priced apart from
ZeRO-3 over every rank and chosen where it is cheaper; ``zero=3`` without ``hsdp`` stays ZeRO-3
over all the data ranks."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar import Cluster, ConstraintError, Constraints
from helpers import measured_comm_bytes, native_loop_errors
from autopar.testing.parity import build_case, parity_failures, parity_worker, relative_error

TOL = 1e-5


def native_hsdp_worker(case: str, opt: str, steps: int = 3) -> dict:
    """``case`` under ``Constraints(hsdp=2)`` in the native loop (``loss.backward()``, the user's
    optimizer over ``pm.parameters()``) beside one device: the worst relative errors of the loss,
    of the gradients (each step, before the optimizer step) and of the parameters after."""
    model, batches, loss_fn = build_case(case)
    ref = copy.deepcopy(model)
    pm = autopar.compile(model, Cluster.local(), constraints=Constraints(hsdp=2))

    def make(m):
        if opt == "adam":
            return torch.optim.Adam(m.parameters(), lr=1e-3)
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    loss_err, grad_err = native_loop_errors(pm, ref, make, batches, loss_fn, steps)
    # the evaluation program (planned at its first use, every parameter pinned where it is stored)
    pm.eval(), ref.eval()
    x = batches[0][0]
    with torch.no_grad():
        eval_err = relative_error(pm(*(x if isinstance(x, tuple) else (x,))), ref(*(x if isinstance(x, tuple) else (x,))))
    pm.train(), ref.train()
    full, want = pm.full_state_dict(), ref.state_dict()
    placements = {k: (tuple(p.device_mesh.mesh_dim_names), tuple(p.placements))
                  for k, p in pm.named_parameters()}
    return {"mesh": pm.plan.mesh, "loss_err": loss_err, "grad_err": grad_err, "placements": placements,
            "eval_err": eval_err,
            "param_err": max(relative_error(full[k], v) for k, v in want.items())}


def measure_hsdp_worker() -> dict:
    """One measured ``train_step`` of the MLP under HSDP (after a first step): bytes per collective
    kind measured and predicted, and the bytes of its parameters."""
    measured, predicted = measured_comm_bytes("mlp", Constraints(hsdp=2))
    return {"measured": measured, "predicted": predicted,
            "param_bytes": sum(p.numel() * p.element_size() for p in build_case("mlp")[0].parameters())}


def _suite() -> list:
    fused = parity_worker("gpt", {"hsdp": 2}, steps=3, opt="adamw")
    fused.pop("program"), fused.pop("plan")
    fused.update(case="gpt", constraints={"hsdp": 2}, optimizer="adamw")
    return [native_hsdp_worker("mlp", "sgd"), native_hsdp_worker("mlp", "adam"),
            native_hsdp_worker("gpt", "adam"), fused, measure_hsdp_worker()]


@pytest.mark.slow
def test_hsdp_parity_four_ranks_2x2():
    sgd, adam, gpt, fused, measured = autopar.launch(_suite, 4, timeout_s=900)[0]
    for r in (sgd, adam, gpt):
        assert r["mesh"] == {"dp": 2, "dp_shard": 2}
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL and r["param_err"] <= TOL and r["eval_err"] <= TOL, r
        # FSDP2's HSDP placements: replicated across groups, dim 0 sharded within one
        assert set(r["placements"].values()) == {(("dp", "dp_shard"), (Replicate(), Shard(0)))}, r["placements"]
    assert not parity_failures(fused, TOL), parity_failures(fused, TOL)
    assert fused["mesh"] == {"dp": 2, "dp_shard": 2}
    got, want, whole = measured["measured"], measured["predicted"], measured["param_bytes"]
    # each gradient is reduce-scattered within its group (whole), then only its half is
    # all-reduced across the groups (plus the loss value); parameters are gathered in the group
    assert got["reduce_scatter"] == whole
    assert whole / 2 <= got["all_reduce"] < whole / 2 + 64, got
    assert got["all_gather"] >= whole
    for kind in ("reduce_scatter", "all_reduce", "all_gather"):
        assert got[kind] == pytest.approx(want[kind], rel=0.02), (kind, got, want)


# --------------------------------------------------------------------------- planning
def test_hsdp_constraint_errors_and_meshes():
    for kw, match in (({"hsdp": 1}, "plain data parallelism"), ({"hsdp": 2, "zero": 2}, "zero=2 asks otherwise"),
                      ({"hsdp": 2, "ep": 2}, "not supported"), ({"hsdp": 4, "dp": 4}, "must divide dp=4 and be smaller")):
        with pytest.raises(ConstraintError, match=match):
            Constraints(**kw)
    assert Constraints.from_dict(Constraints(hsdp=8).to_dict()) == Constraints(hsdp=8)
    assert "hsdp" not in Constraints().to_dict()  # plans made without it keep their fingerprints
    from autopar.planner.meshes import hsdp_mesh
    from autopar.planner.search import mesh_candidates

    c = Cluster.preset("dgx-a100", nodes=4)
    assert mesh_candidates(c, Constraints(hsdp=8)) == [hsdp_mesh(32, 8), hsdp_mesh(16, 8, 2)]
    assert mesh_candidates(c, Constraints(hsdp=4, tp=2)) == [hsdp_mesh(16, 4, 2)]
    with pytest.raises(ConstraintError, match="hsdp=64 must divide"):
        mesh_candidates(c, Constraints(hsdp=64))
    # plain ZeRO-3 (or any dp / ZeRO choice) keeps ZeRO over every data rank: no HSDP twin
    assert all("dp_shard" not in getattr(m, "names", ()) for m in mesh_candidates(c, Constraints(zero=3)))
    assert all("dp_shard" not in getattr(m, "names", ()) for m in mesh_candidates(Cluster.preset("dgx-a100"), Constraints()))


def test_hsdp_gathers_prefetched_and_gradients_reduced_in_background_as_zero3():
    """HSDP's parameter gathers are issued ahead (``gather_param_start``) exactly as ZeRO-3's,
    each gradient reduce-scattered within the group and its shard all-reduced across the groups
    asynchronously (``grad_all_reduce``), not by a blocking ``reshard``; the planner prices them
    overlapped, as it does ZeRO-3's."""
    import copy as _copy

    from autopar.ir import gather_param_start, reshard
    from autopar.passes import run_passes
    from autopar.passes.analysis import count_collectives
    from autopar.passes.context import PassContext
    from autopar.planner.search import search_plan
    from autopar.trace import trace_model
    from examples.mlp import MLP, example_batch as mlp_batch, mlp_loss

    x, t = mlp_batch()
    traced = trace_model(MLP(64, 256, 2), (x,), loss_fn=mlp_loss, example_target=t)
    programs = {}
    for name, c in (("hsdp", Constraints(hsdp=2)), ("zero3", Constraints(dp=4, zero=3))):
        plan = search_plan(traced, Cluster.local(4), constraints=c, _with_free=False, _with_baseline=False)
        programs[name] = (plan, run_passes(_copy.deepcopy(traced.gm), PassContext.for_stage(plan)))
    (hplan, hsdp), (_, zero3) = programs["hsdp"], programs["zero3"]
    assert hplan.mesh == {"dp": 2, "dp_shard": 2}
    n = len(hplan.params)

    def starts(gm):
        return [g for g in gm.graph.nodes if g.target is gather_param_start]

    assert len(starts(hsdp)) == len(starts(zero3)) == n
    assert not [g for g in hsdp.graph.nodes if g.target is reshard and g.kwargs.get("param")]
    dp, shard = hplan.mesh_axes_index("dp"), hplan.mesh_axes_index("dp_shard")
    assert all(g.args[1] == shard and g.kwargs["grad"] and g.kwargs["grad_all_reduce"] == (dp,) for g in starts(hsdp))
    assert all(not g.kwargs.get("grad_all_reduce") for g in starts(zero3))
    counts = count_collectives(hsdp, (2, 2))
    assert counts[("forward", "all_gather")] == counts[("backward", "reduce_scatter")] == n
    assert counts[("backward", "all_reduce")] == n


def _plan_big_gpt(cluster, constraints):
    """A 20B-parameter GPT (24 x 8192, fp32) on 64 sequences of 128 tokens: its fp32 weights
    alone (79 GB) fill an A100, so every plan shards them (ZeRO-3, HSDP or a free split on the
    data axes; tensor parallelism is ruled out by the constraints of the test). HSDP's gathers are
    prefetched and its gradients reduce-scattered then all-reduced in the background, as ZeRO-3's
    are (``ir.prefetchable_gather``): what it saves is the bytes crossing nodes, which on 8 nodes
    outweighs its larger resident state (measured here on 2026-12-07: HSDP 1.33 s, the best plan on
    dp=64 1.40 s; on 4 nodes they tie within 0.2% and the search keeps dp=32)."""
    from examples.gpt import GPT, GPTConfig, gpt_loss

    cfg = GPTConfig(vocab_size=50304, block_size=128, n_layer=24, n_head=32, n_embd=8192)
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.empty(64, cfg.block_size, dtype=torch.long, device="meta")
    return autopar.plan(model, cluster, idx, loss_fn=gpt_loss, example_target=idx.clone(), constraints=constraints)


@pytest.mark.slow
def test_hsdp_priced_faster_than_zero3_across_nodes_and_chosen():
    cluster = Cluster.preset("dgx-a100", nodes=8)
    # data parallelism only (tp=1, one microbatch: no tensor or pipeline parallelism to weigh)
    free = _plan_big_gpt(cluster, Constraints(tp=1, microbatches=1))
    zero3 = _plan_big_gpt(cluster, Constraints(dp=64, zero=3))
    hsdp = _plan_big_gpt(cluster, Constraints(hsdp=8, tp=1))
    tried = "\n".join(f"{label}: {v}" for label, v in free.solver.candidates)
    # forced ZeRO-3 stays ZeRO-3 over all 64 ranks
    assert zero3.mesh == {"dp": 64, "tp": 1}
    assert all(p.layout.startswith("[S(") for p in zero3.params.values())
    # forced HSDP: replicated across the 8 nodes, sharded within each
    assert hsdp.mesh == {"dp": 8, "dp_shard": 8}
    assert all(p.layout.startswith("[R, S(") for p in hsdp.params.values() if len(p.shape) >= 1 and max(p.shape) > 8)
    # its all-gathers stay in a node (NVLink) and only an 8th of each gradient crosses nodes:
    # priced faster than ZeRO-3's gathers and reduce-scatters over every rank
    assert hsdp.predicted.step_time_s < zero3.predicted.step_time_s, (hsdp.predicted, zero3.predicted)
    # and the search, free to choose, takes it
    assert free.mesh == {"dp": 8, "dp_shard": 8}, tried
    # as HSDP: replicated on 'dp', ZeRO-3 on 'dp_shard' (not weights split across nodes)
    big = [p for p in free.params.values() if len(p.shape) >= 1 and max(p.shape) > 8]
    assert all(p.layout.startswith("[R, S(") for p in big), sorted({p.layout for p in big})
    assert free.predicted.step_time_s <= zero3.predicted.step_time_s
    assert any(label.startswith("dp=64 tp=1") for label, _ in free.solver.candidates), tried
