"""Pipeline stages: where to cut a planned graph, and what a schedule then costs in time and memory.

Pure functions over a traced graph and the per-operator plan of one stage's submesh
(``pipeline_search`` calls them). The model, stated once:

* A cut sits between two operators in program order. It is allowed where no buffer is used on
  both sides (its updates stay in one stage), no recomputed block instance straddles it (its
  checkpoint is one region) and no multi-output value crosses it unindexed. Batch inputs never
  cross: each stage that uses one takes it from the batch. A parameter used on both sides (tied
  weights: an embedding reused as the output head) gets a copy in every stage that uses it,
  their gradients summed between those stages' ranks once per step (``pipeline_search`` prices
  that sum after the schedule, where it runs).
* A stage costs the forward + backward compute of its operators (the per-operator plan's
  ``compute_s``) plus sending what crosses each of its boundaries (activations forward,
  their gradients back) over the link between stages; the cut minimises the slowest stage
  (exact dynamic program over the allowed cuts, ties to fewer bytes sent).
* Messages (``message_seconds``, ``messages_seconds``): each tensor crossing a boundary is its own
  message per microbatch, and so is its gradient back (zeros for a value without one: the
  runtime's protocol on every torch version), at the link's ``send_recv`` time.
* Schedules (``schedule_step_time``, ``in_flight``): GPipe and 1F1B run ``m`` microbatches
  through ``p`` stages in ``sum(t_s) + (m - 1) * max(t_s)`` (bubble ``(p - 1) / (m + p - 1)``
  for balanced stages, Narayanan et al. 2021); interleaved schedules divide the bubble by the
  stages per rank; zero-bubble ones also fill it with deferred weight gradients. A rank's peak
  (``pipeline_search``) adds its stages' receive buffers: torch allocates one per microbatch.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch
import torch.fx as fx

from autopar.errors import ConstraintError
from autopar.layouts import parse_layout
from autopar.schedules import V_SCHEDULES, in_flight

__all__ = ["StageCut", "CutModel", "BoundaryChoice", "cut_model", "cut_stages", "schedule_step_time", "in_flight", "held_per_stage", "torch_rank_actions", "stage_rank",
           "message_seconds", "messages_seconds",
           "PIPELINE_SCHEDULES", "MULTI_STAGE_SCHEDULES", "V_SCHEDULES", "SPLIT_BACKWARD_SCHEDULES",
           "ZERO_BUBBLE_W_SHARE", "local_bytes"]

# the schedules a pipeline plan can run today (``Constraints(schedule=)``); the first is the default
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
MULTI_STAGE_SCHEDULES = ("interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")  # several stages per rank
# schedules that run the weight gradients apart from the input gradients (torch's split backward)
SPLIT_BACKWARD_SCHEDULES = ("zero-bubble", "zbv", "dualpipev")


@dataclass(frozen=True)
class StageCut:
    stage_of: dict  # traced node name -> stage index
    stage_time_s: tuple[float, ...]  # per stage, per step: compute + boundary sends
    boundary_bytes: tuple[float, ...]  # per boundary, per step, one direction, per device
    # per boundary, per step: the collectives regathering what crosses it sent in pieces
    # (forward on the receiving side, its gradient's backward on the sending side)
    boundary_gather_s: tuple[float, ...]
    send_layouts: dict  # traced node name -> the layout it crosses boundaries in, where not its own
    # per boundary: (tensors crossing it forward, tensors whose gradients cross it back, bytes per
    # device per step of those gradients): each tensor is its own message per microbatch
    boundary_messages: tuple[tuple[int, int, float], ...] = ()


# How a value may cross a stage boundary: ``(layout sent, bytes per device per step, seconds per
# step of the collectives that put it back in its planned layout)``, or None to send it as planned.
BoundaryChoice = tuple[str, float, float]


def _op_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]


def local_bytes(n: fx.Node, layout: str | None, mesh_sizes: tuple[int, ...]) -> float:
    """Bytes of ``n``'s value one device holds under its planned layout (all outputs)."""
    metas = [m for m in (n.meta.get("autopar.outputs") or ()) if m is not None]
    total = float(sum(m.nbytes for m in metas))
    if layout is None or layout == "-":
        return total
    shards = 1
    for p, size in zip(parse_layout(layout), mesh_sizes):
        if p.is_shard():
            shards *= size
    return total / shards


