"""The outer search: mesh shapes x recompute x microbatches, an ILP for each, the best wins.

Mesh axes are ``("dp", "tp")`` with ranks laid out row-major, so ``tp`` (the last axis) is made of
consecutive ranks: inside one node whenever ``tp`` divides the devices per node. Candidate ``tp``
sizes are the divisors of the devices per node (tensor parallel inside a node first); a ``tp``
spanning nodes is tried only when the user asks for it.

Every attempt is an ``attempts.Attempt`` (its choice and the step simulation's evaluation of
it), made under one ``attempts.SearchContext``; the fastest attempt becomes the one ``Plan``
built (``extract.extract_plan``). ``search_plan`` is the entry; ``stage_plan`` is the
single-stage search of a pipeline stage's submesh (the plan and the attempt behind it, which the
pipeline search prices again per stage).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from autopar.cluster import Cluster
from autopar.constraints import Constraints
from autopar.cost_models.memory import OptimizerSpec, PrecisionPolicy, optimizer_spec, precision_policy
from autopar.errors import ConstraintError, NoFeasiblePlanError
from autopar.plan import Baseline, Plan
from autopar.planner.attempts import (RESULTS, Attempt, SearchContext, inputs_key, naive_dp_baseline, prove_best,
                                      solve_attempt, solver_note)
from autopar.planner.blocks import find_repeated_blocks
from autopar.planner.constraint_filter import AXES, check_heads, pin_key, validate_pins
from autopar.planner.experts import check_experts
from autopar.planner.candidates import (PIPELINE_STAGES, USABLE_MEMORY_FRACTION, context_mesh_candidates, mesh_candidates,
                                       microbatch_counts)
from autopar.layouts import DATA_AXIS_NAMES
from autopar.planner.meshes import axis_names, data_degree, describe, shard_axis
from autopar.cost_models.communication import axis_group
from autopar.planner.contexts import memo
from autopar.planner.extract import extract_plan
from autopar.planner.ilp import InfeasibleProblem, SolverConfig
from autopar.planner.problem import REFUSED_RESHARD_S
from autopar.planner.threads import run_concurrently
from autopar.trace import TracedGraph
from autopar.node_view import node_flops, op_name

__all__ = ["search_plan", "stage_plan", "mesh_candidates", "naive_dp_baseline", "USABLE_MEMORY_FRACTION", "AXES"]


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
) -> Plan:
    """The best plan under ``constraints``: with ``pp`` given, a pipeline plan
    (``pipeline_search``); otherwise the best single-stage plan and, on a multi-node cluster,
    the pipeline plans ``free_pipelines.free_pipeline_candidates`` proposes, whichever is
    predicted fastest. ``_with_baseline`` / ``_with_free``: also price the naive data-parallel
    baseline / the plan without constraints (for comparison)."""
    from autopar.planner import free_pipelines, pipeline_search

    _refuse_microbatched_batch_norm(traced, constraints)
    if (constraints.pp or 1) > 1:
        mesh_candidates(cluster, constraints)  # the degrees are checked before any search
        return pipeline_search.search_pipeline_plan(traced, cluster, constraints=constraints, precision=precision,
                                                    optimizer=optimizer, solver=solver, progress=progress,
                                                    inner_search=stage_plan)
    sc = _search_context(traced, cluster, constraints, precision, optimizer, solver, progress, {})
    candidates = free_pipelines.free_pipeline_candidates(traced, cluster, constraints)
    if not candidates:
        return _single_stage_plan(sc, _with_baseline, _with_free)
    try:
        single, failure = _single_stage_plan(sc, _with_baseline, _with_free), None
    except NoFeasiblePlanError as exc:
        single, failure = None, exc
    return free_pipelines.best_of(single, failure, candidates, traced, cluster, precision=precision,
                                   optimizer=optimizer, solver=solver, progress=progress, inner_search=stage_plan)


def stage_plan(traced: TracedGraph, cluster: Cluster, *, constraints: Constraints, precision, optimizer,
               solver: SolverConfig, progress, cache: dict) -> tuple[Plan, Attempt]:
    """The single-stage plan of a pipeline stage's submesh ``cluster`` and the attempt behind it
    (without the baseline and the comparison plan). ``cache``: the strategy cache the submesh
    plans of one stage count share, its ``candidates.PIPELINE_STAGES`` entry the stage count."""
    _refuse_microbatched_batch_norm(traced, constraints)
    sc = _search_context(traced, cluster, constraints, precision, optimizer, solver, progress, cache)
    found = _search_single_stage(sc, with_baseline=False, with_free=False, step_time_only=False)
    return _plan_of(sc, found, with_baseline=False, with_free=False), found.best


def _search_context(traced, cluster, c: Constraints, precision, optimizer, solver, progress, cache) -> SearchContext:
    """The search's context; the constraints' pins and heads checked."""
    blocks = find_repeated_blocks(traced.graph, pin_key(c))
    return SearchContext(traced, blocks, cluster, precision_policy(precision), optimizer_spec(optimizer), c,
                         cluster.device.memory_bytes * USABLE_MEMORY_FRACTION, solver, cache, progress)


@dataclass
class _Found:
    """A single-stage search's outcome: the fastest attempt, every attempt's outcome line, the
    results of the tasks run beside the meshes (baseline, free plan) and when it started."""
    best: Attempt
    outcomes: list
    done: dict
    started: float
    results: dict


def _single_stage_plan(sc: SearchContext, with_baseline: bool, with_free: bool) -> Plan:
    return _plan_of(sc, _search_single_stage(sc, with_baseline, with_free, step_time_only=False), with_baseline,
                    with_free)


def _plan_of(sc: SearchContext, found: _Found, with_baseline: bool, with_free: bool) -> Plan:
    """The Plan of the search's fastest attempt, built once, with its baseline and the step time
    of the plan without constraints (for comparison)."""
    strategy_s = time.perf_counter() - found.started
    best, done, results, c = found.best, found.done, found.results, sc.constraints
    baseline = done["baseline"] if with_baseline else Baseline("naive data parallel", None, False, "not computed")
    free_like = dataclasses.replace(c, pp=None).is_free()
    if free_like:
        results["free"] = best.evaluation.step_time_s
    free_time = None
    if with_free and not free_like:
        if "free" in done:
            results["free"] = done["free"]
        free_time = results["free"]
    # a pipeline stage's submesh plan (PIPELINE_STAGES > 1): the pipeline plan counts the bytes per rank itself
    plan = extract_plan(sc.traced, sc.blocks, sc.cluster, best, c, sc.policy.name, sc.optimizer, baseline, free_time,
                        found.outcomes, comm_bytes=sc.stages == 1)
    plan.timings.update({"search_s": time.perf_counter() - found.started, "first_search_s": strategy_s,
                         "build_s": best.solution.build_s, "solve_s": best.solution.solve_s})
    return plan


def _free_step_time(sc: SearchContext) -> float | None:
    """The predicted step time of the plan without constraints (None: none fits)."""
    free = dataclasses.replace(sc, constraints=Constraints(), blocks=find_repeated_blocks(sc.traced.graph,
                                                                                           pin_key(Constraints())),
                               progress=None)
    try:
        return _search_single_stage(free, with_baseline=False, with_free=False, step_time_only=True).best.evaluation.step_time_s
    except NoFeasiblePlanError:
        return None


def _search_single_stage(sc: SearchContext, with_baseline: bool, with_free: bool, step_time_only: bool) -> _Found:
    """Every mesh's attempts (``_search_meshes``), gradient accumulation where nothing fits or
    where it may beat recompute; the fastest attempt, proven optimal where that is cheap."""
    started = time.perf_counter()
    c, traced = sc.constraints, sc.traced
    # (HSDP twins and free expert meshes only for a whole single-stage plan, not for a pipeline stage's submesh)
    whole = PIPELINE_STAGES not in sc.cache
    meshes = check_experts(traced.graph, c, mesh_candidates(sc.cluster, c, hsdp=whole),
                           sc.cluster.devices_per_node if whole else None)
    check_heads(traced, c)
    for mesh in meshes:
        validate_pins(traced, c, mesh)
    results = memo(RESULTS, inputs_key(traced, sc.cluster, sc.policy.name, sc.optimizer, sc.solver), dict)
    extra: dict = {}
    if with_free and not dataclasses.replace(c, pp=None).is_free() and not step_time_only and "free" not in results:
        extra["free"] = lambda: _free_step_time(sc)
    if with_baseline and not step_time_only:
        extra["baseline"] = lambda: naive_dp_baseline(traced, sc.cluster, sc.policy, sc.optimizer, sc.solver,
                                                      blocks=sc.blocks, cache=sc.cache)
    meshes, done, skipped = _search_meshes(sc, meshes, extra)
    attempts, outcomes, failures = [], [], []
    for mesh in meshes:
        if mesh in skipped:
            outcomes.append(skipped[mesh])
            continue
        mesh_attempts, mesh_outcomes, mesh_failures = done[mesh]
        attempts += mesh_attempts
        outcomes += mesh_outcomes
        failures += mesh_failures
    _accumulate(sc, meshes, attempts, outcomes)
    if not attempts:
        from autopar.planner.diagnose import raise_no_plan

        raise_no_plan(sc, meshes, failures)
    best = _fastest(attempts)
    _refuse_moved_writes(best, c)
    return _Found(prove_best(best, sc, outcomes), outcomes, done, started, results)


def _fastest(attempts: list[Attempt]) -> Attempt:
    """The fastest attempt; ties to the smaller mesh's last axis, no recompute, fewer microbatches."""
    return min(attempts, key=lambda a: (round(a.evaluation.step_time_s, 12), a.mesh[1], a.recompute, a.microbatches))


