"""No hangs, and steps that check their inputs (issue 8).

* ``autopar.launch`` returns or raises in bounded time: a rank that dies without a result (signal,
  ``os._exit``), raises, or runs past ``timeout_s`` stops every rank and is named;
* collectives time out after minutes (``DEFAULT_COLLECTIVE_TIMEOUT_S``), and a rank left alone in
  ``train_step`` fails with an error that says so;
* every step checks its batch against the compiled example (count, shapes, dtypes), and the ranks
  compare their batches on the first steps (``check_inputs``);
* the plan fingerprint covers the plan's decisions, so ranks holding different plans are refused.

Every multi-process test runs under ``launch``'s ``timeout_s`` and asserts how long it took.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch

import autopar
from autopar.errors import AutoparError, WorkerFailedError

# ----------------------------------------------------------------------------- launch


def _rank() -> int:
    return int(os.environ["RANK"])


def rank_worker(extra=0):
    return _rank() + extra


def killed_worker():
    if _rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # rank 0 would wait for ever on its peer; launch must stop it
    return "late"


def exiting_worker():
    if _rank() == 1:
        os._exit(3)
    time.sleep(120)
    return "late"


def raising_worker():
    if _rank() == 0:
        raise ValueError("boom on rank 0")
    time.sleep(120)
    return "late"


def sleeping_worker():
    if _rank() >= 1:
        time.sleep(120)
    return _rank()


def test_launch_returns_every_rank_result_in_order():
    assert autopar.launch(rank_worker, 3, 10, timeout_s=120) == [10, 11, 12]


@pytest.mark.parametrize("worker, message", [
    (killed_worker, r"rank 1 died with exit code -9 \(SIGKILL\) before returning a result"),
    (exiting_worker, r"rank 1 died with exit code 3 before returning a result"),
])
def test_launch_names_a_rank_that_died_without_a_result(worker, message):
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError, match=message) as info:
        autopar.launch(worker, 2, timeout_s=100)
    assert time.monotonic() - t0 < 60  # not launch's timeout, nor the sleeping rank's 120 s
    assert isinstance(info.value, RuntimeError)  # callers catching RuntimeError keep working


def test_launch_raises_a_failing_rank_traceback_and_stops_the_others():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)rank 0 failed:.*ValueError: boom on rank 0"):
        autopar.launch(raising_worker, 2, timeout_s=100)
    assert time.monotonic() - t0 < 60


def test_launch_names_the_ranks_still_running_at_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError, match=r"ranks \[1\] did not finish within 30 s \(ranks \[0\] returned\)"):
        autopar.launch(sleeping_worker, 2, timeout_s=30)  # long enough for a process to start here
    assert time.monotonic() - t0 < 70


# ----------------------------------------------------------------------------- plan fingerprint


@pytest.fixture(scope="module")
def mlp_plan():
    from examples.mlp import MLP, example_batch, mlp_loss

    x, t = example_batch(64, 16)
    p = autopar.plan(MLP(64, 256, 2), autopar.Cluster.local(2), x, loss_fn=mlp_loss, example_target=t,
                     constraints=autopar.Constraints(dp=2, tp=1))
    return dataclasses.replace(p, baseline=dataclasses.replace(p.baseline, fits=bool(p.baseline.fits)))


def _replace_param(plan, fqn, **changes):
    stage = plan.stages[0]
    params = tuple(dataclasses.replace(p, **changes) if p.fqn == fqn else p for p in stage.params)
    return dataclasses.replace(plan, stages=(dataclasses.replace(stage, params=params),) + plan.stages[1:])


def _replace_node(plan, name, **changes):
    stage = plan.stages[0]
    nodes = tuple(dataclasses.replace(n, **changes) if n.name == name else n for n in stage.nodes)
    return dataclasses.replace(plan, stages=(dataclasses.replace(stage, nodes=nodes),) + plan.stages[1:])


def test_the_plan_fingerprint_covers_its_decisions(mlp_plan):
    p = mlp_plan
    assert p.inputs_fingerprint and p.fingerprint != p.inputs_fingerprint
    assert dataclasses.replace(p).fingerprint == p.fingerprint  # rebuilt unchanged: the same plan
    sharded = next(n for n in p.stages[0].nodes if any(i not in ("[R, R]", "any") for i in n.ins))
    changed = {
        "a parameter's layout": _replace_param(p, "layers.0.up.weight", layout="[R, R]"),
        "a parameter's ZeRO stage": _replace_param(p, "layers.0.up.bias", zero_stage=1),
        "a parameter's ZeRO axes": _replace_param(p, "layers.0.up.bias", zero_axes=()),
        "a node's strategy": _replace_node(p, sharded.name, ins=tuple("[R, R]" for _ in sharded.ins)),
        "the mesh": dataclasses.replace(p, mesh_axes=(("dp", 1), ("tp", 2))),
        "microbatches": dataclasses.replace(p, microbatches=2),
        "recompute": dataclasses.replace(p, recompute=not p.recompute),
        "recompute blocks": dataclasses.replace(p, recompute_blocks=("layers.0",)),
        "precision": dataclasses.replace(p, precision="bf16"),
    }
    prints = {what: q.fingerprint for what, q in changed.items()}
    for what, q in changed.items():
        assert q.fingerprint != p.fingerprint, what
        assert q.inputs_fingerprint == p.inputs_fingerprint, what
    assert len(set(prints.values())) == len(prints)
    # what the plan predicts or explains is not a decision: the same program runs
    assert dataclasses.replace(p, notes=p.notes + ("a note",)).fingerprint == p.fingerprint
    assert _replace_param(p, "layers.0.up.bias", bytes_per_device=1.0).fingerprint == p.fingerprint


def test_the_plan_fingerprint_survives_json_and_an_edited_file_gets_a_new_one(mlp_plan):
    import json

    p = mlp_plan
    text = p.to_json()
    q = autopar.Plan.from_json(text)
    assert q == p and q.fingerprint == p.fingerprint and q.to_json() == text
    d = json.loads(text)
    weight = next(x for x in d["stages"][0]["params"] if x["fqn"] == "layers.0.up.weight")
    weight["layout"] = "[R, R]"  # edited by hand on one rank; the stored fingerprint is stale
    edited = autopar.Plan.from_json(json.dumps(d))
    assert edited.fingerprint != p.fingerprint
    assert edited.fingerprint == _replace_param(p, "layers.0.up.weight", layout="[R, R]").fingerprint
    # a plan written before the fingerprint covered decisions (it held the inputs' hash only)
    d = json.loads(text)
    d["fingerprint"] = d.pop("inputs_fingerprint")
    assert autopar.Plan.from_json(json.dumps(d)).fingerprint == p.fingerprint
