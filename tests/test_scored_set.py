"""The scored set of ``benchmarks/calibration.py`` (issue 44): drawn from a seed, the same for the
same seed in any process, over every model family and plan kind, every configuration plannable
under its constraints; and the calibration that is scored on it reads none of it. Planning only:
no process group, no timing."""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import autopar
from autopar.report import _roles, zero_stage
from benchmarks.scored_set import FAMILIES, PLAN_KINDS, ScoredPlan, plan_kinds, scored_set

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_same_seed_draws_the_same_set_and_other_seeds_other_sets():
    for seed in range(6):
        assert scored_set(seed, 20) == scored_set(seed, 20)
        assert scored_set(seed, 8) == scored_set(seed, 20)[:8]  # a longer set extends a shorter one
    assert len({scored_set(seed, 20) for seed in range(6)}) == 6
    assert scored_set(1, 20, world=2) != scored_set(1, 20, world=4)


def test_the_draw_does_not_depend_on_the_process_hash_seed():
    """Ranks and later runs rebuild a set from its seed: no str hashing or global RNG in the draw."""
    code = "from benchmarks.scored_set import scored_set; print(repr(scored_set(3, 12)))"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    torch.manual_seed(99)  # the global RNGs are not the draw's
    assert out.stdout.strip() == repr(scored_set(3, 12))


@pytest.mark.parametrize("world", [2, 4])
def test_every_family_and_plan_kind_is_drawn(world):
    for seed in range(3):
        drawn = scored_set(seed, 20, world)
        assert {p.family for p in drawn} == set(FAMILIES)  # round-robin: any 5 consecutive cover them
        assert {p.family for p in scored_set(seed, len(FAMILIES), world)} == set(FAMILIES)
        assert all(p.world == world and p.kind in plan_kinds(world) for p in drawn)
    kinds = {p.kind for seed in range(5) for p in scored_set(seed, 20, world)}
    assert kinds == set(plan_kinds(world))
    assert ("dpxtp" in kinds) == (world == 4)  # 2 processes have no 2-D mesh


def test_a_configuration_builds_the_same_model_and_batch_each_time():
    plan = next(p for p in scored_set(2, 20) if p.family == "gpt")
    (m1, x1, _, t1), (m2, x2, _, t2) = plan.build(), plan.build()
    assert torch.equal(x1[0], x2[0]) and torch.equal(t1, t2)
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))


@pytest.mark.slow
def test_every_drawn_configuration_plans_under_its_constraints():
    """The first 10 of seed 1 on 4 processes (every family twice): planned, with the mesh and the
    ZeRO stage the plan kind asks for."""
    cluster = autopar.Cluster.local(4)
    drawn = scored_set(1, 10)
    assert {p.family for p in drawn} == set(FAMILIES)
    for config in drawn:
        model, inputs, loss_fn, target = config.build()
        plan = autopar.plan(model, cluster, inputs, loss_fn=loss_fn, example_target=target,
                            constraints=autopar.Constraints(**config.constraints))
        want = config.constraints
        mesh = dict(plan.mesh)
        assert all(mesh.get(axis, 1) == want[axis] for axis in ("dp", "tp") if axis in want), (config.label, mesh)
        assert plan.predicted.step_time_s > 0, config.label
        if config.kind.startswith("zero"):
            stages = {zero_stage(pp, plan.mesh_axes, _roles(plan)) for pp in plan.params.values()}
            assert max(stages) == int(config.kind[4:]), (config.label, stages)


def test_the_fit_sets_pipeline_plans_plan_on_a_spec_calibrated_for_their_world():
    """calibration.py's fit set on 4 processes after ``autopar calibrate --nproc 4``: its pipeline
    plans price each stage on a 2-process view of the 4-process spec, which is not a spec
    calibrated for 2 (``check_calibrated_world`` refused that view: every pp plan failed)."""
    import dataclasses

    from benchmarks.calibration import CONFIGS
    from autopar.bench import load_bench_model

    said = ("autopar calibrate on 2026-12-07: 4 cpu process(es) measured together",)
    plain = autopar.Cluster.local(4, calibrated=False)
    cluster = dataclasses.replace(plain, sources=tuple(plain.sources) + said)
    with pytest.raises(autopar.errors.ClusterSpecError, match="calibrated with 4 processes"):
        dataclasses.replace(cluster, devices_per_node=2)  # a spec of its own for 2 is still refused
    piped = [(name, c) for name, c in CONFIGS[4] if c.get("pp", 1) > 1]
    assert piped
    for name, constraints in piped:
        model, inputs, loss_fn, target = load_bench_model(name)
        plan = autopar.plan(model, cluster, inputs, loss_fn=loss_fn, example_target=target,
                            constraints=autopar.Constraints(**constraints))
        assert len(plan.stages) == constraints["pp"] and plan.predicted.step_time_s > 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="world >= 2"):
        scored_set(0, 5, world=1)
    with pytest.raises(ValueError, match="unknown model family 'rnn'"):
        ScoredPlan("rnn", (), "free", 4)
    with pytest.raises(ValueError, match="plan kind 'dpxtp' on 2 processes"):
        ScoredPlan("gpt", (), "dpxtp", 2)
    assert set(plan_kinds(4)) == set(PLAN_KINDS)


@pytest.mark.slow
def test_calibration_reads_no_benchmark_plan():
    """``autopar calibrate`` fits on its own probes: nothing in ``autopar.calibration`` imports
    ``benchmarks`` (the fit set, the scored set) or ``examples`` (their models), nor names them."""
    package = ROOT / "autopar" / "calibration"
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("benchmarks", "examples") for n in names), (path.name, names)
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert "benchmarks" not in node.value and "scored_set" not in node.value, path.name
    code = ("import sys, autopar.calibration, autopar.calibration.comm_probes, autopar.calibration.host_probe, "
            "autopar.calibration.training_probe, autopar.calibration.cpu_cache; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('benchmarks', 'examples')))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
