"""The Plan: what the planner decided, what it predicts, and why. Frozen and JSON round-trippable.

Invariants:
* ``to_json()`` is deterministic: the same inputs give byte-identical JSON (timings measured while
  planning live in ``timings``, which is not serialised and not compared).
* ``Plan.from_json(p.to_json()) == p``.
* ``fingerprint`` identifies what runs: a hash of ``inputs_fingerprint`` (what was planned: the
  graph, shapes, cluster, constraints, precision, optimizer, versions; given by the planner) and of
  every decision the plan holds (mesh, per-node and per-parameter layouts, ZeRO, microbatches,
  recompute, ...; predictions and explanations excluded). It is derived on construction, so a
  plan changed by ``dataclasses.replace`` or an edited JSON file gets a new one, and ranks that
  hold different plans are refused by ``compile`` instead of deadlocking.
* ``stages``: one per pipeline stage (one for plans without pipelining), each with its submesh
  (``mesh``, ranks ``first_rank`` onwards), its nodes and the parameters it owns; ``mesh_axes``
  is one stage's submesh and ``world_size`` counts every stage's devices.
"""
from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from autopar.errors import PlanFormatError
from autopar.plan_fields import NOT_SERIALISED

__all__ = ["Plan", "Stage", "NodePlacement", "ParamPlacement", "Alternative", "Predicted", "Baseline", "SolverReport", "SCHEMA_VERSION"]

SCHEMA_VERSION = 2
GiB = 2**30


@dataclass(frozen=True)
class Alternative:
    strategy: str
    delta_time_s: float  # step-time change if this node alone switched (neighbours fixed)
    delta_memory_bytes: float
    note: str = ""


@dataclass(frozen=True)
class NodePlacement:
    """One graph node: its output layouts, the input layouts it consumes, and its costs.

    ``rep`` names the node whose decision it shares (repeated blocks); ``""`` if it is its own.
    """

    name: str
    op: str
    module: str
    outs: tuple[str, ...]
    ins: tuple[str, ...]
    grad_ins: tuple[str, ...]
    rep: str = ""
    compute_s: float = 0.0
    alternatives: tuple[Alternative, ...] = ()
    excluded: tuple[tuple[str, str], ...] = ()
    fallback: bool = False


@dataclass(frozen=True)
class ParamPlacement:
    fqn: str
    node: str
    layout: str
    zero_axes: tuple[str, ...]
    shape: tuple[int, ...]
    bytes_per_device: float
    zero_stage: int = 0  # 1 (state) or 2 (state and gradients) where zero_axes shard; ZeRO-3 is the layout


@dataclass(frozen=True)
class Stage:
    index: int
    mesh: tuple[tuple[str, int], ...]
    first_rank: int
    nodes: tuple[NodePlacement, ...]
    params: tuple[ParamPlacement, ...]
    # pipeline plans (predictions): one microbatch's forward + backward on this stage, and the
    # stage's peak memory per device with the schedule's microbatches in flight
    predicted_time_s: float = 0.0
    peak_memory_bytes: float = 0.0
    # values this stage sends on in pieces of a layout other than their planned one, regathered
    # where they are received: ((node name, layout sent), ...)
    send_layouts: tuple[tuple[str, str], ...] = ()
    # pipeline plans: bytes per collective kind per step on a rank of this stage's pipeline rank
    # (its stages' collectives, its parameters' syncs, tied copies' sums; p2p sends not included)
    comm_bytes: tuple[tuple[str, float], ...] = ()
    # pipeline plans: how this stage's operators use each submesh axis of size > 1, read from its
    # parameters' edges (``planner.axis_use``): ((axis, ("data", "tensor", "ZeRO-3") subset), ...)
    axis_use: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def span(self) -> str:
        """The first and last module the stage runs (``wte .. blocks.2.attn``)."""
        mods = [n.module for n in self.nodes if n.module and n.op not in ("param", "buffer", "input", "placeholder")]
        if not mods:
            return "(no module)"
        return mods[0] if mods[0] == mods[-1] else f"{mods[0]} .. {mods[-1]}"


@dataclass(frozen=True)
class Predicted:
    step_time_s: float
    compute_s: float
    comm_s: tuple[tuple[str, float], ...]  # per collective kind, total (hidden or not)
    exposed_comm_s: float
    blocking_comm_s: float
    overlappable_comm_s: float
    peak_memory_bytes: float
    memory_bytes: tuple[tuple[str, float], ...]  # breakdown per device
    model_flops: float
    mfu: float
    comm_bytes: tuple[tuple[str, float], ...] = ()  # per collective kind per step (nccl-tests size)

    @property
    def comm(self) -> dict[str, float]:
        return dict(self.comm_s)

    @property
    def total_comm_s(self) -> float:
        return sum(v for _, v in self.comm_s)


