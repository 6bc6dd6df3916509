"""Rewrite shape arguments (view / reshape / expand sizes) from global to per-rank sizes."""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.layouts import local_shape, parse_layout
from autopar.node_view import op_name
from autopar.passes.context import PassContext

__all__ = ["localize_shapes_pass", "SHAPE_ARG_OPS"]

# op name -> index of the argument holding the full output shape
SHAPE_ARG_OPS = {"view": 1, "reshape": 1, "_unsafe_view": 1, "expand": 1, "_reshape_alias": 1}


_CONV_OPS = {"conv1d": 6, "conv2d": 6, "conv3d": 6}  # op name -> position of ``groups``


def _conv_groups(node: fx.Node) -> int:
    idx = _CONV_OPS[op_name(node)]
    return int(node.args[idx]) if len(node.args) > idx else int(node.kwargs.get("groups", 1))


def _set_conv_groups(node: fx.Node, groups: int) -> None:
    idx = _CONV_OPS[op_name(node)]
    if len(node.args) > idx:
        node.args = node.args[:idx] + (groups,) + node.args[idx + 1:]
    else:
        node.kwargs = {**node.kwargs, "groups": groups}


def localize_shapes_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Requires: plan layouts for every op node. Guarantees: ops whose arguments spell the output
    shape get the local output shape (a ``-1`` is replaced too), ``unflatten`` its local
    sizes, and a grouped convolution split on channels its local number of groups. Why: the
    graph was traced at global sizes; each rank computes on its shard.
    """
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta.get("autopar.kind") != "op":
            continue
        name = op_name(node)
        meta = node.meta["autopar.outputs"][0] if node.meta.get("autopar.outputs") else None
        if meta is None:
            continue
        out = ctx.node(node.name).outs[0]
        if out == "-":
            continue
        local = list(local_shape(meta.shape, parse_layout(out), ctx.mesh_shape))
        if name in ("view", "_unsafe_view"):
            # a local shard may be laid out with other strides than the global tensor was
            # (resharding makes fresh tensors): reshape gives the same values and copies if needed
            node.target = torch.ops.aten.reshape.default
        if name in SHAPE_ARG_OPS:
            idx = SHAPE_ARG_OPS[name]
            if len(node.args) > idx:
                args = list(node.args)
                args[idx] = local
                node.args = tuple(args)
            elif "size" in node.kwargs or "shape" in node.kwargs:
                key = "size" if "size" in node.kwargs else "shape"
                node.kwargs = {**node.kwargs, key: local}
        elif name in _CONV_OPS and _conv_groups(node) > 1 and local[1] != meta.shape[1]:
            # grouped conv split on channels: each rank holds whole groups (see rules.convolution)
            _set_conv_groups(node, _conv_groups(node) * local[1] // meta.shape[1])
        elif name == "unflatten":
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            sizes = node.args[2] if len(node.args) > 2 else node.kwargs.get("sizes")
            dim = dim + len(meta.shape) - len(sizes) + 1 if dim < 0 else dim
            args = list(node.args)
            args[2] = local[dim : dim + len(sizes)]
            node.args = tuple(args)
    return gm
