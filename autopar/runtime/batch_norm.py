"""Batch normalisation on a sharded batch: statistics over all shards, as on one device.

``sharded_batch_norm`` replaces ``aten.batch_norm`` in training where the plan splits its input
(``passes.sync_batch_norm``). Each rank sums its shard per channel; the sums are all-reduced over
the mesh axes that split the batch or spatial dims (``sync_axes``), so every rank normalises with
the global mean and variance (two passes, as the CPU kernel computes them); backward all-reduces
the two per-channel sums the input gradient needs, SyncBatchNorm-style, so each rank gets the
exact gradient of its shard without gathering any activation.

Why by hand: ``torch.nn.SyncBatchNorm`` takes one process group and refuses CPU tensors; here the
batch may be split over several mesh axes and gloo on CPU is the default backend.
"""
from __future__ import annotations

import torch

from autopar.layouts import R, parse_layout
from autopar.runtime.collectives import apply_steps, current_mesh
from autopar.resharding import reshard_steps_for

__all__ = ["sharded_batch_norm"]


def _all_reduce(t: torch.Tensor, axes, comm) -> torch.Tensor:
    for a in axes:
        comm.all_reduce(t, a)
    return t


class _SyncBatchNorm(torch.autograd.Function):
    """Training-mode batch norm whose per-channel statistics span the shards on ``axes``.

    Saves what ``aten.batch_norm`` saves (the input, weight, mean and inverse std), so the
    memory the planner priced from the aten op's profile is what runs. Backward all-reduces the
    two per-channel sums the input gradient needs; the weight and bias gradients stay this
    shard's partial sums (their layout is Partial on ``axes``, reduced by gradient sync)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, count, axes, comm):
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        mean = _all_reduce(x.sum(dims, dtype=torch.float32), axes, comm) / count
        centred = x.float() - mean.view(shape)
        var = _all_reduce((centred * centred).sum(dims), axes, comm) / count
        invstd = torch.rsqrt(var + eps)
        y = centred.mul_(invstd.view(shape))
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.axes, ctx.comm, ctx.count, ctx.has_bias = axes, comm, count, bias is not None
        return y.to(x.dtype), mean, var

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        x, weight, mean, invstd = ctx.saved_tensors
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        dy = dy.float()
        xhat = (x.float() - mean.view(shape)) * invstd.view(shape)
        local = torch.stack([dy.sum(dims), (dy * xhat).sum(dims)])  # this shard's sums, per channel
        total = _all_reduce(local.clone(), ctx.axes, ctx.comm) / ctx.count
        scale = invstd if weight is None else invstd * weight.float()
        dx = (dy - total[0].view(shape) - xhat * total[1].view(shape)) * scale.view(shape)
        dw = local[1].to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        db = local[0].to(x.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx.to(x.dtype), dw, db, None, None, None, None


def sharded_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled=True, *,
                       sync_axes: tuple[int, ...] = (), channel_layout: str | None = None):
    """``aten.batch_norm`` on this rank's shard of the input; ``sync_axes``: mesh axes splitting
    the batch/spatial dims; ``channel_layout``: the layout of a per-channel vector on this mesh
    (channels split where the input's are), used to update the whole running statistics."""
    if not training:
        return torch.ops.aten.batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps,
                                         cudnn_enabled)
    comm = current_mesh()
    count = x.numel() // max(x.shape[1], 1)  # values per channel over all shards
    for a in sync_axes:
        count *= comm.sizes[a]
    y, mean, var = _SyncBatchNorm.apply(x, weight, bias, eps, count, tuple(sync_axes), comm)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            m, v = mean, var * (count / max(count - 1, 1))
            if channel_layout is not None:  # every rank updates every channel (tiny gathers)
                src = parse_layout(channel_layout)
                steps = reshard_steps_for((running_mean.numel(),), src, (R,) * len(src), comm.sizes)
                m, v = apply_steps(m, steps, comm), apply_steps(v, steps, comm)
            running_mean.mul_(1 - momentum).add_(m.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(v.to(running_var.dtype), alpha=momentum)
    return y
