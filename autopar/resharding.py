"""How to move a tensor from one layout to another: an ordered list of per-axis steps.

Shared by the planner (which prices the steps) and the passes (which emit them as collectives),
so what is priced is exactly what runs. Per axis:

* ``Partial -> Replicate``: all-reduce;   ``Partial -> Shard(d)``: reduce-scatter on ``d``;
* ``Shard(d) -> Replicate``: all-gather;  ``Shard(i) -> Shard(j)``: all-to-all;
* ``Replicate -> Shard(d)``: local slice; ``Replicate -> Partial``: local (rank 0 keeps, others 0
  for sum; every rank keeps for avg); ``Partial(sum) <-> Partial(avg)``: local scaling.

Order: cheap steps that shrink the tensor first (slices, reductions), gathers last, except that
nested shards of one dim (``[S(0), S(0)]``: cut on axis 0, each piece cut again on axis 1, as
DTensor cuts them; only on data axes, see ``planner.meshes``) are formed outer axis first and
undone inner axis first: a step introducing a shard on dim ``e`` waits until every other axis
sharding ``e`` is an outer one that keeps it, and a step removing axis ``a``'s shard of ``e``
waits until no inner axis shards ``e``. A swap cycle is broken by gathering first (the innermost
shard of the dim in the way).

Uneven shards (``uneven``: (axis, dim) pairs, parameter storage only, see
``layouts.uneven_dims``) never take part in an all-to-all: ``Shard(i) -> Shard(j)`` on such an
axis is an all-gather followed by a slice. Slices, gathers and reduce-scatters of an uneven dim
pad to ``ceil(size / n)`` per rank (the runtime needs the global shape for them).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from autopar.layouts import Layout, Partial, Placement, Replicate, Shard, uneven_dims

__all__ = ["ReshardStep", "reshard_steps", "reshard_steps_for", "COMM_KINDS"]

COMM_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


@dataclass(frozen=True)
class ReshardStep:
    """One step on one mesh axis. ``kind`` is a collective name or a local op.

    kinds: "all_reduce" (op), "reduce_scatter" (dim, op), "all_gather" (dim), "all_to_all"
    (src_dim -> dim), "slice" (dim), "to_partial" (op), "scale" (factor kind: "avg_to_sum" or
    "sum_to_avg").
    """

    kind: str
    axis: int
    dim: int | None = None
    src_dim: int | None = None
    op: str | None = None

    @property
    def is_collective(self) -> bool:
        return self.kind in COMM_KINDS


def _one_axis(axis: int, p: Placement, q: Placement, uneven: frozenset = frozenset()) -> list[ReshardStep]:
    if p == q:
        return []
    if isinstance(p, Shard) and isinstance(q, Shard) and ((axis, p.dim) in uneven or (axis, q.dim) in uneven):
        return [ReshardStep("all_gather", axis, dim=p.dim), ReshardStep("slice", axis, dim=q.dim)]
    if isinstance(p, Partial):
        if isinstance(q, Replicate):
            return [ReshardStep("all_reduce", axis, op=p.reduce_op)]
        if isinstance(q, Shard):
            return [ReshardStep("reduce_scatter", axis, dim=q.dim, op=p.reduce_op)]
        kind = "avg_to_sum" if p.reduce_op == "avg" else "sum_to_avg"
        return [ReshardStep("scale", axis, op=kind)]
    if isinstance(p, Shard):
        if isinstance(q, Replicate):
            return [ReshardStep("all_gather", axis, dim=p.dim)]
        if isinstance(q, Shard):
            return [ReshardStep("all_to_all", axis, dim=q.dim, src_dim=p.dim)]
        return [ReshardStep("all_gather", axis, dim=p.dim), ReshardStep("to_partial", axis, op=q.reduce_op)]
    # Replicate
    if isinstance(q, Shard):
        return [ReshardStep("slice", axis, dim=q.dim)]
    return [ReshardStep("to_partial", axis, op=q.reduce_op)]


# (a reduce-scatter before an all-reduce: a gradient Partial on two axes and kept sharded on one,
# as HSDP's, is reduce-scattered in its group and only its shard all-reduced across groups)
_PRIORITY = {"slice": 0, "scale": 0, "reduce_scatter": 1, "all_reduce": 1.5, "all_to_all": 2,
             "all_gather": 3, "to_partial": 4}


def reshard_steps(src: Sequence[Placement], dst: Sequence[Placement],
                  uneven: frozenset[tuple[int, int]] = frozenset()) -> list[ReshardStep]:
    """Steps turning a tensor laid out ``src`` into ``dst`` (same mesh), in execution order (a
    fresh list; computed once per distinct arguments: the planner prices the same layout pairs
    tens of thousands of times)."""
    return list(_reshard_steps(tuple(src), tuple(dst), frozenset(uneven)))


@functools.lru_cache(maxsize=1 << 16)  # (the planner meets tens of thousands of pairs on a 3-axis mesh)
def _reshard_steps(src: tuple, dst: tuple, uneven: frozenset) -> tuple[ReshardStep, ...]:
    if len(src) != len(dst):
        raise ValueError(f"layouts of different mesh rank: {src} vs {dst}")
    cur: list[Placement] = list(src)
    pending = {a for a in range(len(src)) if src[a] != dst[a]}
    steps: list[ReshardStep] = []

    def introduces(a: int) -> int | None:
        q = dst[a]
        return q.dim if isinstance(q, Shard) and cur[a] != q else None

    def innermost(e: int) -> int | None:
        holders = [b for b in range(len(cur)) if cur[b] == Shard(e)]
        return max(holders) if holders else None

    def blocked(a: int) -> bool:
        p = cur[a]
        if isinstance(p, Shard) and p != dst[a] and innermost(p.dim) != a:
            return True  # an inner axis still cuts this axis's pieces
        e = introduces(a)
        if e is None:
            return False
        # every other axis cutting e is an outer one that keeps it; an outer axis still to cut e goes first
        return any((cur[b] == Shard(e) and not (b < a and dst[b] == Shard(e))) or (b < a and introduces(b) == e)
                   for b in range(len(cur)) if b != a)

    while pending:
        ready = [a for a in pending if not blocked(a)]
        if ready:
            a = min(ready, key=lambda ax: (_PRIORITY[_one_axis(ax, cur[ax], dst[ax], uneven)[0].kind], ax))
            new = _one_axis(a, cur[a], dst[a], uneven)
            steps += new
            cur[a] = dst[a]
            pending.discard(a)
        else:  # a swap cycle: gather the innermost shard in the way to Replicate first
            a = min(pending)
            e = cur[a].dim if isinstance(cur[a], Shard) else introduces(a)
            b = innermost(e) if e is not None else None
            b = a if b is None else b
            steps += _one_axis(b, cur[b], Replicate())
            cur[b] = Replicate()
            if dst[b] != cur[b]:
                pending.add(b)
    return tuple(steps)


def reshard_steps_for(shape: Sequence[int] | None, src: Sequence[Placement], dst: Sequence[Placement],
                      mesh_shape: Sequence[int]) -> list[ReshardStep]:
    """``reshard_steps`` for a tensor of global ``shape`` on a mesh of ``mesh_shape``: the dims
    ``src`` or ``dst`` shards unevenly are passed as ``uneven``. ``shape=None``: every shard is even.
    The planner (pricing) and the runtime (running) both derive their steps here."""
    uneven = uneven_dims(shape, (src, dst), mesh_shape) if shape is not None else frozenset()
    return reshard_steps(src, dst, uneven)


def layout_after(layout: Layout, step: ReshardStep) -> Layout:
    """Layout after applying one step (for byte accounting)."""
    cur = list(layout)
    if step.kind in ("all_reduce", "all_gather"):
        cur[step.axis] = Replicate()
    elif step.kind in ("reduce_scatter", "slice", "all_to_all"):
        cur[step.axis] = Shard(step.dim)
    elif step.kind == "to_partial":
        cur[step.axis] = Partial(step.op)
    elif step.kind == "scale":
        cur[step.axis] = Partial("sum" if step.op == "avg_to_sum" else "avg")
    return tuple(cur)
