"""Provenance: plan again from a recorded plan and say whether the same plan comes out.

A plan's JSON is its record: the graph and shapes it was made for (``inputs_fingerprint``), the
cluster spec, the constraints, precision, optimizer and package versions, every decision, and a
checksum of all of it. ``replay(record, model, inputs, ...)`` plans the model again as the
record was planned and compares the new plan's JSON with the record, byte for byte; when they
differ it says why: a record edited after autopar wrote it (``Plan.edited``), other software,
another graph or other inputs, the same decisions with other predictions, or the same inputs
with other decisions (a nondeterminism in the planner, a bug).

"As the record was planned": with its cluster, constraints, precision and optimizer, and the
way it was planned, which the record shows: ``autopar.plan`` traces on the CPU and, under
constraints, also prices the free optimum (``free_step_time_s``); ``autopar.compile`` traces on
the cluster's device type (the torch-native loop: the forward alone) and prices neither the
free optimum nor, for a second program over the same shards, the baseline. Of the traces, the
one whose inputs hash matches the record's is planned. ``autopar replay RECORD MODULE:FACTORY``
runs it from the command line (RECORD: a plan JSON file, or a monitored run's folder holding
``plan.json``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.plan import Plan

__all__ = ["ReplayResult", "replay", "read_record"]


@dataclass(frozen=True)
class ReplayResult:
    identical: bool
    recorded_fingerprint: str
    replayed_fingerprint: str
    reason: str  # "" when identical; else what differs first

    def __str__(self) -> str:
        if self.identical:
            return f"reproduced byte for byte: plan {self.recorded_fingerprint}"
        return f"not reproduced: recorded plan {self.recorded_fingerprint}, replayed {self.replayed_fingerprint}: {self.reason}"


def read_record(path) -> Plan:
    """The recorded plan: a plan JSON file, or a run folder's ``plan.json``."""
    from autopar.errors import PlanFormatError
    from autopar.plan import Plan

    p = Path(path)
    if p.is_dir():
        p = p / "plan.json"
    if not p.is_file():
        raise PlanFormatError(f"{path}: no plan record there (a plan JSON file, e.g. from autopar plan -o, or a run "
                              "folder written with monitor=autopar.Monitoring(run_dir), which holds plan.json)")
    return Plan.from_json(p.read_text())


def replay(record, model, example_inputs, *, loss_fn=None, example_target=None) -> ReplayResult:
    """Plan ``model`` again as ``record`` (a Plan) was planned; compare (module docstring)."""
    again = _plan_again(record, model, example_inputs, loss_fn, example_target)
    old, new = record.to_json(), again.to_json()
    if old == new and not record.edited:
        return ReplayResult(True, record.fingerprint, again.fingerprint, "")
    return ReplayResult(False, record.fingerprint, again.fingerprint, _why(record, again))


def _traces(record, model, example_inputs, loss_fn, example_target):
    """The traces autopar plans from (``autopar.plan``'s, then ``compile``'s), each once."""
    from autopar.api import trace_checked
    from autopar.cluster import Cluster
    from autopar.cost_models.memory import precision_policy

    policy = precision_policy(record.precision)
    autocast = policy.torch_compute_dtype if policy.mixed else None
    common = dict(loss_fn=loss_fn, example_target=example_target, autocast_dtype=autocast)
    ways = [dict(device_type="cpu"),  # autopar.plan
            dict(device_type=Cluster.from_json(record.cluster_json).device_type, to_user=loss_fn is None)]  # compile
    seen = []
    for way in ways:
        if way in seen:
            continue
        seen.append(way)
        yield trace_checked(model, example_inputs, **common, **way)


def _plan_again(record, model, example_inputs, loss_fn, example_target) -> Plan:
    from autopar.api import check_fits_cluster, check_model_args, cyclic_gc_paused
    from autopar.cluster import Cluster
    from autopar.constraints import Constraints, with_annotations
    from autopar.planner.search import search_plan

    check_model_args(model, example_inputs, loss_fn, example_target)
    cluster = Cluster.from_json(record.cluster_json)
    constraints = with_annotations(Constraints.from_dict(json.loads(record.constraints)), model)
    # what the record shows of how it was planned: compile prices no free optimum (and, for a
    # second program over the same shards, no baseline)
    with_free = record.free_step_time_s is not None
    with_baseline = record.baseline.note != "not computed"
    again = None
    with cyclic_gc_paused():
        for traced in _traces(record, model, example_inputs, loss_fn, example_target):
            check_fits_cluster(traced, cluster, constraints)
            again = search_plan(traced, cluster, constraints=constraints, precision=record.precision,
                                optimizer=record.optimizer_spec or record.optimizer, _with_free=with_free,
                                _with_baseline=with_baseline)
            if again.inputs_fingerprint == record.inputs_fingerprint:
                break
    return again


def _why(old, new) -> str:
    if old.edited:
        a, b = json.loads(old.to_json()), json.loads(new.to_json())
        fields = [k for k in sorted(a) if k != "checksum" and a.get(k) != b.get(k)]
        return (f"the record was edited after autopar wrote it ({old.edited})"
                + (f"; it differs from the replayed plan in fields {', '.join(fields[:6])}" if fields else "")
                + ": replay compares the planner with a record as written")
    if old.versions != new.versions:
        return f"other software: recorded {dict(old.versions)}, now {dict(new.versions)}"
    if old.inputs_fingerprint != new.inputs_fingerprint:
        return ("other planning inputs (the model's graph or shapes, the example inputs, or the record's cluster, "
                "constraints, precision or optimizer as read back)")
    a, b = json.loads(old.to_json()), json.loads(new.to_json())
    fields = [k for k in sorted(a) if k != "checksum" and a.get(k) != b.get(k)]
    if old.fingerprint == new.fingerprint:
        return (f"the same decisions with other predictions (fields {', '.join(fields[:6])}): the cost model or the "
                "solver's report is not deterministic here; please report it")
    return (f"the same inputs gave other decisions (fields {', '.join(fields[:6])}): the planner is not deterministic "
            "here; please report it")
