"""Per-rank memory of one training step, simulated over the program a plan produces.

The runtime (``autopar.runtime``) keeps parameters, gradient buffers and optimizer state for the
whole step, and allocates everything else as the step runs. This module replays that step on
paper, in the order the per-rank program runs, at each value's local size under the chosen
layouts:

* forward, node by node: the buffers the passes' ``reshard`` calls create for inputs that arrive
  in another layout (and the staging copies their collectives make), each op's outputs (an output
  that aliases an input allocates nothing) and its temporaries; what autograd saves
  (``planner.op_memory``: an input, a cast copy, an output, a new tensor) stays until that op's
  backward; other values are freed after their last use. Gathered parameters (ZeRO-3) are not
  kept: they are gathered again in backward. Blocks run under activation checkpointing keep only
  their inputs, and recompute their saved set in backward;
* backward, in reverse: input gradients at the consumer's layout (then at the producer's, when
  the edge reshards), accumulated into one buffer per value (parameters: into the persistent
  gradient buffers; ZeRO-2: held until their reduce-scatter, at most ``MAX_INFLIGHT`` pending),
  the op's backward temporaries, and the release of its saved tensors and output gradients;
* the optimizer step: its temporaries (``OptimizerSpec``) and ZeRO-1/2's parameter all-gathers.

It reports the same categories ``memory_tracker.MemoryTracker`` measures: persistent
``params``, ``grads`` and ``optimizer_state``; the maxima over the step of what forward
(``activations``), backward (``backward``) and the optimizer (``optimizer_step``) allocated; and
the peak. With ``m`` microbatches one microbatch runs at a time: batch-derived values are 1/m.

The graph's structure (inputs, uses, op profiles) is gathered once per traced graph
(``_skeleton``); a simulation then only looks up layouts, so the search can run one per attempt.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

from autopar.ir import edge_reshard, gradient_sink_params, param_cast_dtype, prefetchable_gather, pure_all_reduce_axes
from autopar.layouts import Layout, Shard, grad_layout, local_shape, split_factor, state_dim, state_layout
from autopar.planner.costing import reshard_staging_bytes
from autopar.planner.ilp_model import InfeasibleProblem
from autopar.planner.op_memory import OpMemory, op_memory
from autopar.planner.problem import Problem, batch_derived, producer_of
from autopar.resharding import reshard_steps_for
from autopar.strategies import Strategy
from autopar.trace import TensorMeta, tensor_inputs

__all__ = ["MemoryEstimate", "simulate_step_memory", "persistent_bytes", "persistent_floor", "check_state_fits"]

from autopar.sync_settings import ZERO2_MAX_INFLIGHT as _ZERO2_INFLIGHT  # noqa: E402
from autopar.sync_settings import ZERO3_MAX_INFLIGHT as _ZERO3_INFLIGHT  # noqa: E402


@dataclass
class MemoryEstimate:
    """``kept_by_node``: the bytes alive at the end of forward (what backward needs, and the
    loss), by the node whose forward made them: a pipeline stage keeps its own nodes' share."""
    peak_bytes: float
    categories: dict[str, float] = field(default_factory=dict)
    peak_phase: str = ""
    kept_by_node: dict[str, float] = field(default_factory=dict)

    @property
    def persistent_bytes(self) -> float:
        return sum(self.categories.get(c, 0.0) for c in ("params", "grads", "optimizer_state"))


# ---------------------------------------------------------------------------- graph structure
@dataclass(frozen=True)
class _In:
    producer: str  # the node owning the value (through getitem)
    index: int  # its output index
    meta: TensorMeta | None
    batch: bool  # batch-derived (1/m per microbatch)
    param: bool  # the producer is a parameter
    cast: object  # the dtype a parameter is cast to before it is gathered for this op (or None)
    grad: bool  # a floating value a gradient flows back to
    sink: bool = False  # its producer hands a pending gradient sum back to its parameters (ir.gradient_sink_params)


@dataclass(frozen=True)
class _Op:
    name: str
    ins: tuple[_In, ...]
    outs: tuple[TensorMeta | None, ...]
    uses: tuple[int, ...]  # per output: how many op inputs read it (the loss output counts)
    prof: OpMemory
    batch: bool
    needs_grad: bool
    instance: str | None  # the block instance it belongs to (for recompute)


