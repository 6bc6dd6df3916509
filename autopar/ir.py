"""The contract between the passes (which write per-rank programs) and the runtime (which runs them).

The graph targets the passes insert: ``reshard`` for every layout change (implemented in
``autopar.runtime.collectives``), ``sharded_batch_norm`` for a batch norm over a split batch,
``gather_param_start`` / ``gather_param_finish`` for prefetched parameter gathers
(``autopar.runtime.prefetch``), ``context_sdpa`` for causal attention whose queries are split
along the sequence (``autopar.runtime.context_attention``); and the ``GraphModule.meta`` keys the passes leave for the runtime. Passes import from here, never from the runtime's modules; the runtime reads these keys.
Rules both sides must apply identically (what the planner prices is what the passes emit) live
here too. ``autopar.ir_ops`` declares the same communication as registered ``torch.library`` ops
(fake kernels, autograd formulas) for compiled programs (``runtime.compiled_program``).
"""
from __future__ import annotations

import torch.fx as fx

from autopar.layouts import Layout, Partial, Replicate, Shard, grad_layout, parse_layout
from autopar.runtime.batch_norm import sharded_batch_norm
from autopar.runtime.collectives import reshard, reshard_finish, reshard_start
from autopar.runtime.context_attention import context_sdpa
from autopar.runtime.prefetch import gather_param_finish, gather_param_start

__all__ = ["context_sdpa", "context_split_axis", "context_causal_imbalance", "reshard_start", "reshard_finish", "batch_only_values", "block_instance", "early_start_lead", "region_expert_axis", "region_exchanges", "reshard", "sharded_batch_norm", "gather_param_start", "gather_param_finish", "param_cast_dtype", "edge_reshard", "pure_all_reduce_axes", "reshard_summed_axes", "reshard_source", "pending_loss", "gradient_sink_params", "sunk_param_grad", "prefetchable_gather", "prefetched_grad_all_reduces", "batch_norm_split", "batch_norm_sync", "training_batch_norms", "GRAD_SYNC_KEY",
           "LOSS_LAYOUT_KEY", "RECOMPUTE_KEY", "LOCAL_OUTPUTS_KEY", "local_rows", "boundary_layout", "mark_local_batch",
           "is_local_batch"]

GRAD_SYNC_KEY = "autopar.grad_sync"  # parameter placeholder -> mesh axes its gradient is all-reduced over
LOSS_LAYOUT_KEY = "autopar.loss_layout"  # layout of a returned, not yet reduced, scalar loss
RECOMPUTE_KEY = "autopar.recompute"  # names of the submodules run under activation checkpointing
# On the output node of a graph compiled for local batches (each rank passes its own data shard):
# the names of the outputs returned as this rank's rows, laid out ``LOCAL_ROWS`` instead of
# replicated. Its presence marks local-batch mode (the planner keeps every batch input on "dp").
LOCAL_OUTPUTS_KEY = "autopar.local_outputs"


def local_rows(ndim: int):
    """The layout of a value split by rows over the data axis ("dp", axis 0) and whole elsewhere:
    how a batch input arrives and a batch output leaves in local-batch mode."""
    return (Shard(0),) + (Replicate(),) * (ndim - 1)


def boundary_layout(out_node: fx.Node, arg: fx.Node, ndim: int):
    """The layout the program hands output ``arg`` to the user in (the planner prices it, the
    passes emit it): this rank's rows in local-batch mode, else replicated."""
    if arg.name in out_node.meta.get(LOCAL_OUTPUTS_KEY, ()):
        return local_rows(ndim)
    return (Replicate(),) * ndim


def mark_local_batch(graph: fx.Graph, batch: int | None) -> None:
    """Mark ``graph`` as compiled for local batches: its outputs whose dim 0 is the batch come back
    as each rank's rows."""
    out = next(n for n in graph.nodes if n.op == "output")
    rows = set()
    for a in out.all_input_nodes:
        meta = (a.meta.get("autopar.outputs") or (None,))[0]
        if meta is not None and meta.shape and batch is not None and meta.shape[0] == batch:
            rows.add(a.name)
    out.meta[LOCAL_OUTPUTS_KEY] = frozenset(rows)


def is_local_batch(graph: fx.Graph) -> bool:
    return LOCAL_OUTPUTS_KEY in next(n for n in graph.nodes if n.op == "output").meta


