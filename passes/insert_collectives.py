"""Insert a ``reshard`` call on every edge whose layouts differ (forward or gradient)."""
from __future__ import annotations

import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.layouts import format_layout, parse_layout, uneven_dims
from autopar.errors import NoFeasiblePlanError
from autopar.functionalize import written_edges
from autopar.ir import LOSS_LAYOUT_KEY, boundary_layout, edge_reshard, param_cast_dtype, pending_loss, reshard
from autopar.passes.context import PassContext

__all__ = ["insert_collectives_pass", "edge_call", "LOSS_LAYOUT_KEY"]




def _is_scalar(n: fx.Node) -> bool:
    outs = n.meta.get("autopar.outputs") or ()
    return len(outs) == 1 and outs[0] is not None and outs[0].numel == 1


def edge_call(graph: fx.Graph, before: fx.Node, arg: fx.Node, src: str, dst: str, gsrc, gdst,
              ctx: PassContext) -> fx.Node:
    """A ``reshard`` of ``arg`` for ``before`` (inserted just ahead of it), with the kwargs and
    meta every pass and the runtime expect (parameter casts, uneven shapes, the site it serves)."""
    kwargs = {}
    metas = arg.meta.get("autopar.outputs") or (None,)
    if metas[0] is not None:
        layouts = [parse_layout(x) for x in (src, dst, gsrc, gdst) if x is not None]
        if uneven_dims(metas[0].shape, layouts, ctx.mesh_shape):
            kwargs["shape"] = tuple(metas[0].shape)  # uneven (padded) gathers need the global size
    if arg.op == "placeholder" and arg.meta.get("autopar.kind") == "param":
        kwargs["param"] = True  # a gathered copy is freed after use and gathered again for backward
        cast = param_cast_dtype(arg, before)
        if cast is not None:  # mixed precision: the parameter travels in the compute dtype
            kwargs["dtype"] = cast
            kwargs["reduce_dtype"] = ctx.policy.torch_reduce_dtype
    module = before.meta.get("autopar.module", "")
    kwargs["site"] = f"plan node '{before.name}'" + (f" in module '{module}'" if module else "")
    with graph.inserting_before(before):
        node = graph.call_function(reshard, (arg, src, dst, gsrc, gdst), kwargs)
    node.meta["autopar.kind"] = "reshard"
    node.meta["autopar.serves"] = before.name  # the plan node this collective serves
    node.meta["autopar.outputs"] = arg.meta.get("autopar.outputs")
    node.meta["autopar.module"] = before.meta.get("autopar.module", "")
    return node


def insert_collectives_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Requires: a traced graph whose node names match ``ctx.stage``'s placements.

    Guarantees: each consumer receives every tensor input in the layout its strategy expects, and
    in backward each producer receives its gradient in ``grad_layout`` of its output layout;
    the training loss ends replicated. Every inserted node carries ``autopar.serves``.
    Why: this is where the plan's communication becomes explicit code.
    """
    graph = gm.graph
    gm.meta.pop(LOSS_LAYOUT_KEY, None)
    writes = written_edges(graph)  # before any reshard is inserted
    for node in list(graph.nodes):
        if node.op not in ("call_function", "output") or node.meta.get("autopar.kind") == "reshard":
            continue
        if node.op == "call_function" and node.meta.get("autopar.kind") != "op":
            continue
        if node.op == "call_function" and ctx.node(node.name).op == "getitem":
            continue
        if node.op == "output":
            # the loss ends replicated (backward is seeded with 1 on every rank); outputs for the
            # user's loss replicated too, or as this rank's rows (local batches)
            handed = {a.name: format_layout(boundary_layout(node, a, len(ctx.mesh_shape))) for a in node.all_input_nodes}
            loss = node.args[0] if len(node.args) == 1 and isinstance(node.args[0], fx.Node) else None
            if loss is not None and _is_scalar(loss) and pending_loss(parse_layout(ctx.node(loss.name).outs[0])):
                # a scalar loss still pending a reduction: the runtime reduces its value off the
                # critical path and seeds backward with the matching scale (see ParallelModel)
                gm.meta[LOSS_LAYOUT_KEY] = ctx.node(loss.name).outs[0]
                continue
        else:
            p = ctx.node(node.name)
            needs = list(zip(p.ins, p.grad_ins))
        counter = iter(range(10**9))

        def visit(a):
            if not isinstance(a, fx.Node):
                return a
            i = next(counter)
            if node.op == "output":
                want = gwant = handed[a.name]
            else:
                want, gwant = needs[i]
            if want == "any":
                return a
            src = ctx.node(a.name).outs[0]
            produces_grad = a.meta.get("autopar.needs_grad", False)
            edge = edge_reshard(parse_layout(src), parse_layout(want),
                                None if gwant in (None, "any") else parse_layout(gwant), produces_grad)
            if edge is None:
                return a
            if node.op != "output" and i in writes.get(node.name, ()):
                module = node.meta.get("autopar.module") or "<root>"
                raise NoFeasiblePlanError(
                    f"the plan moves '{a.name}' from {src} to {want} before {node.target} (node '{node.name}' in "
                    f"module '{module}') writes it in place (or a view of it is written later): the write would "
                    "land in a copy. The planner moves such a tensor only where no plan without the move exists: "
                    "relax the constraints, or write the op out of place in the model")
            src, want, gsrc, gdst = (format_layout(x) if x is not None else None for x in edge)
            return edge_call(graph, node, a, src, want, gsrc, gdst, ctx)

        new_args, new_kwargs = pytree.tree_map(visit, (node.args, node.kwargs))
        node.args, node.kwargs = tuple(new_args), dict(new_kwargs)
    return gm
