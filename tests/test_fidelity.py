"""The plan's promises, measured: per-rank peak memory and memory by category within tolerance,
and the bytes of every collective kind equal to the prediction, on 4 real gloo processes.

``benchmarks/memory_fidelity.py`` runs every plan family on both models; CI runs this subset
(each family at least once across the two models). The measured peak is the whole process's
(every storage alive); the one thing excused, by name, is the user's original model's full copy
of its parameters (``user_model_copy``) while ``compile`` keeps it (issue 43 item 1 removes it;
then it measures 0 and nothing is excused). Everything else no category covers counts.
"""
from __future__ import annotations

import math

import pytest

import autopar
from autopar.testing.fidelity import MIB, fidelity_misses, fidelity_suite, user_model_copy, worst_rank


def _copy_is_the_model_or_nothing(r: dict) -> str | None:
    """The named copy is the user's whole model (its parameters, and buffers) or nothing: never a
    part of one, never anything else under that name."""
    copy = user_model_copy(r)
    if copy and not r["model_param_bytes"] <= copy <= r["model_param_bytes"] + MIB:
        return f"the user's model holds {copy / MIB:.2f} MiB, its parameters are {r['model_param_bytes'] / MIB:.2f}"
    return None

CASES = [
    ("mlp", "zero1"),
    ("mlp", "zero3"),
    ("mlp", "dp_tp"),
    ("mlp", "tp"),
    ("gpt", "dp"),
    ("gpt", "zero2"),
    ("gpt", "sp"),
    ("gpt", "recompute"),
    ("gpt", "micro2"),
    ("gpt", "bf16"),
    ("mlp", "bf16_dp_bf16_reduce"),
    ("gpt", "bf16_zero3_bf16_reduce"),
    ("cnn", "dp"),
    ("cnn", "dp_tp"),
]


@pytest.mark.slow
def test_measured_memory_and_collective_bytes_match_the_plan():
    results = autopar.launch(fidelity_suite, 4, CASES)
    failures = []
    for i, (model, family) in enumerate(CASES):
        per_rank = [rank[i] for rank in results]
        for r in per_rank:  # every rank moves exactly the predicted bytes
            predicted = {k: int(v) for k, v in r["predicted_comm_bytes"].items() if v}
            assert r["comm_bytes"] == predicted, (model, family, r["comm_bytes"], predicted)
        for r in per_rank:
            bad = _copy_is_the_model_or_nothing(r)
            if bad:
                failures.append(f"{model} {family}: {bad}")
        for miss in fidelity_misses(worst_rank(per_rank), without_user_model=True):
            failures.append(f"{model} {family}: {miss}")
    # the families exercise what they claim to
    by = {(m, f): results[0][i] for i, (m, f) in enumerate(CASES)}
    assert by[("gpt", "recompute")]["recompute"] and by[("gpt", "micro2")]["microbatches"] == 2
    assert by[("gpt", "recompute")]["peak"] < by[("gpt", "dp")]["peak"]  # recompute saves memory
    assert by[("mlp", "zero3")]["categories"]["params"] < by[("mlp", "zero1")]["categories"]["params"] / 3
    assert by[("gpt", "zero2")]["categories"]["grads"] < by[("gpt", "dp")]["categories"]["grads"] / 3
    assert "reduce_scatter" in by[("gpt", "zero2")]["comm_bytes"]
    assert not failures, "\n".join(failures)


def _plan_peak(memory_bytes=None, **constraints):
    import dataclasses

    from autopar.testing.fidelity import fidelity_model

    model, inputs, target, loss_fn = fidelity_model("gpt")
    cluster = autopar.Cluster.local(4)
    if memory_bytes is not None:
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=memory_bytes))
    return autopar.plan(model, cluster, inputs, loss_fn=loss_fn, example_target=target,
                        constraints=autopar.Constraints(**constraints))


@pytest.mark.slow
def test_memory_that_only_recompute_fits_gets_a_recomputing_plan_that_trains_exactly():
    from autopar.planner.search import USABLE_MEMORY_FRACTION
    from autopar.testing.fidelity import tight_memory_worker

    # data parallel, the whole batch at once: 3% above the plan that recomputes every block, no
    # plan without recompute fits
    fixed = {"dp": 4, "zero": 0, "microbatches": 1}
    everything = _plan_peak(recompute=True, **fixed).predicted.peak_memory_bytes
    memory = int(everything * 1.03 / USABLE_MEMORY_FRACTION)
    with pytest.raises(autopar.NoFeasiblePlanError):
        _plan_peak(memory, recompute=False, **fixed)
    results = autopar.launch(tight_memory_worker, 4, memory, fixed)
    for r in results:
        assert r["recompute_blocks"], r  # only a recomputing plan fits
        assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-5, r
        peak = r["peak"] - r["user_model_copy"]  # the whole process, less the user's model's named copy
        assert peak <= r["budget"], r  # what it measured stays within the usable memory
        assert abs(peak / r["predicted_peak"] - 1) <= 0.15, r


