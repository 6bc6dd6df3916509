"""Build the planning problem for one mesh: representative nodes, strategies, priced edges.

The ILP (``planner.ilp``) sees only numbers from here: per representative node a strategy list with
compute seconds and memory bytes (already multiplied by the number of block instances sharing it),
and per representative edge a table of seconds indexed by (producer layout key, consumer key)
(``planner.edge_tables``).

Costs that overlap with compute (parameter all-gathers ahead of use, gradient reductions during
backward) are kept apart from blocking costs (activation resharding on the critical path); the
overlap model lives in the ILP objective.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch.fx as fx

from autopar.layouts import local_numel, local_shape, split_factor
from autopar.node_view import op_name
from autopar.planner.blocks import BlockInfo
from autopar.planner.bounded_memo import memo_of
from autopar.planner.costing import (CostContext, VIEW_OPS, gradient_buffer_time, node_compute_time, node_work,
                                     optimizer_update_time, param_memory, reshard_time)
from autopar.planner.edge_tables import REFUSED_RESHARD_S, EdgeTable, build_edges, is_alias_getitem, producer_of
from autopar.planner.op_memory import op_memory, warnings_silenced
from autopar.planner.sync_pricing import own_sync_time, post_step_gather_time
from autopar.planner.variables import NodeVar
from autopar.strategies import NodeStrategies, Strategy, enumerate_strategies
from autopar.trace import TracedGraph, tensor_inputs

__all__ = ["NodeVar", "EdgeTable", "Problem", "build_problem", "node_strategies", "StrategyFilter", "batch_derived",
           "producer_of", "REFUSED_RESHARD_S"]

# (node, strategy) -> None if allowed, else the reason it is not
StrategyFilter = Callable[[fx.Node, Strategy], "str | None"]


@dataclass
class Problem:
    ctx: CostContext
    nodes: dict[str, NodeVar]
    edges: list[EdgeTable]
    recompute: bool
    microbatches: int
    traced: TracedGraph | None = None  # the whole graph (nodes holds representatives only)
    blocks: BlockInfo | None = None
    # whether the loss counts its tokens in a program the runtime can run per microbatch
    # (``loss_rewrite.token_count_program``); None until ``planner.loss_rider`` first asks
    token_count_found: bool | None = field(default=None, repr=False, compare=False)
    # what the planner derives from this problem and a choice, by a key naming the deriving function
    # first (``evaluate``'s results per (choice, recompute): the searches ask again for a choice they
    # priced already; the step simulation's parts that do not depend on recompute). The problem does
    # not change after it is built, so neither do they; callers must not change what they get
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def choice_key(self, choice: dict[str, int]) -> tuple[int, ...]:
        """``choice`` as a hashable key (its strategy indices in node order)."""
        return tuple(choice[n] for n in self.nodes)

    def block_instances(self) -> tuple[str, ...]:
        """Every instance of every repeated block, in the order the model runs them."""
        if self.blocks is None:
            return ()
        order = {p: i for i, p in enumerate(dict.fromkeys(self.blocks.instance_of.values()))}
        return tuple(sorted((p for ps in self.blocks.blocks.values() for p in ps), key=lambda p: order.get(p, 0)))

    def recomputed_share(self, name: str, recompute: frozenset[str]) -> float:
        """Of the instances sharing node ``name``'s decisions, the share checkpointed."""
        inst = self.blocks.instance_of.get(name) if self.blocks is not None else None
        for prefixes in (self.blocks.blocks.values() if inst is not None else ()):
            if inst in prefixes:
                return sum(1 for p in prefixes if p in recompute) / len(prefixes)
        return 0.0

    def strategy_of(self, name: str, choice: dict[str, int]) -> Strategy:
        """The chosen strategy of any node (its representative's)."""
        r = self.blocks.rep[name] if self.blocks is not None else name
        v = self.nodes[r]
        return v.strategies[choice[r]]

    def size(self) -> tuple[int, int]:
        return len(self.nodes), len(self.edges)


def batch_derived(traced: TracedGraph) -> set[str]:
    """Names of the values computed from the batch (inputs or target): they shrink with
    microbatching; everything else (parameters, buffers, constants) does not."""
    out: set[str] = set()
    for n in traced.graph.nodes:
        if n.meta.get("autopar.kind") in ("input", "target") or any(a.name in out for a in tensor_inputs(n)):
            out.add(n.name)
    return out


