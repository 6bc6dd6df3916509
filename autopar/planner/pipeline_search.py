"""Pipeline plans (``Constraints(pp=p)``): one stage's submesh, its per-operator plan, the cut.

The search, in order:

1. The submesh: ``world / p`` devices per stage, stages outermost (whole nodes per stage when
   ``p`` divides the node count, else a share of one node's devices), so stages talk over the
   inter-node link exactly when they sit on different nodes.
2. The per-operator plan of the whole graph on that submesh at ``m`` microbatches
   (``search.search_plan``: mesh shape, layouts, ZeRO, recompute), with the memory of ``p``
   devices: a stage holds about ``1/p`` of the model. Every stage runs the same per-operator
   decisions (uniform stages, as Megatron's and torchtitan's pipelines).
3. The cut (``stages.cut_stages``): contiguous stages minimising the slowest one, compute plus
   boundary sends.
4. The schedule's time and memory (``stages``): bubble, microbatches in flight per stage; a stage
   whose predicted peak exceeds the device's memory is refused here, naming it.

Not yet searched (``Constraints`` fixes them): the stage count (``pp``), the microbatch count
(default ``2 * pp`` where the batch allows), the schedule (default 1F1B).
"""
from __future__ import annotations

import dataclasses
import json
import math

from autopar.cluster import Cluster
from autopar.constraints import Constraints
from autopar.errors import ConstraintError, NoFeasiblePlanError
from autopar.plan import Plan, Stage, fingerprint_of
from autopar.planner.stages import (MULTI_STAGE_SCHEDULES, PIPELINE_SCHEDULES, cut_model, cut_stages, in_flight,
                                    schedule_step_time, stage_rank)

__all__ = ["search_pipeline_plan", "stage_cluster", "default_microbatches", "virtual_stages"]

GiB = 2**30


