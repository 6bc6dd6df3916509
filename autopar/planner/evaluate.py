"""Evaluate a strategy choice: predicted step time, communication by kind, memory, alternatives.

The same arithmetic as the ILP objective (``planner.ilp``), in floating point, so what the plan
reports is what the solver minimised; memory and bytes per collective come from simulating the
step the runtime will run (``planner.memory_model``, ``planner.comm_model``), not from the ILP's
linear memory model (a problem built without a traced graph, as in the ILP tests, keeps that).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


from autopar.planner.costing import node_flops
from autopar.cost_models.communication import blocking_collective_time
from autopar.planner.loss_rider import local_counts_reduction, loss_rides
from autopar.planner.overlap import exposed_floor, exposed_latency, exposed_seconds
from autopar.planner.memory_model import MemoryEstimate, simulate_step_memory
from autopar.planner.problem import Problem

# the overlap windows' seconds and their waiting parts (``EdgeTable``)
OVERLAP_WINDOWS = ("overlap", "overlap_bwd", "overlap_last", "overlap_lat", "overlap_bwd_lat", "overlap_last_lat")

__all__ = ["Evaluation", "evaluate", "step_parts", "node_alternatives", "model_flops", "autocast_dtype"]


@dataclass
class Evaluation:
    step_time_s: float
    compute_s: float
    blocking_s: float
    overlap_s: float
    exposed_s: float
    comm_by_kind: dict[str, float]
    memory: MemoryEstimate
    ilp_memory_bytes: float  # what the ILP's linear memory model charged for this choice
    recompute: frozenset = frozenset()  # block instances checkpointed

    @property
    def peak_bytes(self) -> float:
        return self.memory.peak_bytes


def _edge_keys(e, choice):
    ku = int(e.u_key[choice[e.u]])
    kv = int(e.v_key[choice[e.v]]) if e.v is not None else 0
    return ku, kv


def step_parts(problem: Problem, choice: dict[str, int], recompute: frozenset[str] | None = None,
               pipelined: bool = False) -> tuple:
    """(forward compute, backward compute (the optimizer's updates included), blocking
    communication, seconds per collective kind, overlappable seconds per window: "overlap",
    "overlap_bwd", "overlap_last", and the waiting part of each: "overlap_lat", ...) of one step under ``choice`` (``evaluate``'s parts). The loss
    value's all-reduce costs no time where it rides the gradient sync (``loss_rider``; never
    under a pipeline schedule, ``pipelined``)."""
    fwd = sum(v.fwd_s[choice[n]] for n, v in problem.nodes.items())
    bwd = sum(v.bwd_s[choice[n]] for n, v in problem.nodes.items())
    if problem.recompute and recompute is not None:
        for n, v in problem.nodes.items():
            if v.in_block:  # bwd_s includes one forward more for every instance
                bwd -= v.fwd_s[choice[n]] * (1.0 - problem.recomputed_share(n, recompute))
    # node-level communication: ZeRO-1/2's parameter all-gathers after the optimizer step, batch
    # norm statistics over a split batch
    blocking = 0.0
    kinds: dict[str, float] = defaultdict(float)
    for n, v in problem.nodes.items():
        for k, arr in (v.comm_kinds or {}).items():
            if arr[choice[n]]:
                kinds[k] += arr[choice[n]]
                blocking += arr[choice[n]]
    counts = local_counts_reduction(problem)
    if counts is not None:  # local batches: the microbatches' target counts summed over the dp ranks, before the step
        t = blocking_collective_time("all_reduce", counts[1], problem.ctx.groups[counts[0]], problem.ctx.cluster)
        kinds["all_reduce"] += t
        blocking += t
    ovl = dict.fromkeys(OVERLAP_WINDOWS, 0.0)
    rides = not pipelined and loss_rides(problem, choice)
    for e in problem.edges:
        if rides and e.loss_value:
            continue
        ku, kv = _edge_keys(e, choice)
        blocking += e.blocking[ku, kv]
        for name in ovl:
            arr = getattr(e, name)
            if arr is not None:
                ovl[name] += arr[ku, kv]
        for k, t in e.kinds[ku][kv].items():
            kinds[k] += t
    return fwd, bwd, blocking, kinds, ovl


def evaluate(problem: Problem, choice: dict[str, int], recompute: frozenset[str] | None = None) -> Evaluation:
    """``recompute``: the block instances checkpointed (default: all of them when the problem was
    priced with recompute; fewer take back their share of the recomputed forward). Memoised on
    ``problem`` (``Problem.memo``): callers must not change the result."""
    key = ("evaluate", problem.choice_key(choice), recompute)
    found = problem.memo.get(key)
    if found is None:
        found = problem.memo[key] = _evaluate(problem, choice, recompute)
    return found


def _evaluate(problem: Problem, choice: dict[str, int], recompute: frozenset[str] | None) -> Evaluation:
    fwd, bwd, blocking, kinds, ovl = step_parts(problem, choice, recompute)
    ilp_memory = sum(v.static_bytes[choice[n]] + v.saved_bytes[choice[n]] for n, v in problem.nodes.items())
    ilp_memory += max((v.transient_bytes[choice[n]] for n, v in problem.nodes.items() if v.transient_bytes is not None),
                      default=0.0)
    exposed_f, exposed_b = exposed_seconds(fwd, bwd, ovl["overlap"], ovl["overlap_bwd"], ovl["overlap_last"],
                                           problem.microbatches, exposed_floor(problem.ctx.cluster),
                                           ovl["overlap_lat"], ovl["overlap_bwd_lat"], ovl["overlap_last_lat"],
                                           exposed_latency(problem.ctx.cluster))
    compute = fwd + bwd
    return Evaluation(
        step_time_s=compute + blocking + exposed_f + exposed_b,
        compute_s=compute,
        blocking_s=blocking,
        overlap_s=ovl["overlap"] + ovl["overlap_bwd"] + ovl["overlap_last"],
        exposed_s=exposed_f + exposed_b,
        comm_by_kind=dict(sorted(kinds.items())),
        memory=(simulate_step_memory(problem, choice, recompute, autocast_dtype=autocast_dtype(problem))
                if problem.traced is not None else MemoryEstimate(ilp_memory)),
        ilp_memory_bytes=ilp_memory,
        recompute=(recompute if recompute is not None
                   else frozenset(problem.block_instances()) if problem.recompute else frozenset()),
    )


def autocast_dtype(problem: Problem):
    """The dtype the program runs under autocast with (None: no autocast)."""
    policy = problem.ctx.policy
    return policy.torch_compute_dtype if policy.mixed else None


def node_alternatives(problem: Problem, choice: dict[str, int], incident: dict, top: int = 3) -> dict[str, list]:
    """Per node: the best other strategies with their step-time and memory deltas (others fixed)."""
    result: dict[str, list] = {}
    for name, v in problem.nodes.items():
        if len(v.strategies) < 2:
            result[name] = []
            continue
        cur = choice[name]
        base_t = v.fwd_s[cur] + v.bwd_s[cur]
        base_m = v.static_bytes[cur] + v.saved_bytes[cur]
        alts = []
        seen = {v.strategies[cur]}
        for s in range(len(v.strategies)):
            if v.strategies[s] in seen:
                continue  # followers may list one strategy several times
            seen.add(v.strategies[s])
            dt = v.fwd_s[s] + v.bwd_s[s] - base_t
            for e in incident.get(name, ()):
                ku, kv = _edge_keys(e, choice)
                if e.u == name:
                    ku2, kv2 = int(e.u_key[s]), kv
                else:
                    ku2, kv2 = ku, int(e.v_key[s])
                dt += e.seconds(ku2, kv2) - e.seconds(ku, kv)
            dm = v.static_bytes[s] + v.saved_bytes[s] - base_m
            alts.append((dt, dm, s))
        alts.sort(key=lambda a: (a[0], a[1], a[2]))
        result[name] = alts[:top]
    return result


def incident_edges(problem: Problem) -> dict[str, list]:
    inc: dict[str, list] = defaultdict(list)
    for e in problem.edges:
        inc[e.u].append(e)
        if e.v is not None and e.v != e.u:
            inc[e.v].append(e)
    return inc


def model_flops(problem: Problem) -> float:
    """Model FLOPs per step (matmul + attention, forward + backward, no recompute).

    Attention is counted without the causal halving, as published MFU figures do.
    """
    total = 0.0
    for v in problem.nodes.values():
        flops, kind = node_flops(v.node)
        if kind not in ("matmul", "attention"):
            continue
        if kind == "attention" and v.node.kwargs.get("is_causal", False) or (
            kind == "attention" and len(v.node.args) > 5 and v.node.args[5]
        ):
            flops *= 2.0
        grad = v.node.meta.get("autopar.needs_grad", False)
        total += flops * (3.0 if grad else 1.0) * v.count
    return total
