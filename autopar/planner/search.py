"""The outer search: mesh shapes x recompute x microbatches, an ILP for each, the best wins.

Mesh axes are ``("dp", "tp")`` with ranks laid out row-major, so ``tp`` (the last axis) is made of
consecutive ranks: inside one node whenever ``tp`` divides the devices per node. Candidate ``tp``
sizes are the divisors of the devices per node (tensor parallel inside a node first); a ``tp``
spanning nodes is tried only when the user asks for it.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from autopar.cluster import Cluster
from autopar.constraints import Constraints
from autopar.cost_models.memory import OptimizerSpec, PrecisionPolicy, optimizer_spec, precision_policy
from autopar.errors import ConstraintError, NoFeasiblePlanError
from autopar.plan import Baseline, Plan, fingerprint_of
from autopar.planner.bounded_memo import BoundedMemo
from autopar.planner.blocks import find_repeated_blocks
from autopar.planner.constraint_filter import AXES, check_heads, make_filter, pin_key, validate_pins
from autopar.planner.experts import check_experts
from autopar.planner.candidates import (PIPELINE_STAGES, USABLE_MEMORY_FRACTION, context_mesh_candidates, mesh_candidates,
                                       microbatch_counts)
from autopar.layouts import DATA_AXIS_NAMES
from autopar.planner.meshes import axis_names, data_degree, describe, shard_axis
from autopar.cost_models.communication import axis_group
from autopar.planner.contexts import (MEMO_LOCK, MEMO_SIZE, cost_context, estimated_state_numel, memo, plan_state_numel,
                                      update_costs_moved)
from autopar.planner.evaluate import Evaluation, evaluate
from autopar.planner.extract import extract_plan, predicted_of
from autopar.planner.ilp import InfeasibleProblem, SolverConfig, Solution, solve
from autopar.planner.memory_model import check_state_fits
from autopar.planner.problem import REFUSED_RESHARD_S, Problem, build_problem, node_strategies
from autopar.planner.threads import run_concurrently
from autopar.trace import TracedGraph
from autopar.node_view import node_flops, op_name

__all__ = ["search_plan", "mesh_candidates", "naive_dp_baseline", "USABLE_MEMORY_FRACTION", "AXES"]

# per planning inputs (graph, cluster, precision, optimizer, solver), the results that do not
# depend on the constraints: the naive data-parallel baseline and the free plan's step time
_RESULTS = BoundedMemo(MEMO_SIZE, MEMO_LOCK)
_MEMORY_ROUNDS = 4  # ILP re-solves with a tightened budget when the simulated peak exceeds it


@dataclass
class _Attempt:
    mesh: tuple[int, int]
    recompute: bool
    microbatches: int
    problem: Problem
    solution: Solution
    evaluation: Evaluation


def _inputs_key(traced: TracedGraph, cluster: Cluster, precision: str, optimizer, solver) -> str:
    """What a search without constraints depends on: the graph with every ``autopar.*`` fact
    the tracer recorded per node, the cluster, precision, optimizer and solver settings."""
    return fingerprint_of(_graph_key(traced), cluster.to_json(), precision, repr(optimizer), repr(solver))


# id(traced) -> (weak reference to it, its graph's hash): a graph's hash once per traced graph;
# bounded (a dead or dropped graph's entry only costs hashing again)
_GRAPH_KEYS = BoundedMemo(4 * MEMO_SIZE, MEMO_LOCK)


def _graph_key(traced: TracedGraph) -> str:
    """The hash of the graph and its per-node facts, once per traced graph (planning does not
    change it; a pipeline search asks for it once per stage count it weighs)."""
    import weakref

    hit = _GRAPH_KEYS.get(id(traced))
    if hit is not None and hit[0]() is traced:
        return hit[1]
    parts = [traced.gm.code, repr((traced.has_loss, tuple(traced.input_names)))]
    for n in traced.graph.nodes:
        meta = sorted((k, repr(v)) for k, v in n.meta.items() if k.startswith("autopar."))
        parts.append(f"{n.name}|{n.op}|{n.target}|{meta}")
    key = fingerprint_of("\n".join(parts))
    _GRAPH_KEYS.put(id(traced), (weakref.ref(traced), key))
    return key


def _solve_attempt(traced, blocks, cluster, policy, optimizer, mesh, recompute, micro, c, budget, solver_cfg, cache):
    # one context per mesh (shared by every attempt and plan): its reshard-price memo
    stages = cache.get(PIPELINE_STAGES, 1)
    ctx = cost_context(mesh, cluster, policy, optimizer, traced,
                       estimated_state_numel(traced, mesh) / stages if stages > 1 else None)
    allowed = make_filter(traced, c, mesh, micro)  # (every choice's state over the budget: no problem built)
    check_state_fits(traced, blocks, ctx, lambda n: node_strategies(n, ctx, allowed, cache)[1], budget)
    problem = build_problem(traced, blocks, ctx, recompute=recompute, microbatches=micro, strategy_filter=allowed,
                            strategy_cache=cache)
    # the unconstrained optimum first: when it fits, no memory-saving option can beat it
    sol = solve(problem, None, solver_cfg)
    numel = plan_state_numel(problem, sol.choice) / stages
    if update_costs_moved(ctx, numel):  # priced per element for another count: once more, at the plan's
        ctx = cost_context(mesh, cluster, policy, optimizer, traced, numel)
        problem = build_problem(traced, blocks, ctx, recompute=recompute, microbatches=micro,
                                strategy_filter=make_filter(traced, c, mesh, micro), strategy_cache=cache)
        sol = solve(problem, None, solver_cfg)
    ev = evaluate(problem, sol.choice)
    unconstrained = True
    # the ILP charges a linear memory model; the step simulation (evaluate) is what the plan
    # promises: tighten the ILP's budget by what its model missed until the simulated peak fits
    gap = 0.0
    leanest = ev.peak_bytes  # the least simulated peak seen: what a "does not fit" reports
    for _ in range(_MEMORY_ROUNDS):
        if budget is None or ev.peak_bytes <= budget:
            break
        unconstrained = False
        gap = max(gap, ev.peak_bytes - ev.ilp_memory_bytes)
        if gap >= budget:
            raise InfeasibleProblem(
                "memory", f"beyond what every plan keeps, the step's working set ({gap / 2**30:.2f} GiB: activations, "
                f"gradients in flight, gathered parameters) alone exceeds the {budget / 2**30:.2f} GiB budget",
                peak_bytes=leanest)
        try:
            sol = solve(problem, budget - gap, solver_cfg)
        except InfeasibleProblem as exc:
            exc.peak_bytes = leanest
            raise
        ev = evaluate(problem, sol.choice)
        leanest = min(leanest, ev.peak_bytes)
    if budget is not None and ev.peak_bytes > budget:
        raise InfeasibleProblem("memory", f"peak {ev.peak_bytes / 2**30:.2f} GiB incl. transients exceeds the "
                                          f"{budget / 2**30:.2f} GiB budget", peak_bytes=leanest)
    if recompute and c.recompute is None:
        ev = _fewest_recomputed(problem, sol.choice, ev, budget)
    sol.memory_slack_bytes = float("inf") if unconstrained else sol.memory_slack_bytes
    return _Attempt(mesh, recompute, micro, problem, sol, ev)


def _prove_best(att: _Attempt, c: Constraints, budget: float | None, solver: SolverConfig, outcomes) -> _Attempt:
    """Run the proof MIP the solve skipped (``ilp.solve``) for the chosen plan only, when its
    predicted effort is within ``SolverConfig.prove_best_limit``: the plan becomes OPTIMAL, or a
    better one replaces it (if the step simulation agrees it fits)."""
    sol = att.solution
    if sol.prove is None or not (sol.proof_effort <= solver.prove_best_limit):
        return att
    proven = sol.prove()
    proven.memory_slack_bytes = sol.memory_slack_bytes
    ev = att.evaluation
    if proven.choice != sol.choice:
        ev = evaluate(att.problem, proven.choice)
        if budget is not None and ev.peak_bytes > budget:
            return att  # the linear memory model missed: keep the plan that fits
        if att.recompute and c.recompute is None:
            ev = _fewest_recomputed(att.problem, proven.choice, ev, budget)
    label = f"{describe(att.mesh)} recompute={att.recompute} microbatches={att.microbatches}"
    for i, (lab, _) in enumerate(outcomes):
        if lab == label:
            outcomes[i] = (lab, f"{ev.step_time_s * 1e3:.3f} ms/step, peak {ev.peak_bytes / 2**30:.2f} GiB"
                           + _solver_note(proven, solver))
    return _Attempt(att.mesh, att.recompute, att.microbatches, att.problem, proven, ev)


def _fewest_recomputed(problem: Problem, choice: dict[str, int], ev: Evaluation, budget: float | None) -> Evaluation:
    """Checkpoint only as many block instances as the memory budget needs (the first ones of each
    block: their activations live longest), keeping the strategies; each instance not recomputed
    saves its forward pass in backward. ``Constraints(recompute=True)`` keeps all of them."""
    instances = problem.block_instances()
    if budget is None or not instances:
        return ev

    def first(share: float) -> frozenset[str]:
        chosen = set()
        for prefixes in problem.blocks.blocks.values():
            chosen.update(prefixes[: math.ceil(share * len(prefixes) - 1e-9)])
        return frozenset(chosen)

    steps = max(len(ps) for ps in problem.blocks.blocks.values())
    # The fewest instances k (per block, out of ``steps``) whose peak fits. The peak falls about
    # linearly in k (each instance recomputed frees its activations), so the next k is the
    # interpolated crossing inside the bracket (regula falsi; bisection when that stalls): 2-4
    # simulations of the step instead of log2(steps) + 1. Invariant: k=lo does not fit, k=hi does.
    evals = {steps: ev}

    def at(k: int) -> Evaluation:
        if k not in evals:
            evals[k] = evaluate(problem, choice, first(k / steps))
        return evals[k]

    if at(0).peak_bytes <= budget:
        return at(0)
    lo, hi = 0, steps
    bisect = False
    while hi - lo > 1:
        width = hi - lo
        p_lo, p_hi = at(lo).peak_bytes, at(hi).peak_bytes
        if bisect or p_lo <= p_hi:
            mid = (lo + hi) // 2
        else:
            mid = min(max(lo + math.ceil(width * (p_lo - budget) / (p_lo - p_hi)), lo + 1), hi - 1)
        if at(mid).peak_bytes <= budget:
            hi = mid
            if mid - 1 > lo and at(mid - 1).peak_bytes > budget:  # landed just past the crossing
                lo = mid - 1
        else:
            lo = mid
            if mid + 1 < hi and at(mid + 1).peak_bytes <= budget:  # landed just before it
                hi = mid + 1
        bisect = 2 * (hi - lo) > width  # the interpolation did not halve the bracket: bisect next
    return at(hi)


def _mirror_of(mesh: tuple[int, int], cluster: Cluster, c: Constraints, seen: dict) -> tuple[int, int] | None:
    """An already-searched mesh whose problem equals this one's up to swapping the axis names.

    Only when nothing in ``c`` refers to an axis (dp=, tp=, zero=, pins): then strategies, filters
    and prices depend on each axis only through its size and its communication group's shape
    (e.g. (8, 1) and (1, 8) on one 8-GPU node). Records ``mesh`` when it is new."""
    if c.dp is not None or c.tp is not None or c.ep is not None or c.zero is not None or c.zero_params or c.placements \
            or c.outputs:
        return None
    groups = tuple(axis_group(mesh, a, cluster.devices_per_node) for a in range(len(mesh)))
    key = tuple(sorted(((g.size, g.ranks_per_node) for g in groups)))
    nested = "hsdp" if shard_axis(mesh) is not None else "ep" if "ep" in axis_names(mesh) else None
    if nested:  # an HSDP or expert mesh's data axes (the batch nested on them) are told apart from the others
        key = (nested,) + tuple(sorted((g.size, g.ranks_per_node, name in DATA_AXIS_NAMES)
                                       for g, name in zip(groups, axis_names(mesh))))
    if key in seen:
        return seen[key]
    seen[key] = mesh
    return None


# The share of a model's forward FLOPs in attention from which the free search also tries context
# parallelism when other meshes fit (long sequences: Llama-3-8B's shape reaches it near 20k
# tokens). Below it the attention a context axis would split costs too little to pay for the
# keys' and values' all-gathers and the causal imbalance, and skipping saves the meshes' ILPs.
CONTEXT_ATTENTION_SHARE = 0.25


def _attention_share(traced: TracedGraph) -> float:
    """The share of the forward FLOPs in ``scaled_dot_product_attention`` (context parallelism
    splits it); 0 for a model without it."""
    total = attention = 0.0
    for n in traced.graph.nodes:
        flops, kind = node_flops(n)
        total += flops
        if kind == "attention" and op_name(n) == "scaled_dot_product_attention":
            attention += flops
    return attention / total if total else 0.0


def _candidates(c: Constraints, has_blocks: bool):
    recomputes = [c.recompute] if c.recompute is not None else ([False, True] if has_blocks else [False])
    micros = [c.microbatches] if c.microbatches is not None else [1]
    return [(r, m) for r in recomputes for m in micros]


def _tp_of(mesh) -> int:
    """The tensor-parallel degree of a flat (dp, tp) or HSDP ('dp', 'dp_shard'[, 'tp']) mesh."""
    names = axis_names(mesh)
    return tuple(mesh)[names.index("tp")] if "tp" in names else 1


def _twin_cannot_fit(twin, done: dict) -> str | None:
    """Why the free search's HSDP ``twin`` need not be solved, or None: its flat mesh (the same
    tensor parallelism, every data rank on one axis) found no plan within memory for any recompute
    and microbatch option. HSDP holds at least what ZeRO-3 over all those data ranks holds per rank
    (its state is split over the group only; the batch and the tensor-parallel split are the same),
    and the flat mesh's search may choose ZeRO-3, so nothing fits the twin either."""
    sizes = tuple(twin)
    flat = (sizes[0] * sizes[1], _tp_of(twin))
    if flat not in done:
        return None
    attempts, _, failures = done[flat]
    if attempts or not failures or any(f.family != "memory" for f in failures):
        return None
    return (f"skipped: nothing fits within memory on {describe(flat)}, whose search may shard every parameter over "
            "all its data ranks (ZeRO-3); HSDP keeps more per rank (its state is split within a group only)")


