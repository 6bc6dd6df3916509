"""Take data-parallel gradient all-reduces out of the graph so the runtime can bucket them."""
from __future__ import annotations

from collections import defaultdict

import torch.fx as fx

from autopar.ir import GRAD_SYNC_KEY, reshard, reshard_summed_axes
from autopar.passes.context import PassContext

__all__ = ["defer_gradient_sync_pass", "GRAD_SYNC_KEY"]


def defer_gradient_sync_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Requires: ``insert_collectives_pass`` ran. Guarantees: for every parameter whose every use
    goes through a reshard that only all-reduces its gradient over the same axes, those reshards
    are removed and ``gm.meta[GRAD_SYNC_KEY][param]`` records the axes; the runtime must then
    all-reduce that parameter's gradient (it buckets them and overlaps them with backward, as DDP
    does). Parameters used in any other way keep their in-graph collectives.
    Why: one synchronous all-reduce per parameter, issued inside autograd, serialises the
    backward pass; bucketed asynchronous ones hide behind it.
    """
    uses: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.meta.get("autopar.kind") == "param":
            uses[node] = list(node.users)
    deferred: dict[str, tuple[int, ...]] = {}
    for param, users in uses.items():
        if not users or not all(u.op == "call_function" and u.target is reshard for u in users):
            continue
        axes = {reshard_summed_axes(u) for u in users}
        if len(axes) != 1 or None in axes:
            continue
        for u in users:
            u.replace_all_uses_with(param)
            gm.graph.erase_node(u)
        deferred[param.name] = axes.pop()
    gm.meta[GRAD_SYNC_KEY] = deferred
    return gm
