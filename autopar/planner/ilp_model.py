"""The intra-op ILP as arrays, one function per named constraint family (``planner.ilp`` has the
formulation, the overlap model and how it is solved): strategy binaries, edge indicators whose
marginals equal the endpoint choices, the memory limit, the overlap objective. Nothing here
touches OR-Tools except ``model_proto``, which turns (a column subset of) the arrays into the
``MPModelProto`` that ``ilp`` loads into a solver.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autopar.planner.overlap import EXPOSED_FLOOR, OVERLAP_EFFICIENCY, exposed_floor, exposed_latency
from autopar.planner.problem import Problem

__all__ = ["IlpModel", "Rows", "Expr", "InfeasibleProblem", "build_model", "model_proto", "COL_STRATEGY",
           "COL_INDICATOR", "COL_AUX", "MS", "MIB"]

MS = 1e3  # objective unit: milliseconds
MIB = 2.0**20  # memory unit: MiB


class InfeasibleProblem(Exception):
    """Raised by ``ilp.solve`` (and by ``build_model``); ``family`` names the violated constraint family."""

    def __init__(self, family: str, detail: str, nodes: list[str] = (), peak_bytes: float | None = None):
        super().__init__(f"{family}: {detail}")
        self.family = family
        self.detail = detail
        self.nodes = list(nodes)
        self.peak_bytes = peak_bytes  # memory family: the simulated peak of the leanest plan tried, if any


# Columns are indices into IlpModel's arrays; a term is (coef, column or None for a constant).
# ``ilp._instantiate`` turns the arrays (all of them, or the columns reduced-cost fixing kept)
# into a pywraplp model through ``model_proto``.

COL_STRATEGY, COL_INDICATOR, COL_AUX = 0, 1, 2  # column kinds: strategy binaries, edge indicators, auxiliaries


@dataclass
class IlpModel:
    lb: list = field(default_factory=list)
    ub: list = field(default_factory=list)
    kind: list = field(default_factory=list)
    names: list = field(default_factory=list)
    rows: list = field(default_factory=list)  # (lb, ub, [col], [coef], family)
    objective: dict = field(default_factory=dict)  # col -> coef
    offset: float = 0.0
    x: dict[str, list] = field(default_factory=dict)  # node -> per-strategy column or None (constant 1)
    fwd: list = field(default_factory=list)  # (coef_ms, column|None)
    bwd: list = field(default_factory=list)
    blocking: list = field(default_factory=list)
    ovl_f: list = field(default_factory=list)  # the windows of the module docstring
    ovl_b: list = field(default_factory=list)
    ovl_l: list = field(default_factory=list)
    lat_f: list = field(default_factory=list)  # the waiting part of each window (``EdgeTable.overlap_lat``, ...)
    lat_b: list = field(default_factory=list)
    lat_l: list = field(default_factory=list)
    memory: list = field(default_factory=list)  # (MiB, column|None)
    working_sets: list = field(default_factory=list)  # per node: [(MiB, column|None)]

    def col(self, kind: int, lb: float, ub: float, name: str) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.kind.append(kind)
        self.names.append(name)
        return len(self.lb) - 1

    def row(self, lb: float, ub: float, expr: "Expr", family: str) -> None:
        cols = list(expr.coefs)
        self.rows.append((lb - expr.const, ub - expr.const, cols, [expr.coefs[c] for c in cols], family))

    def arrays(self) -> "Rows":
        """The rows as flat numpy arrays (built once, after the families are added)."""
        if getattr(self, "_rows_cache", None) is None or self._rows_cache[0] != len(self.rows):
            lens = [len(r[2]) for r in self.rows]
            ends = np.cumsum(lens, dtype=np.int64) if lens else np.zeros(0, dtype=np.int64)
            starts = ends - np.asarray(lens, dtype=np.int64)
            cols = np.fromiter((c for r in self.rows for c in r[2]), dtype=np.int64, count=int(sum(lens)))
            coefs = np.fromiter((v for r in self.rows for v in r[3]), dtype=float, count=int(sum(lens)))
            self._rows_cache = (len(self.rows), Rows(starts, ends, cols, coefs, np.asarray(lens, dtype=np.int64),
                                                      np.array([r[0] for r in self.rows], dtype=float),
                                                      np.array([r[1] for r in self.rows], dtype=float)))
        return self._rows_cache[1]

    def edge_terms(self):
        """(edge array name, the list its costs go to)."""
        return (("blocking", self.blocking), ("overlap", self.ovl_f), ("overlap_bwd", self.ovl_b),
                ("overlap_last", self.ovl_l), ("overlap_lat", self.lat_f), ("overlap_bwd_lat", self.lat_b),
                ("overlap_last_lat", self.lat_l))


@dataclass
class Rows:
    """The rows of a ``IlpModel`` in CSR form: row ``r``'s entries are ``cols[starts[r]:ends[r]]``."""

    starts: np.ndarray
    ends: np.ndarray
    cols: np.ndarray
    coefs: np.ndarray
    lens: np.ndarray
    row_lb: np.ndarray
    row_ub: np.ndarray

    def kept_per_row(self, entry_kept: np.ndarray) -> np.ndarray:
        """How many of each row's entries are marked in ``entry_kept``."""
        csum = np.concatenate([[0], np.cumsum(entry_kept, dtype=np.int64)])
        return csum[self.ends] - csum[self.starts]


