"""Per-rank memory of one training step, simulated over the program a plan produces.

The runtime (``autopar.runtime``) keeps parameters, gradient buffers and optimizer state for the
whole step, and allocates everything else as the step runs. This module replays that step on
paper, in the order the per-rank program runs, at each value's local size under the chosen
layouts:

* forward, node by node: the buffers the passes' ``reshard`` calls create for inputs that arrive
  in another layout, each op's outputs (an output that aliases an input allocates nothing) and
  its temporaries; what autograd saves (``planner.op_memory``: an input, a cast copy, an output,
  a new tensor) stays until that op's backward; other values are freed after their last use.
  Gathered parameters (ZeRO-3) are not kept: they are gathered again in backward. Blocks run under
  activation checkpointing keep only their inputs, and recompute their saved set in backward;
* backward, in reverse: input gradients at the consumer's layout (then at the producer's, when
  the edge reshards), accumulated into one buffer per value (parameters: into the persistent
  gradient buffers; ZeRO-2: held until their reduce-scatter, at most ``MAX_INFLIGHT`` pending),
  the op's backward temporaries, and the release of its saved tensors and output gradients;
* the optimizer step: its temporaries (``OptimizerSpec``) and ZeRO-1/2's parameter all-gathers.

It reports the same categories ``runtime.memory.MemoryTracker`` measures: persistent
``params``, ``grads`` and ``optimizer_state``; the maxima over the step of what forward
(``activations``), backward (``backward``) and the optimizer (``optimizer_step``) allocated; and
the peak. With ``m`` microbatches one microbatch runs at a time: batch-derived values are 1/m.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch.fx as fx

from autopar.ir import param_cast_dtype
from autopar.layouts import Layout, Shard, grad_layout, local_shape, split_factor, state_layout
from autopar.planner.costing import reshard_staging_bytes
from autopar.planner.op_memory import op_memory
from autopar.planner.problem import Problem, batch_derived, producer_of
from autopar.resharding import reshard_steps_for
from autopar.trace import TensorMeta, tensor_inputs

__all__ = ["MemoryEstimate", "simulate_step_memory", "persistent_bytes"]

_ZERO2_INFLIGHT = 2  # runtime.grad_sync.MAX_INFLIGHT


@dataclass
class MemoryEstimate:
    peak_bytes: float
    categories: dict[str, float] = field(default_factory=dict)
    peak_phase: str = ""

    @property
    def persistent_bytes(self) -> float:
        return sum(self.categories.get(c, 0.0) for c in ("params", "grads", "optimizer_state"))


def _numel(shape) -> int:
    return math.prod(shape)


def _local_bytes(meta: TensorMeta, layout: Layout | None, mesh, itemsize: float | None = None) -> float:
    shape = local_shape(meta.shape, layout, mesh) if layout is not None else meta.shape
    return _numel(shape) * (itemsize if itemsize is not None else meta.itemsize)


def persistent_bytes(problem: Problem, choice: dict[str, int]) -> dict[str, float]:
    """Per-rank bytes kept across steps: parameters (+buffers), gradient buffers, optimizer state."""
    ctx = problem.ctx
    mesh = ctx.mesh_shape
    out = {"params": 0.0, "grads": 0.0, "optimizer_state": 0.0}
    for n in problem.traced.graph.nodes:
        kind = n.meta.get("autopar.kind")
        if kind not in ("param", "buffer"):
            continue
        s = problem.strategy_of(n.name, choice)
        meta = n.meta["autopar.outputs"][0]
        local = _local_bytes(meta, s.outs[0], mesh)
        out["params"] += local
        if kind != "param" or not n.meta.get("autopar.requires_grad", True):
            continue
        state = state_layout(meta.shape, s.outs[0], s.zero_axes) or s.outs[0]
        state_bytes = _local_bytes(meta, state, mesh)
        out["grads"] += state_bytes if s.zero_stage == 2 else local
        out["optimizer_state"] += state_bytes * ctx.optimizer.states
    return out


class _Sim:
    """Live bytes by phase; storages with reference counts (pending uses + saved references)."""

    def __init__(self, trace: list | None = None):
        self.trace = trace
        self.where = ""
        self.size: dict[int, float] = {}
        self.phase_of: dict[int, str] = {}
        self.refs: dict[int, int] = {}
        self.live = {"fwd": 0.0, "bwd": 0.0}
        self.max = {"fwd": 0.0, "bwd": 0.0, "total": 0.0}
        self.max_phase = ""
        self._next = 0

    def alloc(self, nbytes: float, phase: str, refs: int = 0) -> int:
        sid = self._next
        self._next += 1
        self.size[sid] = nbytes
        self.phase_of[sid] = phase
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
    ctx, traced, blocks = problem.ctx, problem.traced, problem.blocks
    mesh = ctx.mesh_shape
    m = problem.microbatches
    if recompute is None:
        recompute = frozenset(p for ps in blocks.blocks.values() for p in ps) if problem.recompute else frozenset()
    batch = batch_derived(traced)
    nodes = [n for n in traced.graph.nodes if n.op != "output"]
    strat = {n.name: problem.strategy_of(n.name, choice) for n in nodes
             if n.op == "placeholder" or (n.op == "call_function" and n.target is not operator.getitem)}
    region = {n.name: blocks.instance_of.get(n.name) for n in nodes}
    region = {k: v for k, v in region.items() if v in recompute}

    def out_layout(node: fx.Node, idx: int = 0):
        u, j = producer_of(node)
        s = strat.get(u.name)
        return s.outs[j] if s is not None and j < len(s.outs) else None

    def scale(name: str) -> float:
        return 1.0 / m if name in batch else 1.0

    def meta_of(node: fx.Node) -> TensorMeta | None:
        outs = node.meta.get("autopar.outputs") or (None,)
        return outs[0] if len(outs) == 1 else None

    uses: dict[tuple, int] = {}
    for n in nodes:
        if n.op == "call_function" and n.target is operator.getitem:
            continue  # reading a tuple element is not a use of the tuple
        for a in tensor_inputs(n):
            key = producer_of(a)
            uses[(key[0].name, key[1])] = uses.get((key[0].name, key[1]), 0) + 1
    out_node = next(n for n in traced.graph.nodes if n.op == "output")
    for a in tensor_inputs(out_node):
        key = producer_of(a)
        uses[(key[0].name, key[1])] = uses.get((key[0].name, key[1]), 0) + 1

    sim = _Sim(trace)
    val: dict[tuple, int | None] = {}  # (node, out index) -> storage id (None: persistent)
    saved_at: dict[str, list[int]] = {}  # node -> storages released by its backward
    regathered: dict[str, list[float]] = {}  # node -> bytes of parameters gathered again in its backward
    arrived: dict[str, list] = {}  # node -> per input: (storage, bytes, resharded, regather)
    region_inputs: dict[str, list[int]] = {}  # recompute instance -> storages checkpoint keeps
    region_saved: dict[str, dict] = {}  # recompute instance -> {storage: (bytes, first saver)} it re-creates
    region_temp: dict[str, float] = {}
    region_first: dict[str, int] = {}  # recompute instance -> first storage id made inside it
    profiles = {}
    # ------------------------------------------------------------------ forward
    for n in nodes:
        kind = n.meta.get("autopar.kind")
        if n.op == "placeholder":
            meta = meta_of(n)
            lay = strat[n.name].outs[0]
            if kind in ("input", "target") and meta is not None and any(
                    isinstance(p, Shard) and k > 1 for p, k in zip(lay, mesh)):
                val[(n.name, 0)] = sim.alloc(_local_bytes(meta, lay, mesh) * scale(n.name), "fwd", uses.get((n.name, 0), 0))
            else:
                val[(n.name, 0)] = None  # parameters, buffers, whole inputs: not allocated by the step
            continue
        if n.target is operator.getitem:
            continue  # an alias of its producer's output
        s = strat[n.name]
        sim.where = n.name
        prof = profiles[n.name] = op_memory(n, autocast_dtype)
        ins = tensor_inputs(n)
        arrive = []
        arrive_first = sim._next
        comm_temp = 0.0
        for i, a in enumerate(ins):
            u, j = producer_of(a)
            sid = val.get((u.name, j))
            meta = meta_of(a)
            src, dst = out_layout(a), (s.ins[i] if i < len(s.ins) else None)
            if meta is not None and src is not None and dst is not None and src != dst:
                is_param = u.op == "placeholder" and u.meta.get("autopar.kind") == "param"
                cast = param_cast_dtype(u, n) if is_param else None
                size = _local_bytes(meta, dst, mesh, cast.itemsize if cast is not None else None) * scale(a.name)
                steps = reshard_steps_for(meta.shape, src, dst, mesh)
                gathers = any(st.kind == "all_gather" for st in steps)
                r = sim.alloc(size, "fwd", 1)
                per_elem = cast.itemsize if cast is not None else meta.itemsize
                comm_temp = max(comm_temp, reshard_staging_bytes(meta.shape, per_elem, src, dst, mesh) * scale(a.name))
                arrive.append((r, size, True, is_param and gathers))
            else:
                arrive.append((sid, 0.0, False, False))
        arrived[n.name] = arrive
        inst = region.get(n.name)
        out_lay = next((o for o in s.outs if o is not None), None)
        split = split_factor(out_lay, mesh) if out_lay is not None else 1
        shrink = scale(n.name) / split
        outs = n.meta.get("autopar.outputs") or ()
        for j, om in enumerate(outs):
            if om is None:
                continue
            alias = prof.aliases[j] if j < len(prof.aliases) else None
            k = uses.get((n.name, j), 0)  # (uses through getitem resolve to (n, j) too)
            if alias is not None and alias < len(arrive):
                base = arrive[alias][0]
                sim.ref(base, k)
                val[(n.name, j)] = base
            else:
                lay = s.outs[j] if j < len(s.outs) else None
                val[(n.name, j)] = sim.alloc(_local_bytes(om, lay, mesh) * scale(n.name), "fwd", k)
        for g in n.users:  # getitem outputs share the tuple element's storage
            if g.target is operator.getitem:
                val[(g.name, 0)] = val.get((n.name, g.args[1]))
        sim.check(extra_fwd=prof.fwd_temp * shrink + comm_temp)
        keep: list[int] = []
        new_saved = 0.0
        for e in prof.saved:
            if e[0] == "in" and e[1] < len(arrive):
                sid, _, _, regather = arrive[e[1]]
                if regather:
                    regathered.setdefault(n.name, []).append(arrive[e[1]][1])
                elif sid is not None:
                    keep.append(sid)
            elif e[0] == "cast" and e[1] < len(arrive):
                sid, size, _, regather = arrive[e[1]]
                a = ins[e[1]]
                meta = meta_of(a)
                if regather:
                    regathered.setdefault(n.name, []).append(size)
                elif meta is not None:
                    lay = s.ins[e[1]] if s.ins[e[1]] is not None else out_layout(a)
                    b = _local_bytes(meta, lay, mesh, e[2]) * scale(a.name)
                    keep.append(sim.alloc(b, "fwd"))
                    new_saved += b
            elif e[0] == "out":
                sid = val.get((n.name, e[1]))
                if sid is not None:
                    keep.append(sid)
            elif e[0] == "new":
                b = e[1] * shrink
                keep.append(sim.alloc(b, "fwd"))
                new_saved += b
        if inst is not None:
            # checkpointed: nothing is kept now; what it saves inside the block is recomputed in
            # backward (the block's inputs are kept by the checkpoint instead)
            first = region_first.setdefault(inst, arrive_first)
            store = region_saved.setdefault(inst, {})
            for k in sorted(set(keep)):
                if k >= first and k not in store:
                    store[k] = (sim.size.get(k, 0.0), n.name)  # released by its first saver's backward
            region_temp[inst] = max(region_temp.get(inst, 0.0), prof.fwd_temp * shrink)
            for k in set(keep):
                if sim.refs.get(k, 0) == 0:
                    sim.free(k)
            keep = []
            for i, a in enumerate(ins):  # checkpoint keeps the block's inputs (made outside it)
                u, j = producer_of(a)
                if region.get(u.name) != inst and val.get((u.name, j)) is not None:
                    region_inputs.setdefault(inst, []).append(val[(u.name, j)])
                    sim.ref(val[(u.name, j)])
        for k in set(keep):
            sim.ref(k)
        saved_at[n.name] = sorted(set(keep))
        for i, a in enumerate(ins):
            u, j = producer_of(a)
            sid, _, resharded, _ = arrive[i]
            if resharded:
                sim.unref(sid)  # the reshard's output had this one use
            sim.unref(val.get((u.name, j)))
    fwd_peak = sim.max["fwd"]
    # ------------------------------------------------------------------ backward
    grad_of: dict[int, int] = {}  # value storage -> its gradient's storage
    inflight: list[int] = []
    seen_regions: set[str] = set()
    ops = [n for n in nodes if n.op == "call_function" and n.target is not operator.getitem]
    first_of_region: dict[str, str] = {}
    for n in ops:
        if n.name in region:
            first_of_region.setdefault(region[n.name], n.name)
    for n in reversed(ops):
        if not n.meta.get("autopar.needs_grad"):
            for sid in saved_at.get(n.name, ()):
                sim.unref(sid)
            continue
        s = strat[n.name]
        sim.where = n.name
        prof = profiles[n.name]
        inst = region.get(n.name)
        if inst is not None and inst not in seen_regions:
            # the first backward of a checkpointed block recomputes its forward: what it saves
            # comes back, and goes again as backward passes its savers
            seen_regions.add(inst)
            for size, saver in region_saved.get(inst, {}).values():
                saved_at.setdefault(saver, []).append(sim.alloc(size, "bwd", 1))
            sim.check(extra_bwd=region_temp.get(inst, 0.0), phase="backward")
        out_lay = next((o for o in s.outs if o is not None), None)
        shrink = scale(n.name) / (split_factor(out_lay, mesh) if out_lay is not None else 1)
        regather = sum(regathered.get(n.name, ()))
        ins = tensor_inputs(n)
        new_grads = []
        for i, a in enumerate(ins):
            u, j = producer_of(a)
            meta = meta_of(a)
            if meta is None or not a.meta.get("autopar.needs_grad") or not meta.is_floating:
                continue
            prod_sid = val.get((u.name, j))
            lin = s.ins[i] if i < len(s.ins) else None
            lout = out_layout(a)
            g_bytes = _local_bytes(meta, lin if lin is not None else lout, mesh) * scale(a.name)
            alias = any(al == i for al in prof.aliases if al is not None)
            if alias and not arrived[n.name][i][2]:
                continue  # a view's input gradient is a view of its output gradient
            g = sim.alloc(g_bytes, "bwd")
            new_grads.append(g)
            sim.check(extra_bwd=prof.bwd_temp * shrink + regather, phase="backward")
            gin = s.grad_ins[i] if i < len(s.grad_ins) else None
            if lin is not None and lout is not None and gin is not None and gin != grad_layout(lout):
                g2 = sim.alloc(_local_bytes(meta, grad_layout(lout), mesh) * scale(a.name), "bwd")
                staging = reshard_staging_bytes(meta.shape, meta.itemsize, gin, grad_layout(lout), mesh) * scale(a.name)
                sim.check(extra_bwd=regather + staging, phase="backward")
                sim.free(g)
                g = g2
            is_param = u.op == "placeholder" and u.meta.get("autopar.kind") == "param"
            if is_param:
                if strat[u.name].zero_stage == 2:
                    # no gradient buffer to add into: autograd keeps the incoming gradient, copied
                    # to the parameter's layout, until its reduce-scatter completes
                    sim.check(extra_bwd=sim.size[g] + prof.bwd_temp * shrink, phase="backward")
                    inflight.append(g)
                    while len(inflight) > _ZERO2_INFLIGHT + 1:
                        sim.free(inflight.pop(0))
                else:
                    sim.free(g)  # accumulated into the persistent gradient buffer
            elif prod_sid is not None and prod_sid in grad_of and grad_of[prod_sid] in sim.size:
                sim.free(g)  # added into the value's gradient
            elif prod_sid is not None:
                grad_of[prod_sid] = g
            else:
                sim.free(g)
        sim.check(extra_bwd=prof.bwd_temp * shrink + regather, phase="backward")
        for sid in saved_at.get(n.name, ()):
            sim.unref(sid)
        for j in range(len(n.meta.get("autopar.outputs") or ())):
            sid = val.get((n.name, j))
            if sid is not None and sid in grad_of and not any(al is not None for al in prof.aliases):
                sim.free(grad_of.pop(sid))
        if inst is not None and first_of_region.get(inst) == n.name:
            for sid in region_inputs.get(inst, ()):
                sim.unref(sid)
    for g in inflight:
        sim.free(g)
    # ------------------------------------------------------------------ optimizer
    persistent = persistent_bytes(problem, choice)
    opt = ctx.optimizer
    shard_bytes = []
    gathers = [0.0]
    for nd in traced.graph.nodes:
        if nd.meta.get("autopar.kind") != "param" or not nd.meta.get("autopar.requires_grad", True):
            continue
        st = strat[nd.name]
        meta = nd.meta["autopar.outputs"][0]
        state = state_layout(meta.shape, st.outs[0], st.zero_axes) or st.outs[0]
        shard_bytes.append(_local_bytes(meta, state, mesh))
        if st.zero_axes:
            gathers.append(_zero_gather_bytes(meta, st, mesh))
    opt_temp = opt.step_temporary_bytes(shard_bytes)
    opt_step = max(opt_temp, max(gathers))
    peak = max(sim.max["total"], opt_step)
    phase = sim.max_phase if sim.max["total"] >= opt_step else "optimizer"
    categories = dict(persistent)
    categories.update(activations=fwd_peak, backward=sim.max["bwd"], optimizer_step=opt_step)
    return MemoryEstimate(sum(persistent.values()) + peak, categories, phase)


def _zero_gather_bytes(meta: TensorMeta, s, mesh) -> float:
    """Transient of ZeRO-1/2's post-step all-gather of one parameter: the gathered (padded)
    tensor, plus a copy where the state dim is not dim 0 (moved to the front and back)."""
    local = local_shape(meta.shape, s.outs[0], mesh)
    from autopar.layouts import state_dim

    d = state_dim(meta.shape, s.outs[0])
    n = math.prod(mesh[a] for a in s.zero_axes)
    rows = -(-local[d] // n) * n
    padded = _numel(local) // max(local[d], 1) * rows * meta.itemsize
    return padded * (2 if d != 0 else 1)
