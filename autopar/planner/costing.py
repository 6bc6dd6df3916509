"""Prices of strategies and edges in seconds and bytes, from the cost models and a mesh.

* compute: forward and backward time of a node's local work (roofline, ``cost_models.compute``);
  the work is split by the number of devices its output is split over (Shard or Partial axes).
* resharding: the steps of ``autopar.resharding`` priced with ``cost_models.communication``.
* memory: parameter/gradient/optimizer bytes of a parameter strategy (ZeRO by layout,
  ``zero_axes`` and stage); what an op keeps for backward is ``problem.saved_bytes``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType

import torch.fx as fx

from autopar.cluster import Cluster
from autopar.cost_models.communication import (CommGroup, axis_group, blocking_collective_time, collective_latency,
                                               collective_time)
from autopar.cost_models.compute import conv_time, matmul_time, op_time
from autopar.cost_models.compute import dtype_bytes
from autopar.cost_models.memory import OptimizerSpec, PrecisionPolicy
from autopar.regions import REGION_GROUPED_KEY
from autopar.ir import context_causal_imbalance, context_split_axis
from autopar.layouts import Layout, local_numel, local_shape, split_factor, state_layout
from autopar.resharding import layout_after, reshard_steps_for
from autopar.node_view import VIEW_OPS, OpView, node_flops, op_name, single_meta
from autopar.strategies import Strategy
from autopar.trace import TensorMeta

__all__ = ["CostContext", "node_flops", "node_work", "node_compute_time", "optimizer_update_time", "gradient_buffer_time",
           "update_ops", "BWD_OPS", "updated_numel", "element_costs", "rank_element_costs",
           "reshard_time", "reshard_step_bytes", "reshard_copy_bytes", "bucketed_time", "reshard_latency",
           "bucketed_latency",
           "reshard_staging_bytes", "param_memory",
           "param_state_bytes", "VIEW_OPS"]

# backward / forward cost ratios by op kind
_BWD_FLOPS_RATIO = MappingProxyType({"matmul": 2.0, "attention": 2.5, "pointwise": 2.0, "other": 2.0})
# ops a backward runs per forward op, each paying DeviceSpec.op_overhead: a matmul's two GEMMs
# (input and weight gradient), one fused attention backward, one op for the rest
BWD_OPS = MappingProxyType({"matmul": 2, "attention": 1, "pointwise": 1, "other": 1})


@dataclass(frozen=True)
class CostContext:
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    cluster: Cluster
    policy: PrecisionPolicy
    optimizer: OptimizerSpec
    # the model's trainable gradient bytes: GradSync's buckets are no larger (a model smaller than
    # one bucket all-reduces all of its gradients in one collective of that size)
    grad_bytes: float = math.inf
    # the elements of parameters, gradients or optimizer state a rank holds (the largest count of
    # the three): the optimizer's and the gradient buffers' cost per element depends on what the
    # step streams (``DeviceSpec.warm_elements``); inf: the large count's
    rank_state_numel: float = math.inf
    # memo of reshard prices for this context (hashing the whole context per lookup was a
    # tenth of planning time)
    reshard_memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def groups(self) -> tuple[CommGroup, ...]:
        return _groups(self.mesh_shape, self.cluster.devices_per_node)

    def act_bytes(self, meta: TensorMeta) -> float:
        """Bytes of a value (the graph is traced under the policy's autocast, so its dtype is the
        one the runtime produces)."""
        return float(meta.nbytes)


@lru_cache(maxsize=256)
def _groups(mesh_shape: tuple[int, ...], devices_per_node: int) -> tuple[CommGroup, ...]:
    return tuple(axis_group(mesh_shape, a, devices_per_node) for a in range(len(mesh_shape)))


def node_bytes(node: fx.Node, ctx: CostContext) -> float:
    """Global bytes a node reads and writes in forward (0 for views)."""
    if node.op != "call_function" or op_name(node) in VIEW_OPS:
        return 0.0
    total = 0.0
    for m in OpView(node).in_metas:
        if m is not None:
            total += ctx.act_bytes(m)
    for m in node.meta["autopar.outputs"]:
        if m is not None:
            total += ctx.act_bytes(m)
    return total


def node_work(node: fx.Node, ctx: CostContext) -> tuple[float, str, float, tuple | None, tuple[bool, bool]]:
    """(global forward flops, kind, global bytes, measured, gemm form): what ``node_compute_time``
    divides by a split, and what it needs of the node whatever the strategy. ``measured``:
    (forward s per element, backward s per element, global elements, forward s per FLOP, backward
    s per forward FLOP) where the device has the op's cost measured (``DeviceSpec.op_costs``, per
    element, none per FLOP; not for matmuls, whose cost follows their FLOPs; attention's
    ``DeviceSpec.attention_costs``: its elements the (batch, head) pairs), else None. ``gemm
    form``: (right operand transposed, has a bias) of a matmul priced by the device's shape tables
    (``_right_transposed``, ``_has_bias``)."""
    flops, kind = node_flops(node)
    measured = None
    if kind == "attention" and ctx.cluster.device.attention_costs is not None:
        a = ctx.cluster.device.attention_costs
        measured = (a[0], a[2], float(math.prod(OpView(node).in_metas[0].shape[:-2])), a[1], a[3])
    elif kind in ("pointwise", "other") and node.op == "call_function" and ctx.cluster.device.op_costs:
        per = ctx.cluster.device.op_cost(op_name(node))
        if per is not None:
            metas = [m for m in OpView(node).in_metas if m is not None] + [m for m in node.meta["autopar.outputs"]
                                                                              if m is not None]
            measured = per + (float(max((m.numel for m in metas), default=0)), 0.0, 0.0)
    tabled = kind == "matmul" and node.op == "call_function" and bool(ctx.cluster.device.matmul_table)
    form = (_right_transposed(node), _has_bias(node)) if tabled else (False, False)
    return flops, kind, node_bytes(node, ctx), measured, form


def node_compute_time(node: fx.Node, strategy: Strategy, ctx: CostContext,
                      work: tuple[float, str, float, tuple | None, tuple[bool, bool]] | None = None,
                      runs: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds of the node's local work under ``strategy`` (``work``: the
    node's ``node_work``, when the caller prices many strategies of one node), run ``runs``
    times on ``1 / runs`` of the work each (microbatches): each run pays ``DeviceSpec.op_overhead``."""
    flops, kind, nbytes, measured, (transposed, has_bias) = work if work is not None else node_work(node, ctx)
    if flops == 0.0 and nbytes == 0.0:
        return 0.0, 0.0
    if REGION_GROUPED_KEY in node.meta and ctx.cluster.expert_imbalance != 1.0:
        flops = _imbalanced_region_flops(node, strategy, ctx, flops)
    ref = next((o for o in strategy.outs if o is not None), None)
    split = split_factor(ref, ctx.mesh_shape) if ref is not None else 1
    if kind == "attention" and strategy.ins:
        split /= _context_imbalance(node, strategy, ctx)
    dtype = ctx.policy.compute_dtype
    device = ctx.cluster.device
    eff = _efficiency(device, kind)
    overhead = (device.op_overhead or 0.0) * runs
    queued = host_queues(ctx.cluster)
    if measured is not None:  # its measured cost per element (attention: per pair) and per FLOP, this device's share
        per_fwd, per_bwd, elements, flop_fwd, flop_bwd = measured
        fwd = with_overhead(overhead, (per_fwd * elements + flop_fwd * flops) / split, queued)
        if not node.meta.get("autopar.needs_grad", False):
            return fwd, 0.0
        bwd = (per_bwd * elements + flop_bwd * flops) / split
        return fwd, with_overhead(overhead * BWD_OPS.get(kind, 1), bwd, queued)
    conv = _conv_dims(node, strategy, ctx) if kind == "matmul" and device.conv_table else None
    if conv is not None:  # the measured convolution of this implicit GEMM shape, per microbatch
        m, k, n = conv
        m = -(-m // runs)
        fwd = with_overhead(overhead, runs * conv_time(m, k, n, device, dtype), queued)
        if not node.meta.get("autopar.needs_grad", False):
            return fwd, 0.0
        # one backward op (convolution_backward: the input's and the weight's gradients)
        return fwd, with_overhead(overhead, runs * conv_time(m, k, n, device, dtype, backward=True), queued)
    gemm = _gemm_dims(node, strategy, ctx) if kind == "matmul" and device.matmul_table else None
    if gemm is not None:  # the measured efficiency of this shape, for each microbatch's matmul
        batch, m, k, n = gemm
        if runs > 1:
            batch, m = (-(-batch // runs), m) if batch > 1 else (batch, -(-m // runs))
        # a bias costs two passes over the output forward (broadcast into it, then read back by
        # the GEMM accumulating onto it) and one backward (its gradient: a sum over the rows)
        bias = op_time(0.0, batch * m * n * dtype_bytes(dtype), device, dtype, "pointwise") if has_bias else 0.0
        gemm_s = matmul_time(m, k, n, device, dtype, batch, linear=transposed)
        fwd = with_overhead(overhead, runs * (gemm_s + 2 * bias), queued)
        if not node.meta.get("autopar.needs_grad", False):
            return fwd, 0.0
        # the input's gradient [m, n] x [n, k]; the weight's [k, m] x [m, n] (inner dim: the rows)
        grads = matmul_time(m, n, k, device, dtype, batch) + matmul_time(k, m, n, device, dtype, batch) + bias
        return fwd, with_overhead(overhead * BWD_OPS["matmul"], runs * grads, queued)
    work = op_time(flops / split, nbytes / split, device, dtype, kind, efficiency=eff)
    fwd = with_overhead(overhead, work, queued)
    if not node.meta.get("autopar.needs_grad", False):
        return fwd, 0.0
    ratio = _BWD_FLOPS_RATIO.get(kind, 2.0)
    work = op_time(ratio * flops / split, ratio * nbytes / split, device, dtype, kind, efficiency=eff)
    bwd = with_overhead(overhead * BWD_OPS.get(kind, 1), work, queued)
    return fwd, bwd


def _context_imbalance(node: fx.Node, strategy: Strategy, ctx: CostContext) -> float:
    """The busiest rank's share of a causal attention over an even share (``ir.context_causal_imbalance``)
    when its queries are split along the sequence (context parallelism), else 1: the step waits for it."""
    axis = context_split_axis(node, strategy.ins[0], ctx.mesh_shape)
    if axis is None or not OpView(node).arg("is_causal", False):
        return 1.0
    return context_causal_imbalance(ctx.mesh_shape[axis])


def host_queues(cluster) -> bool:
    """Whether ``cluster``'s hosts queue their ops' work ahead of the device (a GPU's stream), so
    an op's overhead and work overlap (``with_overhead``); a CPU process runs them in turn."""
    return cluster.device_type != "cpu"


def with_overhead(overhead: float, work: float, queued: bool) -> float:
    """An op's seconds from its host overhead (``DeviceSpec.op_overhead``: dispatch, autograd)
    and its work. A CPU process runs the two one after the other; a GPU's host queues kernels
    ahead of the device (``queued``), so the op takes the longer of the two: a small kernel is
    launch-bound, a large one hides its launch (one H100, calibrated: 42 us per op, added to
    every op of a GPT-2-small step at batch 8 x 1024, priced 101 ms against 34 measured)."""
    return max(overhead, work) if queued else overhead + work


def update_ops(states: int) -> int:
    """Ops the optimizer's per-parameter loop runs for one parameter with ``states`` state tensors
    (SGD: the update and its scaling; each state: its update, and Adam's denominator terms)."""
    return 2 + 3 * states


_GEMM_OPS = MappingProxyType({"linear": 0, "mm": 0, "addmm": 1, "bmm": 0, "matmul": 0, "baddbmm": 1})  # op -> index of its left operand


def _gemm_dims(node: fx.Node, strategy: Strategy, ctx: CostContext) -> tuple[int, int, int, int] | None:
    """(batch, m, k, n) of the local matmul(s) a linear / mm / bmm / matmul node runs under
    ``strategy`` (its left operand's and its output's local shapes); None for other matmul-like
    ops (einsum, convolutions, grouped matmuls: priced by their FLOPs) or unknown layouts."""
    name = op_name(node)
    left = _GEMM_OPS.get(name)
    if left is None or left >= len(strategy.ins) or strategy.ins[left] is None or not strategy.outs \
            or strategy.outs[0] is None:
        return None
    a = OpView(node).in_metas[left]
    out = node.meta["autopar.outputs"][0]
    if a is None or out is None or len(a.shape) < 2 or len(out.shape) < 2:
        return None
    la = local_shape(a.shape, strategy.ins[left], ctx.mesh_shape)
    lo = local_shape(out.shape, strategy.outs[0], ctx.mesh_shape)
    if name == "linear":
        return 1, math.prod(lo[:-1]), la[-1], lo[-1]
    return math.prod(lo[:-2]), lo[-2], la[-1], lo[-1]


_CONV_OPS = frozenset({"conv1d", "conv2d", "conv3d"})


def _conv_dims(node: fx.Node, strategy: Strategy, ctx: CostContext) -> tuple[int, int, int] | None:
    """(m, k, n) of the implicit GEMM of a convolution node's local work under ``strategy``: m the
    local batch x output pixels, k the local input channels per group x kernel elements, n the
    local output channels (a tensor-parallel split of either channel axis shrinks k or n); None
    for other ops or unknown layouts."""
    if op_name(node) not in _CONV_OPS or len(strategy.ins) < 2 or strategy.ins[1] is None or not strategy.outs \
            or strategy.outs[0] is None:
        return None
    w = OpView(node).in_metas[1]
    out = node.meta["autopar.outputs"][0]
    if w is None or out is None or len(out.shape) < 3 or len(w.shape) != len(out.shape):
        return None
    lw = local_shape(w.shape, strategy.ins[1], ctx.mesh_shape)
    lo = local_shape(out.shape, strategy.outs[0], ctx.mesh_shape)
    return lo[0] * math.prod(lo[2:]), math.prod(lw[1:]), lo[1]


def _right_transposed(node: fx.Node) -> bool:
    """Whether a matmul's right operand is a transposed view ([m, k] x [n, k].T): nn.Linear's
    weight, or an explicit ``t`` / ``transpose`` of the last two dims (``q @ k.transpose(-2, -1)``)."""
    name = op_name(node)
    if name == "linear":
        return True
    ins = OpView(node).inputs
    right = ins[_GEMM_OPS[name] + 1] if name in _GEMM_OPS and len(ins) > _GEMM_OPS[name] + 1 else None
    if right is None or right.op != "call_function":
        return False
    op = op_name(right)
    if op == "t":
        return True
    if op in ("transpose", "swapaxes"):
        meta = single_meta(right)
        dims = [a for a in right.args[1:3] if isinstance(a, int)]
        return meta is not None and len(dims) == 2 and {d % len(meta.shape) for d in dims} == \
            {len(meta.shape) - 1, len(meta.shape) - 2}
    return False


def _has_bias(node: fx.Node) -> bool:
    """Whether a linear adds a bias (its third input)."""
    if op_name(node) != "linear":
        return False
    metas = OpView(node).in_metas
    return len(metas) >= 3 and metas[2] is not None


def optimizer_update_time(meta: TensorMeta, strategy: Strategy, ctx: CostContext) -> float:
    """Seconds of the optimizer's update of one parameter on one device, over the shard it
    updates (ZeRO's shard where the state is sharded): ``update_ops(states)`` ops of
    ``DeviceSpec.update_op_overhead`` each (torch's per-parameter loop), and per element the
    calibrated ``DeviceSpec.update_element_s``, else one fused pass streaming the parameter (read
    and written), its gradient and its states (each read and written) at memory bandwidth."""
    numel = updated_numel(meta, strategy, ctx)
    states = ctx.optimizer.states
    device = ctx.cluster.device
    fixed = update_ops(states) * (device.update_op_overhead or 0.0)
    queued = host_queues(ctx.cluster)
    if device.update_element_s is not None:
        per, per_state = rank_element_costs(ctx)[0]
        return with_overhead(fixed, numel * (per + per_state * states), queued)
    nbytes = numel * (3 * meta.itemsize + 2 * states * dtype_bytes(ctx.policy.optimizer_dtype))
    return with_overhead(fixed, op_time(numel * (1 + 3 * states), nbytes, device, "fp32", "pointwise"), queued)


def updated_numel(meta: TensorMeta, strategy: Strategy, ctx: CostContext) -> int:
    """Elements of one parameter a rank updates (ZeRO's shard where the state is sharded)."""
    state = state_layout(meta.shape, strategy.outs[0], strategy.zero_axes)
    return local_numel(meta.shape, state if state is not None else strategy.outs[0], ctx.mesh_shape)


def element_costs(device, rank_numel: float, ranks_per_node: int = 1, states: int = 2) -> tuple:
    """(``update_element_s``, ``grad_buffer_element_s``) of ``device`` for a rank that holds
    ``rank_numel`` elements (``CostContext.rank_state_numel``), between
    ``DeviceSpec.warm_elements``' figures and theirs (each pair None where not calibrated).
    Where ``DeviceSpec.shared_cache_bytes`` is known: by what the node's ``ranks_per_node`` ranks
    stream (each element's parameter, gradient and ``states`` optimizer states in fp32), warm up to
    half the cache, cold from all of it, linear between; else log-linearly in ``rank_numel``
    between the two counts measured."""
    update, buffer, warm = device.update_element_s, device.grad_buffer_element_s, device.warm_elements
    if warm is None or update is None or buffer is None:
        return update, buffer
    if device.shared_cache_bytes is not None:
        filled = rank_numel * ranks_per_node * (2 + states) * 4.0 / device.shared_cache_bytes
        t = min(1.0, max(0.0, 2.0 * filled - 1.0))
    elif rank_numel >= warm[1]:
        return update, buffer
    else:
        t = 0.0 if rank_numel <= warm[0] else math.log(rank_numel / warm[0]) / math.log(warm[1] / warm[0])
    update = (warm[2] + t * (update[0] - warm[2]), warm[3] + t * (update[1] - warm[3]))
    return update, (warm[4] + t * (buffer[0] - warm[4]), warm[5] + t * (buffer[1] - warm[5]))


def rank_element_costs(ctx: CostContext, rank_numel: float | None = None) -> tuple:
    """``element_costs`` of ``ctx``'s device for a rank holding ``rank_numel`` elements (default
    ``ctx.rank_state_numel``), among the node's ranks, under ``ctx``'s optimizer."""
    numel = ctx.rank_state_numel if rank_numel is None else rank_numel
    return element_costs(ctx.cluster.device, numel, ctx.cluster.devices_per_node, ctx.optimizer.states)


def gradient_buffer_time(meta: TensorMeta, strategy: Strategy, ctx: CostContext, microbatches: int = 1) -> float:
    """Seconds per step of a parameter's gradient buffer besides the GEMMs that produce its
    gradient: zeroed once per step (``runtime.grad_buffers``' ``GradBuffers.zero``), and each
    microbatch's gradient added into it in place (autograd accumulates into a ``.grad`` that
    exists; a ZeRO-2 shard takes each reduce-scattered gradient the same way), over what the
    rank holds of it. Per element, the device's calibrated ``grad_buffer_element_s``, else
    streamed at memory bandwidth (written; read twice and written).

    Measured (the 8.4M-parameter MLP, 2 gloo processes on 2 cores, ``torch.profiler``): zeroing
    its gradients took 3.8 ms a step, accumulating them about 0.6 ns per element and
    microbatch; neither had been priced, and its 4-microbatch pipeline ran 1.3-1.6x its prediction."""
    grads = param_state_bytes(meta, strategy, ctx)["grads"] / meta.itemsize
    device = ctx.cluster.device
    if device.grad_buffer_element_s is not None:
        zero, add = rank_element_costs(ctx)[1]
        return grads * (zero + microbatches * add)
    zero = op_time(0.0, grads * meta.itemsize, device, "fp32", "pointwise")
    return zero + microbatches * op_time(grads, 3.0 * grads * meta.itemsize, device, "fp32", "pointwise")


def _imbalanced_region_flops(node: fx.Node, strategy: Strategy, ctx: CostContext, flops: float) -> float:
    """An expert-parallel token region's FLOPs on its busiest rank: its grouped matmuls' share
    scaled by the cluster's routing assumption (``Cluster.expert_imbalance``)."""
    from autopar.ir import region_expert_axis

    if region_expert_axis(node, list(strategy.ins), ctx.mesh_shape) is None:
        return flops
    grouped = sum(2.0 * rows * k * n for rows, k, n, *_ in node.meta[REGION_GROUPED_KEY])
    return flops + grouped * (ctx.cluster.expert_imbalance - 1.0)


def _efficiency(device, kind: str) -> float | None:
    """The device's calibrated matmul efficiency (attention: its own where calibrated, else
    scaled as in cost_models.compute)."""
    from autopar.cost_models import compute

    if kind == "attention" and device.attention_efficiency is not None:
        return device.attention_efficiency
    if device.matmul_efficiency is None or kind not in ("matmul", "attention"):
        return None
    if kind == "matmul":
        return device.matmul_efficiency
    return device.matmul_efficiency * compute.ATTENTION_EFFICIENCY / compute.MATMUL_EFFICIENCY


def reshard_time(
    meta: TensorMeta, src: Layout, dst: Layout, ctx: CostContext, nbytes_per_elem: float | None = None,
    blocking: bool = True,
) -> dict[str, float]:
    """Seconds per collective kind to move ``meta`` from ``src`` to ``dst`` (empty: free);
    ``blocking``: waited where issued (each collective also waits for the ranks' skew)."""
    if src == dst or meta is None:
        return {}
    per_elem = nbytes_per_elem if nbytes_per_elem is not None else ctx.act_bytes(meta) / max(meta.numel, 1)
    key = (meta.shape, per_elem, tuple(src), tuple(dst), blocking)
    hit = ctx.reshard_memo.get(key)
    if hit is None:
        hit = ctx.reshard_memo[key] = _reshard_time(meta.shape, per_elem, key[2], key[3], ctx, blocking)
    return hit


def _reshard_time(shape, per_elem, src, dst, ctx, blocking: bool) -> dict[str, float]:
    """Each step's collective and the host's layout copies around it (``reshard_copy_bytes``, at
    ``DeviceSpec.collective_host_byte_s`` per byte; a gradient bucket's all-reduce in place, or a
    ZeRO-3 gather along dim 0, copies nothing)."""
    out: dict[str, float] = {}
    groups = ctx.groups
    price = blocking_collective_time if blocking else collective_time
    per_copied = ctx.cluster.device.collective_host_byte_s
    for step, nbytes, copies in _collective_steps(shape, per_elem, src, dst, ctx.mesh_shape):
        seconds = price(step.kind, nbytes, groups[step.axis], ctx.cluster)
        out[step.kind] = out.get(step.kind, 0.0) + seconds + (per_copied * copies if seconds > 0.0 else 0.0)
    return out


def bucketed_time(meta: TensorMeta, src: Layout, dst: Layout, ctx: CostContext, per_elem: float | None = None) -> dict[str, float]:
    """``reshard_time`` of a gradient reduced in the runtime's buckets (``runtime.grad_sync``):
    a tensor smaller than a bucket (the model's gradient bytes ``ctx.grad_bytes`` over the
    ``sync_settings.bucket_count`` buckets the runtime cuts them into; sent at ``per_elem`` bytes
    per element) costs its share of that bucket's collective,
    a larger one its own (with an alpha-beta model: its bandwidth in full and its share of one
    latency)."""
    if src == dst:
        return {}
    per = per_elem if per_elem is not None else meta.itemsize
    # buckets are cut in the gradient's bytes, sent in ``per``
    bucket = _mean_bucket_bytes(ctx) * per / meta.itemsize
    out: dict[str, float] = {}
    for kind, axis, nbytes in reshard_step_bytes(meta.shape, per, src, dst, ctx.mesh_shape):
        if nbytes >= bucket:
            t = collective_time(kind, nbytes, ctx.groups[axis], ctx.cluster)
        else:
            t = collective_time(kind, bucket, ctx.groups[axis], ctx.cluster) * nbytes / bucket
        out[kind] = out.get(kind, 0.0) + t
    return out


def _mean_bucket_bytes(ctx: CostContext) -> float:
    """The mean bucket of the runtime's gradient sync, in gradient bytes: the model's gradients
    over ``sync_settings.bucket_count`` of them (``BUCKET_BYTES`` for an unbounded model)."""
    from autopar.sync_settings import BUCKET_BYTES, bucket_count

    if not math.isfinite(ctx.grad_bytes):
        return float(BUCKET_BYTES)
    return ctx.grad_bytes / bucket_count(ctx.grad_bytes)


def reshard_latency(meta: TensorMeta, src: Layout, dst: Layout, ctx: CostContext) -> float:
    """The waiting part of ``reshard_time`` (``collective_latency`` of each collective step): what
    can hide behind compute where the bytes cannot (``planner.overlap``)."""
    if src == dst or meta is None:
        return 0.0
    key = ("reshard_latency", meta.shape, tuple(src), tuple(dst))
    hit = ctx.reshard_memo.get(key)
    if hit is None:
        hit = ctx.reshard_memo[key] = sum(
            collective_latency(step.kind, ctx.groups[step.axis], ctx.cluster)
            for step in reshard_steps_for(meta.shape, tuple(src), tuple(dst), ctx.mesh_shape) if step.is_collective)
    return hit


def bucketed_latency(meta: TensorMeta, src: Layout, dst: Layout, ctx: CostContext, per_elem: float | None = None) -> float:
    """The waiting part of ``bucketed_time`` that compute can hide: a bucket's latency, shared as
    its time is, less the last bucket's (the runtime starts it when backward ends): of the
    model's ``sync_settings.bucket_count(ctx.grad_bytes)`` buckets, all but one (counted over the
    whole model's gradients: a rank's share, under tensor parallelism, fills fewer)."""
    from autopar.sync_settings import bucket_count

    if src == dst:
        return 0.0
    per = per_elem if per_elem is not None else meta.itemsize
    hidden_share = 1.0 - 1.0 / bucket_count(ctx.grad_bytes) if math.isfinite(ctx.grad_bytes) else 1.0
    bucket = _mean_bucket_bytes(ctx) * per / meta.itemsize
    return hidden_share * sum(collective_latency(kind, ctx.groups[axis], ctx.cluster) * min(1.0, nbytes / bucket)
                              for kind, axis, nbytes in reshard_step_bytes(meta.shape, per, src, dst, ctx.mesh_shape))


def reshard_step_bytes(shape, per_elem: float, src: Layout, dst: Layout, mesh_shape) -> list[tuple[str, int, float]]:
    """The collectives of moving a tensor of global ``shape`` from ``src`` to ``dst``:
    ``(kind, axis, bytes)`` with bytes in nccl-tests' size convention and the runtime's padding
    (``runtime.collectives``): an all-gather's output, a reduce-scatter's input padded to a
    multiple of the group size, an all-reduce's or all-to-all's buffer."""
    return [(step.kind, step.axis, nbytes) for step, nbytes, _ in _collective_steps(shape, per_elem, src, dst, mesh_shape)]


def reshard_copy_bytes(shape, per_elem: float, src: Layout, dst: Layout, mesh_shape) -> list[float]:
    """Per collective of ``reshard_step_bytes``, the bytes the host copies around it
    (``runtime.collectives``): an all-reduce's clone to reduce in place; an all-gather's blocks
    concatenated along a dim other than 0; a reduce-scatter's input made contiguous from a dim
    other than 0, and its output moved back; an all-to-all's send copy unless it splits dim 0,
    and its result's concatenation unless it gathers dim 0."""
    return [copies for _, _, copies in _collective_steps(shape, per_elem, src, dst, mesh_shape)]


def _collective_steps(shape, per_elem, src, dst, mesh_shape):
    """(step, collective bytes, copied bytes) of each collective step of the reshard."""
    out = []
    key = (tuple(shape) if shape is not None else None, tuple(src), tuple(dst), tuple(mesh_shape))
    for step, numel in _collective_numels(*key):
        n = mesh_shape[step.axis]
        nbytes = numel * per_elem
        if step.kind == "all_reduce":
            copies = nbytes
        elif step.kind == "all_gather":
            copies = nbytes if step.dim != 0 else 0.0
        elif step.kind == "reduce_scatter":
            copies = nbytes + nbytes / n if step.dim != 0 else 0.0
        else:  # all_to_all
            copies = (nbytes if step.dim != 0 else 0.0) + (nbytes if step.src_dim != 0 else 0.0)
        out.append((step, nbytes, copies))
    return out


@lru_cache(maxsize=1 << 16)
def _collective_numels(shape, src, dst, mesh_shape) -> tuple:
    """(step, elements of its collective buffer) of each collective step of moving ``shape``
    from ``src`` to ``dst`` (``_collective_steps`` without the bytes per element: the planner
    prices each pair in several dtypes and windows)."""
    out = []
    cur = src
    for step in reshard_steps_for(shape, src, dst, mesh_shape):
        if step.is_collective:
            local = list(local_shape(shape, cur, mesh_shape))  # the largest shard where uneven
            n = mesh_shape[step.axis]
            if step.kind == "all_gather":
                local[step.dim] *= n
            elif step.kind == "reduce_scatter":
                local[step.dim] = -(-local[step.dim] // n) * n
            out.append((step, math.prod(local)))
        cur = layout_after(cur, step)
    return tuple(out)


def reshard_staging_bytes(shape, per_elem: float, src: Layout, dst: Layout, mesh_shape) -> float:
    """Peak bytes a reshard allocates beyond its input and its final output, as
    ``runtime.collectives`` runs it: send copies of a dim that is not dim 0, padding of uneven
    dims, receive buffers, result copies, and the intermediate results of multi-step reshards."""
    steps = reshard_steps_for(shape, src, dst, mesh_shape)
    peak, cur = 0.0, src
    carried = 0.0  # an intermediate result from the previous step
    for k, step in enumerate(steps):
        after = layout_after(cur, step)
        inp = local_numel(shape, cur, mesh_shape) * per_elem
        out = local_numel(shape, after, mesh_shape) * per_elem
        final = k == len(steps) - 1
        extra = 0.0
        n = mesh_shape[step.axis]
        if step.kind == "all_gather":
            extra = out if step.dim != 0 else 0.0  # the receive buffer its blocks are concatenated from
        elif step.kind == "reduce_scatter":
            padded = -(-shape[step.dim] // n) * n != shape[step.dim]
            extra = inp if step.dim != 0 or padded else 0.0
            extra += out if step.dim != 0 else 0.0  # the scattered block, moved back
        elif step.kind == "all_to_all":
            extra = (inp if step.dim != 0 else 0.0) + inp  # send copy, receive buffer
        elif step.kind == "all_reduce" and step.op == "avg":
            extra = out  # the sum, then divided
        peak = max(peak, carried + extra + (0.0 if final else out))
        carried = 0.0 if final else out
        cur = after
    return peak


def param_state_bytes(meta: TensorMeta, strategy: Strategy, ctx: CostContext, trainable: bool = True) -> dict[str, float]:
    """Persistent bytes per device of one parameter: its local weights, gradient and optimizer
    state (``cost_models.memory``: gradients in the parameter's dtype, ZeRO-1/2 state and ZeRO-2
    gradients on ``layouts.state_layout``, the largest shard where a dim is cut unevenly)."""
    numel = local_numel(meta.shape, strategy.outs[0], ctx.mesh_shape)  # the largest shard
    if not trainable:
        return {"params": numel * meta.itemsize, "grads": 0.0, "optimizer_state": 0.0}
    state_numel = updated_numel(meta, strategy, ctx)
    grad_numel = state_numel if strategy.zero_stage == 2 else numel
    return {
        "params": numel * meta.itemsize,
        "grads": grad_numel * meta.itemsize,
        "optimizer_state": state_numel * ctx.optimizer.states * dtype_bytes(ctx.policy.optimizer_dtype),
    }


def param_memory(meta: TensorMeta, strategy: Strategy, ctx: CostContext, trainable: bool = True) -> float:
    """Persistent bytes per device of a parameter (the sum of ``param_state_bytes``)."""
    return sum(param_state_bytes(meta, strategy, ctx, trainable).values())


