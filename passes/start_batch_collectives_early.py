"""Start the collectives of batch-only values as soon as the batch arrives."""
from __future__ import annotations

import torch.fx as fx

from autopar.ir import batch_only_values, block_instance, reshard, reshard_finish, reshard_start
from autopar.passes.context import PassContext

__all__ = ["start_batch_collectives_early_pass"]


def start_batch_collectives_early_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Requires: ``insert_collectives_pass`` ran.

    Guarantees: every ``reshard`` of a batch-only value (``ir.batch_only_values``: from the batch
    alone, no gradient, no randomness, no in-place write) that is neither made nor used inside
    one of the plan's checkpointed blocks becomes ``reshard_start``, placed with the ops that compute its input
    right after the program's placeholders, and ``reshard_finish`` where the reshard was (it
    carries the reshard's meta). The moved ops keep their order among themselves; nothing else
    moves, so every random op and every write keeps its place in the program.
    Why: the planner prices these collectives overlapped with the forward ops before their first
    use (``ir.early_start_lead``); waited where they are issued, a loss's count of valid targets
    gathered over the data-parallel ranks costs a whole collective's latency at the loss.
    """
    graph = gm.graph
    early = batch_only_values(graph)
    if not early:
        return gm
    instances = tuple(ctx.plan.recompute_blocks)
    order = {n: i for i, n in enumerate(graph.nodes)}
    cursor = max((n for n in graph.nodes if n.op == "placeholder"), key=order.get, default=None)
    if cursor is None:
        return gm
    moved: set[fx.Node] = set()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not reshard or node.kwargs.get("param"):
            continue
        x, src, dst, gsrc, gdst = node.args
        if gsrc is not None or not isinstance(x, fx.Node) or x.name not in early:
            continue
        chain = _ancestors(x, early)
        if any(block_instance(n.meta.get("autopar.module", ""), instances) is not None for n in chain | {node}
               if n.op == "call_function"):
            continue  # a checkpointed block computes it, or uses it, again in backward: it stays there
        for n in sorted(chain - moved, key=order.get):
            cursor.append(n)
            cursor = n
            moved.add(n)
        with graph.inserting_after(cursor):
            start = graph.call_function(reshard_start, (x, src, dst, None, None), {k: node.kwargs[k] for k in ("shape", "site")
                                                                        if k in node.kwargs})
        start.meta.update({"autopar.kind": "reshard_start", "autopar.serves": node.meta.get("autopar.serves"),
                           "autopar.module": node.meta.get("autopar.module", ""),
                           "autopar.outputs": node.meta.get("autopar.outputs")})
        cursor = start
        with graph.inserting_before(node):
            finish = graph.call_function(reshard_finish, (start,))
        finish.meta.update(node.meta)
        node.replace_all_uses_with(finish)
        graph.erase_node(node)
    return gm


def _ancestors(x: fx.Node, early: set[str]) -> set[fx.Node]:
    """``x`` and what it is computed from, up to the batch inputs: the batch-only ops and the
    constants (``get_attr``) among them."""
    out, todo = set(), [x]
    while todo:
        n = todo.pop()
        if n in out or n.op == "placeholder":
            continue
        if n.op == "get_attr" or n.name in early:
            out.add(n)
            todo.extend(n.all_input_nodes)
    return out
