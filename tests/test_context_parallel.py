"""Context parallelism (``Constraints(cp=C)``, ``planner.meshes.context_mesh``): attention split
along the sequence on a ('dp', 'cp', 'tp') mesh's 'cp' axis, queries split, keys and values
all-gathered (their gradients reduce-scattered back), a causal mask by each rank's global rows
(``ir.context_sdpa``).

Executed: 4 gloo ranks train beside one device (fp32, within 1e-5 relative): causal attention
(the example GPT, TinyLlama's grouped-query attention with rotary embeddings) with 2 and with 4
ranks on the context axis, non-causal attention with a key padding mask (TinyEncoder), in
``train_step`` (loss each step, parameters after, SGD with momentum and AdamW) and in the native
loop (every gradient at every step); a step's measured all-gather bytes are the predicted ones.
Planned: the strategy exists only on a context axis and is priced with its all-gathers and the
causal imbalance; a Llama-3-8B-shaped model at 131,072 tokens on 8 x 8 H100 gets a context axis
because no other mesh fits."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar import Cluster, ConstraintError, Constraints
from autopar.layouts import R, Shard, parse_layout
from helpers import measured_comm_bytes, native_loop_errors
from autopar.testing.parity import build_case, parity_failures, parity_worker, relative_error

TOL = 1e-5


def native_cp_worker(case: str, constraints: dict, opt: str, steps: int = 3) -> dict:
    """``case`` under ``constraints`` in the native loop beside one device: the worst relative
    errors of the loss, of every gradient (each step, before the optimizer's step) and of the
    parameters after ``steps``."""
    model, batches, loss_fn = build_case(case)
    ref = copy.deepcopy(model)
    pm = autopar.compile(model, Cluster.local(), constraints=Constraints(**constraints))

    def make(m):
        if opt == "adamw":
            return torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    loss_err, grad_err = native_loop_errors(pm, ref, make, batches, loss_fn, steps)
    full, want = pm.full_state_dict(), ref.state_dict()
    return {"mesh": pm.plan.mesh, "loss_err": loss_err, "grad_err": grad_err,
            "param_err": max(relative_error(full[k], v) for k, v in want.items()),
            "program": pm.program.code}


def measure_cp_worker() -> dict:
    """One measured ``train_step`` of the GPT with 4 ranks on 'cp' (after a first step): bytes per
    collective kind measured and predicted."""
    measured, predicted = measured_comm_bytes("gpt", Constraints(cp=4))
    return {"measured": measured, "predicted": predicted}


# (case, constraints, optimizer, causal)
TRAIN_STEP_CASES = [
    ("gpt", {"cp": 2, "dp": 2}, "sgd", True),
    ("gpt", {"cp": 4}, "adamw", True),
    ("tiny_llama", {"cp": 4}, "sgd", True),
    ("tiny_encoder", {"cp": 4}, "sgd", False),
    ("tiny_encoder", {"cp": 2, "tp": 2}, "adamw", False),
]


def _suite() -> list:
    out = []
    for case, constraints, opt, causal in TRAIN_STEP_CASES:
        r = parity_worker(case, constraints, steps=3, opt=opt, lr=0.05 if opt == "sgd" else 1e-3)
        plan = r.pop("plan")
        r["context_split"] = _split_attention(plan)
        r["attention"] = sum("scaled_dot_product_attention" in n.op for n in plan.stages[0].nodes)
        r.update(case=case, constraints=constraints, optimizer=opt, causal=causal)
        out.append(r)
    native = [native_cp_worker("gpt", {"cp": 4}, opt) for opt in ("sgd", "adamw")]
    return [out, native, measure_cp_worker()]


def _split_attention(plan) -> int:
    """How many attention nodes of ``plan`` split their queries along the sequence (dim -2 of a
    4-D query: S(2)) on the 'cp' axis, keys and values whole there."""
    cp = [a for a, _ in plan.mesh_axes].index("cp")
    count = 0
    for n in plan.stages[0].nodes:
        if "scaled_dot_product_attention" not in n.op:
            continue
        q, k, v = (parse_layout(x) for x in n.ins[:3])
        if q[cp] == Shard(2) and k[cp] == R and v[cp] == R:
            count += 1
    return count


@pytest.mark.slow
def test_context_parallel_parity_four_ranks():
    results, native, measured = autopar.launch(_suite, 4, timeout_s=900)[0]
    for r in results:
        assert not parity_failures(r, TOL), parity_failures(r, TOL)
        assert r["mesh"]["cp"] == r["constraints"]["cp"], r["mesh"]
        # every attention splits its queries on 'cp'; a causal one runs as context_sdpa
        assert r["attention"] >= 2 and r["context_split"] == r["attention"], r
        assert ("context_sdpa" in r["program"]) == r["causal"], r["case"]
    for r in native:
        assert r["mesh"] == {"dp": 1, "cp": 4, "tp": 1}
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL and r["param_err"] <= TOL, r
        assert "context_sdpa" in r["program"]
    got, want = measured["measured"], measured["predicted"]
    # keys and values all-gathered over 'cp' (each layer), their gradients reduce-scattered back
    assert got["all_gather"] > 0 and got["reduce_scatter"] > 0, got
    for kind in ("all_gather", "reduce_scatter"):
        assert got[kind] == pytest.approx(want[kind], rel=0.02), (kind, got, want)


# --------------------------------------------------------------------------- strategies and prices
def _sdpa_node(causal: bool, T: int = 8):
    import torch.nn.functional as F

    from autopar.trace import trace_model

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    x = torch.randn(2, 4, T, 16)
    traced = trace_model(Attn(), (x, x.clone(), x.clone()))
    return next(n for n in traced.graph.nodes if str(n.target).startswith("aten.scaled_dot_product_attention"))


def _context_strategies(node, mesh, names):
    from autopar.strategies import enumerate_strategies

    return [s for s in enumerate_strategies(node, mesh, names).strategies
            if any(p == Shard(2) for p in s.ins[0])]


def test_attention_splits_the_sequence_only_on_a_context_axis():
    node = _sdpa_node(causal=True)
    # on ('dp', 'tp') no axis may split the queries along the sequence (each would need the rest)
    assert _context_strategies(node, (2, 2), ("dp", "tp")) == []
    split = _context_strategies(node, (1, 2, 2), ("dp", "cp", "tp"))
    assert split, "no context-parallel strategy on a ('dp', 'cp', 'tp') mesh"
    for s in split:  # queries split on 'cp' only, keys and values whole there, the output split as the queries
        assert s.ins[0][1] == Shard(2) and s.ins[1][1] == R and s.ins[2][1] == R and s.outs[0][1] == Shard(2)
        assert s.ins[0][2] != Shard(2)


def test_causal_context_attention_priced_with_its_imbalance():
    """The busiest rank of a causal attention split into c contiguous blocks does (2c - 1) / c of
    an even share: the split on 'cp' is priced that much above the same split by heads; without
    a causal mask the two cost the same."""
    from autopar.cost_models.memory import optimizer_spec, precision_policy
    from autopar.planner.contexts import cost_context
    from autopar.planner.costing import node_compute_time
    from autopar.planner.meshes import context_mesh
    from autopar.strategies import enumerate_strategies

    cluster = Cluster.preset("dgx-h100")
    mesh = context_mesh(1, 4, 2)
    ctx = cost_context(mesh, cluster, precision_policy("bf16-mixed"), optimizer_spec("adamw"))
    for causal, ratio in ((True, (2 * 4 - 1) / 4), (False, 1.0)):
        node = _sdpa_node(causal, T=4096)
        strategies = enumerate_strategies(node, tuple(mesh), mesh.names).strategies
        by_seq = next(s for s in strategies if s.ins[0] == (R, Shard(2), R))
        by_heads = next(s for s in strategies if s.ins[0] == (R, Shard(1), R))
        seq, heads = node_compute_time(node, by_seq, ctx), node_compute_time(node, by_heads, ctx)
        assert seq[0] == pytest.approx(ratio * heads[0], rel=1e-6) and seq[1] == pytest.approx(ratio * heads[1], rel=1e-6)


def test_cp_constraint_meshes_and_errors():
    from autopar.planner.candidates import mesh_candidates

    cluster = Cluster.preset("dgx-h100", nodes=2)
    assert [(tuple(m), m.names) for m in mesh_candidates(cluster, Constraints(cp=4, tp=2))] == \
        [((2, 4, 2), ("dp", "cp", "tp"))]
    assert [tuple(m) for m in mesh_candidates(Cluster.local(4), Constraints(cp=2, dp=2))] == [(2, 2, 1)]
    with pytest.raises(ConstraintError, match="dp x cp x tp"):
        mesh_candidates(Cluster.local(4), Constraints(cp=2, dp=4))
    with pytest.raises(ConstraintError, match="cp=2 with hsdp"):
        mesh_candidates(cluster, Constraints(cp=2, hsdp=2))
    with pytest.raises(ConstraintError):
        Constraints(cp=0)


# --------------------------------------------------------------------------- the planner chooses it
def _llama3_8b_shape_plan(seq: int, batch: int):
    """The free plan of a Llama-3-8B-shaped GPT (32 layers, hidden 4096, 32 heads, vocabulary
    128256; ``examples/gpt.py``, causal SDPA) at ``seq`` tokens on 8 dgx-h100 nodes, bf16-mixed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from gpt import GPT, GPTConfig, gpt_loss

    with torch.device("meta"):
        model = GPT(GPTConfig(128256, seq, 32, 32, 4096))
    idx = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return autopar.plan(model, Cluster.preset("dgx-h100", nodes=8), (idx,), loss_fn=gpt_loss, example_target=idx,
                        precision="bf16-mixed")


def _ms_per_step(outcomes, with_cp: bool) -> list[float]:
    return [float(text.split(" ms/step")[0]) for label, text in outcomes
            if " ms/step" in text and ("cp=" in label) == with_cp]


@pytest.mark.slow
def test_llama3_8b_shape_at_131k_tokens_on_8x8_h100_plans_a_context_axis():
    """At 131,072 tokens attention is ~70% of the work: the search tries the context meshes and
    the fastest plan splits every attention along the sequence on 'cp', predicted faster than
    every mesh without a context axis it solved."""
    plan = _llama3_8b_shape_plan(131072, 1)
    mesh = dict(plan.mesh_axes)
    assert mesh.get("cp", 1) > 1, (plan.mesh_axes, plan.solver.candidates)
    assert _split_attention(plan) == 32
    flat, context = _ms_per_step(plan.solver.candidates, False), _ms_per_step(plan.solver.candidates, True)
    assert flat and context, plan.solver.candidates
    assert plan.predicted.step_time_s * 1e3 == pytest.approx(min(context), rel=1e-3) and min(context) < min(flat)
