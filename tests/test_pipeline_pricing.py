"""Pipeline plans priced: the messages and schedule work a stage pays per microbatch, and ZeRO
per stage (with parity on 4 gloo processes)."""
from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.runtime.parity import build_case, parity_failures
from autopar.trace import trace_model

TOL = 1e-5


def test_each_crossing_tensor_is_a_message_and_the_schedule_work_per_microbatch_is_priced():
    """torch's pipelining sends every tensor crossing a boundary as its own message (the GPT's
    residual stream, and the target it carries to the last stage; only the activation's gradient
    comes back), and a stage's schedule spends ``Cluster.pipeline_microbatch_s`` per microbatch
    beyond compute: the step time grows by at least that for each microbatch."""
    from autopar.planner.stages import messages_seconds
    from autopar.planner.stages import cut_model, cut_stages

    model, batches, loss = build_case("gpt")
    x, y = batches[0]
    base = autopar.Cluster.local(2, calibrated=False)
    plan = autopar.plan(model, base, x, loss_fn=loss, example_target=y, constraints=autopar.Constraints(pp=2))
    traced = trace_model(model, x, loss_fn=loss, example_target=y)
    cm = cut_model(traced.graph, plan.nodes, (1, 1), 1e9)
    cut = cut_stages(traced.graph, cm, 2)
    (fwd, bwd, grad_bytes), = cut.boundary_messages
    assert fwd >= 2 and bwd == 1 and 0 < grad_bytes <= cut.boundary_bytes[0]  # the target has no gradient
    # n messages of b / n bytes each cost n latencies
    assert messages_seconds(lambda n: 1e-4 + n / 1e9, 3e3, 1e3, 3, 1) == pytest.approx(4e-4 + 4e3 / 1e9)
    slow = dataclasses.replace(base, pipeline_microbatch_s=1e-3)
    busy = autopar.plan(model, slow, x, loss_fn=loss, example_target=y, constraints=autopar.Constraints(pp=2))
    m = plan.microbatches
    assert busy.microbatches == m and busy.predicted.step_time_s >= plan.predicted.step_time_s + m * 1e-3


def _per_stage_zero_plan():
    """gpt pp=2 x dp=2 (no recompute) on devices whose usable memory lies between what its two
    ranks need without ZeRO: the first rank (two microbatches in flight under 1F1B) overflows,
    the last fits."""
    from autopar.planner.search import USABLE_MEMORY_FRACTION

    model, batches, loss = build_case("gpt")
    x, y = batches[0]
    base = autopar.Cluster.local(4, calibrated=False)
    c = autopar.Constraints(pp=2, dp=2, recompute=False)
    free = autopar.plan(model, base, x, loss_fn=loss, example_target=y, constraints=c)
    first, last = (s.peak_memory_bytes for s in free.stages)
    usable = last + 0.9 * (first - last)
    tight = dataclasses.replace(base, device=dataclasses.replace(base.device, memory_bytes=int(usable / USABLE_MEMORY_FRACTION)))
    return autopar.plan(model, tight, x, loss_fn=loss, example_target=y, constraints=c), free, usable


def test_zero_per_stage_shards_only_the_ranks_that_need_it():
    """Where only the first pipeline rank overflows, its stage's parameters take ZeRO and the last
    stage's stay whole with their optimizer state (``pipeline_search._zero_per_stage``; shrinking
    every stage's memory alike found no plan here), and every rank's predicted peak fits."""
    plan, free, usable = _per_stage_zero_plan()
    zeroed = [[p for p in s.params if p.zero_axes or p.layout.startswith("[S(")] for s in plan.stages]
    assert zeroed[0] and not zeroed[1], [[(p.fqn, p.layout, p.zero_stage) for p in s.params] for s in plan.stages]
    assert all(s.peak_memory_bytes <= usable for s in plan.stages)
    assert plan.stages[0].peak_memory_bytes < free.stages[0].peak_memory_bytes
    assert plan.stages[1].peak_memory_bytes == pytest.approx(free.stages[1].peak_memory_bytes)


def _per_stage_zero_suite(plan_json: str):
    from autopar.runtime.parity import parity_worker

    out = []
    for opt in ("sgd", "adamw"):
        r = parity_worker("gpt", None, 5, opt=opt, lr=0.05 if opt == "sgd" else 1e-3, plan=autopar.Plan.from_json(plan_json))
        r.pop("plan"), r.pop("program")
        r["case"], r["constraints"], r["optimizer"] = "gpt", {"pp": 2, "dp": 2, "zero": "per stage"}, opt
        out.append(r)
    return out


@pytest.mark.slow
def test_zero_per_stage_parity():
    plan, _, _ = _per_stage_zero_plan()
    results = autopar.launch(_per_stage_zero_suite, 4, plan.to_json())
    failures = [line for r in results[0] for line in parity_failures(r, TOL)]
    assert not failures, "\n".join(failures)
