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
from autopar.plan import Plan, Predicted, Stage, fingerprint_of
from autopar.planner.stages import PIPELINE_SCHEDULES, cut_model, cut_stages, in_flight, schedule_step_time

__all__ = ["search_pipeline_plan", "stage_cluster", "default_microbatches"]

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
    sub, link_bw = stage_cluster(cluster, pp)
    m = c.microbatches or default_microbatches(traced.global_batch, pp)
    if traced.global_batch and traced.global_batch % m:
        raise ConstraintError(f"microbatches={m} does not divide the batch of {traced.global_batch}")
    # the per-operator plan of one stage's submesh, with the memory p devices hold together
    roomy = dataclasses.replace(sub, device=dataclasses.replace(sub.device, memory_bytes=sub.device.memory_bytes * pp))
    inner_c = dataclasses.replace(c, pp=None, schedule=None, microbatches=m)
    inner = inner_search(traced, roomy, constraints=inner_c, precision=precision, optimizer=optimizer, solver=solver,
                         progress=progress, _with_baseline=False, _with_free=False)
    placements = inner.nodes
    recomputed = {}
    if inner.recompute_blocks:
        blocks = find_repeated_blocks(traced.graph, pin_key(c))
        chosen = set(inner.recompute_blocks)
        recomputed = {k: v for k, v in blocks.instance_of.items() if v in chosen}
    mesh_sizes = tuple(s for _, s in inner.mesh_axes)
    cut = cut_stages(traced.graph, cut_model(traced.graph, placements, mesh_sizes, link_bw, recomputed), pp)
    compute = [sum(n.compute_s for n in placements.values() if cut.stage_of.get(n.name) == s) for s in range(pp)]
    total_compute = sum(compute) or 1.0
    pipe_compute, bubble = schedule_step_time(compute, m, schedule)
    sends = [2.0 * b / link_bw for b in cut.boundary_bytes]
    p2p = (sum(sends) + (m - 1) * max(sends, default=0.0)) / m
    # the submesh's step (compute and its collectives), stretched as the schedule stretches compute
    step = inner.predicted.step_time_s * pipe_compute / total_compute + p2p

    mem = dict(inner.predicted.memory_bytes)
    state = sum(mem.get(k, 0.0) for k in ("params", "grads", "optimizer_state"))
    working = max(inner.predicted.peak_memory_bytes - state, 0.0)
    param_bytes = {p.fqn: p.bytes_per_device for p in inner.params.values()}
    total_param = sum(param_bytes.values()) or 1.0
    stages = []
    peaks = []
    for s in range(pp):
        fqns = [p for p in inner.params.values() if cut.stage_of.get(p.node) == s]
        pshare = sum(param_bytes[p.fqn] for p in fqns) / total_param
        ashare = compute[s] / total_compute
        peak = state * pshare + working * ashare * in_flight(schedule, s, pp, m)
        peaks.append(peak)
        nodes = tuple(n for n in inner.stages[0].nodes if cut.stage_of.get(n.name, pp - 1) == s)
        stages.append(Stage(s, inner.stages[0].mesh, s * math.prod(mesh_sizes), nodes, tuple(fqns),
                            predicted_time_s=float(f"{cut.stage_time_s[s] / m:.9g}"), peak_memory_bytes=float(f"{peak:.9g}")))
    budget = cluster.device.memory_bytes * USABLE_MEMORY_FRACTION
    worst = max(range(pp), key=lambda s: peaks[s])
    if peaks[worst] > budget:
        raise NoFeasiblePlanError(
            f"pp={pp}: stage {worst} needs {peaks[worst] / GiB:.2f} GiB per device ({in_flight(schedule, worst, pp, m)} "
            f"microbatches in flight under {schedule}) but a device has {budget / GiB:.2f} GiB usable; use more stages "
            f"(pp), more microbatches with 1f1b, recompute, or a larger cluster")
    shown = dict(mem)
    for k in ("params", "grads", "optimizer_state"):
        if k in shown:
            shown[k] = shown[k] * sum(param_bytes[p.fqn] for p in stages[worst].params) / total_param
    world = cluster.world_size
    mfu = inner.predicted.model_flops / (step * world * cluster.device.peak_flops.for_dtype(_compute_dtype(precision))) \
        if step > 0 else 0.0
    predicted = dataclasses.replace(
        inner.predicted, step_time_s=_r(step), peak_memory_bytes=_r(peaks[worst]),
        memory_bytes=tuple((k, _r(v)) for k, v in shown.items()), mfu=_r(mfu))
    cjson = json.dumps(c.to_dict(), sort_keys=True)
    notes = inner.notes + (
        "pipeline plans price every stage with the same per-operator decisions (one submesh plan for the whole "
        "graph); the stage count, microbatches and schedule come from the constraints, not from a search",
    )
    return dataclasses.replace(
        inner, stages=tuple(stages), schedule=schedule, microbatches=m, predicted=predicted, bubble_fraction=_r(bubble),
        cluster_json=cluster.to_json(), constraints=cjson, notes=notes, free_step_time_s=None,
        baseline=naive_dp_baseline(traced, cluster, precision, optimizer, solver),
        inputs_fingerprint=fingerprint_of(inner.inputs_fingerprint, cluster.to_json(), cjson, "pipeline"))


def _compute_dtype(precision) -> str:
    from autopar.cost_models.memory import precision_policy

    return precision_policy(precision).compute_dtype


def _r(x: float) -> float:
    return float(f"{float(x):.9g}")
