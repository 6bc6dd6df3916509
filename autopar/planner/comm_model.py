"""Bytes per collective kind in one training step, as the per-rank program will move them.

The same walk as the passes and the runtime, on the plan's layouts:

* every edge whose layouts differ gets a ``reshard`` (``ir.edge_reshard``): its forward steps per
  microbatch (batch-derived values are 1/m of the traced batch, so their bytes add up to the
  traced figure; anything else is moved m times), and its gradient steps the same way;
* a parameter gathered for an op that saves it is gathered again in backward (ZeRO-3 regather);
  a checkpointed block runs its forward, collectives included, twice;
* parameters whose every use only sums the gradient (``ir.pure_all_reduce_axes``) are reduced by
  the runtime once per step: ZeRO-0/1 all-reduce their gradient buffer, ZeRO-2 reduce-scatters
  (every microbatch, padded along the state dim, one level per zero axis); ZeRO-1/2 all-gather
  the updated shards after the step;
* an op that only reads parameters hands a gradient sum pending at its output back to them
  (``ir.gradient_sink_params``): the sum joins theirs, and that edge moves nothing;
* the loss value, a pending sum or mean over some axes, is all-reduced (4 bytes) once per step,
  the microbatches' values summed first (alone, or riding a gradient bucket's all-reduce);
* a batch norm over a split batch all-reduces its statistics (``ir.batch_norm_sync``).

Bytes follow nccl-tests' size convention, as ``runtime.comm`` counts them (all-gather: output,
reduce-scatter: padded input, all-reduce / all-to-all: the buffer).
"""
from __future__ import annotations

import math
import operator
from collections import defaultdict

from autopar.ir import (batch_norm_sync, boundary_layout, edge_reshard, gradient_sink_params, param_cast_dtype,
                        pure_all_reduce_axes, region_exchanges, sunk_param_grad)
from autopar.layouts import Partial, Shard, grad_layout, local_numel, local_shape, state_dim
from autopar.planner.costing import reshard_step_bytes
from autopar.planner.loss_rider import local_counts_reduction
from autopar.planner.op_memory import op_memory
from autopar.planner.problem import Problem, batch_derived, producer_of
from autopar.trace import tensor_inputs

__all__ = ["predict_comm_bytes", "comm_bytes_by_owner"]

_LOSS_VALUE_BYTES = 4  # the runtime reduces the loss value as one fp32 element


def predict_comm_bytes(problem: Problem, choice: dict[str, int], recompute: frozenset[str] | None = None,
                       autocast_dtype=None, zero2_reductions: int | None = None,
                       split_backward: frozenset[str] = frozenset()) -> dict[str, float]:
    """Bytes per collective kind ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    this rank moves in one training step under ``choice`` (``comm_bytes_by_owner``, summed)."""
    out: dict[str, float] = defaultdict(float)
    for kinds in comm_bytes_by_owner(problem, choice, recompute, autocast_dtype, zero2_reductions,
                                     split_backward).values():
        for kind, nbytes in kinds.items():
            out[kind] += nbytes
    return {k: v for k, v in out.items() if v}