def stage_cluster(cluster: Cluster, pp: int) -> tuple[Cluster, float]:
    """(the cluster one stage plans on, the bandwidth between consecutive stages in bytes/s)."""
    if cluster.nodes % pp == 0:
        sub = dataclasses.replace(cluster, nodes=cluster.nodes // pp)
        link = cluster.inter_node if cluster.nodes > 1 else cluster.intra_node
    elif cluster.nodes == 1 and cluster.devices_per_node % pp == 0:
        sub = dataclasses.replace(cluster, devices_per_node=cluster.devices_per_node // pp)
        link = cluster.intra_node
    else:
        raise ConstraintError(
            f"pp={pp} does not split the cluster's {cluster.nodes} nodes x {cluster.devices_per_node} devices into equal "
            f"stages (whole nodes per stage, or a share of one node); choose pp dividing {cluster.nodes} (the node count)")
    return sub, link.effective_bandwidth


def virtual_stages(schedule: str, asked: int | None) -> int:
    """Stages per rank: 1 for GPipe and 1F1B, 2 for ZBV (its V), ``asked`` (default 2) otherwise."""
    if schedule not in MULTI_STAGE_SCHEDULES:
        if asked not in (None, 1):
            raise ConstraintError(f"virtual_stages={asked} needs an interleaved schedule (interleaved-1f1b, zero-bubble, "
                                  f"zbv); {schedule} runs one stage per rank")
        return 1
    if schedule == "zbv" and asked not in (None, 2):
        raise ConstraintError(f"zbv runs exactly 2 stages per rank (a V), not virtual_stages={asked}")
    return asked or 2


def default_microbatches(batch: int | None, pp: int) -> int:
    """``2 * pp`` microbatches (bubble at most 1/3 for balanced stages) where the batch divides,
    else ``pp``, else the largest divisor of the batch up to ``2 * pp``."""
    if not batch:
        return 2 * pp
    for m in (2 * pp, pp):
        if batch % m == 0:
            return m
    return max(d for d in range(1, 2 * pp + 1) if batch % d == 0)


def search_pipeline_plan(traced, cluster: Cluster, *, constraints: Constraints, precision, optimizer, solver,
                         progress=None, inner_search) -> Plan:
    """The pipeline plan for ``constraints.pp`` stages (see the module docstring).
    ``inner_search``: ``search.search_plan`` (passed in: this module must not import it back)."""
    from autopar.planner.blocks import find_repeated_blocks
    from autopar.planner.constraint_filter import pin_key
    from autopar.planner.search import USABLE_MEMORY_FRACTION, naive_dp_baseline

    c = constraints
    pp = c.pp
    schedule = c.schedule or PIPELINE_SCHEDULES[0]
    if schedule not in PIPELINE_SCHEDULES:
        raise ConstraintError(f"schedule={schedule!r} does not run yet; pipeline plans run {', '.join(PIPELINE_SCHEDULES)}")
    v = virtual_stages(schedule, c.virtual_stages)
    n_stages = pp * v
    sub, link_bw = stage_cluster(cluster, pp)
    m = c.microbatches or default_microbatches(traced.global_batch, pp)
    if traced.global_batch and traced.global_batch % m:
        raise ConstraintError(f"microbatches={m} does not divide the batch of {traced.global_batch}")
    if schedule in ("interleaved-1f1b", "zero-bubble") and m % max(1, m // pp):
        raise ConstraintError(f"{schedule} runs microbatches in rounds of pp={pp}: microbatches={m} must be a multiple of "
                              f"{max(1, m // pp)}; use microbatches={2 * pp}")
    # the per-operator plan of one stage's submesh, with the memory p devices hold together
    roomy = dataclasses.replace(sub, device=dataclasses.replace(sub.device, memory_bytes=sub.device.memory_bytes * pp))
    zero = c.zero
    if schedule in ("zero-bubble", "zbv"):
        # their weight pass takes gradients through the parameters' graph apart from the input pass;
        # a parameter gathered over the data axis (ZeRO-3) or reduce-scattered per microbatch
        # (ZeRO-2) does not take part in it yet
        if zero not in (None, 0):
            raise ConstraintError(f"schedule={schedule} with zero={zero}: zero-bubble schedules run without ZeRO for now "
                                  "(zero=0); use 1f1b or interleaved-1f1b for sharded parameters and optimizer state")
        zero = 0
    inner_c = dataclasses.replace(c, pp=None, schedule=None, microbatches=m, virtual_stages=None, zero=zero)
    inner = inner_search(traced, roomy, constraints=inner_c, precision=precision, optimizer=optimizer, solver=solver,
                         progress=progress, _with_baseline=False, _with_free=False)
    placements = inner.nodes
    recomputed = {}
    if inner.recompute_blocks:
        blocks = find_repeated_blocks(traced.graph, pin_key(c))
        chosen = set(inner.recompute_blocks)
        recomputed = {k: v for k, v in blocks.instance_of.items() if v in chosen}
    mesh_sizes = tuple(s for _, s in inner.mesh_axes)
    cut = cut_stages(traced.graph, cut_model(traced.graph, placements, mesh_sizes, link_bw, recomputed), n_stages)
    compute = [sum(n.compute_s for n in placements.values() if cut.stage_of.get(n.name) == s) for s in range(n_stages)]
    total_compute = sum(compute) or 1.0
    pipe_compute, bubble = schedule_step_time(compute, m, schedule, pp)
    sends = [2.0 * b / link_bw for b in cut.boundary_bytes]
    p2p = (sum(sends) + (m - 1) * max(sends, default=0.0)) / m
    # the submesh's step (compute and its collectives), stretched as the schedule stretches compute
    step = inner.predicted.step_time_s * pipe_compute / total_compute + p2p

    mem = dict(inner.predicted.memory_bytes)
    state = sum(mem.get(k, 0.0) for k in ("params", "grads", "optimizer_state"))
    working = max(inner.predicted.peak_memory_bytes - state, 0.0)
    param_bytes = {p.fqn: p.bytes_per_device for p in inner.params.values()}
    total_param = sum(param_bytes.values()) or 1.0
    owned = [[p for p in inner.params.values() if cut.stage_of.get(p.node) == s] for s in range(n_stages)]
    rank_of = [stage_rank(s, pp, schedule) for s in range(n_stages)]
    peaks = []  # per pipeline rank: its stages' state and activations in flight
    for r in range(pp):
        mine = [s for s in range(n_stages) if rank_of[s] == r]
        pshare = sum(param_bytes[p.fqn] for s in mine for p in owned[s]) / total_param
        ashare = sum(compute[s] for s in mine) / total_compute
        peaks.append(state * pshare + working * ashare * in_flight(schedule, r, pp, m, v))
    stages = []
    for s in range(n_stages):
        nodes = tuple(n for n in inner.stages[0].nodes if cut.stage_of.get(n.name, n_stages - 1) == s)
        stages.append(Stage(s, inner.stages[0].mesh, rank_of[s] * math.prod(mesh_sizes), nodes, tuple(owned[s]),
                            predicted_time_s=_r(cut.stage_time_s[s] / m), peak_memory_bytes=_r(peaks[rank_of[s]])))
    budget = cluster.device.memory_bytes * USABLE_MEMORY_FRACTION
    worst = max(range(pp), key=lambda r: peaks[r])
    if peaks[worst] > budget:
        raise NoFeasiblePlanError(
            f"pp={pp}: pipeline rank {worst} needs {peaks[worst] / GiB:.2f} GiB per device "
            f"({in_flight(schedule, worst, pp, m, v):.2g} microbatches in flight under {schedule}) but a device has "
            f"{budget / GiB:.2f} GiB usable; use more stages (pp), 1f1b rather than gpipe, recompute, or a larger cluster")
    shown = dict(mem)
    worst_params = sum(param_bytes[p.fqn] for s in range(n_stages) if rank_of[s] == worst for p in owned[s])
    for k in ("params", "grads", "optimizer_state"):
        if k in shown:
            shown[k] = shown[k] * worst_params / total_param
    world = cluster.world_size
    mfu = inner.predicted.model_flops / (step * world * cluster.device.peak_flops.for_dtype(_compute_dtype(precision))) \
        if step > 0 else 0.0
    predicted = dataclasses.replace(
        inner.predicted, step_time_s=_r(step), peak_memory_bytes=_r(peaks[worst]),
        memory_bytes=tuple((k, _r(val)) for k, val in shown.items()), mfu=_r(mfu))
    cjson = json.dumps(c.to_dict(), sort_keys=True)
    notes = inner.notes + (
        "pipeline plans price every stage with the same per-operator decisions (one submesh plan for the whole "
        "graph); the stage count, microbatches and schedule come from the constraints, not from a search",
    )
    return dataclasses.replace(
        inner, stages=tuple(stages), schedule=schedule, microbatches=m, predicted=predicted, bubble_fraction=_r(bubble),
        virtual_stages=v,
        cluster_json=cluster.to_json(), constraints=cjson, notes=notes, free_step_time_s=None,
        baseline=naive_dp_baseline(traced, cluster, precision, optimizer, solver),
        inputs_fingerprint=fingerprint_of(inner.inputs_fingerprint, cluster.to_json(), cjson, "pipeline"))


def _compute_dtype(precision) -> str:
    from autopar.cost_models.memory import precision_policy

    return precision_policy(precision).compute_dtype


def _r(x: float) -> float:
    return float(f"{float(x):.9g}")
