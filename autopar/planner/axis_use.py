"""How a group of operators uses each axis of its mesh: for the batch, for the weights, for ZeRO-3.

A mesh axis is not a data or a tensor axis in itself: each operator's layout chooses. One
pipeline stage may split its weights over the axis the next stage splits its batch over (a large
embedding sharded by columns, then data-parallel layers), so the stages of one submesh differ in
how they use its devices. This module reads that use from a plan's parameter edges, per stage:

* ``data``: a parameter's consumer hands back a gradient that is a partial sum over the axis
  (the consumer's other inputs were split there), so the gradient is summed over it;
* ``tensor``: a parameter is consumed split over the axis (its consumer runs on a slice of it);
* ``ZeRO-3``: a parameter is stored split over the axis but consumed whole there (gathered
  before use).

Axes of size 1 are left out.
"""
from __future__ import annotations

from autopar.layouts import Partial, Replicate, Shard, parse_layout
from autopar.trace import tensor_inputs

__all__ = ["ROLES", "axis_use"]

ROLES = ("data", "tensor", "ZeRO-3")


def axis_use(graph, placements: dict, names, mesh_axes) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``((axis name, its roles in ROLES order), ...)`` for the operators named in ``names``
    (``placements``: node name -> ``NodePlacement``; ``mesh_axes``: ((axis name, size), ...))."""
    wanted = set(names)
    roles = [set() for _ in mesh_axes]
    params = [n for n in graph.nodes
              if n.op == "placeholder" and n.meta.get("autopar.kind") == "param" and n.name in placements]
    for p in params:
        stored = _layout(placements[p.name].outs)
        if stored is None:
            continue
        for user in p.users:
            placed = placements.get(user.name)
            if user.name not in wanted or placed is None:
                continue
            for i, arg in enumerate(tensor_inputs(user)):
                if arg is not p or i >= len(placed.ins):
                    continue
                want = _layout((placed.ins[i],))
                grad = _layout((placed.grad_ins[i],)) if i < len(placed.grad_ins) else None
                for a, (_, size) in enumerate(mesh_axes):
                    if size == 1:
                        continue
                    if grad is not None and isinstance(grad[a], Partial):
                        roles[a].add("data")
                    if want is not None and isinstance(want[a], Shard):
                        roles[a].add("tensor")
                    elif want is not None and isinstance(want[a], Replicate) and isinstance(stored[a], Shard):
                        roles[a].add("ZeRO-3")
    return tuple((name, tuple(r for r in ROLES if r in roles[a]))
                 for a, (name, size) in enumerate(mesh_axes) if size > 1)


def _layout(texts):
    """The layout a plan records (``outs`` / ``ins``), or None where it records none ("any", "-")."""
    if not texts or texts[0] in ("any", "-"):
        return None
    return parse_layout(texts[0])