def comm_bytes_by_owner(problem: Problem, choice: dict[str, int], recompute: frozenset[str] | None = None,
                        autocast_dtype=None, zero2_reductions: int | None = None,
                        split_backward: frozenset[str] = frozenset()) -> dict[str, dict[str, float]]:
    """Bytes per collective kind of one training step under ``choice``, per owner: the node a
    collective runs for (its consumer), a parameter for its gradient sync and post-step gather,
    the loss's producer for the loss value's reduction. A pipeline rank moves the bytes of the
    owners its stages run or hold (``pipeline_rank_bytes.rank_comm_bytes``).

    ``zero2_reductions``: how often a ZeRO-2 gradient is reduce-scattered per step (default:
    every microbatch; once under the split-backward pipeline schedules). ``split_backward``: the
    nodes whose backward runs as an input pass then a weight pass (the zero-bubble pipeline
    schedules, past the first stage): a gathered parameter such a consumer keeps is gathered
    again in each pass."""
    traced, blocks, mesh, m = problem.traced, problem.blocks, problem.ctx.mesh_shape, problem.microbatches
    if recompute is None:
        recompute = frozenset(p for ps in blocks.blocks.values() for p in ps) if problem.recompute else frozenset()
    batch = batch_derived(traced)
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def add(owner: str, steps, times: float) -> None:
        for kind, _axis, nbytes in steps:
            out[owner][kind] += nbytes * times

    def layout_of(node):
        u, j = producer_of(node)
        return problem.strategy_of(u.name, choice).outs[j]

    sunk = _sunk_sums(problem, choice, layout_of)
    param_uses: dict[str, list] = defaultdict(list)  # param -> [(consumer, edge)]
    for v in traced.graph.nodes:
        if v.op != "call_function" or v.target is operator.getitem or v.meta.get("autopar.kind") != "op":
            continue
        s = problem.strategy_of(v.name, choice)
        in_region = blocks.instance_of.get(v.name) in recompute
        own = batch_norm_sync(v, s.ins[0] if s.ins else None, mesh)
        own += region_exchanges(v, list(s.ins), s.outs[0] if s.outs else None, mesh)
        for kind, _, nbytes, forward in own:
            out[v.name][kind] += nbytes * m * (2.0 if in_region and forward else 1.0)
        for i, a in enumerate(tensor_inputs(v)):
            meta = (a.meta.get("autopar.outputs") or (None,))[0]
            if meta is None or i >= len(s.ins):
                continue
            u, _ = producer_of(a)
            edge = edge_reshard(layout_of(a), s.ins[i], s.grad_ins[i], bool(a.meta.get("autopar.needs_grad")))
            is_param = u.op == "placeholder" and u.meta.get("autopar.kind") == "param"
            if is_param and v.name in sunk and a.meta.get("autopar.needs_grad"):
                # this op hands its parameter partial gradients (``passes.sink_gradient_sums``)
                src, dst, gsrc, gdst = edge if edge is not None else (layout_of(a), layout_of(a), None, None)
                gdst = gdst if gdst is not None else grad_layout(src)
                edge = (src, dst, sunk_param_grad(gsrc if gsrc is not None else gdst, sunk[v.name]), gdst)
            elif u.name in sunk and edge is not None and pure_all_reduce_axes(*edge) == sunk[u.name]:
                continue  # summed with the op's parameters' gradients instead
            if edge is None:
                if is_param:
                    param_uses[u.name].append((v, None))
                continue
            src, dst, gsrc, gdst = edge
            if is_param:
                param_uses[u.name].append((v, edge))
                if pure_all_reduce_axes(src, dst, gsrc, gdst) is not None:
                    continue  # decided per parameter below
            cast = param_cast_dtype(u, v) if is_param else None
            itemsize = cast.itemsize if cast is not None else meta.itemsize
            per_micro = 1.0 if a.name in batch else float(m)  # batch-derived: m slices of 1/m
            fwd = reshard_step_bytes(meta.shape, itemsize, src, dst, mesh)
            runs = 2.0 if in_region else 1.0  # a checkpointed block runs its forward again
            if is_param and not in_region and any(k == "all_gather" for k, _, _ in fwd) and _saves_input(v, i, autocast_dtype):
                runs = 3.0 if v.name in split_backward else 2.0  # gathered again for backward (each pass of a split one)
            add(v.name, fwd, per_micro * runs)
            if gsrc is not None and gdst is not None:
                grad_size = problem.ctx.policy.torch_reduce_dtype.itemsize if cast is not None else meta.itemsize
                add(v.name, reshard_step_bytes(meta.shape, grad_size, gsrc, gdst, mesh), per_micro)
    for name, uses in param_uses.items():
        node = traced.node(name)
        meta = node.meta["autopar.outputs"][0]
        s = problem.strategy_of(name, choice)
        axes = {pure_all_reduce_axes(*e) if e is not None else None for _, e in uses}
        deferred = len(axes) == 1 and None not in axes and all(e is not None for _, e in uses)
        if deferred and node.meta.get("autopar.requires_grad", True):
            (axes,) = axes
            local = local_numel(meta.shape, s.outs[0], mesh) * _reduce_itemsize(meta, problem)
            if s.zero_stage == 2:
                out[name]["all_reduce"] += sum(local for a in axes if a not in s.zero_axes)
                out[name]["reduce_scatter"] += _reduce_scatter_bytes(meta, s, mesh, axes) * (zero2_reductions or m)
            else:
                out[name]["all_reduce"] += local * len(axes)
        elif any(e is not None and pure_all_reduce_axes(*e) is not None for _, e in uses):
            for v, e in uses:  # not deferred: each such use syncs in the graph, per microbatch
                if e is not None and pure_all_reduce_axes(*e) is not None:
                    add(v.name, reshard_step_bytes(meta.shape, meta.itemsize, e[2], e[3], mesh), m)
        if s.zero_axes and node.meta.get("autopar.requires_grad", True):
            out[name]["all_gather"] += _post_step_gather_bytes(meta, s, mesh)
    out_node = next(n for n in traced.graph.nodes if n.op == "output")
    for a in tensor_inputs(out_node):  # the program's outputs end replicated (a loss, or the model's outputs)
        owner = producer_of(a)[0].name
        lay = layout_of(a)
        meta = a.meta["autopar.outputs"][0]
        if meta is None:
            continue
        if traced.has_loss and meta.numel == 1 and not any(isinstance(p, Shard) for p in lay):
            # a pending scalar loss: the runtime all-reduces its value off the graph
            out[owner]["all_reduce"] += _LOSS_VALUE_BYTES * sum(
                1 for p, k in zip(lay, mesh) if isinstance(p, Partial) and k > 1)
            counts = local_counts_reduction(problem)
            if counts is not None:  # local batches: the microbatches' target counts, summed over 'dp'
                out[owner]["all_reduce"] += counts[1]
        else:
            add(owner, reshard_step_bytes(meta.shape, meta.itemsize, lay, boundary_layout(out_node, a, len(lay)), mesh), m)
    return {owner: dict(kinds) for owner, kinds in out.items()}