@dataclass(frozen=True)
class _Skeleton:
    placeholders: tuple[tuple[str, str, TensorMeta | None, bool, int], ...]  # name, kind, meta, batch, uses
    ops: tuple[_Op, ...]
    params: tuple[tuple[str, TensorMeta, bool], ...]  # name, meta, trainable (in optimizer order)


def _skeleton(problem: Problem, autocast_dtype) -> _Skeleton:
    key = ("autopar.step_skeleton", str(autocast_dtype))
    meta_store = problem.traced.gm.meta
    hit = meta_store.get(key)
    if hit is not None:
        return hit
    traced, blocks = problem.traced, problem.blocks
    batch = batch_derived(traced)
    uses: dict[tuple[str, int], int] = {}
    for n in traced.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem:
            continue  # reading a tuple element is not a use of the tuple
        for a in tensor_inputs(n):
            u, j = producer_of(a)
            uses[(u.name, j)] = uses.get((u.name, j), 0) + 1

    def single(node) -> TensorMeta | None:
        outs = node.meta.get("autopar.outputs") or (None,)
        return outs[0] if len(outs) == 1 else None

    placeholders, ops, params = [], [], []
    for n in traced.graph.nodes:
        kind = n.meta.get("autopar.kind")
        if n.op == "placeholder":
            placeholders.append((n.name, kind, single(n), n.name in batch, uses.get((n.name, 0), 0)))
            if kind == "param":
                params.append((n.name, n.meta["autopar.outputs"][0], bool(n.meta.get("autopar.requires_grad", True))))
            continue
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        ins = []
        for a in tensor_inputs(n):
            u, j = producer_of(a)
            meta = single(a)
            is_param = u.op == "placeholder" and u.meta.get("autopar.kind") == "param"
            ins.append(_In(u.name, j, meta, a.name in batch, is_param, param_cast_dtype(u, n) if is_param else None,
                           bool(meta is not None and meta.is_floating and a.meta.get("autopar.needs_grad")),
                           bool(not is_param and gradient_sink_params(u))))
        outs = tuple(n.meta.get("autopar.outputs") or ())
        ops.append(_Op(n.name, tuple(ins), outs, tuple(uses.get((n.name, j), 0) for j in range(len(outs))),
                       op_memory(n, autocast_dtype), n.name in batch, bool(n.meta.get("autopar.needs_grad")),
                       blocks.instance_of.get(n.name) if blocks is not None else None))
    sk = _Skeleton(tuple(placeholders), tuple(ops), tuple(params))
    meta_store[key] = sk
    return sk


# ---------------------------------------------------------------------------- sizes
def _local_bytes(meta: TensorMeta, layout: Layout | None, mesh, itemsize: float | None = None) -> float:
    shape = local_shape(meta.shape, layout, mesh) if layout is not None else meta.shape
    return math.prod(shape) * (itemsize if itemsize is not None else meta.itemsize)


class _Sizes:
    """Memoised local sizes and reshard facts for one mesh (kept in the cost context's memo)."""

    def __init__(self, problem: Problem):
        self.mesh = problem.ctx.mesh_shape
        self.memo = problem.ctx.reshard_memo

    def local(self, meta: TensorMeta, layout, itemsize=None) -> float:
        key = ("local", meta.shape, meta.itemsize, layout, itemsize)
        hit = self.memo.get(key)
        if hit is None:
            hit = self.memo[key] = _local_bytes(meta, layout, self.mesh, itemsize)
        return hit

    def grad_layout(self, layout) -> Layout:
        """``layouts.grad_layout`` of ``layout``."""
        key = ("grad_layout", layout)
        hit = self.memo.get(key)
        if hit is None:
            hit = self.memo[key] = grad_layout(layout)
        return hit

    def split(self, layout) -> int:
        """``layouts.split_factor`` of ``layout`` on this mesh (1 for None)."""
        if layout is None:
            return 1
        key = ("split", layout)
        hit = self.memo.get(key)
        if hit is None:
            hit = self.memo[key] = split_factor(layout, self.mesh)
        return hit

    def reshard(self, meta: TensorMeta, per_elem: float, src, dst) -> tuple[bool, float]:
        """(whether it all-gathers, staging bytes beyond its input and output)."""
        key = ("sim-reshard", meta.shape, per_elem, src, dst)
        hit = self.memo.get(key)
        if hit is None:
            gathers = any(st.kind == "all_gather" for st in reshard_steps_for(meta.shape, src, dst, self.mesh))
            hit = self.memo[key] = (gathers, reshard_staging_bytes(meta.shape, per_elem, src, dst, self.mesh))
        return hit


