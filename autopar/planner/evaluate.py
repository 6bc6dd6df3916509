"""Evaluate a strategy choice: predicted step time, communication by kind, memory, alternatives.

The same arithmetic as the ILP objective (``planner.ilp``), in floating point, so what the plan
reports is what the solver minimised; plus the transient memory the ILP leaves out (the largest
live working set of a single op, and parameter all-gather buffers).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


from autopar.layouts import Shard
from autopar.planner.costing import node_flops
from autopar.planner.ilp import EXPOSED_FLOOR, OVERLAP_EFFICIENCY
from autopar.planner.problem import Problem

__all__ = ["Evaluation", "evaluate", "node_alternatives", "model_flops"]


@dataclass
class Evaluation:
    step_time_s: float
    compute_s: float
    blocking_s: float
    overlap_s: float
    exposed_s: float
    comm_by_kind: dict[str, float]
    static_bytes: float
    saved_bytes: float
    transient_bytes: float

    @property
    def peak_bytes(self) -> float:
        return self.static_bytes + self.saved_bytes + self.transient_bytes


def _edge_keys(e, choice):
    ku = int(e.u_key[choice[e.u]])
    kv = int(e.v_key[choice[e.v]]) if e.v is not None else 0
    return ku, kv


def evaluate(problem: Problem, choice: dict[str, int]) -> Evaluation:
    compute = sum(v.fwd_s[choice[n]] + v.bwd_s[choice[n]] for n, v in problem.nodes.items())
    static = sum(v.static_bytes[choice[n]] for n, v in problem.nodes.items())
    saved = sum(v.saved_bytes[choice[n]] for n, v in problem.nodes.items())
    blocking = overlap = 0.0
    kinds: dict[str, float] = defaultdict(float)
    for e in problem.edges:
        ku, kv = _edge_keys(e, choice)
        blocking += e.blocking[ku, kv]
        overlap += e.overlap[ku, kv]
        for k, t in e.kinds[ku][kv].items():
            kinds[k] += t
    exposed = max(overlap - OVERLAP_EFFICIENCY * compute, EXPOSED_FLOOR * overlap, 0.0)
    return Evaluation(
        step_time_s=compute + blocking + exposed,
        compute_s=compute,
        blocking_s=blocking,
        overlap_s=overlap,
        exposed_s=exposed,
        comm_by_kind=dict(sorted(kinds.items())),
        static_bytes=static,
        saved_bytes=saved,
        transient_bytes=transient_bytes(problem, choice),
    )


def transient_bytes(problem: Problem, choice: dict[str, int]) -> float:
    """Largest single-op working set (output + its gradient, local) plus the largest gathered
    parameter (an all-gather buffer for ZeRO-3 / FSDP-style parameters)."""
    ctx = problem.ctx
    biggest_act = 0.0
    biggest_param = 0.0
    for name, v in problem.nodes.items():
        s = v.strategies[choice[name]]
        metas = v.node.meta["autopar.outputs"]
        kind = v.node.meta.get("autopar.kind")
        for m, lay in zip(metas, s.outs):
            if m is None or lay is None:
                continue
            shards = 1
            for p, n in zip(lay, ctx.mesh_shape):
                if isinstance(p, Shard):
                    shards *= n
            local = ctx.act_bytes(m) / shards / (problem.microbatches if kind == "op" else 1)
            if kind == "param":
                if shards > 1:
                    biggest_param = max(biggest_param, ctx.act_bytes(m))
            elif kind == "op":
                biggest_act = max(biggest_act, 2 * local)
    return biggest_act + 2 * biggest_param


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
                dt += (e.blocking[ku2, kv2] + e.overlap[ku2, kv2]) - (e.blocking[ku, kv] + e.overlap[ku, kv])
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
