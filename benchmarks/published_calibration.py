"""Fits of one cost-model constant on one published run: ``calibrate_comm`` (the inter-node
``LinkSpec.efficiency`` or ``LinkSpec.rails``) and ``calibrate_exposed``
(``Cluster.exposed_comm_share``). Each re-plans the run (``published_runs.plan_entry``) with a
trial value set in ``published_runs`` until the predicted step time meets the published one, and
leaves the fitted value set there.
"""
from __future__ import annotations

import sys

import published_runs as runs
from published_runs import cluster_for, plan_entry


def _narrow(lo, f_lo, hi, f_hi, side: int, x: float, f: float):
    """One regula falsi (Illinois) step: the trial ``(x, f)`` replaces the bracket's end of its
    sign (``f < 0``: the low end); when the same end moves twice running, the other end's value is
    halved, so a stale end cannot stall the bracket (``f_hi`` None: not bracketed yet). Returns
    ``(lo, f_lo, hi, f_hi, side)``."""
    if f < 0:
        if side == -1 and f_hi is not None:
            f_hi /= 2
        return x, f, hi, f_hi, -1
    if side == 1:
        f_lo /= 2
    return lo, f_lo, x, f, 1


def calibrate_comm(ref: dict, constant: str = "efficiency", tol: float = 0.005, max_plans: int = 10) -> float:
    """The inter-node ``constant`` ("efficiency" or "rails") at which the planner's step time for
    ``ref`` equals the published one. Every trial is a full re-plan. Both constants divide the
    inter-node bandwidth a collective sees, so the search runs on x = 1/efficiency or
    x = devices_per_node/rails (x >= 1; rails cannot go below one NIC, x <= devices_per_node): the
    step time is close to piecewise linear in x (flat while communication hides behind compute,
    then slope = the communication time at x = 1). Regula falsi (Illinois) on x inside a
    bracket, started from that linear model."""
    dpn = cluster_for(ref)[0].devices_per_node
    x_max = float(dpn) if constant == "rails" else float("inf")
    print(f"calibrating the inter-node {constant} on {ref['id']} ...", file=sys.stderr, flush=True)

    def value(x: float) -> float:
        return dpn / x if constant == "rails" else 1.0 / x

    def trial(x: float) -> tuple[float, dict]:
        if constant == "rails":
            runs.RAILS_OVERRIDE = value(x)
        else:
            runs.COMM_EFFICIENCY_OVERRIDE = value(x)
        r = plan_entry(ref)
        if not r["ok"]:
            raise SystemExit(f"cannot calibrate on {ref['id']}: {r['error']}")
        print(f"  {constant} {value(x):.4f}: predicted {r['step_s']:.2f} s/iter vs published {r['published_step_s']:.2f} s",
              file=sys.stderr, flush=True)
        return r["step_s"] - r["published_step_s"], r

    f_lo, r = trial(1.0)
    target = r["published_step_s"]
    if f_lo >= 0:
        raise SystemExit(f"cannot calibrate on {ref['id']}: at the preset's {constant} the prediction ({r['step_s']:.2f} s) "
                         f"is already not below the published {target:.2f} s; communication cannot explain the gap")
    lo, hi, f_hi = 1.0, None, None
    total_comm = sum(r["comm_s"].values())
    # linear model: step(x) = compute + total_comm * x - OVERLAP_EFFICIENCY * compute, once exposed
    x = min(x_max, max(1.0 + 1e-3, (target - 0.2 * r["compute_s"]) / max(total_comm, 1e-12)))
    side = 0
    for _ in range(max_plans - 1):
        f, r = trial(x)
        if abs(f) <= tol * target:
            break
        if f < 0 and x >= x_max:
            print(f"  {constant} at its limit ({value(x):.4f}) and the prediction is still below the published "
                  "step: kept at the limit", file=sys.stderr, flush=True)
            break
        lo, f_lo, hi, f_hi, side = _narrow(lo, f_lo, hi, f_hi, side, x, f)
        if hi is None:
            x = min(x_max, 2 * x)  # not bracketed yet: communication still hidden at this value
        else:
            x = lo - f_lo * (hi - lo) / (f_hi - f_lo)
    fitted = runs.RAILS_OVERRIDE if constant == "rails" else runs.COMM_EFFICIENCY_OVERRIDE
    print(f"calibrated on {ref['id']}: inter-node {constant} {fitted:.4f} "
          f"(predicted {r['step_s']:.2f} s/iter vs published {target:.2f} s)\n")
    return fitted


def calibrate_exposed(ref: dict, tol: float = 0.005, max_plans: int = 8) -> float:
    """The ``Cluster.exposed_comm_share`` at which the planner's step time for ``ref`` (a run
    whose communication could hide behind its compute) equals the published one. The step time
    grows with the share, piecewise linearly (slope: the overlappable communication once the
    floor binds), so the search is regula falsi on the share in [0, 1] (each trial leaves
    ``runs.EXPOSED_OVERRIDE`` at the share it tried: the last one is the fit)."""
    print(f"calibrating the exposed communication share on {ref['id']} ...", file=sys.stderr, flush=True)

    def trial(share: float) -> float:
        runs.EXPOSED_OVERRIDE = share
        r = plan_entry(ref)
        if not r["ok"]:
            raise SystemExit(f"cannot calibrate on {ref['id']}: {r['error']}")
        print(f"  exposed share {share:.4f}: predicted {r['step_s']:.2f} s/iter vs published {r['published_step_s']:.2f} s",
              file=sys.stderr, flush=True)
        return r["step_s"] - r["published_step_s"]

    lo, hi = 0.0, 1.0
    f_lo, f_hi = trial(lo), trial(hi)
    if f_lo >= 0 or f_hi <= 0:
        raise SystemExit(f"cannot calibrate on {ref['id']}: the published step is outside what shares 0..1 predict "
                         f"({f_lo:+.2f} s .. {f_hi:+.2f} s from it)")
    side, share = 0, lo
    for _ in range(max_plans - 2):
        share = lo - f_lo * (hi - lo) / (f_hi - f_lo)
        f = trial(share)
        if abs(f) <= tol * abs(f_hi - f_lo + 1e-12) or abs(f) < 1e-3:
            break
        lo, f_lo, hi, f_hi, side = _narrow(lo, f_lo, hi, f_hi, side, share, f)
    print(f"calibrated on {ref['id']}: exposed communication share {share:.4f}\n")
    return share
