"""The intra-op ILP: one strategy per node, priced edges, a memory limit. The only OR-Tools user.

Three layers: ``planner.ilp_model.build_model`` (one function per named constraint family, the
model as arrays), ``solve`` here (a MIP solver through
OR-Tools' ``pywraplp``, CBC by default, with a time limit and thread count from ``SolverConfig``),
and the caller extracts the chosen strategies. Strategy choices are binaries; edge indicators are
continuous in [0, 1]: their marginals equal the endpoint binaries, which makes them integral.
CBC solved our GPT problems 10-20x faster than CP-SAT on this formulation (LP-tight), and is
deterministic, which the byte-identical Plan JSON needs.

Objective (seconds, milliseconds inside the solver for numerical range)::

    step = F + B + blocking + exposed_f + exposed_b
    exposed_f >= ovl_f - OVERLAP_EFFICIENCY * F,          exposed_f >= EXPOSED_FLOOR * (ovl_f - lat_f) + L * lat_f
    exposed_b >= ovl_b + ovl_l - OVERLAP_EFFICIENCY * B,  exposed_b >= EXPOSED_FLOOR * (ovl_b - lat_b + ovl_l - lat_l)
                                                                       + L * (lat_b + lat_l)
    exposed_b >= ovl_l - OVERLAP_EFFICIENCY * B / m

*Overlap model*, following what the runtime runs asynchronously and when: ``F`` and ``B`` are
forward and backward compute (all ``m`` microbatches). ``ovl_f``: parameter all-gathers issued
one ahead of their use (``runtime.prefetch``) hide behind forward compute. ``ovl_b``: re-gathers
prefetched in backward and asynchronous gradient reduce-scatters (ZeRO-2/3, every microbatch)
hide behind backward compute. ``ovl_l``: the bucketed data-parallel all-reduce runs after the
last microbatch's gradients exist, so only that microbatch's backward (``B / m``) can hide it.
Up to ``OVERLAP_EFFICIENCY`` of a window hides communication and at least ``EXPOSED_FLOOR`` of it
(the last bucket, the first gather; ``Cluster.exposed_comm_share`` where calibrated) stays exposed,
of all but its waiting (``lat_*``: ``communication.collective_latency`` per collective; on CPU ranks
that fill the cores only the waiting hides, ``overlap.exposed_seconds``), and at least ``L``
(``Cluster.exposed_latency_share`` where calibrated, else 0) of the waiting. Everything else (activation resharding,
synchronous collectives, ZeRO-1/2's all-gather after the optimizer step) blocks.

Memory: parameter/gradient/optimizer bytes + saved activations + the largest working set of one
op <= budget per device (``planner.memory_model`` then simulates the step and the search tightens
the budget by what this linear model missed).

*Solving* (``solve``). With a linear objective the LP relaxation of this formulation is tight (its
optimum is integral: measured on every model of ``examples/real_models.py``); the overlap maxima
above make it loose (2-10% below the optimum on small models, whose communication and compute
are of one size): the LP mixes a compute-heavy and a communication-heavy plan so that the mix
hides its communication, which neither plan does. Branch and bound then needs minutes on the
full model (CBC left 4-10% gaps at 20 s). So, for a model of ``FIXING_MIN_COLUMNS`` columns or
more, ``solve`` runs:

1. the LP relaxation (CLP): a lower bound ``z`` and reduced costs ``d``;
2. a rounding: each node's strategy of largest LP value (``_rounding``);
3. the MIP restricted to the strategies in the LP's support and the rounding (a few hundred
   columns; it finds the best mix of the plans the LP mixed), improved by single-node moves
   (``_improve``; improving the rounding as well first cost 0.2-0.5 s on the real models and
   found a better plan in none of them);
4. reduced-cost fixing: a column ``j`` with ``z + d_j`` above the best value ``U`` is in no
   better assignment, so the MIP over the rest decides optimality exactly. It runs when it is
   predicted cheap: its columns times the relative gap ``(U - z) / U`` at most
   ``SolverConfig.prove_limit`` (measured on ``examples/real_models.py``: up to 60 took under
   1 s, 100-500 took 0.4-20 s). Otherwise the plan is reported as FEASIBLE with its gap to ``z``
   (an upper bound on the true gap; where the proof was run, the heuristic's plan was the
   optimum in 17 of 20 problems), and ``Solution.prove`` runs the proof later: the search runs
   it for the plan it chose, up to ``SolverConfig.prove_best_limit``. The proof MIP stops, OPTIMAL,
   once its plan is within ``SolverConfig.proof_gap`` (0.1%, relative) of its bound, as MIP
   solvers define optimal (OR-Tools' default stop is 0.01%). Proving the last 0.1% can stall: on
   T5 (``examples/real_models.py``, dp=2 x tp=2) the plan lay 0.07% above ``z`` and CBC's bound
   stayed at ``z`` through 70,000 nodes to the 20 s time limit (the overlap maxima: many LP mixes
   reach ``z``), so the candidate's result depended on the machine's load; with the 0.1% stop the
   proof ends at its root. The cost model's own error is far above 0.1%.

Every step is deterministic (one thread, no time-dependent stop unless the time limit is hit,
which the Solution records), so planning twice gives the same plan.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from ortools.linear_solver import pywraplp

from autopar.planner.local_search import AssignmentCosts, improve
from autopar.planner.threads import solver_running
from autopar.planner.ilp_model import (
    COL_AUX, COL_INDICATOR, COL_STRATEGY, MIB, MS, IlpModel, InfeasibleProblem, build_model, model_proto,
)
from autopar.planner.overlap import EXPOSED_FLOOR, OVERLAP_EFFICIENCY
from autopar.planner.problem import Problem

__all__ = ["SolverConfig", "Solution", "solve", "OVERLAP_EFFICIENCY", "EXPOSED_FLOOR", "InfeasibleProblem"]

# below this many columns the MIP is solved as it is (the LP pass would cost more than it saves)
FIXING_MIN_COLUMNS = 1000
_SUPPORT_EPS = 1e-6  # an LP value above this puts a strategy in the restricted MIP


@dataclass(frozen=True)
class SolverConfig:
    """``time_limit_s``: per MIP solve; a solve stopped by it is reported (status FEASIBLE, gap)
    and, unlike one that ends proven optimal, need not give the same plan on every run.
    ``reduced_cost_fixing``: the LP pass before the MIP (module docstring); off, every model is
    solved as one MIP. ``proof_gap``: the proof MIP (module docstring) ends, OPTIMAL, once its
    plan is at most this far (relative) above its bound (0: exactly optimal). ``prove_limit``: the
    LP pass proves a plan optimal when the proof MIP's columns x relative gap to the LP bound is at
    most this (0: always); otherwise the plan is reported with that gap (FEASIBLE).
    ``prove_best_limit``: the search proves the plan it
    chose (only that one) up to this effort. ``planner_threads``: threads the search runs its
    independent attempts on (None: ``AUTOPAR_PLANNER_THREADS``, else one per CPU; the plan does not
    depend on it)."""

    time_limit_s: float = 20.0
    threads: int = 1
    seed: int = 0
    backend: str = "CBC"  # any pywraplp MIP backend: "CBC", "SCIP", "HIGHS"
    reduced_cost_fixing: bool = True
    prove_limit: float = 60.0
    prove_best_limit: float = 250.0
    proof_gap: float = 1e-3
    planner_threads: int | None = field(default=None, repr=False, compare=False)


@dataclass
class Solution:
    choice: dict[str, int]
    status: str  # "OPTIMAL" | "FEASIBLE"
    objective_s: float
    bound_s: float
    build_s: float
    solve_s: float
    num_vars: int
    num_constraints: int
    memory_slack_bytes: float = 0.0  # budget minus the ILP's memory at the optimum (inf: no limit)
    time_limit_hit: bool = False  # a MIP stopped at ``SolverConfig.time_limit_s`` (not reproducible)
    columns: int = 0  # columns of the full model (num_vars: those of the last MIP solved)
    lp_s: float = 0.0  # the LP pass (relaxation, rounding, restricted MIP, moves) inside solve_s
    unproven_columns: int = 0  # >0: the proof MIP would have had this many columns and was skipped
    proof_effort: float = 0.0  # that MIP's predicted effort (columns x relative gap)
    prove: Callable[[], "Solution"] | None = field(default=None, repr=False, compare=False)  # runs it

    @property
    def gap(self) -> float:
        if self.objective_s <= 0:
            return 0.0
        return max(0.0, (self.objective_s - self.bound_s) / self.objective_s)

    @property
    def stopped(self) -> str:
        """Why the solve ended (``plan.SolverReport.stopped``): "optimal", "time limit" or "proof
        skipped" (the proof MIP predicted too costly, ``SolverConfig.prove_limit``)."""
        if self.status == "OPTIMAL":
            return "optimal"
        return "time limit" if self.time_limit_hit else "proof skipped"