def test_recompute_is_chosen_per_block_not_all_or_nothing():
    from autopar.planner.search import USABLE_MEMORY_FRACTION

    fixed = {"dp": 4, "zero": 0, "microbatches": 1}  # only recompute can save memory here
    every = _plan_peak(recompute=True, **fixed)
    none = _plan_peak(recompute=False, **fixed)
    assert every.recompute_blocks == ("blocks.0", "blocks.1") and none.recompute_blocks == ()
    # between the two: recomputing one block of two is enough, and cheaper than both
    between = (every.predicted.peak_memory_bytes + none.predicted.peak_memory_bytes) / 2
    p = _plan_peak(int(between / USABLE_MEMORY_FRACTION), **fixed)
    assert p.recompute_blocks == ("blocks.0",), p.recompute_blocks
    assert p.predicted.peak_memory_bytes <= between
    assert none.predicted.step_time_s < p.predicted.step_time_s < every.predicted.step_time_s


@pytest.mark.parametrize("curve", ["linear", "convex", "concave", "steps"])
def test_fewest_recomputed_instances_match_brute_force(monkeypatch, curve):
    """The interpolation search over how many block instances to recompute finds the same fewest
    count as trying every count, whatever the shape of the (falling) peak curve."""
    from types import SimpleNamespace

    from autopar.planner import attempts

    n = 24
    shape = {"linear": lambda f: f, "convex": lambda f: f ** 3, "concave": lambda f: f ** 0.3,
             "steps": lambda f: math.floor(f * 4) / 4}[curve]
    prefixes = [f"blocks.{i}" for i in range(n)]
    problem = SimpleNamespace(block_instances=lambda: prefixes, blocks=SimpleNamespace(blocks={"b": prefixes}))
    calls = []

    def peak(k):  # falls from 2.0 (none recomputed) to 1.0 (all)
        return 1.0 + shape(1 - k / n)

    def fake_evaluate(_problem, _choice, recompute):
        calls.append(len(recompute))
        return SimpleNamespace(peak_bytes=peak(len(recompute)), recompute=recompute)

    monkeypatch.setattr(attempts, "evaluate", fake_evaluate)
    for budget in [1.0 + i / 97 for i in range(98)]:
        calls.clear()
        ev = attempts.fewest_recomputed(problem, {}, fake_evaluate(None, None, frozenset(prefixes)), budget)
        want = min(k for k in range(n + 1) if peak(k) <= budget)
        assert len(ev.recompute) == want, (budget, len(ev.recompute), want)
        assert ev.recompute == frozenset(prefixes[:want])
        assert len(calls) <= 2 + 2 * math.ceil(math.log2(n)) + 1


PIPELINE_CASES = [("gpt", "pp_1f1b"), ("gpt", "pp_interleaved"), ("gpt", "pp_zbv"), ("gpt", "pp_recompute"),
                  ("mlp", "pp_gpipe"), ("gpt", "pp_zbv_zero3"), ("mlp", "pp_zbv_zero2")]


@pytest.mark.slow
def test_every_pipeline_rank_peaks_where_its_plan_says():
    """pp=2 x dp=2 (ZeRO-2 and -3 under zbv among them): each rank's measured peak within 15% of
    its pipeline rank's prediction (its stages' state, the activations each of its stages holds
    under the schedule's order, torch's receive buffers and, under the multi-stage schedules, the
    sends held to the step's end); and the bytes of its collectives exactly its pipeline rank's
    (``Stage.comm_bytes``: its stages' collectives, its parameters' syncs, the loss's on the last)."""
    results = autopar.launch(fidelity_suite, 4, PIPELINE_CASES)
    failures = []
    for i, (model, family) in enumerate(PIPELINE_CASES):
        assert results[0][i]["stages"] > 1
        for rank, per_rank in enumerate(results):
            r = per_rank[i]
            bad = _copy_is_the_model_or_nothing(r)
            if bad:
                failures.append(f"{model} {family} rank {rank}: {bad}")
            ratio = (r["peak"] - user_model_copy(r)) / r["predicted_peak"]  # the whole process less the named copy
            if not 1 / 1.15 <= ratio <= 1.15:
                failures.append(f"{model} {family} rank {rank}: measured / predicted {ratio:.2f}")
            predicted = {k: int(v) for k, v in r["predicted_comm_bytes"].items() if v}
            if r["comm_bytes"] != predicted:
                failures.append(f"{model} {family} rank {rank}: collective bytes {r['comm_bytes']} vs predicted {predicted}")
    assert not failures, "\n".join(failures)
