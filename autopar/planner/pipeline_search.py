"""Pipeline plans (``Constraints(pp=p)``): one stage's submesh, its per-operator plan, the cut.

The search, in order:

1. The submesh: ``world / p`` devices per stage, stages outermost (whole nodes per stage when
   ``p`` divides the node count, else a share of one node's devices), so stages talk over the
   inter-node link exactly when they sit on different nodes.
2. The per-operator plan of the whole graph on that submesh at ``m`` microbatches
   (``search.search_plan``: mesh shape, layouts, ZeRO, recompute), with the memory of ``p``
   devices: a stage holds about ``1/p`` of the model. The submesh's axes are not data or tensor
   axes in themselves: each operator's layout chooses, so one stage may split a large embedding
   over the axis the next splits its batch over (``Stage.axis_use``, the summary's "submesh axes
   used for"). Every stage has the same device count and axis sizes: torch.distributed.pipelining
   pairs one rank of each stage per pipeline group, position for position, so a boundary value
   crosses between the same submesh coordinates; stages of different sizes (Alpa's) would need a
   many-to-many exchange at every boundary, which it has no schedule for.
3. The cut (``stages.cut_stages``): contiguous stages minimising the slowest one, compute plus
   boundary sends.
4. The schedule's time and memory (``stages``): bubble, microbatches in flight per stage; a stage
   whose predicted peak exceeds the device's memory is refused here, naming it.

With ``pp`` given, the constraints fix the microbatch count (default ``2 * pp`` where the batch
allows) and the schedule (default 1F1B). A plan without ``pp`` on several nodes also weighs
pipelines (``planner.free_pipelines``): stage counts, 1F1B or interleaved 1F1B, then the
microbatch count of the fastest.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import operator
from dataclasses import dataclass, field

from autopar.cluster import Cluster
from autopar.constraints import Constraints
from autopar.errors import ConstraintError, NoFeasiblePlanError
from autopar.plan import Plan, Stage, fingerprint_of
from autopar.planner.bounded_memo import BoundedMemo, memo_of
from autopar.planner.axis_use import axis_use
from autopar.planner.costing import gradient_buffer_time
from autopar.planner.boundary_choice import boundary_sender, send_layouts
from autopar.planner.pipeline_rank_bytes import grad_bytes_after_sync, rank_comm_bytes, whole_grad_bytes, zero2_held_whole
from autopar.planner.stages import (MULTI_STAGE_SCHEDULES, PIPELINE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES,
                                    V_SCHEDULES, cut_model, cut_stages, held_per_stage, in_flight, local_bytes, message_seconds,
                                    messages_seconds, schedule_step_time, stage_rank)

__all__ = ["search_pipeline_plan", "price_pipeline_plan", "PricedPipeline", "stage_cluster", "default_microbatches", "virtual_stages"]

GiB = 2**30
# the per-operator plans of stage submeshes, per planning inputs: a schedule compared with another
# on the same submesh and microbatches reuses it (least recently planned dropped first)
_INNER = BoundedMemo(8)


def _stage_view(cluster: Cluster, **changes) -> Cluster:
    """``cluster`` with ``changes`` (one stage's ``nodes`` or ``devices_per_node``; its device's
    memory): a view of the validated spec to plan a stage on, not a spec of its own, so not
    validated again. A CPU spec that ``autopar calibrate`` measured with the whole world's processes
    (``cluster_json.check_calibrated_world`` refuses it for fewer) holds for a stage's processes:
    they share the machine with the other stages' as the calibration's processes did."""
    view = copy.copy(cluster)
    for name, value in changes.items():
        object.__setattr__(view, name, value)
    return view


def stage_cluster(cluster: Cluster, pp: int):
    """(the cluster one stage plans on, the bandwidth between consecutive stages in bytes/s, the
    seconds of one message of n bytes between them: ``message_seconds``)."""
    if cluster.nodes % pp == 0:
        sub = _stage_view(cluster, nodes=cluster.nodes // pp)
        link = cluster.inter_node if cluster.nodes > 1 else cluster.intra_node
    elif cluster.nodes == 1 and cluster.devices_per_node % pp == 0:
        sub = _stage_view(cluster, devices_per_node=cluster.devices_per_node // pp)
        link = cluster.intra_node
    else:
        raise ConstraintError(
            f"pp={pp} does not split the cluster's {cluster.nodes} nodes x {cluster.devices_per_node} devices into equal "
            f"stages (whole nodes per stage, or a share of one node); choose pp dividing {cluster.nodes} (the node count)")
    return sub, link.effective_bandwidth, message_seconds(link)


def virtual_stages(schedule: str, asked: int | None) -> int:
    """Stages per rank: 1 for GPipe and 1F1B, 2 for ZBV (its V), ``asked`` (default 2) otherwise."""
    if schedule not in MULTI_STAGE_SCHEDULES:
        if asked not in (None, 1):
            raise ConstraintError(f"virtual_stages={asked} needs an interleaved schedule (interleaved-1f1b, zero-bubble, "
                                  f"zbv); {schedule} runs one stage per rank")
        return 1
    if schedule in V_SCHEDULES and asked not in (None, 2):
        raise ConstraintError(f"{schedule} runs exactly 2 stages per rank (a V), not virtual_stages={asked}")
    return asked or 2


def default_microbatches(batch: int | None, pp: int, data: int = 1) -> int:
    """``2 * pp`` microbatches (bubble at most 1/3 for balanced stages) where the batch divides
    into them and each microbatch over the ``data`` data-parallel shards, else ``pp``, else the
    largest such count up to ``2 * pp``."""
    if not batch:
        return 2 * pp
    for m in (2 * pp, pp):
        if batch % (m * data) == 0:
            return m
    return max((d for d in range(1, 2 * pp + 1) if batch % (d * data) == 0), default=1)


@dataclass(frozen=True)
class _Priced:
    """A per-operator plan of one stage's submesh, cut into stages and priced under a schedule."""
    inner: Plan
    stage_of: dict
    stage_time_s: tuple
    owned: list  # per stage: its ParamPlacements
    rank_of: list  # per stage: its pipeline rank
    peaks: list  # per pipeline rank: predicted peak bytes per device
    step_s: float
    bubble: float
    recompute_blocks: tuple  # the block instances checkpointed (those of the ranks that recompute)
    send_layouts: tuple  # per stage: ((value, layout it is sent in), ...) where not its planned one
    attempt: object  # the search's attempt behind ``inner`` (its problem and choice): bytes per rank (pipeline_rank_bytes.rank_comm_bytes)


