"""The planning problem's edge tables: what moving a value between two ops' layouts costs.

For each representative edge (producer output -> consumer input, ``count`` original edges
sharing it) a table of seconds indexed by (producer layout key, consumer layout key), split by
when the collectives can run (``_WINDOWS``: blocking, overlapping forward or backward compute, or
the last microbatch's backward) and, for reports, by collective kind. ``planner.problem`` builds
the node variables and calls ``build_edges``; the ILP reads only these numbers.
"""
from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch.fx as fx

from autopar.functionalize import written_edges
from autopar.ir import (LOCAL_OUTPUTS_KEY, early_start_lead, edge_reshard, gradient_sink_params, local_rows, param_cast_dtype,
                        pending_loss, prefetchable_gather, pure_all_reduce_axes, sunk_param_grad)
from autopar.layouts import replicated
from autopar.planner.costing import CostContext, bucketed_latency, bucketed_time, reshard_latency, reshard_time
from autopar.planner.loss_rider import may_ride
from autopar.planner.op_memory import op_memory
from autopar.planner.sync_pricing import zero2_reduce_latency, zero2_reduce_time
from autopar.planner.variables import NodeVar
from autopar.trace import tensor_inputs

__all__ = ["EdgeTable", "REFUSED_RESHARD_S", "build_edges", "early_leads", "is_alias_getitem", "producer_of"]


def producer_of(n: fx.Node) -> tuple[fx.Node, int]:
    """Resolve ``getitem`` chains: (node that owns the value, output index)."""
    if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        base, _ = producer_of(n.args[0])
        return base, int(n.args[1])
    return n, 0

@dataclass
class EdgeTable:
    """Cost of one representative edge; ``count`` original edges share it.

    ``u_key[s]`` / ``v_key[s]``: key index of strategy s of the producer / consumer.
    ``blocking[ku, kv]``: seconds on the critical path; ``overlap`` / ``overlap_bwd`` /
    ``overlap_last``: seconds that can hide behind forward compute / backward compute / the last
    microbatch's backward (``planner.ilp``), all already x count (None: nothing); ``overlap_lat``
    / ``overlap_bwd_lat`` / ``overlap_last_lat``: the waiting part of each window's seconds
    (``costing.reshard_latency``), which can hide where the bytes cannot (``planner.overlap``).
    ``kinds[ku][kv]``: seconds per collective kind (x count), for reports.
    """

    u: str
    v: str | None
    out_index: int
    in_index: int
    count: int
    u_key: np.ndarray
    v_key: np.ndarray
    blocking: np.ndarray
    overlap: np.ndarray
    kinds: list[list[dict[str, float]]]
    overlap_bwd: np.ndarray | None = None
    overlap_last: np.ndarray | None = None
    loss_value: bool = False  # hands the loss value back (reduced by the runtime, planner.loss_rider)
    # the loss edge: per producer key, whether its first partial axis is a data axis, where the
    # value can ride a gradient bucket's all-reduce (the ILP's objective takes it as riding there)
    may_ride: np.ndarray | None = None
    overlap_lat: np.ndarray | None = None
    overlap_bwd_lat: np.ndarray | None = None
    overlap_last_lat: np.ndarray | None = None

    def ilp_overlap_bwd(self) -> np.ndarray | None:
        """``overlap_bwd`` as the ILP's objective and local search count it (``may_ride``)."""
        return self.ilp_window("overlap_bwd")

    def ilp_window(self, name: str) -> np.ndarray | None:
        """The array ``name`` as the ILP's objective and local search count it: the loss value's
        backward-window reduction as riding the gradient sync where it may (``may_ride``)."""
        arr = getattr(self, name)
        if self.may_ride is None or arr is None or name not in ("overlap_bwd", "overlap_bwd_lat"):
            return arr
        return arr * (~self.may_ride)[:, None]

    def seconds(self, ku: int, kv: int) -> float:
        """All communication of the pair, hidden or not."""
        return float(sum(arr[ku, kv] for arr in (self.blocking, self.overlap, self.overlap_bwd, self.overlap_last)
                         if arr is not None))