def build_problem(
    traced: TracedGraph,
    blocks: BlockInfo,
    ctx: CostContext,
    *,
    recompute: bool,
    microbatches: int,
    strategy_filter: StrategyFilter | None = None,
    strategy_cache: dict | None = None,
) -> Problem:
    graph = traced.graph
    rep, count = blocks.rep, blocks.count
    autocast = ctx.policy.torch_compute_dtype if ctx.policy.mixed else None
    batch = batch_derived(traced)
    kept_inputs = _checkpoint_inputs(traced, blocks)
    nodes: dict[str, NodeVar] = {}
    cache = strategy_cache if strategy_cache is not None else {}
    for n in graph.nodes:
        if n.op == "output" or rep[n.name] != n.name or is_alias_getitem(n):
            continue
        ns, strategies, excluded = node_strategies(n, ctx, strategy_filter, cache)
        c = count[n.name]
        in_block = n.name in blocks.instance_of and c > 1
        k = len(strategies)
        fwd = np.zeros(k)
        bwd = np.zeros(k)
        static = np.zeros(k)
        saved = np.zeros(k)
        transient = np.zeros(k)
        kinds: dict[str, np.ndarray] = {}
        priced = _priced_strategies(cache, n, ns, ctx, microbatches, recompute and in_block, c,
                                    tuple(kept_inputs.get(n.name, ())))
        profile = None  # (op_memory, node_work) of an op, once per node where a strategy is not priced yet
        for i, s in enumerate(strategies):
            row = priced.get(id(s))
            if row is None:
                if profile is None and n.meta.get("autopar.kind") == "op":
                    profile = (op_memory(n, autocast), node_work(n, ctx))
                row = priced[id(s)] = _price_strategy(n, s, ctx, microbatches, recompute and in_block, c, batch,
                                                      kept_inputs.get(n.name, ()), profile)
            fwd[i], bwd[i], static[i], saved[i], transient[i], node_kinds = row
            for ck, seconds in node_kinds:
                kinds.setdefault(ck, np.zeros(k))[i] = seconds
        if recompute and in_block:
            fwd_extra = fwd.copy()
            bwd = bwd + fwd_extra  # recomputed forward runs inside backward
        nodes[n.name] = NodeVar(n.name, n, c, strategies, fwd, bwd, static, saved, in_block, excluded, ns.fallback,
                                transient_bytes=transient if transient.any() else None, comm_kinds=kinds or None)

    _merge_followers(traced, blocks, nodes, ctx)
    # (what the edges' grouping derives from the graph alone is kept per traced graph)
    edges = build_edges(traced, blocks, nodes, ctx, microbatches, batch, recompute, autocast, memo=memo_of(traced))
    return Problem(ctx, nodes, edges, recompute, microbatches, traced, blocks)


def _priced_strategies(cache: dict, n: fx.Node, ns: NodeStrategies, ctx: CostContext, microbatches: int,
                       checkpointed: bool, count: int, kept: tuple) -> dict:
    """Per strategy of ``ns`` (by identity), ``_price_strategy``'s row for these arguments, kept in
    ``cache`` (the search's strategy cache: one traced graph) for every problem built on ``ctx``
    alike (the search without constraints beside one with them, the baseline, recompute options
    for the nodes outside blocks)."""
    key = ("priced strategies", n.name, id(ctx), microbatches, checkpointed, count, kept)
    hit = cache.get(key)
    if hit is None or hit[0] is not ctx or hit[1] is not ns:
        hit = cache[key] = (ctx, ns, {})
    return hit[2]


def _price_strategy(n: fx.Node, s: Strategy, ctx: CostContext, microbatches: int, checkpointed: bool, c: int,
                    batch: set[str], kept: list[int], profile) -> tuple:
    """(forward s, backward s, persistent bytes, saved bytes, working set bytes, ((collective kind,
    seconds), ...)) of ``n`` under ``s``, for its ``c`` instances (``checkpointed``: run under
    activation checkpointing, keeping the inputs ``kept``; ``profile``: an op's ``op_memory`` and
    ``node_work``)."""
    kind = n.meta.get("autopar.kind")
    fwd = bwd = static = saved = transient = 0.0
    kinds: dict[str, float] = {}
    if kind == "param":
        trainable = n.meta.get("autopar.requires_grad", True)
        static = param_memory(n.meta["autopar.outputs"][0], s, ctx, trainable) * c
        if trainable:  # the gradient's buffer in backward and the optimizer's update after it
            meta = n.meta["autopar.outputs"][0]
            bwd = (gradient_buffer_time(meta, s, ctx, microbatches) + optimizer_update_time(meta, s, ctx)) * c
        if trainable and s.zero_axes:
            kinds["all_gather"] = post_step_gather_time(n.meta["autopar.outputs"][0], s, ctx) * c
    elif kind == "op":
        prof, work = profile
        for ck, seconds in own_sync_time(n, s, ctx, microbatches, checkpointed).items():
            kinds[ck] = seconds * c
        f, b = node_compute_time(n, s, ctx, work, runs=microbatches)
        fwd, bwd = f * c, b * c
        own = saved_bytes(n, s, ctx, prof, batch, microbatches)
        transient = working_set_bytes(n, s, ctx, prof, batch, microbatches)
        if checkpointed:
            # checkpointed: every instance keeps only its inputs; one instance's saved set
            # exists at a time, recomputed in backward
            saved = own + c * sum(_input_bytes(n, k, s, ctx, batch, microbatches) for k in kept)
        else:
            saved = own * c
    return fwd, bwd, static, saved, transient, tuple(kinds.items())