def _search_meshes(sc: SearchContext, meshes: list, extra: dict) -> tuple[list, dict, dict]:
    """Every mesh's (attempts, outcomes, failures), beside the ``extra`` tasks (their results under
    their keys): (the meshes, context meshes added; the results by mesh or key; the meshes skipped
    with their outcome line)."""
    c = sc.constraints
    micro_options = _candidates(c, bool(sc.blocks.blocks))
    seen_problems: dict[tuple, tuple[int, int]] = {}
    searched: list[tuple[int, int]] = []
    skipped: dict[tuple[int, int], tuple[str, str]] = {}
    for mesh in meshes:
        mirror = _mirror_of(mesh, sc.cluster, c, seen_problems)
        if mirror is None:
            searched.append(mesh)
        else:
            skipped[mesh] = (describe(mesh), f"skipped: the same problem as {describe(mirror)} "
                             "with the axes swapped (no constraint tells the axes apart and their groups have the same shape)")

    def search(mesh):
        return lambda: _search_mesh(sc, mesh, micro_options)

    # The meshes' searches are independent: on worker threads (the solvers release the GIL, so
    # one mesh's LP runs beside another's problem building), with the comparison plan without
    # constraints and the baseline beside them; the largest problems first. The free search's
    # HSDP twins and expert meshes (planner.experts.free_expert_meshes) run after their flat
    # meshes: an HSDP twin whose flat mesh fits nothing is skipped (_twin_cannot_fit)
    twins = [m for m in searched if (c.hsdp is None and shard_axis(m) is not None) or (c.ep is None and "ep" in axis_names(m))]
    tasks: dict = {k: extra[k] for k in ("free",) if k in extra}
    for mesh in sorted((m for m in searched if m not in twins), key=lambda m: -min(m)):  # both axes split first
        tasks[mesh] = search(mesh)
    tasks.update({k: extra[k] for k in ("baseline",) if k in extra})
    done = run_concurrently(tasks, sc.solver.planner_threads)
    skipped.update(_twins_skipped(twins, [a for m in done if isinstance(m, tuple) and m in searched for a in done[m][0]],
                                  done))
    done.update(run_concurrently({m: search(m) for m in twins if m not in skipped}, sc.solver.planner_threads))
    # context parallelism ('dp', 'cp', 'tp') for a model with attention where memory demands it
    # (nothing else fits) or speed may (long sequences: attention's share of the work)
    share = _attention_share(sc.traced) if c.cp is None and PIPELINE_STAGES not in sc.cache else 0.0
    if share and (share >= CONTEXT_ATTENTION_SHARE or not any(done[m][0] for m in searched if m not in skipped)):
        context = [m for m in context_mesh_candidates(sc.cluster, c) if m not in done]
        done.update(run_concurrently({m: search(m) for m in context}, sc.solver.planner_threads))
        meshes = list(meshes) + context
    return meshes, done, skipped