def is_alias_getitem(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is operator.getitem


def early_leads(traced, blocks, recompute: bool) -> dict[tuple[str, str], float]:
    """Per (producer, consumer) edge of representatives whose reshard the passes start as soon as
    the batch arrives (``passes.start_batch_collectives_early``): the share of the forward that
    can hide it (``ir.early_start_lead``), the least over the instances an edge stands for. With
    recompute, an edge made or used inside a block stays where it is."""
    from autopar.planner.costing import node_flops

    rep = blocks.rep
    out: dict[tuple[str, str], float] = {}
    for (u, v), lead in early_start_lead(traced.graph, lambda n: node_flops(n)[0]).items():
        if recompute and (u in blocks.instance_of or v in blocks.instance_of):
            continue
        key = (rep[u], rep[v])
        out[key] = min(out.get(key, 1.0), lead)
    return out


def build_edges(traced, blocks, nodes, ctx, microbatches, batch, recompute, autocast, memo: dict | None = None) -> list[EdgeTable]:
    """``memo``: a dict for one traced graph that keeps what depends on the graph, ``blocks`` and
    ``autocast`` or ``recompute`` alone, for every problem built on it."""
    memo = memo if memo is not None else {}
    key = ("build_edges.groups", id(blocks), str(autocast))
    hit = memo.get(key)
    if hit is None or hit[0] is not blocks:
        hit = memo[key] = (blocks, *_edge_groups(traced, blocks, autocast))
    _, grouped, saving = hit
    edges = []
    writes = written_edges(traced.graph)
    key = ("build_edges.leads", id(blocks), recompute)
    leads = memo.get(key)
    if leads is None or leads[0] is not blocks:
        leads = memo[key] = (blocks, early_leads(traced, blocks, recompute))
    leads = leads[1]
    one_output = len(next(n for n in traced.graph.nodes if n.op == "output").args) == 1
    for (u, idx, v, i), c in grouped:
        if u not in nodes or (v is not None and v not in nodes):
            continue
        table = _edge_table(nodes[u], idx, nodes[v] if v else None, i, c, ctx, microbatches, batch, recompute, autocast,
                            written=v is not None and i in writes.get(v, ()), traced_loss=traced.has_loss,
                            loss_value=v is None and traced.has_loss and one_output,
                            lead=leads.get((u, v)), saved_share=saving.get((u, idx, v, i), 0) / c)
        if table is not None:
            edges.append(table)
    # identical (u, v) edges collapse: the ILP simply sums them
    return edges


def _edge_groups(traced, blocks, autocast) -> tuple[list, dict]:
    """(the representative edges ((producer, out index, consumer or None, in index), how many
    original edges share it), sorted; per parameter edge, how many of its consumers save it)."""
    rep = blocks.rep
    grouped: dict[tuple, int] = defaultdict(int)
    # per parameter edge: how many of the consumers it stands for save the parameter for their
    # backward (under ZeRO-3, gathered again there): block instances differ (the first layer's
    # input may need no gradient, and its weight is then not saved)
    saving: dict[tuple, int] = defaultdict(int)
    for v in traced.graph.nodes:
        if v.op == "output" or is_alias_getitem(v):
            continue
        for i, a in enumerate(tensor_inputs(v)):
            u, idx = producer_of(a)
            grouped[(rep[u.name], idx, rep[v.name], i)] += 1
            if u.meta.get("autopar.kind") == "param" and _saves_input(v, i, autocast):
                saving[(rep[u.name], idx, rep[v.name], i)] += 1
    # the program's outputs end replicated on every rank: a scalar loss, or (without a loss) the
    # model's outputs handed to the user's loss, whose gradient comes back the same on every rank
    out_node = next(n for n in traced.graph.nodes if n.op == "output")
    for a in tensor_inputs(out_node):  # consumer index 1: handed over as this rank's rows (local batches)
        u, idx = producer_of(a)
        grouped[(rep[u.name], idx, None, int(a.name in out_node.meta.get(LOCAL_OUTPUTS_KEY, ())))] += 1
    return sorted(grouped.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or "", kv[0][3])), dict(saving)


def _saves_input(v: fx.Node, i: int, autocast) -> bool:
    """Whether op ``v`` saves its tensor input ``i`` (or a copy of it) for its backward."""
    return any(e[0] in ("in", "cast") and e[1] == i for e in op_memory(v, autocast).saved)