def param_cast_dtype(param: fx.Node, consumer: fx.Node):
    """The dtype a parameter is cast to before it is gathered for ``consumer``: the consumer's
    floating output dtype when it is narrower than the parameter's (autocast computes that op in
    the lower precision, so casting the shard first changes no value and halves the bytes);
    None otherwise. The planner prices gathers with the same rule."""
    pm = (param.meta.get("autopar.outputs") or (None,))[0]
    outs = [m for m in (consumer.meta.get("autopar.outputs") or ()) if m is not None and m.is_floating]
    if pm is None or not pm.is_floating or not outs:
        return None
    low = outs[0].dtype
    return low if low.itemsize < pm.dtype.itemsize else None


def edge_reshard(src: Layout, want: Layout | None, grad_want: Layout | None, produces_grad: bool):
    """The ``reshard`` an edge needs: ``(src, dst, grad_src, grad_dst)``, or None when the value
    arrives as it is and its gradient needs no change. ``want`` / ``grad_want``: the consumer's
    input layout and the layout of the gradient its local backward gives back (None: any)."""
    if want is None:
        return None
    gdst = grad_layout(src) if produces_grad and grad_want is not None else None
    gsrc = grad_want if gdst is not None else None
    if src == want and (gsrc is None or gsrc == gdst):
        return None
    return src, want, gsrc, gdst


def pure_all_reduce_axes(src: Layout, dst: Layout, gsrc: Layout | None, gdst: Layout | None) -> tuple[int, ...] | None:
    """Axes of a reshard whose forward is a no-op and whose backward only sums (``P(sum) -> R``):
    a parameter all of whose uses are such reshards over the same axes has its gradient all-reduced
    by the runtime, once per step, in buckets (``defer_gradient_sync_pass``); None otherwise."""
    if src != dst or gsrc is None:
        return None
    axes = []
    for a, (p, q) in enumerate(zip(gsrc, gdst)):
        if p == q:
            continue
        if isinstance(p, Partial) and p.reduce_op == "sum" and isinstance(q, Replicate):
            axes.append(a)
        else:
            return None
    return tuple(axes) if axes else None


def reshard_summed_axes(node: fx.Node) -> tuple[int, ...] | None:
    """``pure_all_reduce_axes`` of a program's ``reshard`` node (its layouts given as strings)."""
    _, src, dst, gsrc, gdst = node.args
    if gsrc is None or gdst is None:
        return None
    return pure_all_reduce_axes(parse_layout(src), parse_layout(dst), parse_layout(gsrc), parse_layout(gdst))


def reshard_source(a: fx.Node) -> fx.Node:
    """The value behind ``a`` when ``a`` is a reshard (program graphs), else ``a``."""
    if a.op == "call_function" and a.target is reshard:
        return a.args[0]
    return a


def block_instance(module: str, instances: tuple[str, ...]) -> str | None:
    """The block instance among ``instances`` (module paths) that ``module`` lies in, if any."""
    return next((p for p in instances if module == p or module.startswith(p + ".")), None)


def batch_only_values(graph: fx.Graph) -> set[str]:
    """The ops computed from the batch inputs (and constants) alone, that take no gradient, draw
    no random numbers and neither write in place nor read a tensor written in place: each may run
    as soon as the batch arrives. ``passes.start_batch_collectives_early`` starts the collectives
    that move them there (a loss's count of valid targets, a mask), and the planner prices those
    collectives overlapped with the forward ops before their first use (``early_start_lead``)."""
    import torch

    from autopar.functionalize import written_edges
    from autopar.traced_graph import tensor_inputs

    writes = written_edges(graph)
    by_name = {n.name: n for n in graph.nodes}
    written = {tensor_inputs(by_name[c])[i].name for c, positions in writes.items() for i in positions}
    batch, const = set(), set()
    for n in graph.nodes:
        kind = n.meta.get("autopar.kind")
        if n.op == "placeholder" and kind in ("input", "target"):
            batch.add(n.name)
        elif n.op == "get_attr":
            const.add(n.name)
        elif (n.op == "call_function" and kind == "op" and not n.meta.get("autopar.needs_grad")
              and n.name not in writes and torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ())):
            ins = n.all_input_nodes
            if ins and all(a.name in batch or a.name in const for a in ins) and not any(a.name in written for a in ins) \
                    and any(a.name in batch for a in ins):
                batch.add(n.name)
    return {n for n in batch if by_name[n].op == "call_function"}


