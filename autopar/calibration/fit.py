"""Fitting cost-model parameters to measured timings: pure functions over plain numbers.

Every model here is linear in its unknowns, so each fit is one weighted least-squares solve
(``numpy.linalg.lstsq``) that minimises the *relative* error of the prediction (each row divided
by its measured time): a 10 us collective and a 10 ms one weigh the same. Unknowns are kept
positive by refitting without a term that came out negative (an intercept that the data cannot
resolve is 0, not a negative latency).

* ``fit_compute``: ``t = overhead + flops / rate`` for matmuls and ``t = overhead + bytes /
  bandwidth`` for streaming ops, with one shared per-op ``overhead`` (host dispatch, kernel launch):
  what makes a small matmul's achieved efficiency low is that fixed cost, so the fitted pair gives
  a shape-dependent efficiency ``flops / (peak * t)``.
* ``fit_attention``: attention's forward and its backward each ``t = fixed + pairs * per_pair +
  flops * per_flop`` over (batch, head) pairs; the fixed part is ``op_overhead``'s, not kept.
* ``fit_collective``: per collective kind, ``t = latency * hops(p) + bytes * factor(p) / bandwidth``,
  the ring model of ``cost_models.communication`` with the kind's own latency and *bus bandwidth*
  (nccl-tests' definition: the algorithm bandwidth ``bytes / t`` times ``factor(p)``).
* ``monotone_table``: per collective kind and group size, the measured times made non-decreasing
  in the message size (a larger message never takes less time; a dip is noise).
* ``exposed_share``: how much of a collective stays on the critical path when compute runs
  beside it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from autopar.errors import AutoparError

__all__ = ["ComputeFit", "CollectiveFitResult", "fit_compute", "fit_attention", "fit_collective", "fit_op_cost", "ring_terms",
           "exposed_share", "collective_skew", "relative_errors", "monotone_table", "non_decreasing"]


@dataclass(frozen=True)
class ComputeFit:
    """``overhead`` seconds per op, ``matmul_rate`` FLOP/s, ``memory_bandwidth`` bytes/s and
    ``attention_rate`` FLOP/s (None where no attention was measured)."""

    overhead: float
    matmul_rate: float
    memory_bandwidth: float
    attention_rate: float | None = None


@dataclass(frozen=True)
class CollectiveFitResult:
    """One collective kind: ``latency`` seconds per hop and ``bandwidth`` bytes/s (bus bandwidth)."""

    kind: str
    latency: float
    bandwidth: float


def ring_terms(kind: str, p: int) -> tuple[float, float]:
    """(hops, bandwidth factor) of ``kind`` on a ring of ``p`` ranks, as ``cost_models.communication``
    prices it: ``t = hops * latency + factor * bytes / bandwidth``.

    >>> ring_terms("all_reduce", 4), ring_terms("all_gather", 2)
    ((6, 1.5), (1, 0.5))
    """
    if kind == "all_reduce":
        return 2 * (p - 1), 2 * (p - 1) / p
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return p - 1, (p - 1) / p
    if kind == "send_recv":
        return 1, 1.0
    raise AutoparError(f"no ring model for collective kind {kind!r}")


def _positive_lstsq(columns: list[np.ndarray], t: np.ndarray, what: str) -> np.ndarray:
    """Least squares of ``sum_j x_j * columns[j] ~= t`` in relative error, every ``x_j >= 0``:
    a term fitted negative is dropped (set to 0) and the rest refitted."""
    if len(t) < len(columns):
        raise AutoparError(f"fitting {what} needs at least {len(columns)} measurements, got {len(t)}")
    if np.any(~np.isfinite(t)) or np.any(t <= 0):
        raise AutoparError(f"fitting {what}: every measured time must be a positive number, got {t.tolist()}")
    active = list(range(len(columns)))
    x = np.zeros(len(columns))
    while active:
        a = np.stack([columns[j] / t for j in active], axis=1)
        sol, *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
        if np.all(sol >= 0):
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    raise AutoparError(f"fitting {what}: no positive fit to the measurements {t.tolist()}")


def fit_compute(matmuls: Sequence[tuple[float, float]], streams: Sequence[tuple[float, float]],
                attention: Sequence[tuple[float, float]] = ()) -> ComputeFit:
    """Fit one per-op overhead, a matmul rate and a memory bandwidth together.

    ``matmuls``: (flops, seconds) per measured matmul; ``streams``: (bytes read + written,
    seconds) per measured streaming op; ``attention``: (flops, seconds) per attention call, whose
    rate is fitted afterwards with the shared overhead held.

    >>> f = fit_compute([(x, 1e-5 + x / 1e10) for x in (1e6, 1e7, 1e8)], [(b, 1e-5 + b / 1e9) for b in (1e4, 1e6, 1e8)])
    >>> round(f.overhead * 1e6, 3), round(f.matmul_rate / 1e10, 3), round(f.memory_bandwidth / 1e9, 3)
    (10.0, 1.0, 1.0)
    """
    mm = np.asarray(matmuls, dtype=float).reshape(-1, 2)
    st = np.asarray(streams, dtype=float).reshape(-1, 2)
    if len(mm) < 2 or len(st) < 2:
        raise AutoparError("fit_compute needs at least two matmul and two streaming measurements")
    ones = np.ones(len(mm) + len(st))
    flops = np.concatenate([mm[:, 0], np.zeros(len(st))])
    nbytes = np.concatenate([np.zeros(len(mm)), st[:, 0]])
    t = np.concatenate([mm[:, 1], st[:, 1]])
    overhead, inv_rate, inv_bw = _positive_lstsq([ones, flops, nbytes], t, "compute")
    if inv_rate <= 0 or inv_bw <= 0:
        raise AutoparError("fit_compute: the measured times do not grow with the work; measure larger ops")
    att_rate = None
    if len(attention):
        at = np.asarray(attention, dtype=float).reshape(-1, 2)
        rest = np.maximum(at[:, 1] - overhead, 1e-12)
        att_rate = float(np.median(at[:, 0] / rest))
    return ComputeFit(float(overhead), float(1.0 / inv_rate), float(1.0 / inv_bw), att_rate)


def fit_attention(rows: Sequence[tuple[float, float, float, float]]) -> tuple[float, float, float, float]:
    """``DeviceSpec.attention_costs`` from (batch x heads, forward FLOPs, forward seconds, forward
    + backward seconds) per measured shape: for the forward and for the backward (the difference),
    ``t = fixed + pairs * per_pair + flops * per_flop``, every term >= 0. The fixed part (dispatch,
    the autograd engine's entry) is what ``DeviceSpec.op_overhead`` prices per op: dropped.

    >>> rows = [(p, f, 2e-6 + p * 1e-6 + f * 1e-11, 2e-6 + p * 1e-6 + f * 1e-11 + 9e-6 + p * 2e-6 + f * 3e-11)
    ...         for p, f in ((8, 3e5), (128, 2e6), (16, 1e7), (32, 1e8))]
    >>> [round(x, 15) for x in fit_attention(rows)]
    [1e-06, 1e-11, 2e-06, 3e-11]
    """
    at = np.asarray(rows, dtype=float).reshape(-1, 4)
    if len(at) < 3:
        raise AutoparError(f"fit_attention needs at least three measured shapes, got {len(at)}")
    columns = [np.ones(len(at)), at[:, 0], at[:, 1]]
    _, fwd_pair, fwd_flop = _positive_lstsq(columns, at[:, 2], "attention's forward")
    _, bwd_pair, bwd_flop = _positive_lstsq(columns, np.maximum(at[:, 3] - at[:, 2], 1e-9), "attention's backward")
    if fwd_flop + bwd_flop <= 0:
        raise AutoparError("fit_attention: the measured times do not grow with the FLOPs; measure larger shapes")
    return float(fwd_pair), float(fwd_flop), float(bwd_pair), float(bwd_flop)


def fit_collective(kind: str, points: Sequence[tuple[int, float, float]]) -> CollectiveFitResult:
    """Fit ``kind``'s latency per hop and bus bandwidth from (group size, bytes, seconds) points
    (bytes in nccl-tests' size convention, as ``cost_models.communication``).

    >>> pts = [(p, n, 2 * (p - 1) * 1e-4 + 2 * (p - 1) / p * n / 1e9) for p in (2, 4) for n in (1e3, 1e6, 1e7)]
    >>> r = fit_collective("all_reduce", pts)
    >>> round(r.latency * 1e6, 3), round(r.bandwidth / 1e9, 3)
    (100.0, 1.0)
    """
    pts = np.asarray(points, dtype=float).reshape(-1, 3)
    if len(pts) < 2:
        raise AutoparError(f"fitting {kind} needs at least two measurements, got {len(pts)}")
    terms = np.array([ring_terms(kind, int(p)) for p in pts[:, 0]], dtype=float)
    hops, factor = terms[:, 0], terms[:, 1]
    latency, inv_bw = _positive_lstsq([hops, factor * pts[:, 1]], pts[:, 2], kind)
    if inv_bw <= 0:
        raise AutoparError(f"fitting {kind}: its time does not grow with its size; measure larger messages")
    return CollectiveFitResult(kind, float(latency), float(1.0 / inv_bw))


def non_decreasing(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` in least squares (pool adjacent violators:
    a run that decreases is replaced by its mean). Written here because the one library routine,
    ``scipy.optimize.isotonic_regression``, would make scipy a dependency for eight lines.

    >>> non_decreasing([1.8, 1.8, 2.7, 1.0, 2.8, 6.7])
    [1.8, 1.8, 1.85, 1.85, 2.8, 6.7]
    """
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [round(m, 15) for m, n in blocks for _ in range(int(n))]


def monotone_table(rows: Sequence[tuple[str, int, float, float]]) -> tuple[tuple[str, int, float, float], ...]:
    """``(kind, group size, bytes, seconds)`` rows with each (kind, group size)'s seconds made
    non-decreasing in bytes (``non_decreasing``), in (kind, group size, bytes) order. On a shared
    machine one small size can read half its neighbours' time (a 2-rank all-reduce: 1.8 ms at
    32 KiB, 1.0 at 256 KiB, 2.8 at 2 MiB); interpolated as measured, it made mid-size messages
    look cheap enough to change a plan, which then ran at twice its predicted time."""
    series: dict = {}
    for kind, p, nbytes, t in rows:
        series.setdefault((kind, int(p)), []).append((float(nbytes), float(t)))
    out = []
    for (kind, p), pts in sorted(series.items()):
        pts.sort()
        out += [(kind, p, b, t) for (b, _), t in zip(pts, non_decreasing([t for _, t in pts]))]
    return tuple(out)


def fit_op_cost(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """(forward, backward) seconds per element of an op from (elements, forward seconds, forward +
    backward seconds) at two or more sizes: the slopes (what does not grow with the size is the
    per-op overhead, priced apart), never below 0.

    >>> fit_op_cost([(1e3, 1e-5 + 1e-6, 3e-5 + 3e-6), (1e5, 1e-5 + 1e-4, 3e-5 + 3e-4)])
    (1e-09, 2e-09)
    """
    r = np.asarray(rows, dtype=float).reshape(-1, 3)
    if len(r) < 2 or np.ptp(r[:, 0]) <= 0:
        raise AutoparError("fit_op_cost needs measurements at two or more sizes")
    fwd = max(float(np.polyfit(r[:, 0], r[:, 1], 1)[0]), 0.0)
    both = max(float(np.polyfit(r[:, 0], r[:, 2], 1)[0]), fwd)
    return float(np.round(fwd, 18)), float(np.round(both - fwd, 18))


def exposed_share(compute_s: float, comm_s: float, together_s: float) -> float:
    """The share of a collective's time that stays exposed when it runs beside ``compute_s`` of
    compute: ``(together - compute) / comm``, clipped to [0, 1] (0: hidden; 1: serialised).

    >>> exposed_share(1.0, 0.5, 1.25)
    0.5
    """
    if comm_s <= 0:
        raise AutoparError(f"exposed_share: the collective alone must take a positive time, got {comm_s!r}")
    return float(min(1.0, max(0.0, (together_s - compute_s) / comm_s)))


def collective_skew(compute_s: float, alone_s: float, together_s: float) -> float:
    """What a collective waits beyond its own time when the ranks arrive from ``compute_s`` of
    compute: ``together - compute - alone``, at least 0.

    >>> round(collective_skew(1.0e-3, 0.2e-3, 1.5e-3), 6)
    0.0003
    """
    return float(max(0.0, together_s - compute_s - alone_s))


def relative_errors(predicted: Sequence[float], measured: Sequence[float]) -> np.ndarray:
    """``|predicted - measured| / measured`` elementwise."""
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    return np.abs(p - m) / m