def node_strategies(n: fx.Node, ctx: CostContext, strategy_filter: StrategyFilter | None,
                    cache: dict) -> tuple[NodeStrategies, list[Strategy], list[tuple[str, str]]]:
    """(every strategy of ``n`` on ``ctx``'s mesh, memoised in ``cache`` per (node, mesh); those
    ``strategy_filter`` allows; (description, reason) of each it excludes)."""
    key = (n.name, ctx.mesh_shape)
    if key not in cache:
        with warnings_silenced():
            cache[key] = enumerate_strategies(n, ctx.mesh_shape, ctx.axis_names)
    ns: NodeStrategies = cache[key]
    strategies = list(ns.strategies)
    excluded = list(ns.excluded)
    if strategy_filter is not None:
        kept = []
        for s in strategies:
            why = strategy_filter(n, s)
            if why is None:
                kept.append(s)
            else:
                excluded.append((s.describe(), why))
        strategies = kept
    return ns, strategies, excluded


def _input_bytes(n: fx.Node, i: int, s: Strategy, ctx: CostContext, batch: set[str], microbatches: int,
                 itemsize: float | None = None) -> float:
    """Local bytes of input ``i`` of ``n`` as ``n`` receives it (strategy ``s``)."""
    a = tensor_inputs(n)[i]
    meta = (a.meta.get("autopar.outputs") or (None,))[0]
    if meta is None:
        return 0.0
    lay = s.ins[i] if i < len(s.ins) else None
    shape = local_shape(meta.shape, lay, ctx.mesh_shape) if lay is not None else meta.shape
    return math.prod(shape) * (itemsize or meta.itemsize) / (microbatches if a.name in batch else 1)


def saved_bytes(n: fx.Node, s: Strategy, ctx: CostContext, prof, batch: set[str], microbatches: int) -> float:
    """Bytes ``n``'s backward keeps under strategy ``s``, at the layouts it keeps them in (what it
    received, what it produced; ``planner.op_memory``). A parameter it keeps is the parameter
    itself (state, or gathered again in backward); a cast copy of it is counted."""
    ins = tensor_inputs(n)
    out_lay = next((o for o in s.outs if o is not None), None)
    split = split_factor(out_lay, ctx.mesh_shape) if out_lay is not None else 1
    scale = 1.0 / microbatches if n.name in batch else 1.0
    total = 0.0
    for e in prof.saved:
        if e[0] == "in" and e[1] < len(ins):
            if ins[e[1]].meta.get("autopar.kind") not in ("param", "buffer"):
                total += _input_bytes(n, e[1], s, ctx, batch, microbatches)
        elif e[0] == "cast" and e[1] < len(ins):
            total += _input_bytes(n, e[1], s, ctx, batch, microbatches, e[2])
        elif e[0] == "out":
            metas = n.meta.get("autopar.outputs") or ()
            if e[1] < len(metas) and metas[e[1]] is not None and e[1] < len(s.outs) and s.outs[e[1]] is not None:
                total += local_numel(metas[e[1]].shape, s.outs[e[1]], ctx.mesh_shape) * metas[e[1]].itemsize * scale
        elif e[0] == "new":
            total += e[1] * scale / split
    return total


def working_set_bytes(n: fx.Node, s: Strategy, ctx: CostContext, prof, batch: set[str], microbatches: int) -> float:
    """What ``n`` allocates while it runs, beyond what is kept: its outputs and their gradients at
    its layouts, inputs that arrive resharded, and its kernels' temporaries (``planner.op_memory``).
    The step's transient peak is the largest of these (``planner.memory_model`` has the exact one)."""
    out_lay = next((o for o in s.outs if o is not None), None)
    split = split_factor(out_lay, ctx.mesh_shape) if out_lay is not None else 1
    scale = 1.0 / microbatches if n.name in batch else 1.0
    outs = 0.0
    for j, (m, lay) in enumerate(zip(n.meta.get("autopar.outputs") or (), s.outs)):
        if m is not None and lay is not None and (j >= len(prof.aliases) or prof.aliases[j] is None):
            outs += local_numel(m.shape, lay, ctx.mesh_shape) * m.itemsize * scale
    ins = sum(_input_bytes(n, i, s, ctx, batch, microbatches) for i, a in enumerate(tensor_inputs(n))
              if i < len(s.ins) and s.ins[i] is not None and a.meta.get("autopar.kind") != "param")
    return 2.0 * outs + ins + (prof.fwd_temp + prof.bwd_temp) * scale / split


