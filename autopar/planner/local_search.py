"""Single-root moves over a full strategy assignment, with its step time kept up to date
incrementally (the arithmetic of ``planner.evaluate``, without the step simulation): the
polishing step of the ILP's LP-first solve (``planner.ilp``).

Deterministic: roots are visited in the order given, each takes its best strategy if it lowers
the step time, and passes repeat (at most 10) while one does.
"""
from __future__ import annotations

import numpy as np

from autopar.planner.evaluate import OVERLAP_WINDOWS
from autopar.planner.overlap import exposed_floor, exposed_latency, exposed_seconds
from autopar.planner.problem import Problem

__all__ = ["AssignmentCosts", "Assignment", "improve"]

_EDGE_AT = (2, 3, 4, 5, 7, 8, 9)  # where each of an edge cell's numbers (blocking, OVERLAP_WINDOWS) goes in ``Assignment.agg``


class AssignmentCosts:
    """Per-problem tables of ``Assignment``, built once per solve: node costs as tuples, edge
    cells converted on first use."""

    def __init__(self, problem: Problem):
        self.p = problem
        self.members: dict[str, list[str]] = {}
        for n, v in problem.nodes.items():
            self.members.setdefault(v.root or n, []).append(n)
        self.node_cost = {}
        for n, v in problem.nodes.items():
            comm = v.comm_s
            comm = comm if comm is not None else np.zeros(len(v.strategies))
            self.node_cost[n] = list(zip(v.fwd_s.tolist(), v.bwd_s.tolist(), np.asarray(comm, dtype=float).tolist(),
                                         (v.static_bytes + v.saved_bytes).tolist()))
        self.edges: dict[str, list[int]] = {}
        for i, e in enumerate(problem.edges):
            for n in (e.u, e.v):
                if n is None:
                    continue
                r = problem.nodes[n].root or n
                lst = self.edges.setdefault(r, [])
                if not lst or lst[-1] != i:
                    lst.append(i)
        self._cells: dict[tuple[int, int, int], tuple] = {}
        self.ends = [(e.u, e.u_key.tolist(), e.v, e.v_key.tolist() if e.v is not None else None) for e in problem.edges]

    def cell(self, i: int, ku: int, kv: int) -> tuple:
        """(blocking, ovl_f, ovl_b, ovl_l, and the waiting part of each overlap window) of edge
        ``i`` at keys (ku, kv); the loss value's reduction as the ILP's objective counts it."""
        key = (i, ku, kv)
        hit = self._cells.get(key)
        if hit is None:
            e = self.p.edges[i]
            hit = self._cells[key] = (float(e.blocking[ku, kv]),) + tuple(
                0.0 if a is None else float(a[ku, kv]) for a in (e.ilp_window(w) for w in OVERLAP_WINDOWS))
        return hit


class Assignment:
    """A full assignment and its cost components, updated incrementally when one root (with its
    followers) changes strategy: the local search of ``improve``. Seconds and bytes, the
    arithmetic of ``planner.evaluate``; components as plain floats (fwd, bwd, blocking, ovl_f,
    ovl_b, ovl_l, memory, and the waiting parts of ovl_f, ovl_b, ovl_l)."""

    def __init__(self, problem: Problem, choice: dict[str, int], budget_bytes: float | None, costs=None):
        self.p = problem
        self.choice = choice
        self.budget = budget_bytes
        self.c = costs if costs is not None else AssignmentCosts(problem)
        self.members, self.edges, self.node_cost = self.c.members, self.c.edges, self.c.node_cost
        agg = [0.0] * 10
        for n in problem.nodes:
            f, b, c, m = self.node_cost[n][choice[n]]
            agg[0] += f
            agg[1] += b
            agg[2] += c
            agg[6] += m
        for i in range(len(problem.edges)):
            for at, x in zip(_EDGE_AT, self._edge(i)):
                agg[at] += x
        self.agg = agg

    def _edge(self, i: int) -> tuple:
        u, uk, v, vk = self.c.ends[i]
        ch = self.choice
        key = (i, uk[ch[u]], vk[ch[v]] if v is not None else 0)
        hit = self.c._cells.get(key)
        return hit if hit is not None else self.c.cell(*key)

    def value(self) -> float | None:
        """The step time (seconds), None when over the memory budget."""
        f, b, bl, of, ob, ol, mem, lf, lb, ll = self.agg
        if self.budget is not None:
            working = max((v.transient_bytes[self.choice[n]] for n, v in self.p.nodes.items()
                           if v.transient_bytes is not None), default=0.0)
            if mem + working > self.budget:
                return None
        cluster = self.p.ctx.cluster
        ef, eb = exposed_seconds(f, b, of, ob, ol, self.p.microbatches, exposed_floor(cluster), lf, lb, ll,
                                 exposed_latency(cluster))
        return f + b + bl + ef + eb

    def move(self, root: str, s: int) -> None:
        """Set ``root`` (and its followers) to strategy ``s``."""
        agg = self.agg
        es = self.edges.get(root, ())
        for i in es:
            for at, x in zip(_EDGE_AT, self._edge(i)):
                agg[at] -= x
        for n in self.members[root]:
            f0, b0, c0, m0 = self.node_cost[n][self.choice[n]]
            f1, b1, c1, m1 = self.node_cost[n][s]
            agg[0] += f1 - f0
            agg[1] += b1 - b0
            agg[2] += c1 - c0
            agg[6] += m1 - m0
            self.choice[n] = s
        for i in es:
            for at, x in zip(_EDGE_AT, self._edge(i)):
                agg[at] += x


def improve(problem: Problem, roots: list[tuple[str, int]], choice: dict[str, int], budget_bytes: float | None,
            costs: AssignmentCosts | None = None):
    """Single-root moves (a root and its followers together), the best per root, while they
    lower the exact objective and keep the memory limit. Deterministic. Returns (choice,
    step time in seconds) or None when ``choice`` itself breaks the memory limit. ``roots``: (root,
    number of strategies) of the nodes free to move."""
    choice = dict(choice)
    costs = costs if costs is not None else AssignmentCosts(problem)
    state = Assignment(problem, choice, budget_bytes, costs)
    best = state.value()
    if best is None:
        return None
    for _ in range(10):  # passes
        improved = False
        for r, n_strategies in roots:
            cur = pick = choice[r]
            for s in range(n_strategies):
                if s == cur:
                    continue
                state.move(r, s)
                val = state.value()
                if val is not None and val < best - 1e-12 * max(1.0, 1e3 * abs(best)):  # 1e-9 of it, or of 1 ms
                    best, pick, improved = val, s, True
                state.move(r, cur)
            if pick != cur:
                state.move(r, pick)
        if not improved:
            break
    # the exact value again, summed afresh (no drift from the incremental updates)
    return dict(choice), Assignment(problem, dict(choice), budget_bytes, costs).value()
