"""Seconds of the collectives a strategy implies beside the activation reshards on its edges
(``planner.problem`` puts them into the ILP's numbers): the exchanges an op runs inside itself (a
batch norm's statistics over a split batch, an expert-parallel region's all-to-alls), ZeRO-2's sync
of a whole local gradient, and ZeRO-1/2's all-gather of an updated parameter after the step.

Every figure is ``cost_models.communication.collective_time`` over the group of the mesh axis it
runs on (``CostContext.groups``), in seconds: per step or per call, as each function says, and for
one instance (the caller multiplies by the number of block instances sharing the node).
"""
from __future__ import annotations

import functools
import math

import torch.fx as fx

from autopar.ir import batch_norm_sync, region_exchanges
from autopar.layouts import local_numel, local_shape, state_dim, zero_gather_in_place
from autopar.planner.costing import CostContext
from autopar.strategies import Strategy

__all__ = ["own_sync_time", "post_step_gather_time", "axes_group"]


def axes_group(ctx: CostContext, axes):
    """The group of mesh axis ``axes`` (``CostContext.groups``), or of the ranks differing only in
    the coordinates of a tuple of axes (an expert axis borrowing several mesh axes: one all-to-all
    group), its ranks per node the most any such group has on one node."""
    if isinstance(axes, int):
        return ctx.groups[axes]
    return _axes_group(tuple(ctx.mesh_shape), tuple(axes), ctx.cluster.devices_per_node)


@functools.lru_cache(maxsize=256)
def _axes_group(shape: tuple[int, ...], axes: tuple[int, ...], dpn: int):
    import itertools

    from autopar.cost_models.communication import CommGroup

    strides = [math.prod(shape[a + 1:]) for a in range(len(shape))]
    others = [range(n) if a not in axes else range(1) for a, n in enumerate(shape)]
    busiest = 1
    for base in itertools.product(*others):  # each group once, from its ranks' zero coordinates on ``axes``
        start = sum(c * strides[a] for a, c in enumerate(base))
        per_node: dict[int, int] = {}
        for coords in itertools.product(*(range(shape[a]) for a in axes)):
            node = (start + sum(c * strides[a] for a, c in zip(axes, coords))) // dpn
            per_node[node] = per_node.get(node, 0) + 1
        busiest = max(busiest, max(per_node.values()))
    return CommGroup(size=math.prod(shape[a] for a in axes), ranks_per_node=busiest)


def own_sync_time(n: fx.Node, s: Strategy, ctx: CostContext, microbatches: int, recomputed: bool) -> dict[str, float]:
    """Seconds per collective kind of the collectives an op runs inside itself under ``s`` (a
    batch norm over a split batch: ``ir.batch_norm_sync``; an expert-parallel token region:
    ``ir.region_exchanges``), every microbatch; a recomputed
    block runs the forward ones twice."""
    from autopar.cost_models.communication import blocking_collective_time

    out: dict[str, float] = {}
    moves = batch_norm_sync(n, s.ins[0] if s.ins else None, ctx.mesh_shape)
    # an expert exchange lasts as long as the busiest rank's rows take (Cluster.expert_imbalance)
    imbalance = ctx.cluster.expert_imbalance
    moves += [(k, a, b * imbalance, f) for k, a, b, f in
              region_exchanges(n, list(s.ins), s.outs[0] if s.outs else None, ctx.mesh_shape)]
    for kind, axis, nbytes, forward in moves:
        t = blocking_collective_time(kind, nbytes, axes_group(ctx, axis), ctx.cluster) * microbatches
        out[kind] = out.get(kind, 0.0) + t * (2.0 if recomputed and forward else 1.0)
    return out


# torch's ProcessGroupGloo runs a group's asynchronous collectives on this many worker threads
# (``ProcessGroupGloo._Options()._threads``, 2 in torch 2.11-2.13): that many pending at once wait
# side by side
GLOO_WORKER_THREADS = 2


def concurrent_waits(cluster) -> int:
    """How many of ZeRO-2's pending reduce-scatters (``sync_settings.ZERO2_MAX_INFLIGHT``) wait at
    the same time: on gloo, as many as its worker threads run; NCCL runs a communicator's
    collectives one after another on its stream. Measured on 4 gloo processes of 2 cores, 8
    reduce-scatters between blocks of small layers, at most 2 pending (``runtime.grad_sync``): per
    call 1.2 / 1.6 / 5.5 ms beyond the compute at 16 KiB / 256 KiB / 2 MiB, against 2.5 / 3.2 /
    7.5 ms waited one at a time: the waiting halves, the bytes do not."""
    from autopar.sync_settings import ZERO2_MAX_INFLIGHT

    return min(ZERO2_MAX_INFLIGHT, GLOO_WORKER_THREADS) if cluster.backend == "gloo" else 1


def zero2_reduce_time(meta, layout, axes, zero_axes, ctx: CostContext) -> dict[str, float]:
    """ZeRO-2's gradient sync of a whole local gradient: reduce-scatter over its zero axes,
    all-reduce over the others it is summed over (``runtime.grad_sync``); the waiting of each
    shared by the collectives pending beside it (``concurrent_waits``)."""
    from autopar.cost_models.communication import collective_latency, collective_time

    nbytes = float(local_numel(meta.shape, layout, ctx.mesh_shape) * meta.itemsize)
    shared = 1.0 - 1.0 / concurrent_waits(ctx.cluster)
    out: dict[str, float] = {}
    for a in axes:
        kind = "reduce_scatter" if a in zero_axes else "all_reduce"
        t = collective_time(kind, nbytes, ctx.groups[a], ctx.cluster)
        out[kind] = out.get(kind, 0.0) + t - shared * min(t, collective_latency(kind, ctx.groups[a], ctx.cluster))
    return out


def zero2_reduce_latency(axes, zero_axes, ctx: CostContext) -> float:
    """The waiting part of ``zero2_reduce_time`` (``collective_latency`` of each collective, over
    ``concurrent_waits``)."""
    from autopar.cost_models.communication import collective_latency

    return sum(collective_latency("reduce_scatter" if a in zero_axes else "all_reduce", ctx.groups[a], ctx.cluster)
               for a in axes) / concurrent_waits(ctx.cluster)


def post_step_gather_time(meta, s: Strategy, ctx: CostContext) -> float:
    """ZeRO-1/2's all-gather of an updated parameter after the optimizer step (blocking), and where
    it cannot gather in place (``layouts.zero_gather_in_place``) the host's copies: the gathered
    blocks concatenated along a state dim other than 0, the gathered parameter copied back (at
    ``DeviceSpec.collective_host_byte_s`` per byte, as a reshard's layout copies)."""
    from autopar.cost_models.communication import blocking_collective_time

    if not s.zero_axes:
        return 0.0
    local = local_shape(meta.shape, s.outs[0], ctx.mesh_shape)
    nbytes = float(math.prod(local) * meta.itemsize)
    seconds = sum(blocking_collective_time("all_gather", nbytes, ctx.groups[a], ctx.cluster) for a in s.zero_axes)
    dim = state_dim(meta.shape, s.outs[0])
    if not zero_gather_in_place(local, dim, s.zero_axes, ctx.mesh_shape):
        concatenated = nbytes if dim != 0 else 0.0
        seconds += ctx.cluster.device.collective_host_byte_s * (nbytes + concatenated)
    return seconds
