"""Settings and records that were accepted silently or failed with raw Python errors: constraints,
cluster specs and plan JSON are refused with an error naming the field and the fix; a recorded
plan replays to itself (constraints included) and an edited one is named as edited."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import autopar
from autopar import Cluster, Constraints, Plan
from autopar.errors import ClusterSpecError, ConstraintError, PlanFormatError
from autopar.plan import SCHEMA_VERSION
from autopar.replay import replay


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.randn(8, 8), torch.randn(8, 4)


def _plan(constraints=None, world=2):
    model, x, y = _mlp()
    return autopar.plan(model, Cluster.local(world), x, loss_fn=torch.nn.functional.mse_loss, example_target=y,
                        constraints=constraints)


@pytest.fixture(scope="module")
def record():
    return json.loads(_plan(Constraints(dp=2)).to_json())


@pytest.mark.parametrize("make, match", [
    (lambda: Constraints(zero=True), r"Constraints.zero must be 0, 1, 2 or 3.*got True.*write zero=3"),
    (lambda: Constraints(zero=False), r"Constraints.zero must be .*got False"),
    (lambda: Constraints(virtual_stages=2), r"virtual_stages=2 .* but pp is None.*set pp=N"),
    (lambda: Constraints(pp=1, virtual_stages=2), r"virtual_stages=2 .* but pp is 1"),
])
def test_constraints_refuse_settings_they_would_ignore(make, match):
    with pytest.raises(ConstraintError, match=match):
        make()
    Constraints(pp=2, virtual_stages=2)  # with a pipeline: fine


def test_cluster_refuses_impossible_sizes_and_rates():
    with pytest.raises(ClusterSpecError, match=r"1000000000000000000000000000000 nodes x 8 devices.*more than autopar"):
        Cluster.preset("dgx-h100", nodes=10**30)
    with pytest.raises(ClusterSpecError, match=r"more than autopar plans for"):
        dataclasses.replace(Cluster.local(2, calibrated=False), devices_per_node=2**25)
    gpu = Cluster.preset("dgx-h100")
    with pytest.raises(ClusterSpecError, match=r"matmul_efficiency must be at least 0.01, got 1e-09.*fix peak_flops"):
        dataclasses.replace(gpu.device, matmul_efficiency=1e-9)
    spec = json.loads(gpu.to_json())
    spec["device"]["matmul_efficiency"] = 1e-9  # in a spec file: refused, naming the JSON path
    with pytest.raises(ClusterSpecError, match=r"cluster JSON device: .*matmul_efficiency.*1e-09"):
        Cluster.from_json(json.dumps(spec))
    with pytest.raises(ClusterSpecError, match=r"attention_efficiency must be in \(0, 1\] \(at least 0.001\).*got 1e-06"):
        dataclasses.replace(gpu.device, attention_efficiency=1e-6)


def test_a_cpu_calibration_for_another_world_size_is_refused():
    """A CPU spec measured with 4 processes sharing the cores (its collective table has groups of
    4) used for 2 processes: its per-process rates do not hold there."""
    from autopar.cluster import LinkSpec

    table = (("all_reduce", 2, 64.0, 5e-4), ("all_reduce", 2, 4e6, 5e-3), ("all_reduce", 4, 64.0, 7e-4),
             ("all_reduce", 4, 4e6, 8e-3))
    base = Cluster.local(4, calibrated=False)
    link = LinkSpec(bandwidth=1e9, latency=1e-4, collectives=(("all_reduce", 1e-4, 1e9),), collective_table=table)
    four = dataclasses.replace(base, intra_node=link, inter_node=link)
    assert Cluster.from_json(four.to_json()) == four
    with pytest.raises(ClusterSpecError, match=r"calibrated with 4 processes .* describes 2.*autopar calibrate --nproc 2"):
        dataclasses.replace(four, devices_per_node=2)
    spec = json.loads(four.to_json())
    spec["devices_per_node"] = 2
    with pytest.raises(ClusterSpecError, match=r"calibrated with 4 processes"):
        Cluster.from_json(json.dumps(spec))
    # the sources autopar calibrate writes say how many processes it measured: more are refused too
    said = ("autopar calibrate on 2026-12-01 10:00: 2 cpu process(es) measured together",)
    two = dataclasses.replace(Cluster.local(2, calibrated=False), sources=said)
    with pytest.raises(ClusterSpecError, match=r"calibrated with 2 processes .*its sources say so.* describes 4"):
        dataclasses.replace(two, devices_per_node=4)


@pytest.mark.parametrize("value", ["2", 0, -2, [2], 2.5, True, None])
def test_plan_json_refuses_bad_microbatches(record, value):
    with pytest.raises(PlanFormatError, match=r"plan field 'microbatches' must be an integer >= 1.*got"):
        Plan.from_json(json.dumps(dict(record, microbatches=value)))


@pytest.mark.parametrize("field, value, match", [
    ("virtual_stages", 0, r"'virtual_stages' must be an integer >= 1"),
    ("recompute", "no", r"'recompute' must be true or false"),
    ("schedule", "zigzag", r"'schedule' must be null or one of"),
    ("mesh_axes", [["dp", "2"]], r"'mesh_axes' must be a non-empty list"),
    ("bubble_fraction", 3, r"'bubble_fraction' must be a fraction"),
])
def test_plan_json_refuses_bad_fields(record, field, value, match):
    with pytest.raises(PlanFormatError, match=match):
        Plan.from_json(json.dumps(dict(record, **{field: value})))


def test_plan_json_of_a_future_schema_is_refused(record):
    with pytest.raises(PlanFormatError, match=r"schema_version 3 is not 2 \(written by a newer autopar"):
        Plan.from_json(json.dumps(dict(record, schema_version=SCHEMA_VERSION + 1)))
    with pytest.raises(PlanFormatError, match=r"schema_version 2.0 is not 2"):
        Plan.from_json(json.dumps(dict(record, schema_version=float(SCHEMA_VERSION))))
    with pytest.raises(PlanFormatError, match=r"unknown field 'pipeline_offload' \(a record of a newer autopar"):
        Plan.from_json(json.dumps(dict(record, pipeline_offload=True)))
    nested = json.loads(json.dumps(record))
    nested["stages"][0]["params"][0]["offloaded"] = True
    with pytest.raises(PlanFormatError, match=r"unknown field 'stages\[\]\.params\['0.weight'\]\.offloaded'"):
        Plan.from_json(json.dumps(nested))
    with pytest.raises(PlanFormatError, match=r"must be an object"):
        Plan.from_json("[1, 2]")


def test_an_edited_record_is_named_as_edited(record):
    """A record as autopar wrote it loads unedited; one with a field changed by hand loads (an
    edited plan forces decisions) but says so, and replay blames the edit, not the planner."""
    assert Plan.from_json(json.dumps(record)).edited == ""
    edited = dict(record, microbatches=2)
    plan = Plan.from_json(json.dumps(edited))
    assert plan.microbatches == 2 and "checksum" in plan.edited and "decisions hash to" in plan.edited
    model, x, y = _mlp()
    result = replay(plan, model, x, loss_fn=torch.nn.functional.mse_loss, example_target=y)
    assert not result.identical
    assert "the record was edited after autopar wrote it" in result.reason and "microbatches" in result.reason
    assert "not deterministic" not in result.reason
    predicted = dict(record, free_step_time_s=1.0)  # not a decision: caught by the checksum alone
    assert "checksum" in Plan.from_json(json.dumps(predicted)).edited


def test_a_run_compiled_with_constraints_replays_to_itself(world1, tmp_path):
    """compile plans without the free optimum (and traces on the cluster's device): replay plans the
    way the record was planned, so an untouched monitored run is reproduced byte for byte."""
    from autopar.replay import read_record

    model, x, y = _mlp()
    pm = autopar.compile(model, world1, x, loss_fn=torch.nn.functional.mse_loss, example_target=y,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), constraints=Constraints(dp=1),
                         monitor=autopar.Monitoring(tmp_path))
    pm.train_step(x, target=y)
    pm.close()
    recorded = read_record(tmp_path)
    assert recorded.free_step_time_s is None and recorded.edited == ""
    model, x, y = _mlp()
    result = replay(recorded, model, x, loss_fn=torch.nn.functional.mse_loss, example_target=y)
    assert result.identical, result.reason