def persistent_bytes(problem: Problem, choice: dict[str, int]) -> dict[str, float]:
    """Per-rank bytes kept across steps: parameters (+buffers), gradient buffers, optimizer state."""
    ctx = problem.ctx
    out = {"params": 0.0, "grads": 0.0, "optimizer_state": 0.0}
    for n in problem.traced.graph.nodes:
        if n.meta.get("autopar.kind") in ("param", "buffer"):
            for k, b in zip(out, _held(n, problem.strategy_of(n.name, choice), ctx)):
                out[k] += b
    return out


def _held(n, s: Strategy, ctx) -> tuple[float, float, float]:
    """(parameter, gradient buffer, optimizer state) bytes a rank keeps across steps for the
    parameter or buffer node ``n`` under strategy ``s``."""
    meta = n.meta["autopar.outputs"][0]
    local = _local_bytes(meta, s.outs[0], ctx.mesh_shape)
    if n.meta.get("autopar.kind") != "param" or not n.meta.get("autopar.requires_grad", True):
        return local, 0.0, 0.0
    state = state_layout(meta.shape, s.outs[0], s.zero_axes) or s.outs[0]
    state_bytes = _local_bytes(meta, state, ctx.mesh_shape)
    return local, state_bytes if s.zero_stage == 2 else local, state_bytes * ctx.optimizer.states


def persistent_floor(traced, blocks, ctx, strategies_of) -> float:
    """A lower bound on every choice's simulated peak (``simulate_step_memory``, which is the
    persistent bytes plus a peak of what the step allocates, never below zero): per
    representative parameter or buffer, the least persistent bytes its instances hold together
    under any one of its allowed strategies (``strategies_of(node)``; a node with none adds 0)."""
    # per representative: its instances by what their bytes depend on (block instances are alike)
    members: dict[str, dict[tuple, list]] = {}
    for n in traced.graph.nodes:
        kind = n.meta.get("autopar.kind")
        if kind in ("param", "buffer"):
            meta = n.meta["autopar.outputs"][0]
            alike = (kind, n.meta.get("autopar.requires_grad", True), tuple(meta.shape), meta.itemsize)
            members.setdefault(blocks.rep[n.name], {}).setdefault(alike, []).append(n)
    by_name = {n.name: n for n in traced.graph.nodes}
    floor = 0.0
    for rep, groups in members.items():
        floor += min((sum(len(ns) * sum(_held(ns[0], s, ctx)) for ns in groups.values())
                      for s in strategies_of(by_name[rep])), default=0.0)
    return floor


def check_state_fits(traced, blocks, ctx, strategies_of, budget: float | None) -> None:
    """Raise the memory ``InfeasibleProblem`` every plan on ``ctx``'s mesh would end in when the
    persistent bytes alone (``persistent_floor``) exceed ``budget``: an attempt need not build
    and solve its problem to learn that no choice fits."""
    if budget is None:
        return
    floor = persistent_floor(traced, blocks, ctx, strategies_of)
    if floor > budget * (1.0 + 1e-9):  # (a margin for the floor's rounding, summed in another order)
        raise InfeasibleProblem(
            "memory", f"the parameters, gradients and optimizer state alone take at least {floor / 2**30:.2f} GiB per "
                      f"device under any allowed layout, beyond the {budget / 2**30:.2f} GiB budget")