class Expr:
    """A linear expression over columns: coefficients by column, plus a constant."""

    __slots__ = ("coefs", "const")

    def __init__(self, terms=(), scale: float = 1.0):
        self.coefs: dict[int, float] = {}
        self.const = 0.0
        self.add(terms, scale)

    def add(self, terms, scale: float = 1.0) -> "Expr":
        if isinstance(terms, Expr):
            self.const += scale * terms.const
            terms = terms.coefs.items()
            for c, v in terms:
                self.coefs[c] = self.coefs.get(c, 0.0) + scale * v
            return self
        for coef, col in terms:
            if coef == 0:
                continue
            if col is None:
                self.const += scale * coef
            else:
                self.coefs[col] = self.coefs.get(col, 0.0) + scale * coef
        return self

    def is_constant(self) -> bool:
        return not any(self.coefs.values())

    def value(self, z) -> float:
        return self.const + sum(v * z[c] for c, v in self.coefs.items())


def add_one_strategy_per_node(md: IlpModel, problem: Problem) -> None:
    """Family *one-strategy*: each representative node picks exactly one of its strategies."""
    empty = [n for n, v in problem.nodes.items() if not v.strategies]
    if empty:
        reasons = []
        for n in empty[:5]:
            ex = problem.nodes[n].excluded
            reasons.append(f"{n}: " + ("; ".join(r for _, r in ex[:3]) if ex else "no strategy"))
        raise InfeasibleProblem("one-strategy", "no allowed strategy for " + " | ".join(reasons), empty)
    for name, v in problem.nodes.items():
        if v.root is not None:
            md.x[name] = md.x[v.root]  # a follower shares its root's columns (same indexing)
        elif len(v.strategies) == 1:
            md.x[name] = [None]
        else:
            cols = [md.col(COL_STRATEGY, 0.0, 1.0, f"x[{name},{i}]") for i in range(len(v.strategies))]
            md.row(1.0, 1.0, Expr((1.0, c) for c in cols), "one-strategy")
            md.x[name] = cols
        comm = v.comm_s
        for i, lit in enumerate(md.x[name]):
            md.fwd.append((float(v.fwd_s[i] * MS), lit))
            md.bwd.append((float(v.bwd_s[i] * MS), lit))
            if comm is not None:
                md.blocking.append((float(comm[i] * MS), lit))
            md.memory.append((float(((v.static_bytes[i] + v.saved_bytes[i]) / MIB)), lit))
        if v.transient_bytes is not None:
            md.working_sets.append([(float(v.transient_bytes[i] / MIB), lit) for i, lit in enumerate(md.x[name])])


def _key_literals(lits: list, keys: np.ndarray, nkeys: int):
    """Per key: list of strategy columns with that key (None = constant)."""
    out = [[] for _ in range(nkeys)]
    for s, k in enumerate(keys):
        out[int(k)].append(lits[s])
    return out


