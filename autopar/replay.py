"""Provenance: plan again from a recorded plan and say whether the same plan comes out.

A plan's JSON is its record: the graph and shapes it was made for (``inputs_fingerprint``), the
cluster spec, the constraints, precision, optimizer and package versions, and every decision.
``replay(record, model, inputs, ...)`` plans the model again with the recorded cluster,
constraints, precision and optimizer and compares the new plan's JSON with the record, byte for
byte; when they differ it says why: other software, another graph or other inputs, or the same
inputs with other decisions (a nondeterminism in the planner, a bug). ``autopar replay RECORD
MODULE:FACTORY`` runs it from the command line (RECORD: a plan JSON file, or a monitored run's
folder holding ``plan.json``).
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
    import autopar
    from autopar.cluster import Cluster
    from autopar.constraints import Constraints

    cluster = Cluster.from_json(record.cluster_json)
    constraints = Constraints.from_dict(json.loads(record.constraints))
    again = autopar.plan(model, cluster, example_inputs, loss_fn=loss_fn, example_target=example_target,
                         precision=record.precision, optimizer=record.optimizer_spec or record.optimizer,
                         constraints=constraints)
    old, new = record.to_json(), again.to_json()
    if old == new:
        return ReplayResult(True, record.fingerprint, again.fingerprint, "")
    return ReplayResult(False, record.fingerprint, again.fingerprint, _why(record, again))


def _why(old, new) -> str:
    if old.versions != new.versions:
        return f"other software: recorded {dict(old.versions)}, now {dict(new.versions)}"
    if old.inputs_fingerprint != new.inputs_fingerprint:
        return ("other planning inputs (the model's graph or shapes, the example inputs, or the record's cluster, "
                "constraints, precision or optimizer as read back)")
    a, b = json.loads(old.to_json()), json.loads(new.to_json())
    fields = [k for k in a if a.get(k) != b.get(k)]
    return (f"the same inputs gave other decisions or predictions (fields {', '.join(fields[:6])}): the planner is "
            "not deterministic here; please report it")
