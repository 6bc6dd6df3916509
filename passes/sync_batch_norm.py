"""Give a batch norm whose input the plan splits the statistics of the whole batch."""
from __future__ import annotations

import torch.fx as fx

from autopar.ir import batch_norm_split, sharded_batch_norm
from autopar.layouts import R, Shard, format_layout, parse_layout
from autopar.node_view import op_name
from autopar.passes.context import PassContext

__all__ = ["sync_batch_norm_pass"]


def sync_batch_norm_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Requires: plan layouts for every op node. Guarantees: every training-mode ``batch_norm``
    whose input is split on some mesh axis runs ``sharded_batch_norm``, which all-reduces its
    statistics over the axes splitting the batch or spatial dims and keeps the (whole) running
    statistics equal on every rank. Why: a local batch norm over a shard normalises with that
    shard's statistics, which is not the single-device program (``rules.batch_norm``)."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or op_name(node) != "batch_norm":
            continue
        training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False)
        text = ctx.node(node.name).ins[0]
        if not training or not text.startswith("["):
            continue
        sync, channel_axes = batch_norm_split(parse_layout(text), ctx.mesh_shape)
        if not sync and not channel_axes:
            continue
        channels = tuple(Shard(0) if a in channel_axes else R for a in range(len(ctx.mesh_shape)))
        node.target = sharded_batch_norm
        node.kwargs = {**node.kwargs, "sync_axes": sync,
                       "channel_layout": format_layout(channels) if channel_axes else None}
    return gm
