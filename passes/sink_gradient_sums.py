"""Hand a gradient sum pending at a parameter-only op's output back to its parameters."""
from __future__ import annotations

import torch.fx as fx

from autopar.ir import gradient_sink_params, reshard, reshard_source, reshard_summed_axes, sunk_param_grad
from autopar.layouts import Replicate, format_layout, grad_layout, parse_layout
from autopar.passes.context import PassContext
from autopar.passes.insert_collectives import edge_call

__all__ = ["sink_gradient_sums_pass"]


def _replicated_on(layout: str, axes: tuple[int, ...]) -> bool:
    lay = parse_layout(layout)
    return all(isinstance(lay[a], Replicate) for a in axes)


def _param_edges(node: fx.Node, axes: tuple[int, ...], ctx: PassContext) -> list[fx.Node] | None:
    """``node``'s inputs that carry a parameter's gradient (the parameter or its reshard), or None
    when one of them does not reach ``node`` replicated over ``axes`` (nothing is rewritten)."""
    edges = []
    for a in node.all_input_nodes:
        src = reshard_source(a)
        if not src.meta.get("autopar.needs_grad"):
            continue
        if src is not a:  # the parameter's reshard
            if a.args[3] is None or not (_replicated_on(a.args[2], axes) and _replicated_on(a.args[3], axes)):
                return None
        elif not _replicated_on(ctx.node(a.name).outs[0], axes):
            return None
        edges.append(a)
    return edges


def sink_gradient_sums_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Requires: ``insert_collectives_pass`` ran; runs before ``defer_gradient_sync_pass``.

    Guarantees: every reshard whose forward is a no-op and whose backward only all-reduces
    (``P(sum) -> R`` over axes A) the output gradient of an op that ``ir.gradient_sink_params``
    accepts is removed, with its siblings (all the op's uses must be that same reshard). The op
    then hands its parameters gradients that are partial over A: each parameter input's reshard
    (inserted where the parameter arrived as it is) takes a gradient source partial over A
    (``ir.sunk_param_grad``), so the parameter's own reduction sums it: ``GradSync``'s buckets
    when every use of it only sums (``defer_gradient_sync_pass``), a ZeRO-3 reduce-scatter, or
    an in-graph all-reduce otherwise. Values are unchanged (a vjp is linear in its gradient).
    Why: the op's output gradient was summed by a blocking all-reduce inside backward; a
    parameter's sum joins the overlapped buckets (a data-parallel GPT's position embedding,
    whose gradient DDP also sums in its buckets). The planner prices the same rule
    (``planner.problem``'s sunk edges, ``planner.comm_model``).
    """
    graph = gm.graph
    done: set[fx.Node] = set()
    for r in list(graph.nodes):
        if r in done or r.op != "call_function" or r.target is not reshard or r.kwargs.get("param"):
            continue
        axes = reshard_summed_axes(r)
        node = r.args[0]
        if axes is None or not gradient_sink_params(node):
            continue
        uses = list(node.users)
        if any(u.target is not reshard or u.args[1:] != r.args[1:] for u in uses):
            continue
        edges = _param_edges(node, axes, ctx)
        if edges is None:
            continue
        for a in edges:
            if a.op == "call_function":  # the parameter's own reshard: its gradient starts partial
                a.args = (*a.args[:3], format_layout(sunk_param_grad(parse_layout(a.args[3]), axes)), a.args[4])
            else:
                layout = ctx.node(a.name).outs[0]
                gdst = grad_layout(parse_layout(layout))
                gsrc = sunk_param_grad(gdst, axes)
                node.replace_input_with(a, edge_call(graph, node, a, layout, layout, format_layout(gsrc),
                                                     format_layout(gdst), ctx))
        for u in uses:
            u.replace_all_uses_with(node)
            graph.erase_node(u)
            done.add(u)
    return gm