def _sunk_sums(problem: Problem, choice: dict[str, int], layout_of) -> dict[str, tuple[int, ...]]:
    """Ops whose output gradient sum is handed back to their parameters (``ir.gradient_sink_params``,
    ``passes.sink_gradient_sums``): name -> the axes summed."""
    out: dict[str, tuple[int, ...]] = {}
    for v in problem.traced.graph.nodes:
        if v.op != "call_function" or v.target is operator.getitem or v.meta.get("autopar.kind") != "op":
            continue
        s = problem.strategy_of(v.name, choice)
        for i, a in enumerate(tensor_inputs(v)):
            u, _ = producer_of(a)
            if i >= len(s.ins) or not a.meta.get("autopar.needs_grad") or not gradient_sink_params(u):
                continue
            edge = edge_reshard(layout_of(a), s.ins[i], s.grad_ins[i], True)
            axes = pure_all_reduce_axes(*edge) if edge is not None else None
            if axes is not None:
                out[u.name] = axes
    return out


def _saves_input(node, i: int, autocast_dtype) -> bool:
    """Whether ``node``'s backward keeps input ``i`` (or a cast copy of it)."""
    return any(e[0] in ("in", "cast") and e[1] == i for e in op_memory(node, autocast_dtype).saved)


def _reduce_itemsize(meta, problem) -> int:
    """Bytes per element of a gradient summed by ``GradSync``: the policy's reduce dtype under
    mixed precision, else the gradient's own."""
    policy = problem.ctx.policy
    return policy.torch_reduce_dtype.itemsize if policy.mixed else meta.itemsize


def _zero_levels(meta, s, mesh) -> list[tuple[int, int, float]]:
    """Per zero axis, in the order the state is cut (``runtime.param_store.state_chunk``):
    ``(axis, group size, bytes of the whole local tensor padded to a multiple of the group along
    the state dim)`` for the largest chunk (rank 0's), each level cutting the previous one's."""
    local = list(local_shape(meta.shape, s.outs[0], mesh))
    d = state_dim(meta.shape, s.outs[0])
    rest = math.prod(local) // max(local[d], 1) * meta.itemsize
    length, out = local[d], []
    for a in sorted(s.zero_axes):
        n = mesh[a]
        rows = -(-length // n)
        out.append((a, n, rows * n * rest))
        length = rows
    return out


def _post_step_gather_bytes(meta, s, mesh) -> float:
    """ZeRO-1/2's all-gathers of one updated parameter (innermost cut first, padded)."""
    return sum(b for _a, n, b in _zero_levels(meta, s, mesh) if n > 1)


def _reduce_scatter_bytes(meta, s, mesh, reduced_axes) -> float:
    """ZeRO-2's reduce-scatters of one gradient over the zero axes it is partial on."""
    return sum(b for a, n, b in _zero_levels(meta, s, mesh) if n > 1 and a in reduced_axes)