def _memory_parts(categories: dict, peak: float) -> tuple[float, float, float]:
    """(state, kept activations, transient working set) of a submesh plan's per-device memory:
    the activations kept for backward exist once per microbatch in flight; the rest of the
    working set is the transient of one op at the peak, there once."""
    state = sum(categories.get(k, 0.0) for k in ("params", "grads", "optimizer_state"))
    working = max(peak - state, 0.0)
    kept = min(categories.get("activations", working), working)
    return state, kept, working - kept


def _rank_param_bytes(owned: list, rank_of, r: int) -> float:
    """Bytes of the parameters pipeline rank ``r``'s stages hold (``owned``: per stage), a tied
    parameter held by two of its stages counted once."""
    held = {p.fqn: p for s, params in enumerate(owned) if rank_of[s] == r for p in params}
    return sum(p.bytes_per_device for p in held.values())


def _kept_per_stage(kept_by_node: dict[str, float], stage_of, n_stages: int, produced: list[float],
                    fed: dict[str, set[int]] | None = None) -> list[float]:
    """Per stage, its share of the activations kept for backward: of the bytes alive at the end
    of the submesh plan's forward, those its own nodes made (``MemoryEstimate.kept_by_node``); a
    batch input's (``fed``: placeholder -> the stages using it) on every stage that takes it from
    the batch; by the bytes its operators produce where the simulation gave none."""
    per = [0.0] * n_stages
    fed = fed or {}
    for name, nbytes in kept_by_node.items():
        for s in fed.get(name, (stage_of(name),)):
            per[s] += nbytes
    total = sum(kept_by_node.values())
    if total <= 0.0:
        per, total = list(produced), sum(produced) or 1.0
    return [x / total for x in per]


def _gradient_buffer_s(problem, choice: dict, name: str, microbatches: int) -> float:
    """One instance's ``costing.gradient_buffer_time`` of parameter ``name`` under its chosen
    strategy (what its planned compute holds beside the optimizer's update)."""
    var = problem.nodes[name]
    if not var.node.meta.get("autopar.requires_grad", True):
        return 0.0
    return gradient_buffer_time(var.node.meta["autopar.outputs"][0], var.strategies[choice[name]], problem.ctx,
                                microbatches)