@dataclass(frozen=True)
class CutModel:
    """The priced cut points of a graph (``cut_model``): cut ``c`` sits before ``ops[c]``."""
    ops: list
    prefix: np.ndarray  # prefix[i]: compute of ops[:i]
    send: np.ndarray  # send[c]: seconds to send what crosses cut c (forward and back), per step
    crossing: np.ndarray  # crossing[c]: bytes per device crossing cut c, one direction, per step
    allowed: list[int]  # the cuts allowed, ascending
    gather: np.ndarray  # gather[c]: seconds per step regathering what crosses cut c in pieces
    sent: dict  # traced node name -> the layout it crosses a cut in, where not its own
    messages: np.ndarray  # messages[c]: tensors crossing cut c forward (one message each per microbatch)
    grad_messages: np.ndarray  # grad_messages[c]: the gradients crossing back (one per value: zeros where it has none)
    grad_crossing: np.ndarray  # grad_crossing[c]: their bytes per device per step

    def stage_times(self, bounds: list[int]) -> list[float]:
        """Per stage, for stages ``ops[bounds[s]:bounds[s + 1]]`` (bounds from 0 to len(ops)):
        compute plus the sends at both of its boundaries."""
        last = len(bounds) - 2
        return [float(self.prefix[hi] - self.prefix[lo] + (self.send[lo] if s else 0.0) + (self.send[hi] if s < last else 0.0))
                for s, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]


def carrier_dtype(dtype: torch.dtype) -> torch.dtype:
    """The floating dtype a value of ``dtype`` crosses a stage boundary in (itself if floating;
    torch's stages exchange gradients for every value they send): the float of the same width
    (the bytes reinterpreted), float16 for one-byte values (converted: every bool, int8 and uint8
    is exact in it, at twice their bytes)."""
    if dtype.is_floating_point:
        return dtype
    return {8: torch.float64, 4: torch.float32, 2: torch.float16}.get(dtype.itemsize, torch.float16)


def _carried_bytes(node: fx.Node, nbytes: float) -> float:
    """``nbytes`` of ``node``'s value as its stage boundary carries it (``carrier_dtype``)."""
    metas = [m for m in (node.meta.get("autopar.outputs") or ()) if m is not None]
    dtype = metas[0].dtype if len(metas) == 1 else None
    if dtype is None or dtype.is_floating_point:
        return nbytes
    return nbytes * carrier_dtype(dtype).itemsize / dtype.itemsize