def add_edge_costs(md: IlpModel, problem: Problem) -> None:
    """Family *edge-consistency*: edge indicator e[ku,kv] marginals equal the endpoint choices.

    Keys no strategy uses, and pairs of keys whose costs are equal in every array (rows or
    columns of the tables that coincide), share one indicator: exact, and fewer columns."""
    for ei, e in enumerate(problem.edges):
        nu, nv = e.blocking.shape
        # the loss value's reduction rides the gradient sync where its first partial axis is a
        # data axis and another node's layout allows (``planner.loss_rider``): the objective takes
        # it as riding there (``EdgeTable.ilp_overlap_bwd``), the plan's evaluation decides
        terms = [(e.ilp_window(name), out) for name, out in md.edge_terms() if getattr(e, name) is not None]

        def add(lit, ku, kv):
            for arr, out in terms:
                if arr[ku, kv]:
                    out.append((float(arr[ku, kv] * MS), lit))

        if all(np.all(arr == arr.flat[0]) for arr, _ in terms):
            add(None, 0, 0)
            continue
        if e.v is not None and md.x[e.u] is md.x[e.v]:
            # both ends decided by the same columns: the cost is a function of that one choice
            for s, lit in enumerate(md.x[e.u]):
                add(lit, int(e.u_key[s]), int(e.v_key[s]))
            continue
        u_const = len(md.x[e.u]) == 1
        v_const = e.v is None or len(md.x[e.v]) == 1
        if u_const or v_const:
            # cost depends on one side only: attach it to that side's columns directly
            if u_const and v_const:
                add(None, int(e.u_key[0]), int(e.v_key[0]) if e.v is not None else 0)
            elif u_const:
                for s, lit in enumerate(md.x[e.v]):
                    add(lit, int(e.u_key[0]), int(e.v_key[s]))
            else:
                kv = int(e.v_key[0]) if e.v is not None else 0
                for s, lit in enumerate(md.x[e.u]):
                    add(lit, int(e.u_key[s]), kv)
            continue
        ulits = _key_literals(md.x[e.u], e.u_key, nu)
        vlits = _key_literals(md.x[e.v], e.v_key, nv)
        # keys in use, grouped where their cost rows (columns) are identical in every array
        stack = np.stack([arr for arr, _ in terms], axis=-1)
        used_u = [a for a in range(nu) if ulits[a]]
        used_v = [b for b in range(nv) if vlits[b]]
        ugroups = _groups(used_u, lambda a: stack[a, used_v])
        vgroups = _groups(used_v, lambda b: stack[used_u, b])
        ka = [k for k, _ in ugroups]
        kb = [k for k, _ in vgroups]
        first = len(md.lb)
        n_u, n_v = len(ka), len(kb)
        n = n_u * n_v
        md.lb.extend([0.0] * n)
        md.ub.extend([1.0] * n)
        md.kind.extend([COL_INDICATOR] * n)
        md.names.extend([""] * n)
        # the indicator of group pair (a, b) is column first + a * n_v + b
        for arr, out in terms:
            vals = (arr[np.ix_(ka, kb)] * MS).ravel()
            nz = np.flatnonzero(vals)
            out.extend(zip(vals[nz].tolist(), (nz + first).tolist()))
        for a, (_, members) in enumerate(ugroups):
            row = Expr()
            row.coefs = dict.fromkeys(range(first + a * n_v, first + (a + 1) * n_v), 1.0)
            md.row(0.0, 0.0, row.add(((-1.0, c) for k in members for c in ulits[k])), "edge-consistency")
        for b, (_, members) in enumerate(vgroups):
            row = Expr()
            row.coefs = dict.fromkeys(range(first + b, first + n, n_v), 1.0)
            md.row(0.0, 0.0, row.add(((-1.0, c) for k in members for c in vlits[k])), "edge-consistency")


def _groups(keys: list[int], row) -> list[tuple[int, list[int]]]:
    """``keys`` grouped by identical ``row(key)`` arrays: (representative key, members), in order."""
    index: dict[bytes, int] = {}
    out: list[tuple[int, list[int]]] = []
    for k in keys:
        sig = np.ascontiguousarray(row(k)).tobytes()
        if sig in index:
            out[index[sig]][1].append(k)
        else:
            index[sig] = len(out)
            out.append((k, [k]))
    return out


def add_memory_limit(md: IlpModel, budget_bytes: float | None) -> None:
    """Family *memory*: per-device bytes of state and saved activations within the budget."""
    if budget_bytes is None:
        return
    expr = Expr(md.memory)
    # the largest working set of one op, on top of what is kept (one variable, bounded by each)
    exprs = [Expr(ws) for ws in md.working_sets]
    floor = max((w.const for w in exprs if w.is_constant()), default=0.0)
    varying = [w for w in exprs if not w.is_constant()]
    if expr.is_constant() and not varying:  # every node has one strategy: nothing to choose
        if expr.const + floor > budget_bytes / MIB:
            raise InfeasibleProblem("memory", f"the only strategy assignment needs {(expr.const + floor) * MIB / 2**30:.2f} "
                                              f"GiB per device, over the {budget_bytes / 2**30:.2f} GiB budget")
        return
    working = md.col(COL_AUX, floor, np.inf, "working_set")
    for w in varying:
        md.row(0.0, np.inf, Expr([(1.0, working)]).add(w, -1.0), "memory")
    md.row(-np.inf, budget_bytes / MIB, expr.add([(1.0, working)]), "memory")


