"""Why no plan exists: the constraint that rules every plan out, or how much memory the leanest
plan needs against what a device has, and the smallest cluster of the same preset that fits.

Called by ``search`` when every attempt failed (a rare path: it plans again, for the least
memory, on the same meshes and then on clusters of twice as many nodes, at most
``MAX_DIAGNOSIS_DOUBLINGS`` times).
"""
from __future__ import annotations

import math

from autopar.constraints import Constraints
from autopar.errors import NoFeasiblePlanError
from autopar.planner.candidates import USABLE_MEMORY_FRACTION, mesh_candidates, microbatch_counts
from autopar.planner.constraint_filter import make_filter
from autopar.planner.meshes import data_degree
from autopar.planner.evaluate import evaluate
from autopar.planner.ilp import InfeasibleProblem, solve
from autopar.planner.problem import build_problem
from autopar.planner.contexts import cost_context
from autopar.trace import TracedGraph

__all__ = ["raise_no_plan"]


def raise_no_plan(sc, meshes, failures):
    """Raise the ``NoFeasiblePlanError`` of a search (``sc``: its ``attempts.SearchContext``) that
    found no plan on ``meshes``: the constraint that rules every plan out, or how much memory the
    leanest plan needs beside what a device has and the smallest cluster of the preset that fits."""
    traced, blocks, cluster, policy, optimizer = sc.traced, sc.blocks, sc.cluster, sc.policy, sc.optimizer
    c, budget, solver, cache = sc.constraints, sc.budget, sc.solver, sc.cache
    non_memory = [f for f in failures if f.family != "memory"]
    if non_memory and all(f.family != "memory" for f in failures):
        f = non_memory[0]
        raise NoFeasiblePlanError(f"no plan satisfies the constraints ({f.family}): {f.detail}. Relax {c}.")
    # the least memory any plan needs on this cluster: the leanest simulated peak the search met,
    # and the simulated peak of the assignment minimising the ILP's (linear) memory model
    need = min((f.peak_bytes for f in failures if getattr(f, "peak_bytes", None) is not None), default=math.inf)
    recomputes = [c.recompute] if c.recompute is not None and blocks.blocks else (
        [True, False] if blocks.blocks else [False])
    for mesh in meshes:
        for recompute in recomputes:
            try:
                ctx = cost_context(mesh, cluster, policy, optimizer, traced)
                problem = build_problem(traced, blocks, ctx, recompute=recompute, microbatches=_leanest_micro(traced, mesh, c),
                                        strategy_filter=make_filter(traced, c, mesh), strategy_cache=cache)
                sol = solve(problem, None, solver, objective="memory")
                need = min(need, evaluate(problem, sol.choice).peak_bytes)
            except InfeasibleProblem:
                continue
    have = cluster.device.memory_bytes
    suggestion = _smallest_fitting_cluster(traced, blocks, cluster, policy, optimizer, c, solver)
    raise NoFeasiblePlanError(
        f"no plan fits in memory: the leanest plan on {cluster.world_size} x {cluster.device.name} needs "
        f"{need / 2**30:.3g} GiB per device, but a device has {have / 2**30:.3g} GiB "
        f"({budget / 2**30:.3g} GiB usable). {suggestion}"
    )



def _leanest_micro(traced: TracedGraph, mesh: tuple[int, int], c: Constraints) -> int:
    """The most microbatches the batch allows on this mesh (the least activation memory); one
    where a batch norm needs the whole batch."""
    from autopar.ir import training_batch_norms

    if c.microbatches is not None:
        return c.microbatches
    if training_batch_norms(traced.graph):
        return 1
    counts = microbatch_counts(traced.global_batch or 1, data_degree(mesh))
    return counts[-1] if counts else 1


# the diagnosis doubles the node count at most this many times (each doubling plans the leanest
# plan of every mesh of the larger cluster again), and never past MAX_DIAGNOSIS_NODES nodes
MAX_DIAGNOSIS_DOUBLINGS = 4
MAX_DIAGNOSIS_NODES = 4096


def _smallest_fitting_cluster(traced, blocks, cluster, policy, optimizer, c, solver) -> str:
    """Double the node count until the leanest plan fits: at most ``MAX_DIAGNOSIS_DOUBLINGS``
    times (16 times the nodes), up to ``MAX_DIAGNOSIS_NODES`` nodes."""
    if c.dp is not None or c.tp is not None:
        return "Relax the fixed dp/tp degrees or add devices."
    nodes = cluster.nodes
    budget = cluster.device.memory_bytes * USABLE_MEMORY_FRACTION
    for _ in range(MAX_DIAGNOSIS_DOUBLINGS):
        if nodes * 2 > MAX_DIAGNOSIS_NODES:
            break
        nodes *= 2
        bigger = cluster.with_nodes(nodes)
        cache: dict = {}
        for mesh in mesh_candidates(bigger, c):
            ctx = cost_context(mesh, bigger, policy, optimizer, traced)
            problem = build_problem(traced, blocks, ctx, recompute=bool(blocks.blocks), microbatches=_leanest_micro(traced, mesh, c),
                                    strategy_filter=make_filter(traced, c, mesh), strategy_cache=cache)
            try:
                sol = solve(problem, None, solver, objective="memory")
            except InfeasibleProblem:
                continue
            if evaluate(problem, sol.choice).peak_bytes <= budget:
                from autopar.cost_models.hardware import PRESETS

                how = (f"Cluster.preset({cluster.name!r}, nodes={nodes})" if cluster.name in PRESETS
                       else f"cluster.with_nodes(nodes={nodes})")
                return (f"The smallest {cluster.name} cluster that fits has {nodes} nodes "
                        f"({nodes * cluster.devices_per_node} devices): {how}.")
    if nodes == cluster.nodes:
        return (f"(No larger cluster was tried: {nodes} nodes is the most the diagnosis weighs.) Use a lower precision, "
                "an optimizer with less state, or a smaller model.")
    return (f"No cluster of this preset up to {nodes} nodes ({nodes // cluster.nodes} times this one; the diagnosis looks "
            "no further) fits it: use a lower precision, an optimizer with less state, or a smaller model.")