def search_plan(
    traced: TracedGraph,
    cluster: Cluster,
    *,
    constraints: Constraints,
    precision: str | PrecisionPolicy = "fp32",
    optimizer: str | OptimizerSpec = "adamw",
    solver: SolverConfig = SolverConfig(),
    progress=None,
    _with_baseline: bool = True,
    _with_free: bool = True,
    _cache: dict | None = None,
    _step_time_only: bool = False,
    _with_pipelines: bool = True,
) -> Plan | float:
    """The best plan under ``constraints``: with ``pp`` given, a pipeline plan
    (``pipeline_search``); otherwise the best single-stage plan and, on a multi-node cluster,
    the pipeline plans ``free_pipelines.free_pipeline_candidates`` proposes, whichever is
    predicted fastest (``_with_pipelines=False``: single-stage only)."""
    from autopar.planner import free_pipelines, pipeline_search

    _refuse_microbatched_batch_norm(traced, constraints)
    if (constraints.pp or 1) > 1:
        mesh_candidates(cluster, constraints)  # the degrees are checked before any search
        return pipeline_search.search_pipeline_plan(traced, cluster, constraints=constraints, precision=precision,
                                                    optimizer=optimizer, solver=solver, progress=progress,
                                                    inner_search=search_plan)
    kwargs = dict(constraints=constraints, precision=precision, optimizer=optimizer, solver=solver, progress=progress,
                  _with_baseline=_with_baseline, _with_free=_with_free, _cache=_cache, _step_time_only=_step_time_only)
    candidates = (free_pipelines.free_pipeline_candidates(traced, cluster, constraints)
                  if _with_pipelines and not _step_time_only else [])
    if not candidates:
        return _search_single_stage(traced, cluster, **kwargs)
    try:
        single, failure = _search_single_stage(traced, cluster, **kwargs), None
    except NoFeasiblePlanError as exc:
        single, failure = None, exc
    return free_pipelines.best_of(single, failure, candidates, traced, cluster, precision=precision,
                                   optimizer=optimizer, solver=solver, progress=progress, inner_search=search_plan)


