"""One attempt of the search: a (mesh, recompute, microbatches) choice solved and evaluated.

``SearchContext`` holds what every attempt of one search shares (the graph, its repeated blocks,
the cluster, precision, optimizer, constraints, memory budget, solver settings, the strategy
cache and the progress callback); ``solve_attempt`` turns one choice into an ``Attempt``: the
choice, its problem and solution and the step simulation's ``Evaluation`` of it. Attempts are
compared by their evaluations; the ``Plan`` is built once, for the winner (``extract``).

Below both the single-stage search (``search``) and the pipeline search (``pipeline_search``),
which share the naive data-parallel baseline (``naive_dp_baseline``) and the results memo.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

from autopar.cluster import Cluster
from autopar.constraints import Constraints
from autopar.cost_models.memory import OptimizerSpec, PrecisionPolicy, optimizer_spec, precision_policy
from autopar.plan import Baseline, fingerprint_of
from autopar.planner.blocks import BlockInfo, find_repeated_blocks
from autopar.planner.bounded_memo import BoundedMemo
from autopar.planner.candidates import PIPELINE_STAGES, USABLE_MEMORY_FRACTION
from autopar.planner.constraint_filter import make_filter, pin_key
from autopar.planner.contexts import (MEMO_LOCK, MEMO_SIZE, cost_context, estimated_state_numel, memo, plan_state_numel,
                                      update_costs_moved)
from autopar.planner.evaluate import Evaluation, evaluate
from autopar.planner.extract import predicted_of
from autopar.planner.ilp import InfeasibleProblem, SolverConfig, Solution, solve
from autopar.planner.memory_model import check_state_fits
from autopar.planner.meshes import describe
from autopar.planner.problem import Problem, build_problem, node_strategies
from autopar.trace import TracedGraph

__all__ = ["SearchContext", "Attempt", "solve_attempt", "prove_best", "fewest_recomputed", "solver_note",
           "naive_dp_baseline", "RESULTS", "inputs_key", "MEMORY_ROUNDS"]

# per planning inputs (graph, cluster, precision, optimizer, solver), the results that do not
# depend on the constraints: the naive data-parallel baseline and the free plan's step time
RESULTS = BoundedMemo(MEMO_SIZE, MEMO_LOCK)
MEMORY_ROUNDS = 4  # ILP re-solves with a tightened budget when the simulated peak exceeds it


@dataclass(frozen=True)
class SearchContext:
    """What every attempt of one search shares. ``budget``: usable bytes per device (None: no
    limit, the baseline's); ``cache``: strategies per (node, mesh) and one CostContext per mesh,
    shared with the baseline and the comparison search without constraints; under
    ``candidates.PIPELINE_STAGES`` the stage count of a pipeline stage's submesh search."""
    traced: TracedGraph
    blocks: BlockInfo
    cluster: Cluster
    policy: PrecisionPolicy
    optimizer: OptimizerSpec
    constraints: Constraints
    budget: float | None
    solver: SolverConfig
    cache: dict = field(compare=False, repr=False)
    progress: Callable | None = field(default=None, compare=False, repr=False)

    @property
    def stages(self) -> int:
        """The pipeline stages a rank's parameters are split over (1: a whole single-stage plan)."""
        return self.cache.get(PIPELINE_STAGES, 1)


@dataclass(frozen=True)
class Attempt:
    """A choice (mesh, recompute, microbatches) with its problem, solution and evaluation."""
    mesh: tuple[int, ...]
    recompute: bool
    microbatches: int
    problem: Problem
    solution: Solution
    evaluation: Evaluation

    @property
    def label(self) -> str:
        return f"{describe(self.mesh)} recompute={self.recompute} microbatches={self.microbatches}"


def inputs_key(traced: TracedGraph, cluster: Cluster, precision: str, optimizer, solver) -> str:
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


def _first_solve(sc: SearchContext, mesh, recompute: bool, micro: int) -> tuple[Problem, Solution, Evaluation]:
    """The attempt's problem and its optimum without a memory limit, evaluated (the search
    starts there: when it fits, no memory-saving option can beat it).

    None of it reads the memory budget: memoised in ``sc.cache`` per (cost context, constraints,
    recompute, microbatches, solver settings), so a pipeline stage's submesh planned again with
    less memory (``pipeline_search``'s memory rounds) solves each attempt's first ILP once."""
    traced, c, cache = sc.traced, sc.constraints, sc.cache
    # one context per mesh (shared by every attempt and plan): its reshard-price memo
    stages = sc.stages
    ctx = cost_context(mesh, sc.cluster, sc.policy, sc.optimizer, traced,
                       estimated_state_numel(traced, mesh) / stages if stages > 1 else None)
    allowed = make_filter(traced, c, mesh, micro)  # (every choice's state over the budget: no problem built)
    check_state_fits(traced, sc.blocks, ctx, lambda n: node_strategies(n, ctx, allowed, cache)[1], sc.budget)
    # (the context is held by the entry's problem: its id is not reused while the entry lives)
    key = ("attempts.first_solve", id(ctx), id(sc.blocks), repr(c), recompute, micro, repr(sc.solver))
    hit = cache.get(key)
    if hit is None or hit[0] is not ctx or hit[1] is not sc.blocks:
        hit = cache[key] = (ctx, sc.blocks, _solve_unlimited(sc, ctx, allowed, mesh, recompute, micro))
    return hit[2]


def _solve_unlimited(sc: SearchContext, ctx, allowed, mesh, recompute: bool, micro: int):
    traced, c, cache, stages = sc.traced, sc.constraints, sc.cache, sc.stages
    problem = build_problem(traced, sc.blocks, ctx, recompute=recompute, microbatches=micro, strategy_filter=allowed,
                            strategy_cache=cache)
    sol = solve(problem, None, sc.solver)
    numel = plan_state_numel(problem, sol.choice) / stages
    if update_costs_moved(ctx, numel):  # priced per element for another count: once more, at the plan's
        ctx = cost_context(mesh, sc.cluster, sc.policy, sc.optimizer, traced, numel)
        problem = build_problem(traced, sc.blocks, ctx, recompute=recompute, microbatches=micro,
                                strategy_filter=make_filter(traced, c, mesh, micro), strategy_cache=cache)
        sol = solve(problem, None, sc.solver)
    return problem, sol, evaluate(problem, sol.choice)


def solve_attempt(sc: SearchContext, mesh, recompute: bool, micro: int) -> Attempt:
    """The attempt of one (mesh, recompute, microbatches) choice under ``sc``; an
    ``InfeasibleProblem`` when no assignment fits ``sc.budget``."""
    c, budget = sc.constraints, sc.budget
    problem, sol, ev = _first_solve(sc, mesh, recompute, micro)
    unconstrained = True
    # the ILP charges a linear memory model; the step simulation (evaluate) is what the plan
    # promises: tighten the ILP's budget by what its model missed until the simulated peak fits
    gap = 0.0
    leanest = ev.peak_bytes  # the least simulated peak seen: what a "does not fit" reports
    for _ in range(MEMORY_ROUNDS):
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
            sol = solve(problem, budget - gap, sc.solver)
        except InfeasibleProblem as exc:
            exc.peak_bytes = leanest
            raise
        ev = evaluate(problem, sol.choice)
        leanest = min(leanest, ev.peak_bytes)
    if budget is not None and ev.peak_bytes > budget:
        raise InfeasibleProblem("memory", f"peak {ev.peak_bytes / 2**30:.2f} GiB incl. transients exceeds the "
                                          f"{budget / 2**30:.2f} GiB budget", peak_bytes=leanest)
    if recompute and c.recompute is None:
        ev = fewest_recomputed(problem, sol.choice, ev, budget)
    sol.memory_slack_bytes = float("inf") if unconstrained else sol.memory_slack_bytes
    return Attempt(mesh, recompute, micro, problem, sol, ev)


def prove_best(att: Attempt, sc: SearchContext, outcomes: list) -> Attempt:
    """Run the proof MIP the solve skipped (``ilp.solve``) for the chosen plan only, when its
    predicted effort is within ``SolverConfig.prove_best_limit``: the plan becomes OPTIMAL, or a
    better one replaces it (if the step simulation agrees it fits). Updates its line in ``outcomes``."""
    sol, budget = att.solution, sc.budget
    if sol.prove is None or not (sol.proof_effort <= sc.solver.prove_best_limit):
        return att
    proven = sol.prove()
    proven.memory_slack_bytes = sol.memory_slack_bytes
    ev = att.evaluation
    if proven.choice != sol.choice:
        ev = evaluate(att.problem, proven.choice)
        if budget is not None and ev.peak_bytes > budget:
            return att  # the linear memory model missed: keep the plan that fits
        if att.recompute and sc.constraints.recompute is None:
            ev = fewest_recomputed(att.problem, proven.choice, ev, budget)
    for i, (lab, _) in enumerate(outcomes):
        if lab == att.label:
            outcomes[i] = (lab, f"{ev.step_time_s * 1e3:.3f} ms/step, peak {ev.peak_bytes / 2**30:.2f} GiB"
                           + solver_note(proven, sc.solver))
    return dataclasses.replace(att, solution=proven, evaluation=ev)


def fewest_recomputed(problem: Problem, choice: dict[str, int], ev: Evaluation, budget: float | None) -> Evaluation:
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


def solver_note(sol: Solution, config: SolverConfig) -> str:
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
    results = memo(RESULTS, inputs_key(traced, cluster, policy.name, optimizer, solver), dict)
    if "baseline" not in results:
        world = cluster.world_size
        sc = SearchContext(traced, blocks if blocks is not None else find_repeated_blocks(traced.graph, pin_key(Constraints())),
                           cluster, policy, optimizer, Constraints(dp=world, tp=1, zero=0, recompute=False, microbatches=1),
                           None, solver, cache if cache is not None else {})
        results["baseline"] = _naive_dp_baseline(sc, cluster.device.memory_bytes * USABLE_MEMORY_FRACTION)
    return results["baseline"]


def _naive_dp_baseline(sc: SearchContext, usable: float) -> Baseline:
    world = sc.cluster.world_size
    batch = sc.traced.global_batch
    if batch is not None and batch % world:
        return Baseline("naive data parallel", None, False,
                        f"not expressible: the global batch {batch} does not divide over {world} devices")
    try:
        att = solve_attempt(sc, (world, 1), False, 1)
    except InfeasibleProblem as exc:
        return Baseline("naive data parallel", None, False, f"not expressible: {exc.detail}")
    pred = predicted_of(att)
    fits = bool(att.evaluation.peak_bytes <= usable)
    from autopar.report import format_bytes

    note = "fits" if fits else (
        f"does not fit: needs {format_bytes(att.evaluation.peak_bytes)} per device, has {format_bytes(usable)} usable"
    )
    return Baseline("naive data parallel", pred, fits, note)
