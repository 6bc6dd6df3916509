"""A pipeline plan's per-rank gradient and collective bytes (``pipeline_search`` prices and
assembles with these): each rank's collectives by kind, the gradients its stages hold whole, and
a gradient's bytes once synchronised over its submesh."""
from __future__ import annotations

import math

from autopar.plan import Plan
from autopar.planner.stages import SPLIT_BACKWARD_SCHEDULES

__all__ = ["rank_comm_bytes", "zero2_held_whole", "whole_grad_bytes", "grad_bytes_after_sync"]


def rank_comm_bytes(traced, priced, pp: int, schedule: str) -> list[dict[str, float]]:
    """Per pipeline rank, the bytes per collective kind it moves in one step: those of the
    collectives its stages' nodes run, of the gradient syncs and post-step gathers of the
    parameters it holds, of the loss's where the last stage runs (``comm_model.comm_bytes_by_owner``),
    and the gradient sums of the tied parameters it holds a copy of (``PipelineRunner.sum_tied_grads``)."""
    from autopar.planner.comm_model import comm_bytes_by_owner
    from autopar.planner.evaluate import autocast_dtype

    problem, choice = priced.attempt.problem, priced.attempt.solution.choice
    n_stages = len(priced.rank_of)
    stage_of = priced.stage_of
    sizes = dict(priced.inner.mesh_axes)
    grad_bytes = whole_grad_bytes(traced, priced.inner)
    holders: dict[str, set[int]] = {}
    for s, params in enumerate(priced.owned):
        for p in params:
            holders.setdefault(p.node, set()).add(priced.rank_of[s])
    trainable = {n.name for n in traced.graph.nodes if n.op == "placeholder" and n.meta.get("autopar.requires_grad")}
    split = schedule in SPLIT_BACKWARD_SCHEDULES
    # torch splits a stage's backward into an input pass and a weight pass where the stage has
    # inputs taking a gradient: every stage but the first (its input is the batch)
    owners = comm_bytes_by_owner(problem, choice, frozenset(priced.recompute_blocks), autocast_dtype(problem),
                                 zero2_reductions=1 if split else None,
                                 split_backward=frozenset(n for n, s in stage_of.items() if s > 0) if split else frozenset())
    out = []
    for r in range(pp):
        mine = {s for s in range(n_stages) if priced.rank_of[s] == r}
        held = {p.node: p for s in mine for p in priced.owned[s]}
        got: dict[str, float] = {}
        for owner, kinds in owners.items():
            if owner in held or (owner not in holders and stage_of.get(owner, n_stages - 1) in mine):
                for kind, nbytes in kinds.items():
                    got[kind] = got.get(kind, 0.0) + nbytes
        for p in held.values():
            if p.node in trainable and len(holders[p.node]) > 1:
                got["all_reduce"] = got.get("all_reduce", 0.0) + grad_bytes_after_sync(p, sizes, grad_bytes)
        out.append({k: float(v) for k, v in sorted(got.items()) if v})
    return out


def zero2_held_whole(inner: Plan, ctx, owned: list, schedule: str, grad_bytes: dict[str, float]
                      ) -> tuple[list[float], list[float], list[float]]:
    """Per stage, under a split-backward schedule (``grad_bytes``: a parameter node's whole local
    gradient, ``whole_grad_bytes``): (the bytes its ZeRO-2 gradients hold whole beside
    their shards while they accumulate whole, the time of their one reduce-scatter after the
    schedule, exposed, and the time of one microbatch's overlapped reduce-scatters that the
    submesh plan priced instead); zeros under any other schedule (those reduce-scatter per
    microbatch, overlapped, as the submesh plan priced)."""
    from autopar.cost_models.communication import blocking_collective_time, collective_time

    whole = [0.0] * len(owned)
    after = [0.0] * len(owned)
    per_micro = [0.0] * len(owned)
    if schedule not in SPLIT_BACKWARD_SCHEDULES:
        return whole, after, per_micro
    axis = {name: i for i, (name, _) in enumerate(inner.mesh_axes)}
    for s, params in enumerate(owned):
        for p in params:
            if p.zero_stage != 2 or not p.zero_axes:
                continue
            g = grad_bytes.get(p.node, 0.0)
            whole[s] += g  # beside the shard buffer (runtime.param_store), until the reduce-scatter
            after[s] += sum(blocking_collective_time("reduce_scatter", g, ctx.groups[axis[a]], ctx.cluster)
                            for a in p.zero_axes)
            per_micro[s] += sum(collective_time("reduce_scatter", g, ctx.groups[axis[a]], ctx.cluster)
                                for a in p.zero_axes)
    return whole, after, per_micro


def whole_grad_bytes(traced, inner: Plan) -> dict[str, float]:
    """Per trainable parameter node: its gradient's bytes on one device under its layout (in the
    parameter's dtype; ZeRO-3's shard), before any ZeRO-2 reduce-scatter."""
    from autopar.layouts import local_numel, parse_layout

    sizes = tuple(s for _, s in inner.mesh_axes)
    nodes = {n.name: n for n in traced.graph.nodes if n.op == "placeholder"}
    out = {}
    for p in inner.params.values():
        node = nodes.get(p.node)
        if node is None or not node.meta.get("autopar.requires_grad"):
            continue
        meta = node.meta["autopar.outputs"][0]
        out[p.node] = float(local_numel(meta.shape, parse_layout(p.layout), sizes) * meta.itemsize)
    return out


def grad_bytes_after_sync(p, sizes: dict[str, int], grad_bytes: dict[str, float]) -> float:
    """A parameter's gradient bytes on one rank once synchronised over its submesh: ZeRO-2 keeps
    only its shard on the zero axes."""
    g = grad_bytes.get(p.node, 0.0)
    if p.zero_stage == 2 and p.zero_axes:
        return g / math.prod(sizes[a] for a in p.zero_axes)
    return g
