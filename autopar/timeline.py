"""The predicted timeline of a pipeline plan's step: which rank runs which microbatch's forward
and backward when (``Plan.draw`` renders it as a PNG).

A list-schedule simulation over the plan's per-stage times (``Stage.predicted_time_s``, one
microbatch's forward + backward, split 1:2 as a matmul's backward is twice its forward): an
operation starts when its rank is free and its inputs exist (a forward after the previous
stage's forward of that microbatch; a backward after the next stage's backward and its own
forward). Per rank, GPipe runs every forward then every backward and 1F1B its warm-up forwards,
then one forward / one backward, then the rest, as ``torch.distributed.pipelining`` runs them.
Several looped stages per rank run Megatron's interleaved 1F1B order (stage chunks in groups of
``pp`` microbatches; zero-bubble's split weight gradients are drawn inside the backward): the
shape of those schedules, not torch's exact order. For the V schedules (zbv, dualpipev), or
where the microbatches are not a multiple of ``pp``, a rank takes, when free, the ready backward
of the earliest microbatch once it holds its in-flight limit (``planner.stages.in_flight``), else the
earliest ready forward. Sends between stages are not drawn.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TimelineOp", "simulate", "draw_timeline"]

FORWARD_SHARE = 1.0 / 3.0  # of a stage's forward + backward


@dataclass(frozen=True)
class TimelineOp:
    rank: int
    stage: int
    microbatch: int
    kind: str  # "F" or "B"
    start_s: float
    end_s: float


def _fixed_order(schedule: str, rank: int, ranks: int, m: int) -> list[tuple[str, int]]:
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(m, ranks - rank - 1)
    order = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while f < m:
        order += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    return order + [("B", i) for i in range(b, m)]


def _interleaved_order(rank: int, ranks: int, virtual: int, m: int) -> list[tuple[str, int, int]]:
    """Megatron's interleaved 1F1B order on ``rank``: (kind, chunk, microbatch); microbatches in
    groups of ``ranks`` per chunk, ``2 (p - r - 1) + (v - 1) p`` warm-up forwards."""
    p, v = ranks, virtual
    total = m * v

    def ident(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (v - 1 - chunk if backward else chunk), (k // (p * v)) * p + k % p

    warmup = min(total, 2 * (p - rank - 1) + (v - 1) * p)
    order = [("F", *ident(k, False)) for k in range(warmup)]
    f, b = warmup, 0
    while f < total:
        order += [("F", *ident(f, False)), ("B", *ident(b, True))]
        f, b = f + 1, b + 1
    return order + [("B", *ident(k, True)) for k in range(b, total)]


def simulate(stage_times: list[float], rank_of: list[int], microbatches: int, schedule: str) -> list[TimelineOp]:
    """The operations of one step (see the module docstring); ``stage_times[s]``: stage ``s``'s
    forward + backward for one microbatch; ``rank_of[s]``: the pipeline rank running it."""
    from autopar.schedules import V_SCHEDULES, in_flight

    n, m = len(stage_times), microbatches
    ranks = max(rank_of) + 1
    fwd = [t * FORWARD_SHARE for t in stage_times]
    bwd = [t - f for t, f in zip(stage_times, fwd)]
    end: dict[tuple[str, int, int], float] = {}
    free = [0.0] * ranks
    ops: list[TimelineOp] = []
    virtual = n // ranks
    stage_of_rank = {r: [s for s in range(n) if rank_of[s] == r] for r in range(ranks)}
    orders: dict[int, list[tuple[str, int, int]]] = {}
    if virtual == 1:
        orders = {r: [(k, stage_of_rank[r][0], i) for k, i in _fixed_order(schedule, r, ranks, m)] for r in range(ranks)}
    elif m % ranks == 0 and schedule not in V_SCHEDULES:  # looped stages: stage chunk * pp + r on rank r
        orders = {r: [(k, c * ranks + r, i) for k, c, i in _interleaved_order(r, ranks, virtual, m)] for r in range(ranks)}
    fixed = bool(orders)
    pending = {r: [("F", s, i) for i in range(m) for s in stage_of_rank[r]]
               + [("B", s, i) for i in range(m) for s in stage_of_rank[r]] for r in range(ranks)}
    limit = {r: in_flight(schedule, r, ranks, m, virtual) * virtual for r in range(ranks)}
    live = [0] * ranks  # forwards whose backward has not run, per rank

    def ready(kind: str, s: int, i: int) -> float | None:
        if kind == "F":
            return 0.0 if s == 0 else end.get(("F", s - 1, i))
        if ("F", s, i) not in end:
            return None
        return end[("F", s, i)] if s == n - 1 else end.get(("B", s + 1, i))

    while any(pending.values()):
        best = None
        for r in range(ranks):
            if not pending[r]:
                continue
            if fixed:
                choice = orders[r][0]
                t = ready(*choice)
                if t is None:
                    continue
            else:
                cands = [(op, ready(*op)) for op in pending[r]]
                cands = [(op, t) for op, t in cands if t is not None]
                if not cands:
                    continue
                now = free[r]
                backs = [c for c in cands if c[0][0] == "B"]
                fwds = [c for c in cands if c[0][0] == "F"]
                if backs and (live[r] >= limit[r] or not fwds or min(t for _, t in backs) <= now):
                    choice, t = min(backs, key=lambda c: (max(c[1], now), c[0][2], -c[0][1]))
                else:
                    choice, t = min(fwds, key=lambda c: (max(c[1], now), c[0][2], c[0][1]))
            start = max(free[r], t)
            if best is None or start < best[0]:
                best = (start, r, choice)
        if best is None:
            raise RuntimeError("internal: the pipeline timeline simulation deadlocked")
        start, r, (kind, s, i) = best
        duration = fwd[s] if kind == "F" else bwd[s]
        end[(kind, s, i)] = start + duration
        free[r] = start + duration
        live[r] += 1 if kind == "F" else -1
        pending[r].remove((kind, s, i))
        if fixed:
            orders[r].pop(0)
        ops.append(TimelineOp(r, s, i, kind, start, start + duration))
    return ops


def draw_timeline(plan, path: str) -> list[TimelineOp]:
    """Render ``plan``'s predicted step as a PNG at ``path`` (one row per pipeline rank); returns
    the simulated operations. Needs matplotlib (``pip install autopar[plot]``)."""
    from autopar.errors import AutoparError

    if len(plan.stages) < 2:
        raise AutoparError("draw() renders a pipeline plan's schedule; this plan has one stage (no pipeline)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AutoparError("Plan.draw needs matplotlib: pip install matplotlib (or autopar[plot])") from None
    rank_of = [plan.pipeline_rank(s.index) for s in plan.stages]
    ops = simulate([s.predicted_time_s for s in plan.stages], rank_of, plan.microbatches, plan.schedule)
    ranks = max(rank_of) + 1
    step = max(op.end_s for op in ops)
    fig, ax = plt.subplots(figsize=(min(18, 4 + 0.35 * plan.microbatches * len(plan.stages) / ranks * 2), 1 + 0.6 * ranks))
    cmap = plt.get_cmap("tab20")
    for op in ops:
        color = cmap((op.stage % 10) * 2 + (0 if op.kind == "F" else 1))
        ax.broken_barh([(op.start_s * 1e3, (op.end_s - op.start_s) * 1e3)], (ranks - 1 - op.rank - 0.4, 0.8),
                       facecolors=color, edgecolors="black", linewidth=0.3)
        if plan.microbatches <= 32:
            ax.text((op.start_s + op.end_s) / 2 * 1e3, ranks - 1 - op.rank, f"{op.kind}{op.microbatch}",
                    ha="center", va="center", fontsize=6)
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"pp rank {r}" for r in reversed(range(ranks))])
    ax.set_xlabel("ms (predicted)")
    ax.set_title(f"{plan.schedule}: {len(plan.stages)} stages on {ranks} ranks, {plan.microbatches} microbatches; "
                 f"simulated step {step * 1e3:.2f} ms, bubble {plan.bubble_fraction * 100:.1f}% (plan)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return ops
