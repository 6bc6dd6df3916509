"""autopar.plan.Plan: JSON round trip, reports (summary, explain, diff), format errors."""
import dataclasses
import json
import re

import pytest
import torch

import autopar
from autopar import Cluster, Constraints, Plan, PlanFormatError
from autopar.plan import SCHEMA_VERSION

from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss

CFG = GPTConfig()


def _plan(constraints):
    torch.manual_seed(0)
    idx, tgt = example_batch(CFG, 8)
    return autopar.plan(GPT(CFG), Cluster.local(2), idx, loss_fn=gpt_loss, example_target=tgt,
                        constraints=constraints)


def json_safe(p: Plan) -> Plan:
    """Work around the numpy-bool ``baseline.fits`` (see test_to_json_of_a_fresh_plan) so the
    serialisation machinery itself can be tested."""
    return dataclasses.replace(p, baseline=dataclasses.replace(p.baseline, fits=bool(p.baseline.fits)))


@pytest.fixture(scope="module")
def plan_tp1():
    return _plan(Constraints(tp=1))


@pytest.fixture(scope="module")
def plan_tp2():
    return _plan(Constraints(tp=2))


def test_to_json_of_a_fresh_plan(plan_tp1):
    text = plan_tp1.to_json()
    assert Plan.from_json(text) == plan_tp1


def test_baseline_fits_is_a_python_bool_after_round_trip(plan_tp1):
    p = Plan.from_json(json_safe(plan_tp1).to_json())
    assert type(p.baseline.fits) is bool


@pytest.mark.parametrize("which", ["plan_tp1", "plan_tp2"])
def test_json_round_trip(which, request):
    p = json_safe(request.getfixturevalue(which))
    text = p.to_json()
    q = Plan.from_json(text)
    assert q == p
    assert q.to_json() == text  # byte-identical re-serialisation
    assert q.mesh == p.mesh and q.params == p.params and q.nodes == p.nodes
    assert q.predicted.comm == p.predicted.comm
    assert q.free_step_time_s == p.free_step_time_s
    assert q.cluster == Cluster.local(2)
    d = json.loads(text)
    assert d["schema_version"] == SCHEMA_VERSION
    assert "timings" not in d  # wall-clock timings are not part of the plan


def test_timings_do_not_affect_equality(plan_tp1):
    p = json_safe(plan_tp1)
    q = Plan.from_json(p.to_json())
    assert p.timings and not q.timings
    assert p == q


def test_summary(plan_tp1):
    s = plan_tp1.summary()
    assert plan_tp1.mesh == {"dp": 2, "tp": 1}
    assert re.search(r"dp=2\b.*tp=1\b", s)
    assert "predicted step time" in s
    assert "naive data parallel" in s
    assert plan_tp1.fingerprint in s
    assert "blocks.*.mlp" in s  # repeated blocks are collapsed in the table


def test_summary_reports_override_cost(plan_tp2):
    s = plan_tp2.summary()
    assert re.search(r"dp=1\b.*tp=2\b", s)
    assert "free optimum" in s


def test_explain_lists_alternatives_with_deltas(plan_tp1):
    text = plan_tp1.explain("blocks.0.mlp")
    lines = text.splitlines()
    assert "blocks.0.mlp" in lines[0]
    alt = [line for line in lines if line.strip().startswith("alternative ")]
    assert alt
    assert all(re.search(r": [+-]\d+\.\d+ ms, [+-]\d+\.\d+ MiB$", line) for line in alt)
    # at least one alternative is strictly slower (the chosen one is not arbitrary)
    assert any(re.search(r": \+0*[1-9]\d*\.\d+ ms|: \+0\.\d*[1-9]\d* ms", line) for line in alt)
    assert "param blocks.0.mlp.fc.weight (256, 64)" in text
    assert "blocks.1" not in text  # only the module asked for
    with pytest.raises(KeyError, match="no node in module"):
        plan_tp1.explain("no.such.module")


def test_alternatives_differ_from_the_choice(plan_tp1):
    for n in plan_tp1.nodes.values():
        if n.op in ("param", "input", "target", "buffer"):
            continue  # a parameter's ZeRO flag is not in NodePlacement; skip those
        chosen = "out " + ", ".join(n.outs) + (" <- " + ", ".join(n.ins) if n.ins else "")
        alts = [a.strategy for a in n.alternatives]
        assert len(set(alts)) == len(alts), (n.name, alts)
        assert chosen not in alts, (n.name, chosen)