def _refuse_microbatched_batch_norm(traced: TracedGraph, c: Constraints) -> None:
    """Microbatches (gradient accumulation, pipelines) change what a batch norm in training
    computes: a microbatch's statistics, not the batch's. Refused rather than trained apart from
    the model as written."""
    from autopar.ir import training_batch_norms

    asked = [f"{k}={v}" for k, v in (("microbatches", c.microbatches), ("pp", c.pp)) if (v or 1) > 1]
    if not asked:
        return
    norms = training_batch_norms(traced.graph)
    if norms:
        raise ConstraintError(
            f"{' and '.join(asked)} splits each batch into microbatches, but the batch norm of module {norms[0]!r}"
            f"{f' (and {len(norms) - 1} more)' if len(norms) > 1 else ''} normalises over the whole batch in training: "
            "over a microbatch it would compute other statistics and train a different model. Use microbatches=1 and "
            "pp=1 (data, tensor and ZeRO parallelism keep the batch's statistics), or replace BatchNorm with GroupNorm "
            "or LayerNorm")


def _search_single_stage(
    traced: TracedGraph,
    cluster: Cluster,
    *,
    constraints: Constraints,
    precision: str | PrecisionPolicy = "fp32",
    optimizer: str | OptimizerSpec = "adamw",
    solver: SolverConfig = SolverConfig(),
    progress=None,
    _with_baseline: bool = True,
    _with_free: bool = True,
    _cache: dict | None = None,
    _step_time_only: bool = False,
) -> Plan | float:
    t_start = time.perf_counter()
    policy = precision_policy(precision)
    precision = policy.name
    optimizer = optimizer_spec(optimizer)
    c = constraints
    # (HSDP twins and free expert meshes only for a whole single-stage plan, not for a pipeline stage's submesh)
    whole = PIPELINE_STAGES not in (_cache or {})
    meshes = check_experts(traced.graph, c, mesh_candidates(cluster, c, hsdp=whole), cluster.devices_per_node if whole else None)
    check_heads(traced, c)
    for mesh in meshes:
        validate_pins(traced, c, mesh)
    blocks = find_repeated_blocks(traced.graph, pin_key(c))
    budget = cluster.device.memory_bytes * USABLE_MEMORY_FRACTION
    # strategies per (node, mesh) and one CostContext per mesh (with its memo of priced reshards),
    # shared with the baseline and the comparison search without constraints
    cache: dict = _cache if _cache is not None else {}
    attempts: list[_Attempt] = []
    outcomes: list[tuple[str, str]] = []
    failures: list[InfeasibleProblem] = []
    micro_options = _candidates(c, bool(blocks.blocks))
    seen_problems: dict[tuple, tuple[int, int]] = {}
    searched: list[tuple[int, int]] = []
    skipped: dict[tuple[int, int], tuple[str, str]] = {}
    for mesh in meshes:
        mirror = _mirror_of(mesh, cluster, c, seen_problems)
        if mirror is None:
            searched.append(mesh)
        else:
            skipped[mesh] = (describe(mesh), f"skipped: the same problem as {describe(mirror)} "
                             "with the axes swapped (no constraint tells the axes apart and their groups have the same shape)")

    # The meshes' searches are independent: on worker threads (the solvers release the GIL, so
    # one mesh's LP runs beside another's problem building), with the comparison plan without
    # constraints and the baseline beside them; the largest problems first.
    tasks: dict = {}
    results = memo(_RESULTS, _inputs_key(traced, cluster, precision, optimizer, solver), dict)
    free_like = dataclasses.replace(c, pp=None).is_free()  # pp=1 is what a single-stage search does anyway
    if _with_free and not free_like and not _step_time_only and "free" not in results:
        tasks["free"] = lambda: _free_step_time(traced, cluster, precision, optimizer, solver, cache)
    def search(mesh):
        return lambda: _search_mesh(traced, blocks, cluster, policy, optimizer, mesh, micro_options, c, budget, solver,
                                    cache, progress)

    # the free search's HSDP twins and expert meshes (planner.experts.free_expert_meshes) run after
    # their flat meshes: an HSDP twin whose flat mesh fits nothing is skipped (_twin_cannot_fit)
    twins = [m for m in searched if (c.hsdp is None and shard_axis(m) is not None) or (c.ep is None and "ep" in axis_names(m))]
    for mesh in sorted((m for m in searched if m not in twins), key=lambda m: -min(m)):  # both axes split first
        tasks[mesh] = search(mesh)
    if _with_baseline and not _step_time_only:
        tasks["baseline"] = lambda: naive_dp_baseline(traced, cluster, policy, optimizer, solver, blocks=blocks, cache=cache)
    done = run_concurrently(tasks, solver.planner_threads)
    flat_best = min((a for m in done if isinstance(m, tuple) and m in searched for a in done[m][0]),
                    key=lambda a: a.evaluation.step_time_s, default=None)
    # the expert mesh tried: the one beside the fastest flat mesh of its tensor-parallel degree
    flat_times: dict[int, float] = {}
    for a in (a for m in done if isinstance(m, tuple) and m in searched for a in done[m][0]):
        flat_times[_tp_of(a.mesh)] = min(flat_times.get(_tp_of(a.mesh), float("inf")), a.evaluation.step_time_s)
    expert_best = min((t for t in twins if shard_axis(t) is None),
                      key=lambda t: flat_times.get(_tp_of(t), float("inf")), default=None)
    for twin in twins:
        reason = _twin_cannot_fit(twin, done) if shard_axis(twin) is not None else None
        if reason is None and shard_axis(twin) is None and twin != expert_best:
            reason = (f"skipped: only the expert mesh beside the fastest flat mesh that has one ({describe(expert_best)}) "
                      "is tried (plan time: one expert mesh per search)")
        elif reason is None and shard_axis(twin) is not None and flat_best is not None and _tp_of(twin) != _tp_of(flat_best.mesh):
            # one twin per search, the best flat plan's: each twin's ILP costs as much as a flat mesh's
            reason = (f"skipped: only the HSDP twin of the fastest mesh ({describe(flat_best.mesh)}) is tried "
                      "(plan time: one twin per search)")
        if reason:
            skipped[twin] = (describe(twin), reason)
    done.update(run_concurrently({m: search(m) for m in twins if m not in skipped}, solver.planner_threads))
    # context parallelism ('dp', 'cp', 'tp') for a model with attention where memory demands it
    # (nothing else fits) or speed may (long sequences: attention's share of the work)
    share = _attention_share(traced) if c.cp is None and PIPELINE_STAGES not in (_cache or {}) else 0.0
    if share and (share >= CONTEXT_ATTENTION_SHARE or not any(done[m][0] for m in searched if m not in skipped)):
        context = [m for m in context_mesh_candidates(cluster, c) if m not in done]
        done.update(run_concurrently({m: search(m) for m in context}, solver.planner_threads))
        meshes = list(meshes) + context
    for mesh in meshes:
        if mesh in skipped:
            outcomes.append(skipped[mesh])
            continue
        mesh_attempts, mesh_outcomes, mesh_failures = done[mesh]
        attempts += mesh_attempts
        outcomes += mesh_outcomes
        failures += mesh_failures
    batch = traced.global_batch
    from autopar.ir import training_batch_norms

    norms = training_batch_norms(traced.graph) if not attempts and c.microbatches is None and batch else []
    if norms:  # (a microbatch's statistics would train another model: _refuse_microbatched_batch_norm)
        outcomes.append(("gradient accumulation", f"not tried: the batch norm of module {norms[0]!r} normalises over the "
                                                  "whole batch in training"))
    elif not attempts and c.microbatches is None and batch:
        # gradient accumulation: smaller microbatches hold fewer activations (fewest steps first)
        recompute = bool(blocks.blocks) if c.recompute is None else c.recompute
        for mesh in meshes:
            for micro in microbatch_counts(batch, data_degree(mesh)):
                label = f"{describe(mesh)} recompute={recompute} microbatches={micro}"
                if progress:
                    progress(label)
                try:
                    attempts.append(_solve_attempt(traced, blocks, cluster, policy, optimizer, mesh, recompute,
                                                   micro, c, budget, solver, cache))
                    outcomes.append((label, f"{attempts[-1].evaluation.step_time_s * 1e3:.3f} ms/step"
                                            + _solver_note(attempts[-1].solution, solver)))
                    break
                except InfeasibleProblem as exc:
                    outcomes.append((label, f"infeasible ({exc.family}): {exc.detail}"))
    if attempts and c.microbatches is None and c.recompute is None and batch and not training_batch_norms(traced.graph):
        _accumulate_instead(attempts, outcomes, traced, blocks, cluster, policy, optimizer, c, budget, solver, cache,
                            progress)
    if not attempts:
        from autopar.planner.diagnose import raise_no_plan

        raise_no_plan(traced, blocks, cluster, policy, optimizer, meshes, c, budget, solver, cache, failures)
    best = min(attempts, key=lambda a: (round(a.evaluation.step_time_s, 12), a.mesh[1], a.recompute, a.microbatches))
    _refuse_moved_writes(best, c)
    best = _prove_best(best, c, budget, solver, outcomes)
    if _step_time_only:
        return best.evaluation.step_time_s
    cache["chosen"] = best  # the pipeline search re-prices its problem with recompute per stage
    strategy_s = time.perf_counter() - t_start

    if _with_baseline:
        baseline = done["baseline"]
    else:
        baseline = Baseline("naive data parallel", None, False, "not computed")
    if free_like:
        results["free"] = best.evaluation.step_time_s
    free_time = None
    if _with_free and not free_like:
        if "free" in done:
            results["free"] = done["free"]
        free_time = results["free"]
    # a pipeline stage's submesh plan (PIPELINE_STAGES > 1): the pipeline plan counts the bytes per rank itself
    plan = extract_plan(traced, blocks, cluster, best, c, precision, optimizer, baseline, free_time, outcomes,
                        comm_bytes=cache.get(PIPELINE_STAGES, 1) == 1)
    plan.timings.update({"search_s": time.perf_counter() - t_start, "first_search_s": strategy_s,
                         "build_s": best.solution.build_s, "solve_s": best.solution.solve_s})
    return plan