# --------------------------------------------------------------------------- solving
def _instantiate(md: IlpModel, backend: str, keep=None, relax: bool = False):
    """A pywraplp solver holding the model (only the columns ``keep`` marks, when given), and the
    model column of each solver variable, in the solver's order (``_results`` reads them)."""
    solver = pywraplp.Solver.CreateSolver(backend)
    if solver is None:
        raise ValueError(f"OR-Tools has no MIP backend {backend!r}; use 'CBC', 'SCIP' or 'HIGHS'")
    arr = md.arrays()
    kept = np.ones(len(md.lb), dtype=bool) if keep is None else np.asarray(keep, dtype=bool)
    row_kept = arr.kept_per_row(kept[arr.cols])
    # a row left without columns is kept only if 0 breaks it (then the model is infeasible)
    rows = np.flatnonzero((row_kept > 0) | (arr.row_lb > 0.0) | (arr.row_ub < 0.0))
    cols = np.flatnonzero(kept)
    error = solver.LoadModelFromProto(model_proto(md, arr, rows, cols, relax))
    if error:
        raise RuntimeError(f"OR-Tools refused the model: {error}")
    return solver, cols


def _results(solver, cols: np.ndarray, n: int):
    """(value of every model column (0 for the dropped ones), reduced costs likewise, objective,
    best bound) of a solved solver, read in one proto (no Python object per variable)."""
    from ortools.linear_solver import linear_solver_pb2

    r = linear_solver_pb2.MPSolutionResponse()
    solver.FillSolutionResponseProto(r)
    values = np.zeros(n)
    values[cols] = np.asarray(r.variable_value, dtype=float)
    reduced = np.zeros(n)
    if len(r.reduced_cost):
        reduced[cols] = np.asarray(r.reduced_cost, dtype=float)
    return values, reduced, r.objective_value, r.best_objective_bound