def early_start_lead(graph: fx.Graph, flops) -> dict[tuple[str, str], float]:
    """Per (batch-only op, its consumer) (``batch_only_values``): the share of the forward's
    FLOPs (``flops(node)``) that runs before the consumer, in program order: what can hide a
    collective started as soon as the batch arrives and waited for just before the consumer."""
    early = batch_only_values(graph)
    by_name = {n.name: n for n in graph.nodes}
    before: dict[str, float] = {}
    total = 0.0
    for n in graph.nodes:
        before[n.name] = total
        total += flops(n)
    total = total or 1.0
    return {(u, v.name): before[v.name] / total for u in early for v in by_name[u].users if v.op != "output"}


def context_split_axis(node: fx.Node, q_layout: Layout | None, mesh_shape) -> int | None:
    """The mesh axis (of size > 1) on which an attention node's queries, laid out ``q_layout``, are
    split along the sequence (dim -2: context parallelism, ``strategies.rules.sdpa``); None when
    they are not. ``passes.context_attention`` runs such a causal attention as ``context_sdpa``,
    and the planner prices its load imbalance (``context_causal_imbalance``) by this one rule."""
    from autopar.node_view import op_name

    if q_layout is None or node.op != "call_function" or op_name(node) != "scaled_dot_product_attention":
        return None
    q = (node.args[0].meta.get("autopar.outputs") or (None,))[0] if isinstance(node.args[0], fx.Node) else None
    if q is None or len(q.shape) < 2:
        return None
    seq = len(q.shape) - 2
    return next((a for a, (p, n) in enumerate(zip(q_layout, mesh_shape)) if n > 1 and p == Shard(seq)), None)


def context_causal_imbalance(parts: int) -> float:
    """How much more than ``1 / parts`` of a causal attention's work the busiest rank does when its
    queries are split into ``parts`` contiguous blocks of the sequence (``context_sdpa``): the
    last block sees every key, ``(2 * parts - 1) / parts**2`` of the (halved) causal work. Load
    balancing (each rank a block from both ends) would bring it to 1; it is not implemented."""
    return (2 * parts - 1) / parts


def pending_loss(layout: Layout) -> bool:
    """Whether a scalar loss in ``layout`` is left pending (partial sums or means, or replicas, on
    every axis): ``insert_collectives_pass`` returns it so, the runtime all-reduces its value
    asynchronously while backward runs, and the planner prices that reduction there."""
    return all(isinstance(p, (Partial, Replicate)) for p in layout)


def gradient_sink_params(node: fx.Node) -> tuple[fx.Node, ...]:
    """The parameters to which a gradient sum pending at ``node``'s output can be pushed back.

    Non-empty when ``node`` is a single-output op with one consumer node whose every input that
    needs a gradient is a parameter (directly, or through that parameter's reshard): e.g. the
    position embedding ``embedding(wpe, arange(T))``, ``w.t()``, ``w * scale``. Such an op whose
    output is replicated on a mesh axis ran redundantly there, and a vjp is linear in its incoming
    gradient: fed a partial sum it returns partial sums of its parameters' gradients. So an edge
    that would all-reduce the op's output gradient (``pure_all_reduce_axes``) instead hands it on
    partial, and the parameters' own gradient sync (``GradSync``'s buckets, a ZeRO
    reduce-scatter) sums it: ``passes.sink_gradient_sums`` rewrites it, the planner prices it
    with this same rule (``sunk_param_grad``). Works on traced and program graphs alike."""
    if node.op != "call_function" or node.meta.get("autopar.kind") != "op":
        return ()
    outs = node.meta.get("autopar.outputs") or ()
    if len(outs) != 1 or outs[0] is None or not node.meta.get("autopar.needs_grad"):
        return ()
    served = {u.meta.get("autopar.serves", u.name) if u.target is reshard else u.name for u in node.users}
    if len(served) != 1:
        return ()
    params = []
    for a in node.all_input_nodes:
        src = reshard_source(a)
        if not src.meta.get("autopar.needs_grad"):
            continue
        if src.op != "placeholder" or src.meta.get("autopar.kind") != "param":
            return ()
        params.append(src)
    return tuple(dict.fromkeys(params))