def _accumulate_instead(attempts, outcomes, traced, blocks, cluster, policy, optimizer, c, budget, solver, cache,
                        progress) -> None:
    """Gradient accumulation instead of recompute: where the fastest attempt recomputes to fit,
    its mesh without recompute at the fewest microbatches that fit (each holds fewer activations;
    the forward runs once) joins the attempts. Every count dividing the batch evenly over the data
    ranks is tried in turn, fewest first, until one fits."""
    lead = min(attempts, key=lambda a: (round(a.evaluation.step_time_s, 12), a.mesh[1], a.recompute, a.microbatches))
    if not (lead.recompute and lead.evaluation.recompute) or lead.microbatches != 1 \
            or traced.global_batch % data_degree(lead.mesh):
        return
    per_replica = traced.global_batch // data_degree(lead.mesh)
    for micro in (m for m in range(2, per_replica + 1) if per_replica % m == 0):
        label = f"{describe(lead.mesh)} recompute=False microbatches={micro}"
        if progress:
            progress(label)
        try:
            att = _solve_attempt(traced, blocks, cluster, policy, optimizer, lead.mesh, False, micro, c, budget, solver,
                                 cache)
        except InfeasibleProblem as exc:
            outcomes.append((label, f"infeasible ({exc.family}): {exc.detail}"))
            continue
        attempts.append(att)
        outcomes.append((label, f"{att.evaluation.step_time_s * 1e3:.3f} ms/step, peak {att.evaluation.peak_bytes / 2**30:.2f} GiB"
                                + _solver_note(att.solution, solver)))
        return