# ---------------------------------------------------------------------------- the simulation
class _Sim:
    """Live bytes by phase; storages with reference counts (pending uses + saved references)."""

    def __init__(self, trace: list | None = None):
        self.trace = trace
        self.where = ""
        self.size: dict[int, float] = {}
        self.phase_of: dict[int, str] = {}
        self.owner: dict[int, str] = {}  # storage -> the node (``where``) that allocated it
        self.refs: dict[int, int] = {}
        self.live = {"fwd": 0.0, "bwd": 0.0}
        self.max = {"fwd": 0.0, "bwd": 0.0, "total": 0.0}
        self.max_phase = ""
        self.next = 0

    def alloc(self, nbytes: float, phase: str, refs: int = 0) -> int:
        sid = self.next
        self.next += 1
        self.size[sid] = nbytes
        self.phase_of[sid] = phase
        self.owner[sid] = self.where
        self.refs[sid] = refs
        self.live[phase] += nbytes
        return sid

    def ref(self, sid: int | None, k: int = 1) -> None:
        if sid is not None and sid in self.refs:
            self.refs[sid] += k

    def unref(self, sid: int | None, k: int = 1) -> None:
        if sid is None or sid not in self.refs:
            return
        self.refs[sid] -= k
        if self.refs[sid] <= 0:
            self.free(sid)

    def free(self, sid: int) -> None:
        if sid in self.size:
            self.live[self.phase_of.pop(sid)] -= self.size.pop(sid)
            self.refs.pop(sid, None)

    def check(self, extra_fwd: float = 0.0, extra_bwd: float = 0.0, phase: str = "forward") -> None:
        f = self.live["fwd"] + extra_fwd
        b = self.live["bwd"] + extra_bwd
        if self.trace is not None:
            self.trace.append((phase, self.where, f, b))
        self.max["fwd"] = max(self.max["fwd"], f)
        self.max["bwd"] = max(self.max["bwd"], b)
        if f + b > self.max["total"]:
            self.max["total"] = f + b
            self.max_phase = phase