def cut_model(graph: fx.Graph, placements: dict, mesh_sizes: tuple[int, ...], link_bandwidth: float,
              recompute_instances: dict[str, str] | None = None, block_instances: dict[str, str] | None = None,
              boundary=None) -> CutModel:
    """Price every cut point of ``graph`` and say which are allowed (the module docstring's rules).
    ``placements``: node name -> ``NodePlacement`` of the per-operator plan; ``recompute_instances``:
    node name -> checkpointed block instance (cuts stay outside); ``block_instances``: node name ->
    repeated block instance, to keep the search to block boundaries beyond ``MAX_CUTS`` cuts.
    ``boundary(node, layout, nbytes)``: how a value crossing a cut is best sent (a
    ``BoundaryChoice``, or None: as planned); a value is sent the same way across every cut."""
    ops = _op_nodes(graph)
    n = len(ops)
    pos = {o.name: i for i, o in enumerate(ops)}
    compute = np.array([placements[o.name].compute_s if o.name in placements else 0.0 for o in ops])
    prefix = np.concatenate([[0.0], np.cumsum(compute)])
    blocked = np.zeros(n + 1, dtype=np.int64)
    crossing = np.zeros(n + 1)
    messages, grad_messages, grad_crossing = np.zeros(n + 1, dtype=np.int64), np.zeros(n + 1, dtype=np.int64), np.zeros(n + 1)
    gather = np.zeros(n + 1)
    sent: dict[str, str] = {}
    for node in graph.nodes:
        users = [pos[u.name] for u in node.users if u.name in pos]
        if not users:
            continue
        last = max(users)
        if node.op == "placeholder":
            if node.meta.get("autopar.kind") == "buffer":  # every use in one stage
                blocked[min(users) + 1: last + 1] += 1
            continue  # a batch input is fed to every stage that uses it (passes.split_stages), not sent
        if node.name not in pos:
            continue
        first = pos[node.name]
        if isinstance(node.meta.get("val"), (tuple, list)):
            # a container used whole stays in one stage; otherwise its getitems carry the bytes,
            # and each runs in its stage: no cut between the container and its last getitem
            whole = any(u.target is not operator.getitem for u in node.users if u.name in pos)
            items = [pos[u.name] for u in node.users if u.name in pos and u.target is operator.getitem]
            blocked[first + 1: (last if whole else max(items, default=first)) + 1] += 1
            continue
        placed = placements.get(node.name)
        layout = placed.outs[0] if placed is not None and placed.outs else None
        nbytes = _carried_bytes(node, local_bytes(node, layout, mesh_sizes))
        choice = boundary(node, layout, nbytes) if boundary is not None else None
        if choice is not None:
            sent[node.name], nbytes, regather = choice
            gather[first + 1: last + 1] += regather
        crossing[first + 1: last + 1] += nbytes
        messages[first + 1: last + 1] += 1
        # every value takes a gradient message back (zeros where it has none: runtime.pipeline)
        grad_messages[first + 1: last + 1] += 1
        grad_crossing[first + 1: last + 1] += nbytes
    members: dict[str, list[int]] = {}  # per checkpointed instance: its operators' positions
    for k, inst in (recompute_instances or {}).items():
        if k in pos:
            members.setdefault(inst, []).append(pos[k])
    for at in members.values():
        blocked[min(at) + 1: max(at) + 1] += 1
    allowed = [c for c in range(1, n) if blocked[c] == 0]
    if block_instances and len(allowed) > MAX_CUTS:
        # a long graph of repeated blocks: cut only where a block instance begins, or outside every
        # instance (the embedding, the head and the loss may still get a stage of their own)
        starts, inside = set(), np.zeros(n + 1, dtype=bool)
        for members in _instance_spans(block_instances, pos):
            starts.add(members[0])
            inside[members[0] + 1: members[1] + 1] = True
        allowed = [c for c in allowed if c in starts or not inside[c]]
    return CutModel(ops, prefix, 2.0 * crossing / link_bandwidth + gather, crossing, allowed, gather, sent, messages,
                    grad_messages, grad_crossing)


def _instance_spans(instances: dict[str, str], pos: dict[str, int]) -> list[tuple[int, int]]:
    """(first, last) operator position of each block instance."""
    spans: dict[str, list[int]] = {}
    for name, inst in instances.items():
        if name in pos:
            spans.setdefault(inst, []).append(pos[name])
    return sorted((min(v), max(v)) for v in spans.values())


