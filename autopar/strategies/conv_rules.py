"""Sharding rules of the convolutional-network ops: convolution (incl. grouped and depthwise),
pooling, batch norm. Registered in ``strategies.rules.RULES``; semantics as stated there.
"""
from __future__ import annotations

from autopar.layouts import Partial, R, Shard
from autopar.node_view import OpView, op_name
from autopar.strategies.op_view import AxisOption

__all__ = ["convolution", "pooling", "batch_norm"]


def convolution(op: OpView) -> list[AxisOption]:
    """conv{1,2,3}d(x[N, C, *], w[O, C/g, *], b[O]): batch, output channels, or (groups=1) input
    channels, which leave the output Partial (the bias then enters Partial too).

    Grouped and depthwise convolutions (groups g > 1) are channel-parallel instead: each rank
    takes whole groups (x, w, b and the output all split on channels), valid on an axis whose
    size divides g; ``localize_shapes_pass`` then runs the local conv with g / n groups.
    """
    has_bias = len(op.inputs) > 2
    tail = (R,) if has_bias else ()
    options = [AxisOption((Shard(0), R) + tail, (Shard(0),))]
    groups = op.arg("groups", 1)
    if groups == 1:
        options.append(AxisOption((R, Shard(0)) + ((Shard(0),) if has_bias else ()), (Shard(1),)))
        options.append(AxisOption((Shard(1), Shard(1)) + ((Partial("sum"),) if has_bias else ()), (Partial("sum"),)))
    else:
        options.append(AxisOption((Shard(1), Shard(0)) + ((Shard(0),) if has_bias else ()), (Shard(1),), divides=groups))
    x, w = op.in_metas[0], op.in_metas[1]
    if x is not None and w is not None and all(k == 1 for k in w.shape[2:]) and _conv_is_pointwise(op):
        # a 1x1 kernel with stride 1 and no padding keeps each spatial position local
        options += [AxisOption((Shard(d), R) + tail, (Shard(d),)) for d in range(2, len(x.shape))]
    return options


def _conv_is_pointwise(op: OpView) -> bool:
    """A 1x1 convolution with stride 1 and no padding maps each spatial position to itself."""
    def ones(v, value):
        if isinstance(v, str):
            return v in ("valid", "same")  # no padding for a 1x1 kernel either way
        v = v if isinstance(v, (list, tuple)) else [v]
        return all(int(x) == value for x in v)
    return ones(op.arg("stride", 1), 1) and ones(op.arg("padding", 0), 0) and ones(op.arg("dilation", 1), 1)


def pooling(op: OpView) -> list[AxisOption]:
    """Pooling over the trailing spatial dims: batch and channel shards pass through."""
    x = op.in_metas[0]
    spatial = {"1d": 1, "2d": 2, "3d": 3}.get(op_name(op.node)[-2:], 2)
    lead = len(x.shape) - spatial
    return [AxisOption((Shard(d),), (Shard(d),) * len(op.out_metas)) for d in range(lead) if x.shape[d] != 1]


def batch_norm(op: OpView) -> list[AxisOption]:
    """batch_norm(x[N, C, *], weight, bias, running_mean, running_var, training, ...).

    Channels: x, weight and bias split on C (statistics are per channel, so each rank's are
    exact). Batch or spatial dims: x split, weight and bias whole; in training the statistics
    then span the shards, which ``sync_batch_norm_pass`` provides (two small all-reduces of C
    values, SyncBatchNorm-style) with no activation gather. In training the running statistics
    stay whole on every rank (they are updated in place, and a shard would be a copy); in eval
    they are only read and follow the channel split.
    """
    x = op.in_metas[0]
    if x is None or len(x.shape) < 2:
        return []
    training = bool(op.arg("training", False))
    idx = {name: op.input_index(name) for name in ("weight", "bias", "running_mean", "running_var")}

    def option(x_p, param_p, stat_p, out_p):
        ins = [None] * len(op.inputs)
        ins[0] = x_p
        for name, i in idx.items():
            if i is not None:
                ins[i] = stat_p if name.startswith("running") else param_p
        return AxisOption(tuple(ins), (out_p,) * len(op.out_metas))

    options = [option(Shard(1), Shard(0), R if training else Shard(0), Shard(1))] if x.shape[1] > 1 else []
    options += [option(Shard(d), R, R, Shard(d)) for d in range(len(x.shape)) if d != 1 and x.shape[d] > 1]
    return options