def _search_mesh(traced, blocks, cluster, policy, optimizer, mesh, micro_options, c, budget, solver, cache, progress):
    """Every (recompute, microbatches) attempt on one mesh: (attempts, outcomes, failures)."""
    attempts: list[_Attempt] = []
    outcomes: list[tuple[str, str]] = []
    failures: list[InfeasibleProblem] = []
    fits_without_recompute = False
    for recompute, micro in micro_options:
        label = f"{describe(mesh)} recompute={recompute} microbatches={micro}"
        if recompute and fits_without_recompute and c.recompute is None:
            # recompute only adds compute: it can win only where memory binds, and it did not
            outcomes.append((label, "skipped: the plan without recompute is not memory bound"))
            continue
        if progress:
            progress(label)
        try:
            att = _solve_attempt(traced, blocks, cluster, policy, optimizer, mesh, recompute, micro, c, budget, solver, cache)
        except InfeasibleProblem as exc:
            failures.append(exc)
            outcomes.append((label, f"infeasible ({exc.family}): {exc.detail}"))
            continue
        attempts.append(att)
        if not recompute and att.solution.memory_slack_bytes == float("inf"):
            fits_without_recompute = True
        outcomes.append((label, f"{att.evaluation.step_time_s * 1e3:.3f} ms/step, peak {att.evaluation.peak_bytes / 2**30:.2f} GiB"
                                + _solver_note(att.solution, solver)))
    return attempts, outcomes, failures


