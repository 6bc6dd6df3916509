"""Read-only analyses of a per-rank program (no rewriting)."""
from __future__ import annotations

from collections import Counter

import torch.fx as fx

from autopar.layouts import parse_layout
from autopar.resharding import reshard_steps_for
from autopar.ir import GRAD_SYNC_KEY, gather_param_start, reshard, reshard_start

__all__ = ["count_collectives", "collective_nodes", "outlined_graph"]


def collective_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes that communicate (reshards, those started early, prefetched parameter gathers),
    in this program and in the submodules it calls (checkpointed blocks)."""
    return [n for g in gm.modules() if isinstance(g, fx.GraphModule) for n in g.graph.nodes
            if n.op == "call_function" and n.target in (reshard, reshard_start, gather_param_start)]


def count_collectives(gm: fx.GraphModule, mesh_shape: tuple[int, ...] | None = None) -> Counter:
    """Collectives the program runs per step: ``{("forward" | "backward", kind): count}``.

    Gradient all-reduces deferred to the runtime's buckets (``defer_gradient_sync_pass``) count
    as backward all-reduces, one per parameter and axis; backward re-gathers are not counted. ``mesh_shape`` is needed to count the
    steps of unevenly sharded (ZeRO-3) parameters exactly.
    """
    counts: Counter = Counter()
    for axes in gm.meta.get(GRAD_SYNC_KEY, {}).values():
        counts[("backward", "all_reduce")] += len(axes)
    for n in collective_nodes(gm):
        if n.target is gather_param_start:  # one all-gather; its gradient one reduce-scatter
            counts[("forward", "all_gather")] += 1  # (then, under HSDP, all-reduces of the shard)
            counts[("backward", "reduce_scatter")] += int(bool(n.kwargs.get("grad")))
            if n.kwargs.get("grad") and n.kwargs.get("grad_all_reduce"):
                counts[("backward", "all_reduce")] += len(n.kwargs["grad_all_reduce"])
            continue
        _, src, dst, gsrc, gdst = n.args
        shape = n.kwargs.get("shape")
        if shape is not None and not mesh_shape:
            raise ValueError(f"{n.name} reshards an unevenly sharded tensor: pass mesh_shape to count its steps")
        for step in reshard_steps_for(shape, parse_layout(src), parse_layout(dst), mesh_shape):
            if step.is_collective:
                counts[("forward", step.kind)] += 1
        if gsrc is not None and gdst is not None:
            for step in reshard_steps_for(shape, parse_layout(gsrc), parse_layout(gdst), mesh_shape):
                if step.is_collective:
                    counts[("backward", step.kind)] += 1
    return counts


def outlined_graph(program: fx.GraphModule, node: fx.Node) -> fx.Graph | None:
    """The graph a ``call_module`` node of ``program`` runs (through ``Checkpointed``): for an
    outlined run, its nodes under their original names; None when the module has no graph."""
    sub = program.get_submodule(node.target)
    return getattr(getattr(sub, "inner", sub), "graph", None)