def _rounding(md: IlpModel, lp_x) -> dict[str, int]:
    """Each node's strategy of largest LP value (the first among equals)."""
    choice = {}
    for name, cols in md.x.items():
        if cols == [None]:
            choice[name] = 0
        else:
            choice[name] = max(range(len(cols)), key=lambda i: (round(lp_x[cols[i]], 9), -i))
    return choice


def _improve(md: IlpModel, problem: Problem, choice: dict[str, int], budget_bytes: float | None, costs=None):
    """``local_search.improve`` over the roots the ILP decides; (choice, objective in ms) or None."""
    roots = [(n, len(cols)) for n, cols in md.x.items() if cols != [None] and problem.nodes[n].root is None]
    found = improve(problem, roots, choice, budget_bytes, costs)
    if found is None or found[1] is None:
        return found
    return found[0], found[1] * MS


@dataclass
class _MipResult:
    status: int
    choice: dict[str, int] | None
    value: float
    bound: float
    solve_s: float
    nodes: int = 0  # branch-and-bound nodes the solver explored (deterministic: a measure of work)


_QUIET_LOCK = threading.Lock()
_QUIET_STATE = {"depth": 0, "saved": -1, "null": -1}  # solves inside _quiet_stdout now; fds to restore


@contextlib.contextmanager
def _quiet_stdout(active: bool):
    """HiGHS (OR-Tools 9.15) prints a banner to the process's stdout on every solve, whatever
    the output settings: hide it at the file-descriptor level while it solves. Solves on several
    planner threads share one redirection (the first in redirects, the last out restores), so
    none can save the other's ``/dev/null`` as "the" stdout."""
    if not active:
        yield
        return
    with _QUIET_LOCK:
        if _QUIET_STATE["depth"] == 0:
            try:
                sys.stdout.flush()
                saved = os.dup(1)
            except (OSError, ValueError, AttributeError):
                saved = -1
            if saved >= 0:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                _QUIET_STATE.update(saved=saved, null=null)
        _QUIET_STATE["depth"] += 1
    try:
        yield
    finally:
        with _QUIET_LOCK:
            _QUIET_STATE["depth"] -= 1
            if _QUIET_STATE["depth"] == 0 and _QUIET_STATE["saved"] >= 0:
                os.dup2(_QUIET_STATE["saved"], 1)
                os.close(_QUIET_STATE["saved"])
                os.close(_QUIET_STATE["null"])
                _QUIET_STATE.update(saved=-1, null=-1)


