"""The habits of a torch training loop, under every plan family, against one device (issue 42).

Each habit (``tests/habit_loops.py``) is the loop a user writes in plain torch: ``zero_grad``
before or after the step (``set_to_none`` True and False), gradient accumulation over several
``backward()`` with ``clip_grad_norm_``, LR schedulers, ``train()``/``eval()`` toggled and
evaluation with and without ``torch.no_grad()`` between steps, state dicts saved and loaded back
(DTensors, and full tensors through ``torch.save``), per-rank seeding, the user's own loss,
keyword inputs, and models returning tuples, dicts and ``ModelOutput``s; in the torch-native
loop and in ``train_step``. SGD and AdamW alternate between habits (every family sees both).

Every family runs every habit in one world of 4 gloo processes (three launches for the seven
families); the native-loop habits of one graph share one compiled model per family, reset to the
fresh model's values before each (``habit_loops.Side.native``); each rank compares the values its loop saw and its final parameters with the
single-device loop, computed once here in the parent, within 1e-5 relative (fp32). Pipeline
plans run in ``train_step`` only: their native-loop habits are replaced by the check that the
native loop is refused with the fix, and ``eval_step`` is refused and training goes on.
"""
from __future__ import annotations

import os
import pickle
import re

import pytest

import autopar
from habit_loops import HABITS, reference

TOL = 1e-5
# family -> (model base, constraints)
FAMILIES = {
    "data": ("gpt", {"dp": 4, "zero": 0}),
    "tensor": ("gpt", {"dp": 2, "tp": 2}),
    "zero1": ("gpt", {"dp": 4, "zero": 1}),
    "zero2": ("gpt", {"dp": 4, "zero": 2}),
    "zero3": ("gpt", {"dp": 4, "zero": 3}),
    "pipeline": ("gpt", {"pp": 2, "dp": 2}),
    "expert": ("moe", {"dp": 4, "ep": 4}),
}
# what a plan of each family must show (``habit_loops.plan_facts``): the family is the plan that ran
IS_FAMILY = {
    "data": lambda p: p["mesh"] == {"dp": 4, "tp": 1} and not p["sharded"] and not p["zero"],
    "tensor": lambda p: p["mesh"] == {"dp": 2, "tp": 2} and p["sharded"] and not p["zero"],
    "zero1": lambda p: p["mesh"] == {"dp": 4, "tp": 1} and p["zero"] == [1] and not p["sharded"],
    "zero2": lambda p: p["mesh"] == {"dp": 4, "tp": 1} and p["zero"] == [2] and not p["sharded"],
    "zero3": lambda p: p["mesh"] == {"dp": 4, "tp": 1} and any(k.endswith("mlp.fc.weight") for k in p["sharded"]),
    "pipeline": lambda p: p["stages"] == 2,
    "expert": lambda p: any(k.endswith("moe.w_in") for k in p["sharded"]),
}
LAUNCHES = [("data", "tensor"), ("zero1", "zero2", "zero3"), ("pipeline", "expert")]
# what a family refuses, by habit: the recorded series it skips and the refusal it must give instead
REFUSED = {
    ("pipeline", "fused_schedule_and_eval"): {
        "eval": r"the plan pipelines the model over 2 stages; only train_step runs it for now"},
    ("pipeline", "native_loop_refused"): {
        "native": r"the plan pipelines the model over 2 stages, which runs in train_step only for now: compile with "
                  r"optimizer= \(a factory\) and train with pm.train_step"},
}


def habits_of(family: str) -> list[str]:
    paths = ("fused", "refusal") if family == "pipeline" else ("native", "fused")
    return [name for name, (_, _, path) in HABITS.items() if path in paths]


CASES = [(family, habit) for family in FAMILIES for habit in habits_of(family)]


def references(base: str) -> dict:
    """Every habit's single-device run on ``base``: (base, habit) -> values seen and final state."""
    return {(base, name): reference(base, loop) for name, (_, loop, path) in HABITS.items() if path != "refusal"}