def add_overlap_objective(md: IlpModel, microbatches: int = 1, floor: float = EXPOSED_FLOOR,
                          lat_share: float = 0.0) -> None:
    """Family *overlap*: exposed communication per the module's overlap model; minimise time."""
    fwd, bwd = Expr(md.fwd), Expr(md.bwd)
    ovl_f, ovl_b, ovl_l = Expr(md.ovl_f), Expr(md.ovl_b), Expr(md.ovl_l)
    lat_f, lat_b, lat_l = Expr(md.lat_f), Expr(md.lat_b), Expr(md.lat_l)
    exposed_f = md.col(COL_AUX, 0.0, np.inf, "exposed_f")
    exposed_b = md.col(COL_AUX, 0.0, np.inf, "exposed_b")
    ef, eb = Expr([(1.0, exposed_f)]), Expr([(1.0, exposed_b)])
    for piece in _pieces_f(ovl_f, fwd, floor, lat_f, lat_share):
        md.row(0.0, np.inf, Expr().add(ef).add(piece, -1.0), "overlap")
    for piece in _pieces_b(ovl_b, ovl_l, bwd, microbatches, floor, lat_b, lat_l, lat_share):
        md.row(0.0, np.inf, Expr().add(eb).add(piece, -1.0), "overlap")
    obj = Expr().add(fwd).add(bwd).add(Expr(md.blocking)).add(ef).add(eb)
    md.objective, md.offset = obj.coefs, obj.const


def _pieces_f(ovl_f, fwd, floor, lat_f=None, lat_share=0.0):
    """exposed_f >= each of these (``exposed_seconds``)."""
    return [Expr().add(ovl_f).add(fwd, -OVERLAP_EFFICIENCY),
            Expr().add(ovl_f, floor).add(lat_f or Expr(), lat_share - floor)]


def _pieces_b(ovl_b, ovl_l, bwd, microbatches, floor, lat_b=None, lat_l=None, lat_share=0.0):
    return [Expr().add(ovl_b).add(ovl_l).add(bwd, -OVERLAP_EFFICIENCY),
            Expr().add(ovl_l).add(bwd, -OVERLAP_EFFICIENCY / microbatches),
            Expr().add(ovl_b, floor).add(ovl_l, floor).add(lat_b or Expr(), lat_share - floor)
            .add(lat_l or Expr(), lat_share - floor)]


def build_model(problem: Problem, budget_bytes: float | None, objective: str) -> IlpModel:
    md = IlpModel()
    add_one_strategy_per_node(md, problem)
    add_edge_costs(md, problem)
    if objective == "memory":
        m = Expr(md.memory)
        md.objective, md.offset = m.coefs, m.const
    else:
        add_memory_limit(md, budget_bytes)
        cluster = problem.ctx.cluster
        add_overlap_objective(md, problem.microbatches, exposed_floor(cluster), exposed_latency(cluster))
    return md


def model_proto(md: IlpModel, arr: "Rows", rows: np.ndarray, cols: np.ndarray, relax: bool):
    """The sub-model on ``rows`` x ``cols`` as an MPModelProto for ``LoadModelFromProto``: 3-5x
    faster to build than the model term by term through pywraplp's objects."""
    from ortools.linear_solver import linear_solver_pb2

    model = linear_solver_pb2.MPModelProto()
    n = len(md.lb)
    obj = np.zeros(n)
    if md.objective:
        idx = np.fromiter(md.objective.keys(), dtype=np.int64, count=len(md.objective))
        obj[idx] = np.fromiter(md.objective.values(), dtype=float, count=len(md.objective))
    lb, ub, kind = np.asarray(md.lb, dtype=float), np.asarray(md.ub, dtype=float), np.asarray(md.kind)
    add = model.variable.add
    for l, u, o, integer in zip(lb[cols].tolist(), ub[cols].tolist(), obj[cols].tolist(),
                                (kind[cols] == COL_STRATEGY).tolist() if not relax else [False] * len(cols)):
        add(lower_bound=l, upper_bound=u, objective_coefficient=o, is_integer=integer)
    index = np.full(n, -1, dtype=np.int64)
    index[cols] = np.arange(len(cols))
    new_cols = index[arr.cols]
    kept = new_cols >= 0
    for r in rows.tolist():
        lo, hi = arr.starts[r], arr.ends[r]
        mask = kept[lo:hi]
        ct = model.constraint.add(lower_bound=arr.row_lb[r], upper_bound=arr.row_ub[r])
        ct.var_index.extend(new_cols[lo:hi][mask].tolist())
        ct.coefficient.extend(arr.coefs[lo:hi][mask].tolist())
    model.objective_offset = md.offset
    return model