def _run_mip(md: IlpModel, keep, config: SolverConfig, relative_gap: float | None = None) -> _MipResult:
    """Solve the model (the ``keep`` columns of it) as a MIP with ``config``'s backend and limits
    (and the solver's stop at ``relative_gap``, where given; OR-Tools' default is 1e-4)."""
    solver, cols = _instantiate(md, config.backend, keep)
    solver.SetTimeLimit(int(config.time_limit_s * 1000))
    solver.SetNumThreads(int(config.threads))
    params = pywraplp.MPSolverParameters()
    if relative_gap is not None:
        params.SetDoubleParam(pywraplp.MPSolverParameters.RELATIVE_MIP_GAP, relative_gap)
    t = time.perf_counter()
    with _quiet_stdout(config.backend == "HIGHS"), solver_running():
        status = solver.Solve(params)
    solve_s = time.perf_counter() - t
    nodes = int(solver.nodes())
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return _MipResult(status, None, np.inf, -np.inf, solve_s, nodes)
    values, _, value, bound = _results(solver, cols, len(md.lb))
    choice = _choice_of(md, values)
    bound = value if status == pywraplp.Solver.OPTIMAL else bound
    return _MipResult(status, choice, value, bound, solve_s, nodes)


def _choice_of(md: IlpModel, values: np.ndarray) -> dict[str, int]:
    """Each node's strategy: its largest column value (ties: the first)."""
    choice = {}
    for name, cols in md.x.items():
        if cols == [None]:
            choice[name] = 0
        else:
            vals = values[cols]
            choice[name] = int(np.argmax(vals))
    return choice


def _infeasible(budget_bytes: float | None) -> InfeasibleProblem:
    return InfeasibleProblem("memory", f"no strategy assignment keeps parameters, optimizer state and saved "
                                       f"activations within {budget_bytes / 2**30:.2f} GiB per device")