def simulate_step_memory(problem: Problem, choice: dict[str, int], recompute: frozenset[str] | None = None,
                         autocast_dtype=None, trace: list | None = None) -> MemoryEstimate:
    """The per-rank memory of one training step under ``choice`` (see the module docstring).

    ``recompute``: block instance prefixes run under activation checkpointing (default: all
    block instances when ``problem.recompute``). ``trace``: a list to append
    ``(phase, node, forward bytes, backward bytes)`` to at every point the peak is checked."""
    blocks = problem.blocks
    if recompute is None:
        recompute = frozenset(p for ps in blocks.blocks.values() for p in ps) if problem.recompute else frozenset()
    sk = _skeleton(problem, autocast_dtype)
    sizes = _Sizes(problem)
    mesh = sizes.mesh
    inv_m = 1.0 / problem.microbatches
    # what depends on the choice alone (the search simulates one choice under several recompute
    # sets): each node's strategy, and each parameter input's gather dim when issued ahead
    key = ("simulate_step_memory.choice", problem.choice_key(choice), str(autocast_dtype))
    if key not in problem.memo:
        problem.memo[key] = _choice_facts(problem, choice, sk, sizes)
    strat, prefetch = problem.memo[key]

    def layout_of(inp: _In):
        s = strat.get(inp.producer)
        if s is None:  # a constant of the graph (get_attr): whole on every rank, not the step's
            return None
        return s.outs[inp.index] if inp.index < len(s.outs) else None

    ops_by_name = {op.name: op for op in sk.ops}
    sim = _Sim(trace)
    val: dict[tuple, int | None] = {}  # (node, out index) -> storage id (None: not the step's)
    saved_at: dict[str, list[int]] = {}  # node -> storages released by its backward
    regathered: dict[str, float] = {}  # node -> bytes of parameters gathered again in its backward
    resharded: dict[str, list[bool]] = {}  # node -> per input: arrived through a reshard
    region_inputs: dict[str, list[int]] = {}  # recompute instance -> storages checkpoint keeps
    region_saved: dict[str, dict] = {}  # recompute instance -> {storage: (bytes, first saver)} it re-creates
    region_temp: dict[str, float] = {}
    region_first: dict[str, int] = {}  # recompute instance -> first storage id made inside it
    # ------------------------------------------------------------------ forward
    for name, kind, meta, batch, n_uses in sk.placeholders:
        sim.where = name
        lay = strat[name].outs[0]
        if kind in ("input", "target") and meta is not None and any(
                isinstance(p, Shard) and k > 1 for p, k in zip(lay, mesh)):
            val[(name, 0)] = sim.alloc(sizes.local(meta, lay) * (inv_m if batch else 1.0), "fwd", n_uses)
        else:
            val[(name, 0)] = None  # parameters, buffers, whole inputs: not allocated by the step
    # parameter gathers issued one ahead (runtime.prefetch): (op, input) in program order
    ahead = [(op.name, i, op.instance) for op in sk.ops for i, inp in enumerate(op.ins)
             if prefetch.get((op.name, i)) is not None]
    # (not across the edge of a checkpointed block: its recomputation gathers again itself)
    region = lambda inst: inst if inst in recompute else None  # noqa: E731
    next_ahead = {(a[0], a[1]): b for a, b in zip(ahead, ahead[1:]) if region(a[2]) == region(b[2])}
    early: dict[tuple[str, int], int] = {}  # gathers started before their op: (op, input) -> storage
    for op in sk.ops:
        s = strat[op.name]
        sim.where = op.name
        prof = op.prof
        arrive = []  # per input: (storage, bytes, resharded, regathered)
        first_new = sim.next
        comm_temp = 0.0
        started = None
        for i, inp in enumerate(op.ins):
            src, dst = layout_of(inp), (s.ins[i] if i < len(s.ins) else None)
            if inp.meta is not None and src is not None and dst is not None and src != dst:
                per_elem = inp.cast.itemsize if inp.cast is not None else inp.meta.itemsize
                scale = inv_m if inp.batch else 1.0
                size = sizes.local(inp.meta, dst, per_elem) * scale
                gathers, staging = sizes.reshard(inp.meta, per_elem, src, dst)
                comm_temp = max(comm_temp, staging * scale)
                sid = early.pop((op.name, i), None)
                arrive.append((sid if sid is not None else sim.alloc(size, "fwd", 1), size, True, inp.param and gathers))
                started = next_ahead.get((op.name, i), started)
            else:
                arrive.append((val.get((inp.producer, inp.index)), 0.0, False, False))
        if started is not None:  # the next parameter's gather is under way while this op runs
            nop = ops_by_name[started[0]]
            ninp = nop.ins[started[1]]
            nsize = sizes.local(ninp.meta, strat[nop.name].ins[started[1]],
                                ninp.cast.itemsize if ninp.cast is not None else ninp.meta.itemsize)
            early[(started[0], started[1])] = sim.alloc(nsize, "fwd", 1)
        resharded[op.name] = [a[2] for a in arrive]
        out_lay = next((o for o in s.outs if o is not None), None)
        shrink = (inv_m if op.batch else 1.0) / sizes.split(out_lay)
        for j, om in enumerate(op.outs):
            if om is None:
                continue
            alias = prof.aliases[j] if j < len(prof.aliases) else None
            if alias is not None and alias < len(arrive):
                sim.ref(arrive[alias][0], op.uses[j])
                val[(op.name, j)] = arrive[alias][0]
            else:
                lay = s.outs[j] if j < len(s.outs) else None
                val[(op.name, j)] = sim.alloc(sizes.local(om, lay) * (inv_m if op.batch else 1.0), "fwd", op.uses[j])
        sim.check(extra_fwd=prof.fwd_temp * shrink + comm_temp)
        keep: list[int] = []
        for e in prof.saved:
            if e[0] in ("in", "cast") and e[1] < len(arrive):
                sid, size, _, regather = arrive[e[1]]
                inp = op.ins[e[1]]
                if regather:
                    regathered[op.name] = regathered.get(op.name, 0.0) + size
                elif e[0] == "in":
                    if sid is not None:
                        keep.append(sid)
                elif inp.meta is not None:  # a copy in another dtype (autocast)
                    lay = s.ins[e[1]] if s.ins[e[1]] is not None else layout_of(inp)
                    keep.append(sim.alloc(sizes.local(inp.meta, lay, e[2]) * (inv_m if inp.batch else 1.0), "fwd"))
            elif e[0] == "out":
                sid = val.get((op.name, e[1]))
                if sid is not None:
                    keep.append(sid)
            elif e[0] == "new":
                keep.append(sim.alloc(e[1] * shrink, "fwd"))
        keep = sorted(set(keep))
        inst = op.instance if op.instance in recompute else None
        if inst is not None:
            # checkpointed: nothing is kept now; what it saves inside the block is recomputed in
            # backward (the block's inputs are kept by the checkpoint instead)
            first = region_first.setdefault(inst, first_new)
            store = region_saved.setdefault(inst, {})
            for k in keep:
                if k >= first and k not in store:
                    store[k] = (sim.size.get(k, 0.0), op.name)  # released by its first saver's backward
                if sim.refs.get(k, 0) == 0:
                    sim.free(k)
            region_temp[inst] = max(region_temp.get(inst, 0.0), prof.fwd_temp * shrink)
            keep = []
            for inp in op.ins:
                sid = val.get((inp.producer, inp.index))
                if sid is not None and sid < first:  # made outside the block
                    region_inputs.setdefault(inst, []).append(sid)
                    sim.ref(sid)
        for k in keep:
            sim.ref(k)
        saved_at[op.name] = keep
        for inp, (sid, _, was_resharded, _) in zip(op.ins, arrive):
            if was_resharded:
                sim.unref(sid)  # the reshard's output had this one use
            sim.unref(val.get((inp.producer, inp.index)))
    fwd_peak = sim.max["fwd"]
    kept_by_node: dict[str, float] = {}
    for sid, size in sim.size.items():
        kept_by_node[sim.owner[sid]] = kept_by_node.get(sim.owner[sid], 0.0) + size
    # ------------------------------------------------------------------ backward
    grad_of: dict[int, int] = {}  # value storage -> its gradient's storage
    inflight: list[int] = []
    seen_regions: set[str] = set()
    first_of_region: dict[str, str] = {}
    for op in sk.ops:
        if op.instance in recompute:
            first_of_region.setdefault(op.instance, op.name)
    # backward gathers again, and starts the gather of the one before (runtime.param_regather)
    with_regather = [op.name for op in sk.ops if regathered.get(op.name)]
    regather_next = {b: regathered[a] for a, b in zip(with_regather, with_regather[1:])}
    inflight3: list[int] = []  # gradients of gathered parameters being reduce-scattered
    for op in reversed(sk.ops):
        if not op.needs_grad:
            for sid in saved_at.get(op.name, ()):
                sim.unref(sid)
            continue
        s = strat[op.name]
        sim.where = op.name
        prof = op.prof
        inst = op.instance if op.instance in recompute else None
        if inst is not None and inst not in seen_regions:
            # the first backward of a checkpointed block recomputes its forward: what it saves
            # comes back, and goes again as backward passes its savers
            seen_regions.add(inst)
            for size, saver in region_saved.get(inst, {}).values():
                saved_at.setdefault(saver, []).append(sim.alloc(size, "bwd", 1))
            sim.check(extra_bwd=region_temp.get(inst, 0.0), phase="backward")
        out_lay = next((o for o in s.outs if o is not None), None)
        shrink = (inv_m if op.batch else 1.0) / sizes.split(out_lay)
        regather = regathered.get(op.name, 0.0) + (regather_next.get(op.name, 0.0) if op.name in regathered else 0.0)
        aliased = {al for al in prof.aliases if al is not None}
        for i, inp in enumerate(op.ins):
            if not inp.grad:
                continue
            if i in aliased and not resharded[op.name][i]:
                continue  # a view's input gradient is a view of its output gradient
            scale = inv_m if inp.batch else 1.0
            lin = s.ins[i] if i < len(s.ins) else None
            lout = layout_of(inp)
            # (a parameter cast before its prefetched gather gets its gradient in the cast dtype)
            prefetch_dim = prefetch.get((op.name, i))
            cast_grad = inp.cast is not None and prefetch_dim is not None
            g = sim.alloc(sizes.local(inp.meta, lin if lin is not None else lout,
                                      inp.cast.itemsize if cast_grad else None) * scale, "bwd")
            sim.check(extra_bwd=prof.bwd_temp * shrink + regather, phase="backward")
            gin = s.grad_ins[i] if i < len(s.grad_ins) else None
            if prefetch_dim is not None:
                # reduce-scattered asynchronously from a copy in the reduce dtype, at most
                # MAX_INFLIGHT pending (runtime.prefetch)
                reduce_size = problem.ctx.policy.torch_reduce_dtype.itemsize
                recast = inp.cast is not None and reduce_size != inp.cast.itemsize
                if recast or prefetch_dim != 0:  # a cast or strided copy
                    ratio = reduce_size / inp.cast.itemsize if recast else 1.0
                    send = sim.alloc(sim.size[g] * ratio, "bwd")
                    sim.check(extra_bwd=prof.bwd_temp * shrink + regather, phase="backward")
                    sim.free(g)
                    g = send
                inflight3.append(g)
                while len(inflight3) > _ZERO3_INFLIGHT + 1:
                    sim.free(inflight3.pop(0))
                continue
            # summed by GradSync (a parameter's, or one its producer hands back to its parameters)
            gout = sizes.grad_layout(lout) if lout is not None else None
            deferred = (inp.param or inp.sink) and lin is not None and gin is not None and \
                pure_all_reduce_axes(lout, lin, gin, gout) is not None
            if lin is not None and lout is not None and gin is not None and gin != gout and not deferred:
                g2 = sim.alloc(sizes.local(inp.meta, gout) * scale, "bwd")
                _, staging = sizes.reshard(inp.meta, float(inp.meta.itemsize), gin, gout)
                sim.check(extra_bwd=regather + staging * scale, phase="backward")
                sim.free(g)
                g = g2
            prod_sid = val.get((inp.producer, inp.index))
            if inp.param:
                if strat[inp.producer].zero_stage == 2:
                    # no gradient buffer to add into: autograd keeps the incoming gradient, copied
                    # to the parameter's layout, until its reduce-scatter completes
                    sim.check(extra_bwd=sim.size[g] + prof.bwd_temp * shrink, phase="backward")
                    inflight.append(g)
                    while len(inflight) > _ZERO2_INFLIGHT + 1:
                        sim.free(inflight.pop(0))
                else:
                    sim.free(g)  # accumulated into the persistent gradient buffer
            elif prod_sid is not None and grad_of.get(prod_sid) in sim.size:
                sim.free(g)  # added into the value's gradient
            elif prod_sid is not None:
                grad_of[prod_sid] = g
            else:
                sim.free(g)
        sim.check(extra_bwd=prof.bwd_temp * shrink + regather, phase="backward")
        for sid in saved_at.get(op.name, ()):
            sim.unref(sid)
        if not aliased:
            for j in range(len(op.outs)):
                sid = val.get((op.name, j))
                if sid is not None and sid in grad_of:
                    sim.free(grad_of.pop(sid))
        if inst is not None and first_of_region.get(inst) == op.name:
            for sid in region_inputs.get(inst, ()):
                sim.unref(sid)
    for g in inflight + inflight3:
        sim.free(g)
    policy = problem.ctx.policy
    if policy.mixed:  # GradSync reduces buckets through copies in the reduce dtype
        sim.where = "gradient buckets"
        # (a function of the choice alone: memoised on the problem for the simulations of one
        # choice under several recompute sets, as the search for the fewest recomputed runs)
        key = ("simulate_step_memory.wire", problem.choice_key(choice), str(autocast_dtype))
        if key not in problem.memo:
            problem.memo[key] = _wire_bytes(sk, strat, problem, sizes, policy.torch_reduce_dtype.itemsize)
        sim.check(extra_bwd=problem.memo[key], phase="backward")
    # ------------------------------------------------------------------ optimizer
    key = ("persistent_bytes", problem.choice_key(choice))
    if key not in problem.memo:
        problem.memo[key] = persistent_bytes(problem, choice)
    persistent = problem.memo[key]
    shard_bytes, gathers = [], [0.0]
    for name, meta, trainable in sk.params:
        if not trainable:
            continue
        st = strat[name]
        state = state_layout(meta.shape, st.outs[0], st.zero_axes) or st.outs[0]
        shard_bytes.append(_local_bytes(meta, state, mesh))
        if st.zero_axes:
            gathers.append(_zero_gather_bytes(meta, st, mesh))
    opt_step = max(problem.ctx.optimizer.step_temporary_bytes(shard_bytes), max(gathers))
    peak = max(sim.max["total"], opt_step)
    phase = sim.max_phase if sim.max["total"] >= opt_step else "optimizer"
    categories = dict(persistent)
    categories.update(activations=fwd_peak, backward=sim.max["bwd"], optimizer_step=opt_step)
    return MemoryEstimate(sum(persistent.values()) + peak, categories, phase, kept_by_node)


