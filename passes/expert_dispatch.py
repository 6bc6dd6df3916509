"""Run expert-parallel token regions with their rows exchanged over the experts' mesh axis."""
from __future__ import annotations

import torch.fx as fx

from autopar.ir import region_expert_axis
from autopar.layouts import parse_layout
from autopar.passes.context import PassContext
from autopar.regions import REGION_EXPERTS_KEY

__all__ = ["expert_dispatch_pass"]


def expert_dispatch_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Requires: plan layouts for every op node. Guarantees: a token-wise region (``autopar.regions``)
    whose expert weights the plan splits over experts on a mesh axis is called with
    ``expert_axis`` = that axis, so its grouped matmuls send each expert's rows to the rank holding
    it and take the results back (``runtime.expert_dispatch``). Why: each rank holds only its share
    of the experts; its tokens need all of them."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not node.meta.get(REGION_EXPERTS_KEY):
            continue
        ins = [parse_layout(t) if t.startswith("[") else None for t in ctx.node(node.name).ins]
        axis = region_expert_axis(node, ins, ctx.mesh_shape)
        if axis is not None:
            node.kwargs = {**node.kwargs, "expert_axis": axis}
    return gm