def _checkpoint_inputs(traced: TracedGraph, blocks: BlockInfo) -> dict[str, list[int]]:
    """Per node of a block instance: the inputs that are values made outside the instance and
    first read here (what a checkpointed instance keeps for backward, counted once)."""
    out: dict[str, list[int]] = {}
    seen: set[tuple[str, str]] = set()
    for n in traced.graph.nodes:
        inst = blocks.instance_of.get(n.name)
        if inst is None or n.op != "call_function":
            continue
        for i, a in enumerate(tensor_inputs(n)):
            u, _ = producer_of(a)
            if blocks.instance_of.get(u.name) == inst or u.meta.get("autopar.kind") in ("param", "buffer"):
                continue
            if (inst, a.name) not in seen:
                seen.add((inst, a.name))
                out.setdefault(n.name, []).append(i)
    return out




def _is_follower_op(n: fx.Node) -> bool:
    """Single-input ops that cost (almost) nothing and can simply follow their input's layout.

    Measured and rejected (slower plans on ``examples/real_models.py``): merging multi-input
    pointwise ops into their latest operand (Alpa-style; 1-7%: it forbids resharding before a
    fan-out or where a Partial operand meets a whole one), and merging ops that are pointwise only
    by rule (casts, dropout, contiguous; up to 5% on T5, 0.03% on Qwen2: a cast after a free
    slice computes on less)."""
    if n.op != "call_function" or n.meta.get("autopar.kind") != "op":
        return False
    if len(tensor_inputs(n)) != 1:
        return False
    name = op_name(n)
    if name in VIEW_OPS:
        return True
    import torch

    return torch.Tag.pointwise in getattr(n.target, "tags", ())


def _merge_followers(traced: TracedGraph, blocks: BlockInfo, nodes: dict[str, NodeVar], ctx: CostContext) -> None:
    """Tie each follower op's strategy to its producer's (Alpa-style operator merging).

    For every strategy of the producer's root, the follower takes the strategy whose input layout
    equals the producer's output (or, if none exists, the one cheapest to reshard into). This
    removes the follower's variables from the ILP; the edge between them costs nothing on the
    paired diagonal.
    """
    order = {n.name: i for i, n in enumerate(traced.graph.nodes)}
    rep = blocks.rep
    for n in traced.graph.nodes:
        if n.name not in nodes or not _is_follower_op(n):
            continue
        u, idx = producer_of(tensor_inputs(n)[0])
        ur = rep[u.name]
        if ur not in nodes or order[ur] >= order[n.name]:
            continue
        U, V = nodes[ur], nodes[n.name]
        if not V.strategies or not U.strategies:
            continue
        root = U.root or U.name
        meta = U.node.meta["autopar.outputs"][idx]
        by_input: dict = {}
        for i, sv in enumerate(V.strategies):
            by_input.setdefault(sv.ins[0], []).append(i)
        picks = []
        pick_for: dict = {}  # producer layout -> follower strategy
        for su in U.strategies:
            lay = su.outs[idx]
            if lay in pick_for:
                picks.append(pick_for[lay])
                continue
            exact = by_input.get(lay)
            if exact:
                pick = min(exact, key=lambda i: (V.fwd_s[i] + V.bwd_s[i], i))
            else:
                def conv(i):
                    sv = V.strategies[i]
                    t = sum(reshard_time(meta, lay, sv.ins[0], ctx).values()) if sv.ins[0] is not None and meta else 0.0
                    return (t + V.fwd_s[i] + V.bwd_s[i], i)
                pick = min(range(len(V.strategies)), key=conv)
            pick_for[lay] = pick
            picks.append(pick)
        V.strategies = [V.strategies[i] for i in picks]
        V.fwd_s, V.bwd_s = V.fwd_s[picks], V.bwd_s[picks]
        V.static_bytes, V.saved_bytes = V.static_bytes[picks], V.saved_bytes[picks]
        if V.comm_kinds is not None:
            V.comm_kinds = {k: arr[picks] for k, arr in V.comm_kinds.items()}
        if V.transient_bytes is not None:
            V.transient_bytes = V.transient_bytes[picks]
        V.root = root