def _edge_table(U: NodeVar, idx: int, V: NodeVar | None, i: int, count: int, ctx: CostContext, microbatches: int,
                batch: set[str] = frozenset(), recompute: bool = False, autocast=None, written: bool = False,
                traced_loss: bool = True, loss_value: bool = False, lead: float | None = None,
                saved_share: float | None = None):
    """Price one edge for every pair of (producer layout, consumer layout): the ``reshard`` the
    passes will insert there (``ir.edge_reshard``), in the window the runtime runs it in.

    Parameters (per microbatch, ``m`` times): a gather that ``ir.prefetchable_gather`` accepts is
    issued ahead (forward window) and, when the consumer keeps the parameter for backward or
    recomputes, gathered again in backward (backward window); its gradient's reduce-scatter (and,
    under HSDP, the all-reduce of the shard after it) is asynchronous (backward window). A
    gradient that only needs summing is all-reduced once per step by the bucketed ``GradSync`` (last-microbatch window, latency per bucket); ZeRO-2
    reduce-scatters it every microbatch instead (backward window). Any other collective blocks.
    Activations (blocking): a batch-derived value moves 1/m per microbatch, anything else whole
    every microbatch; a checkpointed block's forward collectives run twice.

    A pair's price depends only on the value (shape, bytes per element), the two layouts and
    the window rules, not on which edge it is: pairs are priced once per mesh (``_cell``, in
    ``ctx.reshard_memo``) and shared by every edge and attempt that meets them.

    ``written``: the consumer writes this input in place, or through a view of it
    (``functionalize.written_edges``): every pair that moves it costs ``REFUSED_RESHARD_S``.
    ``loss_value``: the edge hands the program's only output, the loss, back: a scalar still
    pending a sum or mean is reduced by the runtime once per step (the microbatches' values
    summed), with the last gradient bucket or asynchronously while the last backward runs
    (``runtime.loss_value``): overlapped, in the backward window.
    ``lead``: the edge moves a batch-only value, started as soon as the batch arrives
    (``early_leads``): that share of its collectives' time is in the forward window, the rest
    blocks."""
    meta = U.node.meta["autopar.outputs"][idx] if idx < len(U.node.meta["autopar.outputs"]) else None
    if meta is None:
        return None
    is_param = U.node.meta.get("autopar.kind") == "param"
    u_index: dict = {}
    u_key = np.zeros(len(U.strategies), dtype=np.int64)
    for s_i, s in enumerate(U.strategies):
        key = (s.outs[idx], s.zero_axes, s.zero_stage) if is_param else s.outs[idx]
        u_key[s_i] = u_index.setdefault(key, len(u_index))
    u_layouts = list(u_index)
    ndim = len(ctx.mesh_shape)
    if V is None:  # the program's output (``insert_collectives_pass``): replicated (or this rank's
        # rows, ``ir.boundary_layout``), its gradient the same
        handed = local_rows(ndim) if i == 1 else replicated(ndim)
        v_layouts = [(handed, None if traced_loss else handed)]
        v_key = np.zeros(1, dtype=np.int64)
    else:
        v_index: dict = {}
        v_key = np.zeros(len(V.strategies), dtype=np.int64)
        for s_i, s in enumerate(V.strategies):
            v_key[s_i] = v_index.setdefault((s.ins[i], s.grad_ins[i]), len(v_index))
        v_layouts = list(v_index)
    needs_grad = bool(U.node.meta.get("autopar.needs_grad", False) and meta.is_floating)
    m = float(microbatches)
    in_recompute = recompute and V is not None and V.in_block
    memo = ctx.reshard_memo
    intern = memo.setdefault("layout-ids", {})
    cells = memo.setdefault("cells", {})
    if is_param:
        # a parameter is gathered in its own dtype, or cast to the consumer's compute dtype first
        # (mixed precision) and its gradient then reduced in the policy's reduce dtype
        cast = param_cast_dtype(U.node, V.node) if V is not None else None
        fwd_per_elem = float(cast.itemsize if cast is not None else meta.itemsize)
        bwd_per_elem = float(ctx.policy.torch_reduce_dtype.itemsize if cast is not None else meta.itemsize)
        if saved_share is None:  # the representative consumer stands for itself
            saved_share = float(V is not None and _saves_input(V.node, i, autocast))
        value = ("param", meta.shape, meta.itemsize, needs_grad, fwd_per_elem, bwd_per_elem, m,
                 1.0 if in_recompute else saved_share)
        u_ids = [(intern.setdefault(k[0], len(intern)), k[1], k[2]) for k in u_layouts]
    else:
        per_micro = 1.0 if U.name in batch else m  # how many times the traced-size bytes move
        # a gradient sum this op can hand back to its parameters (``ir.gradient_sink_params``)
        sink = tuple(p.meta["autopar.outputs"][0] for p in gradient_sink_params(U.node)) if needs_grad else ()
        loss_value = loss_value and meta.numel == 1
        if loss_value:
            per_micro = 1.0  # the runtime sums the step's microbatch values and reduces them once
        value = ("act", meta.shape, ctx.act_bytes(meta) / max(meta.numel, 1), needs_grad, per_micro,
                 2.0 if in_recompute else 1.0, written, sink, loss_value, None if needs_grad else lead)
        u_ids = [intern.setdefault(k, len(intern)) for k in u_layouts]
    v_ids = [(intern.setdefault(lin, len(intern)), intern.setdefault(lgrad, len(intern))) for lin, lgrad in v_layouts]
    nu, nv = len(u_layouts), len(v_layouts)
    arrays = {k: np.zeros((nu, nv)) for k in _WINDOWS + _LATENCIES}
    table: list[list[tuple]] = []
    for a, uid in enumerate(u_ids):
        row = []
        for b, vid in enumerate(v_ids):
            key = (value, uid, vid)
            cell = cells.get(key)
            if cell is None:
                cell = cells[key] = _cell(value, u_layouts[a], v_layouts[b], meta, ctx)
            for where, seconds, _, waiting in cell:
                arrays[where][a, b] += seconds * count
                if waiting:
                    arrays[where + "_lat"][a, b] += waiting * count
            row.append(cell)
        table.append(row)
    loss_value = loss_value and not is_param
    return EdgeTable(U.name, V.name if V else None, idx, i, count, u_key, v_key, arrays["blocking"],
                     arrays["overlap"], _Kinds(table, count), arrays["overlap_bwd"], arrays["overlap_last"],
                     loss_value=loss_value, may_ride=may_ride(u_layouts, ctx.mesh_shape, ctx.axis_names) if loss_value else None,
                     **{k: arrays[k] for k in _LATENCIES})