def solve(
    problem: Problem,
    budget_bytes: float | None,
    config: SolverConfig = SolverConfig(),
    *,
    objective: str = "time",
) -> Solution:
    """Solve ``problem``; ``objective="memory"`` minimises per-device bytes instead of time."""
    t0 = time.perf_counter()
    if objective == "time" and budget_bytes is not None and _memory_floor(problem) > budget_bytes * (1.0 + 1e-6):
        raise _infeasible(budget_bytes)  # the relaxation is infeasible: no model need be built to learn so
    md = build_model(problem, budget_bytes, objective)
    build_s = time.perf_counter() - t0
    if objective == "time" and config.reduced_cost_fixing and len(md.lb) >= FIXING_MIN_COLUMNS:
        found = _solve_lp_first(md, problem, budget_bytes, config)
        if found is not None:
            out, later, effort = found
            sol = _solution(md, problem, budget_bytes, objective, build_s, time.perf_counter() - t0 - build_s, *out)
            if later is not None:
                def prove(solve_s=sol.solve_s):
                    t = time.perf_counter()
                    res = later()
                    return _solution(md, problem, budget_bytes, objective, build_s,
                                     solve_s + time.perf_counter() - t, *res)

                sol.proof_effort, sol.prove = effort, prove
            return sol
    t1 = time.perf_counter()
    r = _run_mip(md, None, config)
    if r.choice is None:
        if r.status == pywraplp.Solver.INFEASIBLE:
            raise _infeasible(budget_bytes)
        raise InfeasibleProblem("time-limit", f"solver stopped (status {r.status}) before finding a plan")
    proven = r.status == pywraplp.Solver.OPTIMAL
    return _solution(md, problem, budget_bytes, objective, build_s, time.perf_counter() - t1, r.choice, r.value,
                     r.bound, proven, not proven, 0.0, 0)


def _memory_floor(problem: Problem) -> float:
    """A lower bound on the memory row of ``build_model`` (``ilp_model.add_memory_limit``) over
    its LP relaxation, in bytes: per strategy column group (a root and its followers) the least
    state and saved bytes, plus the largest of the nodes' least working sets; 0 when every node
    has one strategy (the model then names that assignment itself)."""
    groups: dict[str, np.ndarray] = {}
    working = 0.0
    for name, v in problem.nodes.items():
        if not len(v.strategies):
            return 0.0
        root = v.root or name
        mem = np.asarray(v.static_bytes, dtype=float) + np.asarray(v.saved_bytes, dtype=float)
        groups[root] = groups[root] + mem if root in groups else mem
        if v.transient_bytes is not None:
            working = max(working, float(np.min(v.transient_bytes)))
    if all(len(g) == 1 for g in groups.values()):
        return 0.0
    return float(sum(float(np.min(g)) for g in groups.values())) + working


def _solution(md, problem, budget_bytes, objective, build_s, solve_s, choice, value, bound, proven, hit_limit,
              lp_s, unproven) -> Solution:
    scale = MIB if objective == "memory" else 1 / MS
    z = {c: 1.0 for name, cols in md.x.items() if (c := cols[choice[name]]) is not None}
    used = sum(coef * (1.0 if c is None else z.get(c, 0.0)) for coef, c in md.memory) * MIB
    return Solution(
        choice=choice,
        status="OPTIMAL" if proven else "FEASIBLE",
        objective_s=value * scale,
        bound_s=(value if proven else min(bound, value)) * scale,
        build_s=build_s,
        solve_s=solve_s,
        num_vars=len(md.lb),
        num_constraints=len(md.rows),
        memory_slack_bytes=float("inf") if budget_bytes is None else budget_bytes - used,
        time_limit_hit=hit_limit,
        columns=len(md.lb),
        lp_s=lp_s,
        unproven_columns=unproven,
    )


def _y_rows(md: IlpModel) -> np.ndarray:
    """For every edge-indicator column, the two edge-consistency rows it appears in (-1 elsewhere)."""
    arr = md.arrays()
    kind = np.asarray(md.kind)
    rows_of_entry = np.repeat(np.arange(len(md.rows)), arr.lens)
    consistency = np.array([r[4] == "edge-consistency" for r in md.rows], dtype=bool)
    is_y = (kind[arr.cols] == COL_INDICATOR) & consistency[rows_of_entry]
    out = np.full((len(md.lb), 2), -1, dtype=np.int64)
    cols, rows = arr.cols[is_y], rows_of_entry[is_y]
    order = np.argsort(cols, kind="stable")
    cols, rows = cols[order], rows[order]
    out[cols[0::2], 0] = rows[0::2]
    out[cols[1::2], 1] = rows[1::2]
    return out