def test_diff_mentions_mesh_change(plan_tp1, plan_tp2):
    d = plan_tp1.diff(plan_tp2)
    assert "mesh: {'dp': 2, 'tp': 1} -> {'dp': 1, 'tp': 2}" in d
    assert "predicted step time" in d
    assert plan_tp1.diff(plan_tp1).startswith("predicted step time") or "identical" in plan_tp1.diff(plan_tp1)
    assert "mesh:" not in plan_tp1.diff(plan_tp1)


def test_wrong_schema_version(plan_tp1):
    d = json.loads(json_safe(plan_tp1).to_json())
    d["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(PlanFormatError, match=rf"schema_version {SCHEMA_VERSION + 1} is not {SCHEMA_VERSION}"):
        Plan.from_json(json.dumps(d))
    del d["schema_version"]
    with pytest.raises(PlanFormatError, match="schema_version None"):
        Plan.from_json(json.dumps(d))


def test_malformed_json():
    with pytest.raises(PlanFormatError, match="does not parse"):
        Plan.from_json("{not json")
    with pytest.raises(PlanFormatError, match="missing or has a bad field"):
        Plan.from_json(json.dumps({"schema_version": SCHEMA_VERSION}))


def test_accessors(plan_tp1):
    p = plan_tp1
    assert p.world_size == 2
    assert p.override_cost_s is not None  # tp=1 is a constraint: its cost vs the free optimum is known
    # data parallel: the matmuls run on batch shards split over dp
    linears = [n for n in p.nodes.values() if "aten.linear" in n.op]
    assert linears and all(n.outs[0].startswith("[S(0)") for n in linears)
    assert p.placement("input_0").op == "input"
    with pytest.raises(KeyError, match="no node 'nope'"):
        p.placement("nope")
    mlp = p.nodes_in("blocks.0.mlp")
    assert mlp and all(n.module.startswith("blocks.0.mlp") for n in mlp)
    assert set(p.params) == {k for k, _ in GPT(CFG).named_parameters()}


def test_summary_says_why_a_free_plan_is_not_the_forced_plan_of_its_mesh():
    """The free plan's mesh is dp=2 x tp=1, yet Constraints(dp=2, tp=1) gives another plan: the
    summary says how the free plan uses its axes and that forcing the mesh is another plan; the
    forced plan's summary gives the cost of its constraints instead."""
    free, forced = _plan(None), _plan(Constraints(dp=2, tp=1))
    assert free.mesh == forced.mesh == {"dp": 2, "tp": 1}
    assert free.fingerprint != forced.fingerprint
    assert forced.predicted.step_time_s >= free.predicted.step_time_s
    s = free.summary()
    assert "axes: 'dp' data (a share of the batch each)" in s
    assert "the batch enters whole on 'dp'" in s
    assert re.search(r"note: this mesh is a device grid .*Constraints\(dp=2, tp=1\) forces it as written.*another "
                     r"plan, predicted no faster", s), s
    t = forced.summary()
    assert "note: this mesh is a device grid" not in t and "vs the free optimum" in t


def test_summary_names_the_zero_stage_per_parameter_group_and_the_planning_time(plan_tp1):
    zero2 = _plan(Constraints(dp=2, zero=2))
    s = zero2.summary()
    n = len(zero2.params)
    assert f"parameters: {n} tensors: {n} ZeRO-2 on dp" in s, s
    assert re.search(r"module .* ZeRO +parameter layouts", s)
    assert re.search(r"blocks\.\*\.mlp .* ms  2 ", s), s
    zero3 = _plan(Constraints(dp=2, zero=3)).summary()
    assert re.search(r"parameters: \d+ tensors: \d+ ZeRO-3 on dp", zero3), zero3
    assert re.search(r"planned in \d+\.\d\d s \(trace \d+\.\d\d s, search \d+\.\d\d s", s), s


def test_compile_keeps_the_planning_timings_and_the_summary_names_the_optimizer_used(world1):
    """compile's plan keeps its planning phases' seconds; the summary names the optimizer the loop
    steps once the ParallelModel knows it, and says so (and warns) where the plan priced another."""
    torch.manual_seed(0)
    idx, tgt = example_batch(CFG, 8)
    pm = autopar.compile(GPT(CFG), world1, idx)  # the torch-native loop: its plan prices AdamW
    assert {"trace_s", "search_s", "plan_s"} <= set(pm.plan.timings) and pm.plan.timings["plan_s"] > 0
    assert "planned in" in pm.plan.summary()
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"priced the optimizer state of adamw, but the loop steps SGD"):
        pm.track("optimizer", opt)
    assert "optimizer priced for adamw; the loop steps SGD" in pm.plan.summary()
    pm.close()
    fused = autopar.compile(GPT(CFG), world1, idx, loss_fn=gpt_loss, example_target=tgt,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert "optimizer SGD (the loop's)" in fused.plan.summary()
    fused.close()