def cut_stages(graph: fx.Graph, cm: CutModel, stages: int) -> StageCut:
    """Cut ``graph`` (the traced training graph, priced as ``cm = cut_model(graph, ...)``) into
    ``stages`` contiguous stages minimising the slowest (``CutModel.stage_times``; among equal
    bottlenecks, the fewest bytes sent), by a dynamic program over the allowed cuts."""
    ops, n = cm.ops, len(cm.ops)
    if n < stages:
        raise ConstraintError(f"pp={stages}: the model has only {n} operators to spread over {stages} stages; use a smaller pp")
    if len(cm.allowed) < stages - 1:
        raise ConstraintError(
            f"pp={stages}: the model can be cut in only {len(cm.allowed)} places (between operators that share no "
            f"parameter, outside recomputed blocks); use pp <= {len(cm.allowed) + 1}")
    prefix, send = cm.prefix, cm.send
    idx = np.array([0] + cm.allowed + [n])
    k = len(idx)
    # best[s, j]: the smallest bottleneck of s stages ending at cut idx[j]; arg: where stage s began
    best = np.full((stages + 1, k), math.inf)
    arg = np.zeros((stages + 1, k), dtype=np.int64)
    best[0, 0] = 0.0
    for s in range(1, stages + 1):
        for j in range(1, k):
            if s == stages and j != k - 1:
                continue
            i = np.arange(j)
            cost = prefix[idx[j]] - prefix[idx[i]] + send[idx[i]] * (i > 0) + send[idx[j]] * (j < k - 1)
            total = np.maximum(best[s - 1, :j], cost)
            top = total.min()
            if not math.isfinite(top):
                continue
            near = np.flatnonzero(total <= top * (1 + 1e-9) + 1e-15)
            a = int(near[np.argmin(send[idx[near]])])  # among (near-)equal bottlenecks: the fewest bytes
            best[s, j], arg[s, j] = total[a], a
    if not math.isfinite(best[stages, k - 1]):
        raise ConstraintError(f"pp={stages}: no way to cut the model into {stages} non-empty stages")
    ends = [k - 1]
    for s in range(stages, 0, -1):
        ends.append(int(arg[s, ends[-1]]))
    bounds = [int(idx[j]) for j in reversed(ends)]  # stage s runs ops[bounds[s]:bounds[s + 1]]
    stage_of: dict[str, int] = {}
    for s in range(stages):
        for o in ops[bounds[s]:bounds[s + 1]]:
            stage_of[o.name] = s
    for node in graph.nodes:
        if node.op == "placeholder":
            users = [stage_of[u.name] for u in node.users if u.name in stage_of]
            stage_of[node.name] = min(users) if node.meta.get("autopar.kind") in ("param", "buffer") and users else 0
        elif node.op == "output":
            stage_of[node.name] = stages - 1
    return StageCut(stage_of, tuple(cm.stage_times(bounds)), tuple(float(cm.crossing[b]) for b in bounds[1:-1]),
                    tuple(float(cm.gather[b]) for b in bounds[1:-1]), dict(cm.sent),
                    tuple((int(cm.messages[b]), int(cm.grad_messages[b]), float(cm.grad_crossing[b]))
                          for b in bounds[1:-1]))


def message_seconds(link):
    """Seconds of one stage-to-stage message of n bytes over ``link``: its calibrated ``send_recv``
    times (``LinkSpec.measured_time``, interpolated), else its ``send_recv`` latency + bytes /
    bandwidth (the link's own where that kind was not fitted)."""
    def seconds(nbytes: float) -> float:
        measured = link.measured_time("send_recv", 2, nbytes) if link.collective_table else None
        if measured is not None:
            return measured
        latency, bandwidth = link.collective("send_recv")
        return latency + nbytes / bandwidth
    return seconds


def messages_seconds(send_s, fwd_bytes: float, bwd_bytes: float, fwd_messages: int, bwd_messages: int) -> float:
    """Seconds of one microbatch's messages over a boundary: ``fwd_messages`` tensors of
    ``fwd_bytes`` in all forward, ``bwd_messages`` gradients of ``bwd_bytes`` back (torch's
    pipelining sends each tensor as its own message)."""
    fwd = fwd_messages * send_s(fwd_bytes / fwd_messages) if fwd_messages else 0.0
    return fwd + (bwd_messages * send_s(bwd_bytes / bwd_messages) if bwd_messages else 0.0)


def stage_rank(stage: int, ranks: int, schedule: str) -> int:
    """The pipeline rank (``pp`` coordinate) running ``stage``: stage ``s`` on rank ``s % pp``
    (looped), or for the V schedules (zbv, dualpipev) the V shape (rank ``r`` runs stages ``r`` and
    ``2 pp - 1 - r``)."""
    if schedule in V_SCHEDULES:
        return stage if stage < ranks else 2 * ranks - 1 - stage
    return stage % ranks


# beyond this many allowed cuts, a graph of repeated blocks is cut only at block boundaries (the
# dynamic program is quadratic in the cuts)
MAX_CUTS = 400

# the weight-gradient share of a stage's forward + backward that zero-bubble schedules defer into
# the bubble: W = B / 2 with B = 2 F (a matmul's two backward products), so W = 1/3 of F + B
ZERO_BUBBLE_W_SHARE = 1.0 / 3.0