def _price(traced, blocks, inner: Plan, att, pp: int, v: int, m: int, schedule: str, link_bw: float,
           send_s, budget: float, per_rank_recompute: bool) -> _Priced:
    """Cut ``inner``'s graph into ``pp * v`` stages; the schedule's step time and each rank's peak.
    ``blocks``: the graph's repeated blocks (``find_repeated_blocks``); ``att``: the search's
    attempt behind ``inner`` (its problem and choice).

    Recompute per rank (``per_rank_recompute``, the planner's choice rather than the user's): of
    the instances ``inner`` checkpoints, a rank keeps checkpointing its own only where it would
    overflow ``budget`` without (under 1F1B the first rank holds ``pp`` microbatches in flight, the
    last one), and the others run their forward once."""
    n_stages = pp * v
    placements = inner.nodes
    chosen = set(inner.recompute_blocks)
    recomputed = {k: b for k, b in blocks.instance_of.items() if b in chosen}
    mesh_sizes = tuple(s for _, s in inner.mesh_axes)
    # the cut points' prices depend on the submesh plan, the microbatches and the link, not on the
    # schedule: memoised on the plan's problem for the schedules weighed on one submesh plan
    key = ("pipeline_search.cut_model", att.problem.choice_key(att.solution.choice), inner.fingerprint,
           tuple(sorted(recomputed.items())), tuple(sorted(blocks.instance_of.items())), m, link_bw)
    cm = att.problem.memo.get(key)
    if cm is None:
        cm = att.problem.memo[key] = cut_model(traced.graph, placements, mesh_sizes, link_bw, recomputed,
                                               blocks.instance_of, boundary=boundary_sender(att.problem.ctx, m, link_bw))
    cut = cut_stages(traced.graph, cm, n_stages)
    stage_of = lambda name: cut.stage_of.get(name, n_stages - 1)  # noqa: E731
    rank_of = [stage_rank(s, pp, schedule) for s in range(n_stages)]
    # per stage: compute without any recompute, and the recomputed forward of its checkpointed
    # instances (the problem priced every block's backward with its forward again when it was
    # built with recompute; evaluation takes that back per instance, as here)
    problem, choice = att.problem, att.solution.choice
    plain, again, as_cut, update = [0.0] * n_stages, [0.0] * n_stages, [0.0] * n_stages, [0.0] * n_stages
    param_s: dict[str, tuple[float, float]] = {}  # per parameter: (its planned compute, its gradient buffer's share)
    buffer_s: dict[str, float] = {}  # per representative parameter: its gradient buffer's share
    for n in placements.values():
        if n.op == "param":  # priced below, on every stage holding it
            rep = n.rep or n.name  # (the instances of a repeated block's parameter share one price)
            if rep not in buffer_s:
                buffer_s[rep] = _gradient_buffer_s(problem, choice, rep, m)
            param_s[n.name] = (n.compute_s, buffer_s[rep])
            continue
        as_cut[stage_of(n.name)] += n.compute_s
        extra = 0.0
        var = problem.nodes.get(n.rep or n.name)  # None: a getitem (its producer's compute)
        if problem.recompute and var is not None and var.in_block:
            extra = float(var.fwd_s[choice[var.name]]) / var.count
        plain[stage_of(n.name)] += n.compute_s - extra
        if n.name in recomputed:
            again[stage_of(n.name)] += extra
    # the activations a stage keeps for backward scale with what its operators produce (per
    # device, in their planned layouts); their share of the submesh plan's working set is the stage's
    produced = [0.0] * n_stages
    held_bytes: dict[tuple, float] = {}
    for node in traced.graph.nodes:
        placed = placements.get(node.name)
        if node.op != "call_function" or node.target is operator.getitem or placed is None:
            continue
        key = (placed.rep or node.name, placed.outs[0] if placed.outs else None)  # (instances alike)
        if key not in held_bytes:
            held_bytes[key] = local_bytes(node, key[1], mesh_sizes)
        produced[stage_of(node.name)] += held_bytes[key]
    total_produced = sum(produced) or 1.0
    with_rc = _memory_parts(dict(inner.predicted.memory_bytes), inner.predicted.peak_memory_bytes)
    without_rc = with_rc
    # per placeholder, the stages using it: a batch input is fed to each; a parameter is held by
    # each (tied weights: a copy each, their gradients summed between their ranks after the
    # schedule, runtime.pipeline)
    using = {n.name: {stage_of(u.name) for u in n.users if u.op != "output"}
             for n in traced.graph.nodes if n.op == "placeholder"}
    kind = {n.name: n.meta.get("autopar.kind") for n in traced.graph.nodes if n.op == "placeholder"}
    fed = {n: stages for n, stages in using.items() if kind[n] not in ("param", "buffer")}
    kept_with = kept_without = _kept_per_stage(att.evaluation.memory.kept_by_node, stage_of, n_stages, produced, fed)
    if chosen and per_rank_recompute:
        from autopar.planner.evaluate import evaluate

        ev = evaluate(problem, choice, frozenset())
        without_rc = _memory_parts(ev.memory.categories, ev.peak_bytes)
        kept_without = _kept_per_stage(ev.memory.kept_by_node, stage_of, n_stages, produced, fed)
    total_param = sum(p.bytes_per_device for p in inner.params.values()) or 1.0
    used_in = {n: stages or {stage_of(n)} for n, stages in using.items() if kind[n] == "param"}
    owned = [[p for p in inner.params.values() if s in used_in.get(p.node, {stage_of(p.node)})] for s in range(n_stages)]
    # each stage holding a parameter (a tied weight: every one) zeroes and accumulates its copy's
    # gradient in each microbatch's backward, inside the schedule, and updates it once per step after it
    for name, (compute_s, buffer) in param_s.items():
        for s in used_in.get(name, {stage_of(name)}):
            plain[s] += buffer
            update[s] += compute_s - buffer
    trainable = {n.name for n in traced.graph.nodes if n.op == "placeholder" and n.meta.get("autopar.requires_grad")}
    shared = [p for p in inner.params.values()
              if p.node in trainable and len({rank_of[s] for s in used_in.get(p.node, ())}) > 1]
    bare = [r for r in range(pp) if not any(p.node in trainable for s in range(n_stages) if rank_of[s] == r for p in owned[s])]
    if bare:
        raise ConstraintError(
            f"a cut into {n_stages} pipeline stages leaves pipeline rank {bare[0]} without trainable parameters (its "
            "stages run parameter-free operators or frozen parameters only): use fewer stages")
    loss_rank = rank_of[n_stages - 1]

    held_sends = schedule in MULTI_STAGE_SCHEDULES
    copies = schedule in SPLIT_BACKWARD_SCHEDULES
    fwd_send = [cut.boundary_bytes[s] / m if s < n_stages - 1 else 0.0 for s in range(n_stages)]
    bwd_send = [cut.boundary_messages[s - 1][2] / m if s > 0 else 0.0 for s in range(n_stages)]

    def peak_of(r: int, recomputes: bool) -> float:
        """Rank ``r``'s stages' state, the activations of its microbatches in flight, p2p buffers."""
        state, kept, transient = with_rc if recomputes else without_rc
        mine = [s for s in range(n_stages) if rank_of[s] == r]
        pshare = _rank_param_bytes(owned, rank_of, r) / total_param
        ashare = sum(produced[s] for s in mine) / total_produced
        shares = kept_with if recomputes else kept_without
        # the activations of the microbatches each stage holds; under torch's multi-stage
        # schedules (_PipelineScheduleRuntime) every send of the step also lives until its end:
        # an output sent is one of those activations until its backward, unless the stage sends
        # a copy (split-backward schedules, runtime.pipeline). Every schedule keeps each input
        # gradient a stage sends: it is the ``.grad`` of its receive buffer until the next step
        held = max(sum(kept * shares[s] * h + held_sends * (f if copies else b) * fwd_send[s] + b * bwd_send[s]
                       for s, h, f, b in zip(mine, moment.held, moment.forwards, moment.backwards))
                   for moment in held_per_stage(schedule, r, pp, m, v))
        # torch.distributed.pipelining allocates every microbatch's receive buffers up front: the
        # activations a stage receives and the gradients it receives for what it sends, each the
        # whole step's boundary bytes (m microbatches of 1/m)
        buffers = sum((cut.boundary_bytes[s - 1] if s > 0 else 0.0)
                      + (cut.boundary_bytes[s] if s < n_stages - 1 else 0.0) for s in mine)
        # the transient: whole where the loss starts backward, and on a rank that recomputes (a
        # block's saved set is re-created there, one block at a time); elsewhere its share
        whole = r == loss_rank or recomputes
        return (state * pshare + held
                + (transient if whole else transient * ashare) + buffers)

    # split-backward schedules hold ZeRO-2 gradients whole until one reduce-scatter after the
    # schedule (runtime.pipeline): their whole bytes per stage, and that reduction's time
    grad_bytes = whole_grad_bytes(traced, inner)
    whole_grads, zero2_after, zero2_per_micro = zero2_held_whole(inner, att.problem.ctx, owned, schedule, grad_bytes)

    def peak(r: int, recomputes: bool) -> float:
        return peak_of(r, recomputes) + sum(whole_grads[s] for s in range(n_stages) if rank_of[s] == r)

    recomputes = [bool(chosen) and not (per_rank_recompute and peak(r, False) <= budget) for r in range(pp)]
    peaks = [peak(r, recomputes[r]) for r in range(pp)]
    compute = [plain[s] + (again[s] if recomputes[rank_of[s]] else 0.0) for s in range(n_stages)]
    kept_blocks = tuple(b for b in inner.recompute_blocks
                        if any(recomputes[rank_of[stage_of(k)]] for k, i in recomputed.items() if i == b))
    # each stage's schedule actions per microbatch (``Cluster.pipeline_microbatch_s``), stretched as compute
    actions = m * att.problem.ctx.cluster.pipeline_microbatch_s
    compute = [c + actions for c in compute]
    pipe_compute, bubble = schedule_step_time(compute, m, schedule, pp)
    # per microbatch and boundary: each tensor crossing it forward, and each gradient crossing it
    # back, one message (``message_seconds``); on the critical path, one microbatch crosses every
    # boundary and the other m - 1 queue on the slowest one
    sends = [messages_seconds(send_s, b / m, gb / m, nf, nb) + g / m
             for b, g, (nf, nb, gb) in zip(cut.boundary_bytes, cut.boundary_gather_s, cut.boundary_messages)]
    p2p = sum(sends) + (m - 1) * max(sends, default=0.0)
    # inside the schedule: the submesh plan's compute (without the updates and the recomputed
    # forward of the ranks that fit), its blocking collectives and the exposed part of those it
    # overlaps with forward and backward (ZeRO's gathers and reduce-scatters), stretched as the
    # schedule stretches compute. After each rank's last backward: its share (by parameter
    # bytes) of the gradient buckets, hidden by at most that last microbatch's backward, its
    # optimizer updates, ZeRO-2's deferred reduce-scatters and ZeRO-1/2's gathers of the updated
    # parameters; the step ends with the last rank.
    from autopar.planner.evaluate import step_parts
    from autopar.planner.overlap import OVERLAP_EFFICIENCY, exposed_floor, exposed_latency, exposed_seconds

    fwd, bwd, blocking, _, ovl = step_parts(problem, choice, frozenset(kept_blocks), pipelined=True)
    bwd -= sum(compute_s - buffer for compute_s, buffer in param_s.values())  # the updates, each parameter's once
    # ZeRO-1/2's all-gathers of the updated parameters follow each rank's updates, after the schedule
    post_gather = [0.0] * n_stages
    for name, var in problem.nodes.items():
        if var.node.meta.get("autopar.kind") == "param" and var.comm_kinds:
            post_gather[stage_of(name)] += sum(float(arr[choice[name]]) for arr in var.comm_kinds.values())
    blocking -= sum(post_gather)
    floor, lat_share = exposed_floor(problem.ctx.cluster), exposed_latency(problem.ctx.cluster)
    # held whole under the split-backward schedules, ZeRO-2 gradients are reduced after the
    # schedule (zero2_after), not every microbatch as the submesh plan priced them
    in_backward = max(ovl["overlap_bwd"] - sum(zero2_per_micro) * m, 0.0)
    waiting_b = ovl["overlap_bwd_lat"] * in_backward / ovl["overlap_bwd"] if ovl["overlap_bwd"] > 0 else 0.0
    exposed = sum(exposed_seconds(fwd, bwd, ovl["overlap"], in_backward, 0.0, m, floor, ovl["overlap_lat"], waiting_b,
                                   lat_share=lat_share))
    in_schedule = fwd + bwd + blocking + exposed + actions * n_stages
    bwd_share = max(bwd, 0.0) / max(fwd + bwd, 1e-30)
    split = schedule in SPLIT_BACKWARD_SCHEDULES

    def after_schedule(r: int) -> float:
        mine = [s for s in range(n_stages) if rank_of[s] == r]
        share = _rank_param_bytes(owned, rank_of, r) / total_param
        sync, sync_waiting = ovl["overlap_last"] * share, ovl["overlap_last_lat"] * share
        # torch's weight pass adds to the gradients past the hooks that start a bucket's
        # reduction: under a split-backward schedule only stage 0's buckets start early
        hiding = 0.0 if split and 0 not in mine else OVERLAP_EFFICIENCY * bwd_share * sum(compute[s] for s in mine) / m
        # a tied weight's copies: their gradients (ZeRO-2: each rank's reduced shard of them)
        # summed between the ranks holding them
        tied = sum((len(ranks) - 1) * send_s(grad_bytes_after_sync(p, dict(inner.mesh_axes), grad_bytes)) for p in shared
                   if r in (ranks := {rank_of[s] for s in used_in[p.node]}))
        return (max(sync - hiding, floor * (sync - sync_waiting) + lat_share * sync_waiting, 0.0) + tied
                + sum(update[s] + zero2_after[s] + post_gather[s] for s in mine))

    # every rank returns the global loss: the last stage broadcasts it over the pipeline's ranks
    # after the updates (``runtime.pipeline.PipelineRunner.broadcast_loss``), a tree of tiny messages
    loss_broadcast = math.ceil(math.log2(pp)) * send_s(4.0)
    step = (in_schedule * pipe_compute / (sum(compute) or 1.0) + p2p + max(after_schedule(r) for r in range(pp))
            + loss_broadcast)
    # per stage: its compute and boundary sends (the cut priced the sends beside compute_s)
    stage_time = tuple(t - c + compute[s] for s, (t, c) in enumerate(zip(cut.stage_time_s, as_cut)))
    return _Priced(inner, cut.stage_of, stage_time, owned, rank_of, peaks, step, bubble, kept_blocks,
                   send_layouts(traced.graph, cut, n_stages), att)