def _free_step_time(traced, cluster, precision, optimizer, solver, cache) -> float | None:
    """The predicted step time of the plan without constraints (None: none fits)."""
    try:
        return _search_single_stage(traced, cluster, constraints=Constraints(), precision=precision, optimizer=optimizer,
                                    solver=solver, _with_baseline=False, _with_free=False, _cache=cache,
                                    _step_time_only=True)
    except NoFeasiblePlanError:
        return None


def _refuse_moved_writes(att: _Attempt, c: Constraints) -> None:
    """The best plan still moves a tensor an op writes in place (priced ``REFUSED_RESHARD_S``):
    every plan allowed does, so none computes what the model computes."""
    if att.evaluation.blocking_s < REFUSED_RESHARD_S:
        return
    choice = att.solution.choice
    for e in att.problem.edges:
        if e.v is None:
            continue
        ku, kv = int(e.u_key[choice[e.u]]), int(e.v_key[choice[e.v]])
        if e.blocking[ku, kv] >= REFUSED_RESHARD_S:
            v = att.problem.nodes[e.v].node
            module = v.meta.get("autopar.module") or "<root>"
            raise NoFeasiblePlanError(
                f"every plan under {c} moves '{e.u}' to another layout before {v.target} (node '{v.name}' in module "
                f"'{module}'), which writes it in place or returns a view of it that is written later: the write "
                "would land in a copy. Relax the constraints, or write that op out of place in the model")