def _twins_skipped(twins: list, flat: list[Attempt], done: dict) -> dict:
    """The HSDP twins and expert meshes not searched, with their outcome lines: an HSDP twin whose
    flat mesh fits nothing, or not of the fastest flat attempt's tensor-parallel degree; an expert
    mesh not beside the fastest flat mesh of its tensor-parallel degree (``flat``: the flat
    meshes' attempts, in the order searched)."""
    flat_best = None  # the fastest flat attempt (the first of equals)
    flat_times: dict[int, float] = {}  # per tensor-parallel degree: its fastest flat attempt's step time
    for a in flat:
        t = a.evaluation.step_time_s
        if flat_best is None or t < flat_best.evaluation.step_time_s:
            flat_best = a
        flat_times[_tp_of(a.mesh)] = min(flat_times.get(_tp_of(a.mesh), float("inf")), t)
    expert_best = min((t for t in twins if shard_axis(t) is None),
                      key=lambda t: flat_times.get(_tp_of(t), float("inf")), default=None)
    skipped = {}
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
    return skipped


def _search_mesh(sc: SearchContext, mesh, micro_options) -> tuple[list, list, list]:
    """Every (recompute, microbatches) attempt on one mesh: (attempts, outcomes, failures)."""
    attempts: list[Attempt] = []
    outcomes: list[tuple[str, str]] = []
    failures: list[InfeasibleProblem] = []
    fits_without_recompute = False
    for recompute, micro in micro_options:
        label = f"{describe(mesh)} recompute={recompute} microbatches={micro}"
        if recompute and fits_without_recompute and sc.constraints.recompute is None:
            # recompute only adds compute: it can win only where memory binds, and it did not
            outcomes.append((label, "skipped: the plan without recompute is not memory bound"))
            continue
        att = _try(sc, mesh, recompute, micro, outcomes, failures)
        if att is None:
            continue
        attempts.append(att)
        if not recompute and att.solution.memory_slack_bytes == float("inf"):
            fits_without_recompute = True
    return attempts, outcomes, failures


