"""Issue parameter gathers one parameter ahead of their use (ZeRO-3 / FSDP forward prefetch)."""
from __future__ import annotations

import torch.fx as fx

from autopar.ir import (block_instance, gather_param_finish, gather_param_start, prefetchable_gather,
                        prefetched_grad_all_reduces, reshard)
from autopar.layouts import parse_layout
from autopar.passes.context import PassContext

__all__ = ["prefetch_param_gathers_pass"]


def prefetch_param_gathers_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Requires: ``insert_collectives_pass`` ran (parameter reshards carry ``param=True``).

    Guarantees: every parameter reshard that is one all-gather with a one reduce-scatter
    gradient, possibly followed by all-reduces of the shard (HSDP; ``ir.prefetchable_gather``,
    passed on as ``grad_all_reduce``) becomes ``gather_param_start`` (placed right after the
    previous such gather's ``gather_param_finish``, so one gather is in flight while the op before
    its use computes) and ``gather_param_finish`` (where the reshard was; it carries the reshard's
    meta). A gather is not moved across the boundary of a checkpointed block (its recomputation
    must gather again). Other reshards are untouched.
    Why: the planner prices these gathers as overlapped with forward compute, and their gradient
    reductions as overlapped with backward; this is what makes that true.
    """
    graph = gm.graph
    instances = tuple(ctx.plan.recompute_blocks)
    prev_finish: fx.Node | None = None
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not reshard or not node.kwargs.get("param"):
            continue
        x, src, dst, gsrc, gdst = node.args
        meta = x.meta["autopar.outputs"][0]
        found = prefetchable_gather(meta.shape, parse_layout(src), parse_layout(dst),
                                    parse_layout(gsrc) if gsrc is not None else None,
                                    parse_layout(gdst) if gdst is not None else None, ctx.mesh_shape)
        if found is None:
            continue
        axis, dim = found
        size = meta.shape[dim] if meta.shape[dim] % ctx.mesh_shape[axis] else None
        serves = node.meta.get("autopar.serves")
        kwargs = {"dtype": node.kwargs.get("dtype"), "reduce_dtype": node.kwargs.get("reduce_dtype"),
                  "grad": gsrc is not None, "site": node.kwargs.get("site")}
        if gsrc is not None:
            then = prefetched_grad_all_reduces(meta.shape, parse_layout(gsrc), parse_layout(gdst), ctx.mesh_shape)
            if then:
                kwargs["grad_all_reduce"] = then
        module = node.meta.get("autopar.module", "")
        ahead = prev_finish is not None and (
            block_instance(prev_finish.meta.get("autopar.module", ""), instances) == block_instance(module, instances))
        with graph.inserting_after(prev_finish) if ahead else graph.inserting_before(node):
            start = graph.call_function(gather_param_start, (x, axis, dim, size), kwargs)
        with graph.inserting_before(node):
            finish = graph.call_function(gather_param_finish, (start, dim, size))
        start.meta.update({"autopar.kind": "gather_start", "autopar.serves": serves, "autopar.module": module,
                           "autopar.outputs": node.meta.get("autopar.outputs")})
        finish.meta.update(node.meta)
        node.replace_all_uses_with(finish)
        graph.erase_node(node)
        prev_finish = finish
    return gm