def _solver_note(sol: Solution, config: SolverConfig) -> str:
    """What an outcome says about its solve: nothing when proven optimal."""
    if sol.time_limit_hit:
        return (f"; the ILP solver stopped at its {config.time_limit_s:g} s time limit with a plan {sol.gap * 100:.2f}% "
                f"above its lower bound (status {sol.status}): another run may find a different plan")
    if sol.status != "OPTIMAL":
        return f"; not proven optimal: at most {sol.gap * 100:.2f}% above the LP bound"
    return ""


def naive_dp_baseline(traced: TracedGraph, cluster: Cluster, precision, optimizer, solver: SolverConfig, *,
                      blocks=None, cache: dict | None = None) -> Baseline:
    """The naive data-parallel baseline on ``cluster``, memoised per planning inputs (a plan
    searched again, or one searched on a part of the cluster, pipeline stages, reuses it).
    ``blocks`` / ``cache``: the caller's repeated blocks and strategy cache, where it has them."""
    policy = precision_policy(precision)
    optimizer = optimizer_spec(optimizer)
    results = memo(_RESULTS, _inputs_key(traced, cluster, policy.name, optimizer, solver), dict)
    if "baseline" not in results:
        if blocks is None:
            blocks = find_repeated_blocks(traced.graph, pin_key(Constraints()))
        budget = cluster.device.memory_bytes * USABLE_MEMORY_FRACTION
        results["baseline"] = _naive_dp_baseline(traced, blocks, cluster, policy, optimizer, budget, solver,
                                                 cache if cache is not None else {})
    return results["baseline"]


def _naive_dp_baseline(traced, blocks, cluster, policy, optimizer, budget, solver, cache) -> Baseline:
    world = cluster.world_size
    c = Constraints(dp=world, tp=1, zero=0, recompute=False, microbatches=1)
    batch = traced.global_batch
    if batch is not None and batch % world:
        return Baseline("naive data parallel", None, False,
                        f"not expressible: the global batch {batch} does not divide over {world} devices")
    try:
        att = _solve_attempt(traced, blocks, cluster, policy, optimizer, (world, 1), False, 1, c, None, solver, cache)
    except InfeasibleProblem as exc:
        return Baseline("naive data parallel", None, False, f"not expressible: {exc.detail}")
    pred = predicted_of(att)
    fits = bool(att.evaluation.peak_bytes <= budget)
    from autopar.report import format_bytes

    note = "fits" if fits else (
        f"does not fit: needs {format_bytes(att.evaluation.peak_bytes)} per device, has {format_bytes(budget)} usable"
    )
    return Baseline("naive data parallel", pred, fits, note)