_WINDOWS = ("blocking", "overlap", "overlap_bwd", "overlap_last")
_LATENCIES = ("overlap_lat", "overlap_bwd_lat", "overlap_last_lat")  # the waiting part of each overlap window


class _Kinds:
    """``kinds[ku][kv]``: seconds per collective kind of one pair (x count), built on demand from
    the shared cells (a dict per pair for every edge cost more than the rest of the table)."""

    def __init__(self, table, count: int):
        self.table = table
        self.count = count

    def __len__(self):
        return len(self.table)

    def __getitem__(self, a):
        return _KindsRow(self.table[a], self.count)


class _KindsRow:
    def __init__(self, row, count):
        self.row = row
        self.count = count

    def __len__(self):
        return len(self.row)

    def __getitem__(self, b):
        out: dict[str, float] = {}
        for _, _, times, _ in self.row[b]:
            for k, t in times:
                out[k] = out.get(k, 0.0) + t * self.count
        return out


def _cell(value: tuple, ukey, vkey, meta, ctx: CostContext) -> tuple:
    """The collectives of one (producer layout, consumer layout) pair of a value (``_edge_table``):
    ``((window, seconds, ((kind, seconds), ...), waiting seconds), ...)`` per traced-size step,
    before x count (waiting: the latency part of an overlap window's seconds)."""
    out = []

    def add(times: dict, where: str, repeat: float, waiting: float = 0.0):
        if times:
            out.append((where, sum(times.values()) * repeat, tuple((k, t * repeat) for k, t in times.items()),
                        waiting * repeat))

    lin, lgrad = vkey
    if value[0] == "act":
        _, _, _, needs_grad, per_micro, fwd_times, written, sink, loss_value, lead = value
        edge = edge_reshard(ukey, lin, lgrad, needs_grad) if ukey is not None else None
        if edge is not None and written:
            out.append(("blocking", REFUSED_RESHARD_S, (), 0.0))  # the op would write into a copy
        if edge is not None:
            src, dst, gsrc, gdst = edge
            if loss_value and pending_loss(src):  # the runtime reduces it while backward runs
                add(reshard_time(meta, src, dst, ctx, blocking=False), "overlap_bwd", per_micro,
                    reshard_latency(meta, src, dst, ctx))
            elif lead is not None and src != dst:  # started as soon as the batch arrives; its waiting
                # does not hide (a short forward: the GPT's dp=4 step took as long with its
                # asynchronous collectives waited at once, and its dp=2 ran 1.29-1.38x a prediction
                # that hid this latency)
                add(reshard_time(meta, src, dst, ctx, blocking=False), "overlap", per_micro * fwd_times * lead)
                add(reshard_time(meta, src, dst, ctx), "blocking", per_micro * fwd_times * (1.0 - lead))
            else:
                add(reshard_time(meta, src, dst, ctx) if src != dst else {}, "blocking", per_micro * fwd_times)
            summed = pure_all_reduce_axes(src, dst, gsrc, gdst) if sink and gsrc is not None else None
            if summed is not None:  # handed back partial: summed with the parameters' gradients
                # (``passes.sink_gradient_sums``), priced as a replicated parameter's bucketed sum
                whole = replicated(len(ctx.mesh_shape))
                for pmeta in sink:
                    wire = float(ctx.policy.torch_reduce_dtype.itemsize if ctx.policy.mixed else pmeta.itemsize)
                    add(bucketed_time(pmeta, sunk_param_grad(whole, summed), whole, ctx, wire), "overlap_last", 1.0,
                        bucketed_latency(pmeta, sunk_param_grad(whole, summed), whole, ctx, wire))
            elif gsrc is not None:
                add(reshard_time(meta, gsrc, gdst, ctx), "blocking", per_micro)
        return tuple(out)
    _, _, _, needs_grad, fwd_per_elem, bwd_per_elem, m, again = value
    lu, zero_axes, zero_stage = ukey
    edge = edge_reshard(lu, lin, lgrad, needs_grad) if lu is not None else None
    if edge is not None:
        src, dst, gsrc, gdst = edge
        ahead = prefetchable_gather(meta.shape, src, dst, gsrc, gdst, ctx.mesh_shape) is not None
        fwd = reshard_time(meta, src, dst, ctx, fwd_per_elem, blocking=not ahead) if src != dst else {}
        waiting = reshard_latency(meta, src, dst, ctx) if ahead else 0.0
        add(fwd, "overlap" if ahead else "blocking", m, waiting)
        if fwd and again:  # gathered again in backward, by the consumers that save it (a share of them)
            add(fwd, "overlap_bwd" if ahead else "blocking", m * again, waiting)
        if gsrc is not None:
            summed = pure_all_reduce_axes(src, dst, gsrc, gdst)
            if summed is not None and zero_stage == 2:
                add(zero2_reduce_time(meta, lu, summed, zero_axes, ctx), "overlap_bwd", m,
                    zero2_reduce_latency(summed, zero_axes, ctx))
            elif summed is not None:  # GradSync sums in the policy's reduce dtype
                wire = float(ctx.policy.torch_reduce_dtype.itemsize if ctx.policy.mixed else meta.itemsize)
                add(bucketed_time(meta, gsrc, gdst, ctx, wire), "overlap_last", 1.0,
                    bucketed_latency(meta, gsrc, gdst, ctx, wire))
            else:
                add(reshard_time(meta, gsrc, gdst, ctx, bwd_per_elem, blocking=not ahead),
                    "overlap_bwd" if ahead else "blocking", m, reshard_latency(meta, gsrc, gdst, ctx) if ahead else 0.0)
    return tuple(out)


# What a reshard of a tensor an op writes in place costs the ILP: no plan that needs one can win
# while another exists (``insert_collectives_pass`` refuses a plan that has one).
REFUSED_RESHARD_S = 1e6
