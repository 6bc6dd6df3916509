"""Batch normalisation on a sharded batch: statistics over all shards, as on one device.

``sharded_batch_norm`` replaces ``aten.batch_norm`` in training where the plan splits its input
(``passes.sync_batch_norm``). Each rank sums its shard per channel; the sums are all-reduced over
the mesh axes that split the batch or spatial dims (``sync_axes``), so every rank normalises with
the global mean and variance (two passes, as the CPU kernel computes them). The all-reduce is
differentiable (its backward all-reduces the gradient), so autograd gives each rank the exact
gradient of its shard, SyncBatchNorm-style, without gathering any activation.

Why by hand: ``torch.nn.SyncBatchNorm`` takes one process group and refuses CPU tensors; here the
batch may be split over several mesh axes and gloo on CPU is the default backend.
"""
from __future__ import annotations

import torch

from autopar.layouts import R, parse_layout
from autopar.runtime.collectives import apply_steps, current_mesh
from autopar.resharding import reshard_steps_for

__all__ = ["sharded_batch_norm"]


class _AllReduceSum(torch.autograd.Function):
    """Sum over mesh axes; backward sums the gradient over the same axes."""

    @staticmethod
    def forward(ctx, t, axes, comm):
        ctx.axes, ctx.comm = axes, comm
        out = t.clone()
        for a in axes:
            comm.all_reduce(out, a)
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        for a in ctx.axes:
            ctx.comm.all_reduce(g, a)
        return g, None, None


def sharded_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled=True, *,
                       sync_axes: tuple[int, ...] = (), channel_layout: str | None = None):
    """``aten.batch_norm`` on this rank's shard of the input; ``sync_axes``: mesh axes splitting
    the batch/spatial dims; ``channel_layout``: the layout of a per-channel vector on this mesh
    (channels split where the input's are), used to update the whole running statistics."""
    if not training:
        return torch.ops.aten.batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps,
                                         cudnn_enabled)
    comm = current_mesh()
    dims = [0] + list(range(2, x.dim()))
    count = x.numel() // max(x.shape[1], 1)
    for a in sync_axes:
        count *= comm.sizes[a]
    shape = [1, -1] + [1] * (x.dim() - 2)
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    mean = _AllReduceSum.apply(xf.sum(dims), tuple(sync_axes), comm) / count
    centred = xf - mean.view(shape)
    var = _AllReduceSum.apply((centred * centred).sum(dims), tuple(sync_axes), comm) / count
    y = centred * torch.rsqrt(var + eps).view(shape)
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            m, v = mean.detach(), var.detach() * (count / max(count - 1, 1))
            if channel_layout is not None:  # every rank updates every channel (tiny gathers)
                src = parse_layout(channel_layout)
                steps = reshard_steps_for((running_mean.numel(),), src, (R,) * len(src), comm.sizes)
                m, v = apply_steps(m, steps, comm), apply_steps(v, steps, comm)
            running_mean.mul_(1 - momentum).add_(m.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(v.to(running_var.dtype), alpha=momentum)
    return y.to(x.dtype)