# per bubble slot of the multi-stage schedules, the share of one stage's forward + backward
# (1 = F + B, W = ZERO_BUBBLE_W_SHARE, B = 2 W) that stays idle (schedule_step_time): interleaved
# all of it; zero bubble F + B - 2 W; DualPipeV F&B + B - 3 W with F&B = F + B, i.e. 1 - W
_BUBBLE_SLOT = MappingProxyType({"interleaved-1f1b": 1.0, "zero-bubble": 1.0 - 2 * ZERO_BUBBLE_W_SHARE,
                                 "zbv": 1.0 - 2 * ZERO_BUBBLE_W_SHARE, "dualpipev": 1.0 - ZERO_BUBBLE_W_SHARE})


def schedule_step_time(stage_times: list[float], microbatches: int, schedule: str, ranks: int) -> tuple[float, float]:
    """(step time, bubble fraction) of ``schedule`` running stages of per-step times ``stage_times``
    (each the sum over the step's microbatches) on ``ranks`` pipeline ranks.

    GPipe, 1F1B: ``sum(t_s) + (m - 1) max(t_s)`` (per-microbatch ``t_s``). Interleaved (``v``
    stages per rank): ``m max_r T_r + (p - 1) max_s t_s`` with ``T_r`` a rank's stages per
    microbatch (the bubble shrinks ``v``-fold). Zero bubble: the same with the bubble's stage
    time less the deferred weight gradients, ``(1 - 2 W) max_s t_s`` (Qi et al. 2024, ZB-1P).
    DualPipeV: the same with ``(F&B + B - 3 W)`` per bubble slot (DeepSeek-V3 report, Table 2; its
    ``PP/2 - 1`` counts pairs of chunks, here ``p - 1`` ranks of two stages), where torch's
    overlapped F&B runs the forward and the backward one after the other: ``F + 2 B - 3 W``, with
    ``B = 2 F`` and ``W = B / 2`` two thirds of a stage's time (the zero-bubble schedules: one
    third). The bubble fraction is the share of the ranks' time idle."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ConstraintError(f"schedule={schedule!r} has no time model; pipeline plans run {', '.join(PIPELINE_SCHEDULES)}")
    m, p = microbatches, ranks
    per_micro = [t / m for t in stage_times]
    if schedule in ("gpipe", "1f1b"):
        step = sum(per_micro) + (m - 1) * max(per_micro)
    else:
        per_rank = [0.0] * p
        for s, t in enumerate(per_micro):
            per_rank[stage_rank(s, p, schedule)] += t
        tail = max(per_micro) * _BUBBLE_SLOT[schedule]
        step = m * max(per_rank) + (p - 1) * tail
    busy = sum(stage_times) / p  # what an average rank computes
    return step, (1.0 - busy / step) if step > 0 else 0.0



@dataclass(frozen=True)
class HeldMoment:
    """One moment of a rank's schedule, per local stage (ascending stage order): the microbatches
    whose activations it holds, and the forwards and backwards it has run so far."""
    held: tuple[float, ...]
    forwards: tuple[int, ...]
    backwards: tuple[int, ...]


def _rank_order(schedule: str, r: int, p: int, m: int, v: int) -> list[tuple[int, int]] | None:
    """Rank ``r``'s (local stage, +1 forward / -1 backward) in torch.distributed.pipelining's order,
    for the schedules whose order decides which stage holds what (None: the others). Interleaved
    1F1B runs ``(v-1) * per_round + 2 (p-1-r)`` forwards, then one forward and one backward at a
    time, forwards by rounds of ``per_round`` microbatches from the first local stage, backwards
    from the last; ZBV's rank ``r`` holds, after its warm-up, ``(2p-r-1, r+1)`` or ``(2p-r, r)``
    microbatches on its (first, second) stage; interleaved zero bubble is torch's own calculation."""
    if schedule == "zero-bubble" and v > 1:
        return _torch_zero_bubble_order(r, p, m, v)
    if schedule == "interleaved-1f1b" and v > 1:
        # forwards by rounds of ``per_round`` microbatches from the first local stage; after the
        # warm-up, one forward and one backward at a time, backwards from the last local stage
        per_round = m // max(1, m // p)
        warmup = min((v - 1) * per_round + 2 * (p - 1 - r), m * v)
        order = []
        for op in range(m * v):
            order.append(((op // per_round) % v, 1))
            if op >= warmup:
                order.append((v - 1 - ((op - warmup) // per_round) % v, -1))
        return order
    if schedule == "zbv":
        # chunk 0 is stage r, chunk 1 stage 2p-1-r (ScheduleZBVZeroBubble's warm-up and steady state)
        order, f = [], [0, 0]

        def fwd(c):
            if f[c] < m:
                f[c] += 1
                order.append((c, 1))

        for _ in range(2 * (p - r) - 1):
            fwd(0)
        for _ in range(r):
            fwd(1)
            fwd(0)
        for _ in range(p - r):
            fwd(1)
            order.append((1, -1))
        while f[1] < f[0] or f[0] < m:
            fwd(0)
            order.append((0, -1))
            fwd(1)
            order.append((1, -1))
        return order
    return None


def torch_rank_actions(cls_name: str, r: int, p: int, m: int, v: int) -> list:
    """Rank ``r``'s actions under torch's schedule class ``cls_name`` (p ranks, m microbatches, v
    stages per rank), from torch's own per-rank calculation, run without process groups. Private
    to torch: may raise where another torch computes it otherwise."""
    from torch.distributed.pipelining import schedules

    sched = object.__new__(getattr(schedules, cls_name))
    sched.pp_group_size, sched.n_local_stages, sched.num_stages, sched._n_microbatches = p, v, p * v, m
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    return [a for a in sched._calculate_single_rank_operations(r) if a is not None]


def _torch_zero_bubble_order(r: int, p: int, m: int, v: int) -> list[tuple[int, int]] | None:
    """Rank ``r``'s order under torch's ``ScheduleInterleavedZeroBubble`` (``torch_rank_actions``:
    its weight passes lag the input passes by rules of their own; an activation is released by
    its weight pass). None (the rank's ``in_flight`` on every stage) where this torch computes it
    otherwise."""
    try:
        actions = torch_rank_actions("ScheduleInterleavedZeroBubble", r, p, m, v)
        mine = sorted(s for s in range(p * v) if stage_rank(s, p, "zero-bubble") == r)
        order = []
        for a in actions:
            kind = str(a.computation_type).rsplit(".", 1)[-1]
            if kind == "FORWARD":
                order.append((mine.index(a.stage_index), 1))
            elif kind in ("FULL_BACKWARD", "BACKWARD_WEIGHT"):
                order.append((mine.index(a.stage_index), -1))
        return order if sum(step for _, step in order) == 0 and len(order) == 2 * m * v else None
    except Exception:  # noqa: BLE001 (another torch: its private calculation differs)
        return None


def held_per_stage(schedule: str, rank: int, ranks: int, microbatches: int, virtual: int = 1) -> list[HeldMoment]:
    """The moments of rank ``rank``'s schedule at which its peak may fall (after each forward, and
    its end): per local stage, what it holds and what it has sent. A rank's kept activations peak
    at ``max over moments of sum_j share_j * held_j`` (the stage with the loss weighs by its own
    count, not the rank's average, ``in_flight``). The order is torch's (``_rank_order``); GPipe,
    1F1B and DualPipeV hold ``in_flight`` on every stage."""
    m, p, v, r = microbatches, ranks, virtual, rank
    order = _rank_order(schedule, r, p, m, v)
    if order is None:
        return [HeldMoment((in_flight(schedule, r, p, m, v),) * v, (m,) * v, (0,) * v)]
    held, fwd, bwd = [0] * v, [0] * v, [0] * v
    moments = []
    for j, step in order:
        held[j] += step
        (fwd if step > 0 else bwd)[j] += 1
        if step > 0:
            moments.append(HeldMoment(tuple(float(h) for h in held), tuple(fwd), tuple(bwd)))
    moments.append(HeldMoment(tuple(float(h) for h in held), tuple(fwd), tuple(bwd)))  # the end: every send made
    return moments