@dataclass(frozen=True)
class Baseline:
    name: str
    predicted: Predicted | None
    fits: bool
    note: str


@dataclass(frozen=True)
class SolverReport:
    """How the ILP of the chosen plan ended. ``status``: OPTIMAL (proven to within
    ``SolverConfig.proof_gap`` of the best bound, 0.1% by default; ``proof_gap=0``: exactly) or
    FEASIBLE; ``gap``:
    (objective - bound) / objective, where ``bound_s`` is the best lower bound the solver proved
    (the LP relaxation's, when the proof MIP did not run); ``stopped``: why it stopped —
    "optimal", "time limit" (``SolverConfig.time_limit_s``: another run may differ) or "proof
    skipped" (the proof MIP was predicted slower than ``SolverConfig.prove_limit`` allows)."""

    status: str
    gap: float
    objective_s: float
    bound_s: float
    num_vars: int
    num_constraints: int
    candidates: tuple[tuple[str, str], ...]  # (mesh/recompute description, outcome)
    stopped: str = "optimal"


@dataclass(frozen=True)
class Plan:
    fingerprint: str
    versions: tuple[tuple[str, str], ...]
    model_class: str
    cluster_json: str
    precision: str
    optimizer: str
    constraints: str  # JSON of Constraints.to_dict()
    mesh_axes: tuple[tuple[str, int], ...]
    microbatches: int
    recompute: bool
    schedule: str | None
    stages: tuple[Stage, ...]
    predicted: Predicted
    baseline: Baseline
    solver: SolverReport
    free_step_time_s: float | None  # the free optimum, when constraints were given
    notes: tuple[str, ...] = ()
    optimizer_spec: Any = None  # cost_models.memory.OptimizerSpec the plan was priced for
    recompute_blocks: tuple[str, ...] = ()  # block instances run under activation checkpointing
    bubble_fraction: float = 0.0  # pipeline plans: predicted share of the step a stage idles
    virtual_stages: int = 1  # pipeline stages per rank (``len(stages) / pp``)
    schema_version: int = SCHEMA_VERSION
    # seconds of each planning phase (trace_s, search_s, ...), measured where the plan was made
    timings: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    # the hash of the planning inputs; "" when constructed by the planner, which passes that hash
    # as ``fingerprint`` (see __post_init__)
    inputs_fingerprint: str = ""
    # read back by ``from_json``: "" for a record as autopar wrote it, else what shows it was edited
    # (its checksum or its fingerprint does not match its content); not serialised, not compared
    edited: str = field(default="", compare=False, hash=False, repr=False)
    # what the ParallelModel running this plan learned (``report.note_optimizer``: "optimizer", the
    # class its loop steps), for ``summary``; not serialised, not compared
    observed: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        from autopar.plan_fields import check_plan_fields

        check_plan_fields(self)
        inputs = self.inputs_fingerprint or self.fingerprint
        object.__setattr__(self, "inputs_fingerprint", inputs)
        object.__setattr__(self, "fingerprint", fingerprint_of(inputs, _decisions_json(self)))

    # ----------------------------------------------------------------- accessors
    @property
    def mesh(self) -> dict[str, int]:
        """Mesh axis name -> size, e.g. ``{"dp": 16, "tp": 8}``."""
        return dict(self.mesh_axes)

    def mesh_axes_index(self, name: str) -> int:
        return [a for a, _ in self.mesh_axes].index(name)

    @property
    def stage_size(self) -> int:
        """Devices per pipeline stage (one stage's submesh, ``mesh_axes``)."""
        n = 1
        for _, s in self.mesh_axes:
            n *= s
        return n

    @property
    def world_size(self) -> int:
        return self.stage_size * self.pipeline_degree

    @property
    def pipeline_degree(self) -> int:
        """Ranks along the pipeline (``pp``): stages / stages per rank."""
        return len(self.stages) // self.virtual_stages

    def pipeline_rank(self, stage: int) -> int:
        """The pipeline rank (``pp`` coordinate) that runs stage ``stage`` (from its ``first_rank``)."""
        return self.stages[stage].first_rank // self.stage_size

    @property
    def nodes(self) -> dict[str, NodePlacement]:
        return {n.name: n for s in self.stages for n in s.nodes}

    @property
    def params(self) -> dict[str, ParamPlacement]:
        return {p.fqn: p for s in self.stages for p in s.params}

    @property
    def override_cost_s(self) -> float | None:
        """Extra predicted step time the constraints cost vs the free optimum (None if free)."""
        if self.free_step_time_s is None:
            return None
        return self.predicted.step_time_s - self.free_step_time_s

    @property
    def cluster(self):
        from autopar.cluster import Cluster

        return Cluster.from_json(self.cluster_json)

    # ----------------------------------------------------------------- serialisation
    def to_json(self) -> str:
        """The record: every serialised field and ``checksum``, a hash of all of them (``from_json``
        tells a record edited by hand from one autopar wrote)."""
        d = {f.name: _encode(getattr(self, f.name)) for f in fields(self) if f.name not in NOT_SERIALISED}
        d["checksum"] = _checksum(d)
        return json.dumps(d, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """The plan a ``to_json`` record holds. A record of another schema, with unknown fields or
        bad values is a PlanFormatError naming the field; an edited record loads (an edited plan
        is a way to force decisions) with ``edited`` saying what shows the edit."""
        from autopar.plan_fields import check_known_fields

        try:
            d = json.loads(text)
        except (TypeError, json.JSONDecodeError) as exc:
            raise PlanFormatError(f"plan JSON does not parse: {exc}") from None
        if not isinstance(d, dict):
            raise PlanFormatError(f"plan JSON must be an object (a Plan.to_json() record), got {type(d).__name__}")
        version = d.get("schema_version")
        if type(version) is not int or version != SCHEMA_VERSION:
            newer = " (written by a newer autopar: upgrade autopar to read it)" if (
                type(version) is int and version > SCHEMA_VERSION) else ""
            raise PlanFormatError(
                f"plan schema_version {version!r} is not {SCHEMA_VERSION}{newer}; re-plan with this autopar"
            )
        recorded = d.pop("checksum", None)
        check_known_fields(d, Plan, "")
        try:
            plan = _decode_plan(d)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            if isinstance(exc, PlanFormatError):
                raise
            raise PlanFormatError(f"plan JSON is missing or has a bad field: {exc!r}") from None
        edits = []
        if recorded is not None and recorded != _checksum(d):
            edits.append(f"its checksum {recorded!r} does not match its fields")
        if "inputs_fingerprint" in d and d.get("fingerprint") != plan.fingerprint:
            edits.append(f"its decisions hash to {plan.fingerprint}, not to the fingerprint {d.get('fingerprint')!r} "
                         "it records")
        object.__setattr__(plan, "edited", "; ".join(edits))
        return plan

    # ----------------------------------------------------------------- reports
    def summary(self) -> str:
        from autopar.report import plan_summary

        return plan_summary(self)

    def explain(self, module_path: str = "") -> str:
        from autopar.report import plan_explain

        return plan_explain(self, module_path)

    def diff(self, other: "Plan") -> str:
        from autopar.report import plan_diff

        return plan_diff(self, other)

    def draw(self, path: str):
        """Render a pipeline plan's predicted step as a timeline PNG at ``path`` (``autopar.timeline``)."""
        from autopar.timeline import draw_timeline

        return draw_timeline(self, path)

    def placement(self, node_name: str) -> NodePlacement:
        try:
            return self.nodes[node_name]
        except KeyError:
            raise KeyError(f"no node {node_name!r} in the plan") from None

    def nodes_in(self, module_glob: str) -> list[NodePlacement]:
        return [n for n in self.nodes.values() if n.module == module_glob or fnmatch.fnmatch(n.module, module_glob)
                or n.module.startswith(module_glob + ".")]



def _checksum(d: dict) -> str:
    """The hash of a record's fields (``d``: ``to_json``'s object without ``checksum``)."""
    return fingerprint_of(json.dumps(d, sort_keys=True, separators=(",", ":")))


def fingerprint_of(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


# what a plan holds besides its decisions: hashes, predictions and explanations of the choice
_NOT_DECISIONS = {
    Plan: {"fingerprint", "inputs_fingerprint", "timings", "edited", "observed", "predicted", "baseline", "solver",
           "free_step_time_s", "notes", "bubble_fraction"},
    NodePlacement: {"compute_s", "alternatives", "excluded"},
    ParamPlacement: {"bytes_per_device"},
    Stage: {"predicted_time_s", "peak_memory_bytes", "axis_use"},
}


def _decisions(v: Any) -> Any:
    """``_encode`` of a plan without what ``_NOT_DECISIONS`` names (a field added to the plan is
    a decision, and hashed, unless listed there)."""
    if type(v) in _PLAIN:
        return v
    if hasattr(v, "__dataclass_fields__"):
        return {name: _decisions(getattr(v, name)) for name in _field_names(type(v), True)}
    if isinstance(v, (list, tuple)):
        return [_decisions(x) for x in v]
    return _encode(v)


@functools.lru_cache(maxsize=None)
def _field_names(cls: type, decisions: bool) -> tuple[str, ...]:
    """The fields of dataclass ``cls`` that ``_encode`` writes (``decisions``: that ``_decisions``
    hashes), in declaration order (every plan is hashed at construction: once per type, not per
    instance)."""
    skip = _NOT_DECISIONS.get(cls, ()) if decisions else NOT_SERIALISED
    return tuple(f.name for f in fields(cls) if f.name not in skip)


def _decisions_json(plan: "Plan") -> str:
    return json.dumps(_decisions(plan), sort_keys=True, separators=(",", ":"))


# leaf types ``_encode`` returns as they are (exactly these types: a subclass takes the long way)
_PLAIN = frozenset((str, int, bool, type(None)))


def _encode(v: Any) -> Any:
    if type(v) in _PLAIN:
        return v
    if hasattr(v, "__dataclass_fields__"):
        return {name: _encode(getattr(v, name)) for name in _field_names(type(v), False)}
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):  # numpy scalars
        v = v.item()
    if isinstance(v, float):
        return float(f"{v:.9g}")
    return v


def _tuplify(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_tuplify(x) for x in v)
    return v


def _decode_plan(d: dict) -> Plan:
    from autopar.plan_fields import check_known_fields

    def build(cls, obj, where=""):
        kwargs = {}
        check_known_fields(obj, cls, where)
        for f in fields(cls):
            if f.name in NOT_SERIALISED + ("inputs_fingerprint",):
                continue
            if f.name not in obj and (f.name == "stopped" or f.default is not MISSING):
                continue  # plans written before the field existed: its default (``stopped``: set below)
            kwargs[f.name] = obj[f.name]
        return kwargs

    def node(o):
        k = build(NodePlacement, o, f"stages[].nodes[{o.get('name')!r}].")
        k["alternatives"] = tuple(Alternative(**a) for a in o["alternatives"])
        for key in ("outs", "ins", "grad_ins", "excluded"):
            k[key] = _tuplify(o[key])
        return NodePlacement(**k)

    def param(o):
        k = build(ParamPlacement, o, f"stages[].params[{o.get('fqn')!r}].")
        k["zero_axes"] = tuple(o["zero_axes"])
        k["shape"] = tuple(o["shape"])
        return ParamPlacement(**k)

    def predicted(o, where):
        if o is None:
            return None
        k = build(Predicted, o, where)
        k["comm_s"] = _tuplify(o["comm_s"])
        k["memory_bytes"] = _tuplify(o["memory_bytes"])
        k["comm_bytes"] = _tuplify(o["comm_bytes"])
        return Predicted(**k)

    for i, s in enumerate(d["stages"]):
        check_known_fields(s, Stage, f"stages[{i}].")
    stages = tuple(
        Stage(s["index"], _tuplify(s["mesh"]), s["first_rank"], tuple(node(n) for n in s["nodes"]),
              tuple(param(p) for p in s["params"]), s.get("predicted_time_s", 0.0), s.get("peak_memory_bytes", 0.0),
              _tuplify(s.get("send_layouts", ())), _tuplify(s.get("comm_bytes", ())), _tuplify(s.get("axis_use", ())))
        for s in d["stages"]
    )
    k = build(Plan, d)
    k["versions"] = _tuplify(d["versions"])
    k["mesh_axes"] = _tuplify(d["mesh_axes"])
    k["stages"] = stages
    k["predicted"] = predicted(d["predicted"], "predicted.")
    b = d["baseline"]
    check_known_fields(b, Baseline, "baseline.")
    k["baseline"] = Baseline(b["name"], predicted(b["predicted"], "baseline.predicted."), b["fits"], b["note"])
    s = d["solver"]
    stopped = s.get("stopped", "optimal" if s["status"] == "OPTIMAL" else "not recorded")
    k["solver"] = SolverReport(**{**build(SolverReport, s, "solver."), "candidates": _tuplify(s["candidates"]), "stopped": stopped})
    k["notes"] = tuple(d["notes"])
    k["recompute_blocks"] = tuple(d.get("recompute_blocks", ()))
    # plans written before the fingerprint covered decisions hold only the inputs' hash
    k["inputs_fingerprint"] = d.get("inputs_fingerprint", "")
    if d.get("optimizer_spec") is not None:
        from autopar.cost_models.memory import OptimizerSpec

        k["optimizer_spec"] = OptimizerSpec(**d["optimizer_spec"])
    return Plan(**k)