@dataclass(frozen=True)
class PricedPipeline:
    """A pipeline plan priced but not yet assembled into a ``Plan`` (its stage tables, per-rank
    bytes and fingerprint cost more than the pricing): the free plan's search compares these and
    assembles only the one it keeps. The three figures equal the assembled plan's
    ``predicted.step_time_s``, ``predicted.peak_memory_bytes`` and ``bubble_fraction``."""

    step_time_s: float
    peak_memory_bytes: float
    bubble_fraction: float
    assemble: object = field(repr=False, compare=False)  # () -> Plan


def search_pipeline_plan(traced, cluster: Cluster, *, constraints: Constraints, precision, optimizer, solver,
                         progress=None, inner_search, memory_rounds: int | None = None,
                         recompute_first: bool = False, to_beat_s: float | None = None) -> Plan:
    """The pipeline plan for ``constraints.pp`` stages (see the module docstring)."""
    return price_pipeline_plan(traced, cluster, constraints=constraints, precision=precision, optimizer=optimizer,
                               solver=solver, progress=progress, inner_search=inner_search, memory_rounds=memory_rounds,
                               recompute_first=recompute_first, to_beat_s=to_beat_s).assemble()


def price_pipeline_plan(traced, cluster: Cluster, *, constraints: Constraints, precision, optimizer, solver,
                        progress=None, inner_search, memory_rounds: int | None = None,
                        recompute_first: bool = False, to_beat_s: float | None = None) -> PricedPipeline:
    """``search_pipeline_plan``'s plan, priced, assembled on demand (``PricedPipeline.assemble``).
    ``inner_search``: ``search.stage_plan`` (passed in: this module must not import it back).

    Memory: the per-operator plan is first made with the memory of ``pp`` devices; when a
    pipeline rank's peak (its stages' state, activations of its microbatches in flight) then
    exceeds the device, it is made again with recompute (unless the constraints fix it), then
    with that budget shrunk by the overshoot, up to ``memory_rounds`` (``_MEMORY_ROUNDS``) times.
    ``to_beat_s``: the step time of the best plan found so far (the free plan's search): ZeRO per
    stage is not tried where the pipeline before it, which it can only slow, is no faster.
    ``recompute_first``: start with recompute (the single-stage plan needed it already). Unless the
    constraints fix recompute, only the ranks that overflow without it recompute (``_price``)."""
    from autopar.planner.blocks import find_repeated_blocks
    from autopar.planner.constraint_filter import pin_key
    from autopar.planner.candidates import USABLE_MEMORY_FRACTION
    from autopar.planner.attempts import naive_dp_baseline

    c = constraints
    pp = c.pp
    schedule = c.schedule or PIPELINE_SCHEDULES[0]
    if schedule not in PIPELINE_SCHEDULES:
        raise ConstraintError(f"schedule={schedule!r} does not run yet; pipeline plans run {', '.join(PIPELINE_SCHEDULES)}")
    v = virtual_stages(schedule, c.virtual_stages)
    sub, link_bw, send_s = stage_cluster(cluster, pp)
    m = c.microbatches or default_microbatches(traced.global_batch, pp, c.dp or 1)
    if traced.global_batch and traced.global_batch % m:
        raise ConstraintError(f"microbatches={m} does not divide the batch of {traced.global_batch}")
    if schedule in ("interleaved-1f1b", "zero-bubble") and m % max(1, m // pp):
        raise ConstraintError(f"{schedule} runs microbatches in rounds of pp={pp}: microbatches={m} must be a multiple of "
                              f"{max(1, m // pp)}; use microbatches={2 * pp}")
    zero = c.zero
    if schedule == "dualpipev" and m < 2 * pp:
        raise ConstraintError(f"dualpipev needs at least as many microbatches as stages: microbatches={m} < "
                              f"{2 * pp} stages (2 per rank); use microbatches={2 * pp} or more")
    inner_c = dataclasses.replace(c, pp=None, schedule=None, microbatches=m, virtual_stages=None, zero=zero)
    if recompute_first and c.recompute is None:
        inner_c = dataclasses.replace(inner_c, recompute=True)
    budget = cluster.device.memory_bytes * USABLE_MEMORY_FRACTION
    blocks = find_repeated_blocks(traced.graph, pin_key(c))

    def priced_at(scale: float, inner_c: Constraints) -> _Priced:
        """The pipeline over a submesh plan made with ``scale`` devices' worth of memory."""
        roomy = _stage_view(sub, device=dataclasses.replace(sub.device, memory_bytes=int(sub.device.memory_bytes * scale)))
        inner, att = _inner_plan(traced, roomy, inner_c, precision, optimizer, solver, progress, inner_search, pp)
        return _price(traced, blocks, inner, att, pp, v, m, schedule, link_bw, send_s, budget,
                      per_rank_recompute=c.recompute is None)

    scale = float(pp)  # the submesh plan's memory: pp devices' worth, shrunk below while a rank overflows
    priced = unshrunk = None
    for _ in range(memory_rounds or _MEMORY_ROUNDS):
        try:
            priced = priced_at(scale, inner_c)
        except NoFeasiblePlanError:
            break  # a smaller budget than any per-operator plan needs: the last overflow is the answer
        worst = max(priced.peaks)
        if worst <= budget:
            break
        if not priced.inner.recompute and c.recompute is None and inner_c.recompute is None:
            inner_c = dataclasses.replace(inner_c, recompute=True)  # Megatron's PTD-P recomputes, for this reason
            continue
        if unshrunk is None:
            unshrunk = (priced, inner_c)
        scale *= budget / worst * 0.97
    if priced is None:
        raise NoFeasiblePlanError(f"pp={pp}: no per-operator plan of a stage's {sub.world_size} devices fits")
    if unshrunk is not None and (to_beat_s is None or unshrunk[0].step_s < to_beat_s):
        # the memory was shrunk for every stage alike: ZeRO on the overflowing ranks' stages alone may fit, or be faster
        per_stage = _zero_per_stage(unshrunk, budget, pp, lambda inner_cs: priced_at(float(pp), inner_cs))
        if per_stage is not None and (max(priced.peaks) > budget or per_stage.step_s < priced.step_s):
            priced = per_stage
    worst = max(range(pp), key=lambda r: priced.peaks[r])
    if priced.peaks[worst] > budget:
        from autopar.report import format_bytes

        raise NoFeasiblePlanError(
            f"pp={pp}: pipeline rank {worst} needs {format_bytes(priced.peaks[worst])} per device "
            f"({in_flight(schedule, worst, pp, m, v):.2g} microbatches in flight under {schedule}) but a device has "
            f"{format_bytes(budget)} usable; use more stages (pp), 1f1b rather than gpipe, recompute, or a larger cluster")
    return PricedPipeline(
        _r(priced.step_s), _r(max(priced.peaks)), _r(priced.bubble),
        lambda: _assemble(traced, cluster, c, priced, pp, v, m, schedule, precision, optimizer, solver,
                          naive_dp_baseline(traced, cluster, precision, optimizer, solver)))


_MEMORY_ROUNDS = 4
ZERO_PER_STAGE = (1, 3)  # the ZeRO stages tried on the overflowing ranks' parameters alone, in order


def _zero_per_stage(unshrunk, budget: float, pp: int, price) -> "_Priced | None":
    """ZeRO per stage: the pipeline priced (``price(inner constraints)``) with the parameters of
    the ranks that overflowed (``unshrunk``: a pricing and its inner constraints, before the
    memory was shrunk for every stage alike) under ZeRO-1, else ZeRO-3, and the others free; the
    first that fits, or None. Under 1F1B the first rank holds ``pp`` microbatches in flight and
    the last one: the first overflows first, and sharding its state alone costs the others nothing."""
    priced, inner_c = unshrunk
    if inner_c.zero is not None or inner_c.zero_params:
        return None  # the user chose ZeRO
    over = {r for r in range(pp) if priced.peaks[r] > budget}
    if len(over) == pp:
        return None  # every rank overflows: the memory shrunk for every stage alike is the per-stage plan
    names = sorted({p.fqn for s, ps in enumerate(priced.owned) if priced.rank_of[s] in over for p in ps})
    for level in ZERO_PER_STAGE:
        try:
            attempt = price(dataclasses.replace(inner_c, zero_params={n: level for n in names}))
        except (NoFeasiblePlanError, ConstraintError):
            continue
        if max(attempt.peaks) <= budget:
            return attempt
    return None


def _inner_plan(traced, roomy: Cluster, inner_c: Constraints, precision, optimizer, solver, progress, inner_search,
                stages: int = 1):
    """(the per-operator plan of one stage's submesh, the search's attempt behind it); a rank of
    the ``stages`` will hold its stage's share of the parameters (``candidates.PIPELINE_STAGES``)."""
    from autopar.planner.candidates import PIPELINE_STAGES

    key = (id(traced), traced.gm.code, roomy.to_json(), repr(inner_c), repr(precision), repr(optimizer), repr(solver),
           stages)
    found = _INNER.get(key)
    if found is None:
        # one strategy cache per graph and stage count: the submesh plans of one stage count (its
        # schedules, its memory rounds) share strategies, node and edge prices
        cache = memo_of(traced).setdefault(("stage strategy cache", stages), {PIPELINE_STAGES: stages})
        found = _INNER.put(key, inner_search(traced, roomy, constraints=inner_c, precision=precision,
                                             optimizer=optimizer, solver=solver, progress=progress, cache=cache))
    return found


def _assemble(traced, cluster: Cluster, c: Constraints, priced: _Priced, pp: int, v: int, m: int, schedule: str,
              precision, optimizer, solver, baseline) -> Plan:
    """The pipeline Plan: the submesh plan's placements split into stages, with the schedule's predictions."""
    inner = priced.inner
    n_stages = pp * v
    mesh_sizes = tuple(s for _, s in inner.mesh_axes)
    stages = []
    listed = _listed_stage(traced.graph, priced.stage_of, n_stages)
    placements = inner.nodes
    for s in range(n_stages):
        nodes = tuple(n for n in inner.stages[0].nodes if listed(n.name) == s)
        stages.append(Stage(s, inner.stages[0].mesh, priced.rank_of[s] * math.prod(mesh_sizes), nodes,
                            tuple(priced.owned[s]), predicted_time_s=_r(priced.stage_time_s[s] / m),
                            peak_memory_bytes=_r(priced.peaks[priced.rank_of[s]]),
                            send_layouts=priced.send_layouts[s],
                            axis_use=axis_use(traced.graph, placements, [n.name for n in nodes], inner.mesh_axes)))
    rank_bytes = rank_comm_bytes(traced, priced, pp, schedule)
    stages = [dataclasses.replace(st, comm_bytes=tuple((k, _r(v)) for k, v in rank_bytes[priced.rank_of[st.index]].items()))
              for st in stages]
    worst = max(range(pp), key=lambda r: priced.peaks[r])
    total_param = sum(p.bytes_per_device for p in inner.params.values()) or 1.0
    worst_params = _rank_param_bytes(priced.owned, priced.rank_of, worst)
    shown = dict(inner.predicted.memory_bytes)
    for k in ("params", "grads", "optimizer_state"):
        if k in shown:
            shown[k] = shown[k] * worst_params / total_param
    step = priced.step_s
    peak_flops = cluster.device.peak_flops.for_dtype(_compute_dtype(precision))
    mfu = inner.predicted.model_flops / (step * cluster.world_size * peak_flops) if step > 0 else 0.0
    predicted = dataclasses.replace(
        inner.predicted, step_time_s=_r(step), peak_memory_bytes=_r(priced.peaks[worst]),
        memory_bytes=tuple((k, _r(val)) for k, val in shown.items()), mfu=_r(mfu),
        # the busiest pipeline rank's bytes (each stage lists its own rank's, Stage.comm_bytes)
        comm_bytes=max((tuple((k, _r(v)) for k, v in b.items()) for b in rank_bytes), key=lambda t: sum(v for _, v in t)))
    cjson = json.dumps(c.to_dict(), sort_keys=True)
    notes = inner.notes + (
        "pipeline plans solve one per-operator plan of a stage's submesh for the whole graph, then cut it: each "
        "stage's operators choose their own use of the submesh's axes (the stage table's \"submesh axes used for\"); "
        "where only some ranks overflow, their stages' parameters alone may take ZeRO",
    )
    return dataclasses.replace(
        inner, stages=tuple(stages), schedule=schedule, microbatches=m, predicted=predicted,
        recompute=bool(priced.recompute_blocks), recompute_blocks=priced.recompute_blocks,
        bubble_fraction=_r(priced.bubble), virtual_stages=v, cluster_json=cluster.to_json(), constraints=cjson,
        notes=notes, free_step_time_s=None, baseline=baseline,
        inputs_fingerprint=fingerprint_of(inner.inputs_fingerprint, cluster.to_json(), cjson, "pipeline"))


def _listed_stage(graph, stage_of: dict, n_stages: int):
    """The stage a plan lists a node under: the cut's; a graph constant (the cut leaves it out: it
    runs in every stage that uses it, ``passes.split_stages``) under its first user's stage."""
    users = {n.name: [u.name for u in n.users] for n in graph.nodes if n.name not in stage_of}

    def listed(name: str) -> int:
        if name in stage_of:
            return stage_of[name]
        return min((stage_of[u] for u in users.get(name, ()) if u in stage_of), default=n_stages - 1)

    return listed


def _compute_dtype(precision) -> str:
    from autopar.cost_models.memory import precision_policy

    return precision_policy(precision).compute_dtype


def _r(x: float) -> float:
    return float(f"{float(x):.9g}")