def _prefetch_dim(inp: _In, src, s, i: int, sizes: _Sizes) -> int | None:
    """The dim of this parameter input's gather when it is issued ahead of its op
    (``ir.prefetchable_gather``); None when it is not."""
    dst = s.ins[i] if i < len(s.ins) else None
    if inp.meta is None or src is None or dst is None or src == dst:
        return None
    edge = edge_reshard(src, dst, s.grad_ins[i] if i < len(s.grad_ins) else None, inp.grad)
    if edge is None:
        return None
    key = ("prefetch", inp.meta.shape, edge)
    if key not in sizes.memo:
        found = prefetchable_gather(inp.meta.shape, *edge, sizes.mesh)
        sizes.memo[key] = found[1] if found is not None else None
    return sizes.memo[key]


def _choice_facts(problem: Problem, choice: dict[str, int], sk: _Skeleton, sizes: _Sizes) -> tuple[dict, dict]:
    """(node -> its strategy under ``choice``, (op, input) -> ``_prefetch_dim`` of each parameter
    input whose gather is issued ahead)."""
    strat = {name: problem.strategy_of(name, choice) for name, *_ in sk.placeholders}
    strat.update({op.name: problem.strategy_of(op.name, choice) for op in sk.ops})
    prefetch = {}
    for op in sk.ops:
        for i, inp in enumerate(op.ins):
            s = strat.get(inp.producer)
            if not inp.param or s is None:
                continue
            dim = _prefetch_dim(inp, s.outs[inp.index] if inp.index < len(s.outs) else None, strat[op.name], i, sizes)
            if dim is not None:
                prefetch[(op.name, i)] = dim
    return strat, prefetch