def _restrict(md: IlpModel, allowed: np.ndarray) -> np.ndarray:
    """Columns of the MIP over the ``allowed`` strategy columns: those, every auxiliary, and each
    edge indicator both of whose endpoint keys keep an allowed strategy."""
    arr = md.arrays()
    kind = np.asarray(md.kind)
    x_kept = (kind[arr.cols] == COL_STRATEGY) & allowed[arr.cols]
    per_row = arr.kept_per_row(x_kept)
    yr = _y_rows(md)
    keep = allowed & (kind == COL_STRATEGY) | (kind == COL_AUX)
    is_y = kind == COL_INDICATOR
    keep[is_y] = (per_row[yr[is_y, 0]] > 0) & (per_row[yr[is_y, 1]] > 0)
    return keep


def _restricted_config(config: SolverConfig) -> SolverConfig:
    """The restricted MIP's solver: HiGHS where OR-Tools has it (2-10x faster than CBC on these
    few-hundred-column MIPs of two or three choices per node, and as deterministic)."""
    import dataclasses

    if config.backend == "CBC" and pywraplp.Solver.CreateSolver("HIGHS") is not None:
        return dataclasses.replace(config, backend="HIGHS")
    return config


def _solve_lp_first(md: IlpModel, problem: Problem, budget_bytes: float | None, config: SolverConfig):
    """The LP pass of the module docstring. Returns (the arguments of ``_solution`` after
    ``build_s, solve_s``; the proof MIP, to run later, when predicted too costly now, else
    None; its predicted effort), or None to solve the whole model as one MIP instead."""
    t0 = time.perf_counter()
    lp, cols = _instantiate(md, "CLP", relax=True)
    with solver_running():
        status = lp.Solve()
    if status == pywraplp.Solver.INFEASIBLE and budget_bytes is not None:
        raise _infeasible(budget_bytes)  # the relaxation is: so is every assignment
    if status != pywraplp.Solver.OPTIMAL:
        return None
    lp_x, reduced, z, _ = _results(lp, cols, len(md.lb))
    kind = np.asarray(md.kind)
    costs = AssignmentCosts(problem)
    rounded = _rounding(md, lp_x)
    hit_limit = False

    def columns_of(choice):
        out = np.zeros(len(md.lb), dtype=bool)
        for name, cols in md.x.items():
            c = cols[choice[name]]
            if c is not None:
                out[c] = True
        return out

    # the best mix of the plans the LP mixed: the MIP over its support (and the rounding)
    allowed = (kind == COL_STRATEGY) & (lp_x > _SUPPORT_EPS) | columns_of(rounded)
    r = _run_mip(md, _restrict(md, allowed), _restricted_config(config))
    hit_limit |= r.status == pywraplp.Solver.FEASIBLE
    # then single-node moves from it (or, where that MIP found nothing, from the rounding)
    best = _improve(md, problem, r.choice if r.choice is not None else rounded, budget_bytes, costs)
    if best is not None and best[1] is None:
        best = None
    if best is None:
        return None  # nothing feasible found this way: the whole MIP decides
    choice, value = best
    lp_s = time.perf_counter() - t0
    # reduced-cost fixing: what is left can hold an assignment better than ``value``
    cut = value + 1e-7 * max(abs(value), 1e-12)
    keep = ~((kind != COL_AUX) & (lp_x < 1e-9) & (z + reduced > cut)) | columns_of(choice)
    left = int(keep.sum())
    gap = (value - z) / value if value > 0 else 0.0

    def proof():
        p = _run_mip(md, keep, config, config.proof_gap)
        if p.status == pywraplp.Solver.INFEASIBLE:
            return choice, value, value, True, hit_limit, lp_s, 0  # nothing beats the incumbent
        best_choice, best_value = (p.choice, p.value) if p.choice is not None and p.value < value else (choice, value)
        proven = p.status == pywraplp.Solver.OPTIMAL
        return (best_choice, best_value, best_value if proven else max(z, min(p.bound, best_value)), proven,
                hit_limit or not proven, lp_s, 0)

    effort = left * gap
    if config.prove_limit and effort > config.prove_limit:
        return (choice, value, z, False, hit_limit, lp_s, left), proof, effort
    return proof(), None, 0.0