def _try(sc: SearchContext, mesh, recompute: bool, micro: int, outcomes: list, failures: list | None = None,
         peak: bool = True) -> Attempt | None:
    """``solve_attempt`` with its outcome line appended (and its failure, where ``failures`` is
    given); None when infeasible. ``peak``: the line gives the simulated peak too."""
    label = f"{describe(mesh)} recompute={recompute} microbatches={micro}"
    if sc.progress:
        sc.progress(label)
    try:
        att = solve_attempt(sc, mesh, recompute, micro)
    except InfeasibleProblem as exc:
        if failures is not None:
            failures.append(exc)
        outcomes.append((label, f"infeasible ({exc.family}): {exc.detail}"))
        return None
    ev = att.evaluation
    outcomes.append((label, f"{ev.step_time_s * 1e3:.3f} ms/step" + (f", peak {ev.peak_bytes / 2**30:.2f} GiB" if peak else "")
                     + solver_note(att.solution, sc.solver)))
    return att


def _accumulate(sc: SearchContext, meshes: list, attempts: list, outcomes: list) -> None:
    """Gradient accumulation: where nothing fits, each mesh at the fewest microbatches that fit;
    where the fastest attempt recomputes to fit, its mesh without recompute (``_accumulate_instead``)."""
    from autopar.ir import training_batch_norms

    c, traced = sc.constraints, sc.traced
    batch = traced.global_batch
    norms = training_batch_norms(traced.graph) if not attempts and c.microbatches is None and batch else []
    if norms:  # (a microbatch's statistics would train another model: _refuse_microbatched_batch_norm)
        outcomes.append(("gradient accumulation", f"not tried: the batch norm of module {norms[0]!r} normalises over the "
                                                  "whole batch in training"))
    elif not attempts and c.microbatches is None and batch:
        # gradient accumulation: smaller microbatches hold fewer activations (fewest steps first)
        recompute = bool(sc.blocks.blocks) if c.recompute is None else c.recompute
        for mesh in meshes:
            for micro in microbatch_counts(batch, data_degree(mesh)):
                att = _try(sc, mesh, recompute, micro, outcomes, peak=False)
                if att is not None:
                    attempts.append(att)
                    break
    if attempts and c.microbatches is None and c.recompute is None and batch and not training_batch_norms(traced.graph):
        _accumulate_instead(sc, attempts, outcomes)


def _accumulate_instead(sc: SearchContext, attempts: list, outcomes: list) -> None:
    """Gradient accumulation instead of recompute: where the fastest attempt recomputes to fit,
    its mesh without recompute at the fewest microbatches that fit (each holds fewer activations;
    the forward runs once) joins the attempts. Every count dividing the batch evenly over the data
    ranks is tried in turn, fewest first, until one fits."""
    lead = _fastest(attempts)
    batch = sc.traced.global_batch
    if not (lead.recompute and lead.evaluation.recompute) or lead.microbatches != 1 or batch % data_degree(lead.mesh):
        return
    per_replica = batch // data_degree(lead.mesh)
    for micro in (m for m in range(2, per_replica + 1) if per_replica % m == 0):
        att = _try(sc, lead.mesh, False, micro, outcomes)
        if att is not None:
            attempts.append(att)
            return


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


def _refuse_moved_writes(att: Attempt, c: Constraints) -> None:
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


