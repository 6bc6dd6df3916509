"""Run causal attention whose queries the plan splits along the sequence as ``context_sdpa``."""
from __future__ import annotations

import torch.fx as fx

from autopar.ir import context_sdpa, context_split_axis
from autopar.layouts import parse_layout
from autopar.node_view import OpView, op_name
from autopar.passes.context import PassContext

__all__ = ["context_attention_pass"]


def context_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Requires: plan layouts for every op node. Guarantees: a causal
    ``scaled_dot_product_attention`` whose queries are split along the sequence on a mesh axis
    (``ir.context_split_axis``: context parallelism) calls ``context_sdpa`` with that axis, same
    arguments. Why: ``is_causal`` masks a rank's rows as if they were the sequence's first ones;
    ``context_sdpa`` masks them by their global positions. (Without a causal mask the split is
    exact as traced: each query row attends to the whole gathered keys.)"""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta.get("autopar.kind") != "op" \
                or op_name(node) != "scaled_dot_product_attention":
            continue
        q_layout = ctx.node(node.name).ins[0]
        if q_layout in (None, "any"):
            continue
        axis = context_split_axis(node, parse_layout(q_layout), ctx.mesh_shape)
        if axis is None or not OpView(node).arg("is_causal", False):
            continue
        view = OpView(node)
        node.target = context_sdpa
        node.args = (view.arg("query"), view.arg("key"), view.arg("value"))
        node.kwargs = {"attn_mask": view.arg("attn_mask"), "dropout_p": view.arg("dropout_p", 0.0), "is_causal": True,
                       "scale": view.arg("scale"), "enable_gqa": view.arg("enable_gqa", False), "axis": axis}
    return gm