def _wire_bytes(sk: _Skeleton, strat: dict, problem: Problem, sizes: _Sizes, wire_itemsize: int) -> float:
    """Peak bytes of ``GradSync``'s reduce-dtype copies: its buckets (data-parallel gradients in
    reverse order of first use, cut as ``grad_sync.bucket_full`` cuts them), ``WIRE_BUCKETS`` alive."""
    from autopar.sync_settings import WIRE_BUCKETS, bucket_full

    first_use: dict[str, int] = {}
    deferred: dict[str, set] = {}
    for k, op in enumerate(sk.ops):
        s = strat[op.name]
        for i, inp in enumerate(op.ins):
            if not inp.param:
                continue
            first_use.setdefault(inp.producer, k)
            lout = strat[inp.producer].outs[0]
            edge = edge_reshard(lout, s.ins[i] if i < len(s.ins) else None,
                                s.grad_ins[i] if i < len(s.grad_ins) else None, inp.grad)
            deferred.setdefault(inp.producer, set()).add(pure_all_reduce_axes(*edge) if edge is not None else None)
    buckets: list[float] = []
    cur, cur_axes = None, None
    for name, meta, trainable in sorted(sk.params, key=lambda p: -first_use.get(p[0], -1)):
        axes = deferred.get(name, {None})
        st = strat[name]
        if not trainable or len(axes) != 1 or None in axes or st.zero_stage == 2 or meta.itemsize <= wire_itemsize:
            cur = None
            continue
        local = sizes.local(meta, st.outs[0])
        if cur is None or axes != cur_axes or bucket_full(buckets[cur], len(buckets)):
            buckets.append(0.0)
            cur, cur_axes = len(buckets) - 1, axes
        buckets[cur] += local
    ratio = lambda b: b / 4 * wire_itemsize  # noqa: E731 - fp32 gradients on a narrower wire
    return max((sum(ratio(b) for b in buckets[k: k + WIRE_BUCKETS]) for k in range(len(buckets))), default=0.0)


def _zero_gather_bytes(meta: TensorMeta, s, mesh) -> float:
    """Transient of ZeRO-1/2's post-step all-gather of one parameter: the gathered (padded)
    tensor, plus its blocks concatenated where the state dim is not dim 0
    (``runtime.collectives.gather_dim``)."""
    local = local_shape(meta.shape, s.outs[0], mesh)
    d = state_dim(meta.shape, s.outs[0])
    n = math.prod(mesh[a] for a in s.zero_axes)
    rows = -(-local[d] // n) * n
    padded = math.prod(local) // max(local[d], 1) * rows * meta.itemsize
    return padded + (math.prod(local) * meta.itemsize if d != 0 else 0.0)