def sunk_param_grad(grad_src: Layout, axes: tuple[int, ...]) -> Layout:
    """The gradient source of a parameter edge (``grad_src`` before) when its op's output gradient
    arrives partial over ``axes`` (``gradient_sink_params``): a partial sum there, until the
    parameter's reduction sums it."""
    return tuple(Partial("sum") if a in axes else p for a, p in enumerate(grad_src))


def batch_norm_split(layout: Layout, mesh_shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(sync_axes, channel_axes)`` of a training batch norm whose input has ``layout``: the mesh
    axes (of size > 1) splitting its batch or spatial dims, over which ``sharded_batch_norm``
    all-reduces the statistics, and those splitting its channels, over which it gathers them to
    update the whole running statistics. ``passes.sync_batch_norm`` emits and the planner's
    comm model prices with this one rule."""
    split = [(a, p.dim == 1) for a, (p, k) in enumerate(zip(layout, mesh_shape)) if isinstance(p, Shard) and k > 1]
    return tuple(a for a, ch in split if not ch), tuple(a for a, ch in split if ch)


def training_batch_norms(graph: fx.Graph) -> list[str]:
    """The modules of ``graph``'s batch norms in training mode (their statistics are the
    batch's: a microbatch's differ, so they cannot be split into microbatches exactly)."""
    from autopar.node_view import OpView, op_name

    return [n.meta.get("autopar.module") or n.name for n in graph.nodes
            if n.op == "call_function" and op_name(n) == "batch_norm" and OpView(n).arg("training", False)]


def batch_norm_sync(node: fx.Node, layout: Layout | None, mesh_shape) -> list[tuple[str, int, float, bool]]:
    """What ``sharded_batch_norm`` moves per microbatch for ``node``, a batch norm whose input
    arrives in ``layout``: ``(kind, mesh axis, bytes, whether forward moves them)`` (a checkpointed
    block moves the forward ones twice). In training, on each axis splitting the batch or spatial
    dims, forward all-reduces the sum (C local channels, fp32), then the centred squares (the
    variance needs the global mean: two blocking collectives, one after the other, each waiting
    its latency and the ranks' skew), and backward one of the two gradient sums (2C); where
    channels are split, the whole running mean and running variance are all-gathered (one each)
    to update them on every rank: one entry per collective ``sharded_batch_norm`` issues. The comm
    model counts these bytes and the planner prices their time (blocking), from this one list."""
    import math

    from autopar.node_view import OpView, op_name

    if layout is None or node.op != "call_function" or op_name(node) != "batch_norm":
        return []
    view = OpView(node)
    if not view.arg("training", False):
        return []
    sync, channel_axes = batch_norm_split(layout, mesh_shape)
    channels = view.in_metas[0].shape[1]
    local = channels // math.prod(mesh_shape[a] for a in channel_axes) * 4
    out = [e for a in sync for e in (("all_reduce", a, float(local), True), ("all_reduce", a, float(local), True),
                                     ("all_reduce", a, 2.0 * local, False))]
    if channel_axes and view.input_index("running_mean") is not None:
        out += [e for a in channel_axes for e in (("all_gather", a, channels * 4.0, True),) * 2]
    return out


def region_expert_axis(node: fx.Node, ins: list, mesh_shape) -> int | tuple[int, ...] | None:
    """The mesh axis (size > 1) a token-wise region's expert weights are split over, by experts
    (dim 0), in the input layouts ``ins``; where they are split over several axes (nested, outer
    axis first: an expert axis borrowing data and tensor ranks), the tuple of those axes in mesh
    order, whose ranks form one all-to-all group; None when they are not split."""
    from autopar.regions import REGION_EXPERTS_KEY

    experts = set(node.meta.get(REGION_EXPERTS_KEY, ()))
    for i, a in enumerate(node.args):
        if isinstance(a, fx.Node) and a.name in experts and i < len(ins) and ins[i] is not None:
            axes = tuple(axis for axis, p in enumerate(ins[i]) if isinstance(p, Shard) and p.dim == 0 and mesh_shape[axis] > 1)
            if axes:
                return axes[0] if len(axes) == 1 else axes
    return None


def region_exchanges(node: fx.Node, ins: list, out, mesh_shape) -> list[tuple[str, int, float, bool]]:
    """What an expert-parallel token region moves per microbatch (``runtime.expert_dispatch``), as
    ``(kind, mesh axis, bytes, whether forward moves them)``: each rank's rows to the experts'
    ranks where a chain of grouped matmuls starts and the results back where it ends
    (``regions.grouped_exchanges``: rows stay on the experts' ranks between grouped matmuls over
    one routing), and in backward the same for the gradients; the per-expert row counts (int64)
    once per routing (a layer's grouped matmuls share one). Rows received are as many as sent under balanced routing (what is priced;
    the bytes each rank sends first are exact)."""
    import math

    from autopar.regions import REGION_EXPERTS_KEY, REGION_GROUPED_KEY

    if node.op != "call_function" or out is None:
        return []
    axis = region_expert_axis(node, ins, mesh_shape)
    if axis is None:
        return []
    split = math.prod(k for p, k in zip(out, mesh_shape) if isinstance(p, Shard) and p.dim == 0)
    experts = next(a for a in node.args if isinstance(a, fx.Node) and a.name in
                   set(node.meta[REGION_EXPERTS_KEY])).meta["autopar.outputs"][0].shape[0]
    moves = []
    for rows, _k, _n, item, new_routing, sent, brought in node.meta.get(REGION_GROUPED_KEY, ()):
        local = rows / split
        if new_routing:  # the row counts, once per routing
            moves.append(("all_to_all", axis, 8.0 * experts, True))
        for width in ((sent,) if sent else ()) + tuple(brought):  # each way, and its gradient back
            moves += [("all_to_all", axis, local * width * item, True), ("all_to_all", axis, local * width * item, False)]
    return moves


def prefetchable_gather(shape, src: Layout, dst: Layout, gsrc: Layout | None, gdst: Layout | None, mesh_shape):
    """``(axis, dim)`` when moving a parameter from ``src`` to ``dst`` is one all-gather (of
    ``dim`` over ``axis``) whose gradient, if any, goes back by one reduce-scatter of the same dim
    over the same axis, then possibly sum all-reduces of that shard over other axes (HSDP: the
    group's shard summed across the groups, ``prefetched_grad_all_reduces``): such a gather is
    issued one parameter ahead and waited for at its use, and its gradient reduced asynchronously
    (``passes.prefetch_param_gathers``); None otherwise."""
    from autopar.resharding import reshard_steps_for

    fwd = [s for s in reshard_steps_for(shape, src, dst, mesh_shape) if mesh_shape[s.axis] > 1]
    if len(fwd) != 1 or fwd[0].kind != "all_gather":
        return None
    axis, dim = fwd[0].axis, fwd[0].dim
    if gsrc is not None and gdst is not None and _prefetched_grad_steps(shape, gsrc, gdst, mesh_shape, axis, dim) is None:
        return None
    return axis, dim


def prefetched_grad_all_reduces(shape, gsrc: Layout, gdst: Layout, mesh_shape) -> tuple[int, ...]:
    """The mesh axes, in order, over which the gradient of a gather ``prefetchable_gather``
    accepts is all-reduced (summed) after its reduce-scatter: () for ZeRO-3, ('dp',)'s index for
    HSDP. The runtime (``runtime.prefetch``) issues them asynchronously in this order."""
    from autopar.resharding import reshard_steps_for

    bwd = [s for s in reshard_steps_for(shape, gsrc, gdst, mesh_shape) if mesh_shape[s.axis] > 1]
    return tuple(s.axis for s in bwd[1:])


def _prefetched_grad_steps(shape, gsrc: Layout, gdst: Layout, mesh_shape, axis: int, dim: int):
    """The gradient's steps when they are one sum reduce-scatter of ``dim`` over ``axis`` followed
    only by sum all-reduces over other axes (of the shard); None otherwise."""
    from autopar.resharding import reshard_steps_for

    bwd = [s for s in reshard_steps_for(shape, gsrc, gdst, mesh_shape) if mesh_shape[s.axis] > 1]
    if not bwd or bwd[0].kind != "reduce_scatter" or (bwd[0].axis, bwd[0].dim) != (axis, dim) or bwd[0].op != "sum":
        return None
    rest = bwd[1:]
    if any(s.kind != "all_reduce" or s.op != "sum" or s.axis == axis for s in rest) \
            or len({s.axis for s in rest}) != len(rest):
        return None
    return bwd