def run_launch(group: tuple[str, ...], tmp: str, refs: dict) -> dict:
    """Every habit of the families in ``group`` in one world of 4 processes: (family, habit) ->
    every rank's result. A habit that kills the world (a gloo abort) is reported as such, and a
    new world runs the habits after it."""
    from autopar.runtime.launch import WorkerFailedError
    from habit_loops import result_path, run_families

    todo = [(f, *FAMILIES[f], h) for f in group for h in habits_of(f)]
    crashed: dict = {}
    done = lambda f, h: all(os.path.exists(result_path(tmp, r, f, h)) for r in range(4))  # noqa: E731
    while todo:
        try:
            autopar.launch(run_families, 4, todo, refs, tmp, timeout_s=600)
        except WorkerFailedError as exc:
            lost = next((s for s in todo if not done(s[0], s[3])), None)
            if lost is None:
                raise
            crashed[lost[0], lost[3]] = {"error": f"the world died during this habit: {str(exc)[:1500]}", "traceback": ""}
            todo = todo[todo.index(lost) + 1:]
            continue
        todo = []
    out = {}
    for f in group:
        for h in habits_of(f):
            if (f, h) in crashed:
                out[f, h] = [crashed[f, h]] * 4
                continue
            out[f, h] = []
            for r in range(4):
                with open(result_path(tmp, r, f, h), "rb") as fh:
                    out[f, h].append(pickle.load(fh))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """(family, habit) -> every rank's result; each launch (a few families in one world) runs
    once, when a test of one of its families first asks."""
    cache: dict = {}
    refs: dict = {}  # computed once per model base, here in the parent

    def of(family: str, habit: str) -> list[dict]:
        group = next(g for g in LAUNCHES if family in g)
        if group not in cache:
            for base in {FAMILIES[f][0] for f in group} - {b for b, _ in refs}:
                refs.update(references(base))
            cache[group] = run_launch(group, str(tmp_path_factory.mktemp("habits")), refs)
        return cache[group][family, habit]

    return of


def test_every_family_sees_both_optimizers():
    for family in FAMILIES:
        assert {HABITS[h][0] for h in habits_of(family)} >= {"sgd", "adamw"}, family


@pytest.mark.slow
@pytest.mark.parametrize("family, habit", CASES, ids=[f"{f}-{h}" for f, h in CASES])
def test_habit_matches_one_device(results, family, habit):
    refused = REFUSED.get((family, habit), {})
    for rank, r in enumerate(results(family, habit)):
        label = f"{habit} ({HABITS[habit][0]}) under {family} {FAMILIES[family][1]}, rank {rank}"
        assert "error" not in r, f"{label}: {r['error']}\n{r['traceback']}"
        assert "close_error" not in r, f"{label}: pm.close() raised {r['close_error']}"
        for name, pattern in refused.items():
            assert re.search(pattern, r["notes"].get(name, "")), f"{label}: {name} not refused as expected: {r['notes']}"
        assert set(r["notes"]) <= set(refused), f"{label}: unexpected refusals {r['notes']}"
        if HABITS[habit][2] == "refusal":
            continue
        assert r["plan"] is not None and IS_FAMILY[family](r["plan"]), f"{label}: not a {family} plan: {r['plan']}"
        series = {k: v for k, v in r["series"].items() if k not in refused}
        bad = {k: v for k, v in series.items() if isinstance(v, str) or v > TOL}
        assert not bad and not r["extra_series"], f"{label} on {r['mesh']}: {bad or r['extra_series']}"
        assert not r["missing"] and not r["unexpected"], f"{label}: state keys missing {r['missing']}, " \
                                                          f"unexpected {r['unexpected']}"
        assert r["param_err"] <= TOL, f"{label} on {r['mesh']}: param err {r['param_err']:.2e} (worst {r['worst']})"
