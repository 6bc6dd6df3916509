"""The pipelines a plan without ``pp`` also weighs, on a multi-node cluster: the stage counts
``free_pipeline_candidates`` proposes, each priced by ``pipeline_search.price_pipeline_plan``,
and ``best_of``, the fastest of them and the single-stage plan.
"""
from __future__ import annotations

import dataclasses

from autopar.cluster import Cluster
from autopar.constraints import Constraints
from autopar.errors import ConstraintError, NoFeasiblePlanError
from autopar.plan import Plan
from autopar.planner.pipeline_search import GiB, price_pipeline_plan

__all__ = ["free_pipeline_candidates", "best_of", "MAX_FREE_PIPELINES", "FREE_MEMORY_ROUNDS"]

# at most this many stage counts are searched for a plan without ``pp`` (each costs one
# per-operator search of a submesh)
MAX_FREE_PIPELINES = 5
# memory rounds per stage count weighed for a plan without pp (a stage count that needs more is
# left out; with pp= given, ``pipeline_search._MEMORY_ROUNDS``)
FREE_MEMORY_ROUNDS = 3


def free_pipeline_candidates(traced, cluster: Cluster, c: Constraints) -> list[Constraints]:
    """The pipeline configurations a plan without ``pp`` also weighs, on a multi-node cluster
    of a model with repeated blocks: ``pp`` dividing both the node count (whole nodes per stage)
    and the number of repeated blocks (balanced stages), tensor parallel inside a node
    (``devices_per_node``, as Megatron's PTD-P: the rest of each stage's devices data
    parallel), one sample per microbatch per replica (the smallest bubble for the batch); all of
    them, smallest ``pp`` first (``best_of`` decides which to price). None when the
    constraints fix a decision these would override (microbatches, a schedule, dp and tp both, HSDP)."""
    from autopar.planner.blocks import find_repeated_blocks
    from autopar.planner.constraint_filter import pin_key

    from autopar.ir import training_batch_norms

    batch = traced.global_batch
    if cluster.nodes < 2 or not batch or c.pp == 1 or c.schedule is not None or c.microbatches is not None \
            or c.virtual_stages or c.hsdp is not None or training_batch_norms(traced.graph):  # (a batch norm needs the whole batch)
        return []
    blocks = find_repeated_blocks(traced.graph, pin_key(c))
    layers = max((len(v) for v in blocks.blocks.values()), default=0)
    if layers < 2:
        return []
    tp = c.tp or cluster.devices_per_node
    out = []
    for pp in range(2, cluster.nodes + 1):
        if cluster.nodes % pp or layers % pp or cluster.world_size % (pp * tp):
            continue
        dp = cluster.world_size // (pp * tp)
        if (c.dp is not None and c.dp != dp) or batch % dp:
            continue
        out.append(dataclasses.replace(c, pp=pp, tp=tp, dp=dp, microbatches=batch // dp, schedule="1f1b"))
    return out


def _spread(n: int) -> list[int]:
    """Indices of ``MAX_FREE_PIPELINES`` of ``n`` sorted candidates, spread evenly, ends included."""
    if n <= MAX_FREE_PIPELINES:
        return list(range(n))
    step = (n - 1) / (MAX_FREE_PIPELINES - 1)
    return sorted({round(i * step) for i in range(MAX_FREE_PIPELINES)})


def best_of(single: Plan | None, failure: Exception | None, candidates: list[Constraints], traced, cluster: Cluster, *,
            precision, optimizer, solver, progress, inner_search) -> Plan:
    """The fastest of the single-stage plan (None: ``failure`` says why there is none) and the
    pipeline plans of ``candidates`` (sorted by ``pp``): ``MAX_FREE_PIPELINES`` of them spread
    over the range, then the neighbours of the fastest until it stops moving, each under 1F1B
    and interleaved 1F1B, then the fastest's microbatch count halved while that is faster; every
    alternative's outcome is listed in the plan's solver report."""
    from autopar.planner.ilp import InfeasibleProblem

    tried: list[tuple[str, str]] = []
    best_pipe, best_c = None, None  # the fastest pipeline plan and its constraints
    # memory binds on one stage's devices already: a stage holding pp microbatches recomputes too
    # (PTD-P's choice), so its per-operator plan starts there rather than finding out
    recompute_first = single is None or bool(single.recompute_blocks)

    def price(cand, schedules=("1f1b", "interleaved-1f1b")) -> float | None:
        """Price ``cand`` under each of ``schedules``; its fastest step time (None: none fits)."""
        nonlocal best_pipe, best_c
        fastest = None
        for schedule in schedules:
            c = dataclasses.replace(cand, schedule=schedule)
            label = f"pp={c.pp} dp={c.dp} tp={c.tp} microbatches={c.microbatches} {schedule}"
            beat = ([single.predicted.step_time_s] if single is not None else []) + (
                [best_pipe.step_time_s] if best_pipe is not None else [])
            try:
                plan = price_pipeline_plan(traced, cluster, constraints=c, precision=precision, optimizer=optimizer,
                                           solver=solver, progress=progress, inner_search=inner_search,
                                           memory_rounds=FREE_MEMORY_ROUNDS, recompute_first=recompute_first,
                                           to_beat_s=min(beat, default=None))
            except (ConstraintError, NoFeasiblePlanError, InfeasibleProblem) as exc:
                tried.append((label, f"not possible: {str(exc).split('; ')[0]}"))
                continue
            tried.append((label, f"{plan.step_time_s * 1e3:.3f} ms/step, peak "
                                 f"{plan.peak_memory_bytes / GiB:.2f} GiB, bubble {plan.bubble_fraction * 100:.1f}%"))
            if best_pipe is None or plan.step_time_s < best_pipe.step_time_s * (1 - 1e-9):
                best_pipe, best_c = plan, c
            if fastest is None or plan.step_time_s < fastest:
                fastest = plan.step_time_s
        return fastest

    # a spread of stage counts first; then the nearest untried counts either side of the fastest
    # (past those that did not fit), while the fastest moves
    # (the step time is close to unimodal in pp: bubble and sends grow with it, per-stage work shrinks)
    times: dict[int, float | None] = {}
    for i in _spread(len(candidates)):
        times[i] = price(candidates[i])
    while True:
        priced = [i for i, t in times.items() if t is not None]
        if not priced:
            break
        top = min(priced, key=lambda i: times[i])
        fresh = []
        for step in (-1, 1):  # the nearest untried count each way, past counts that did not fit
            j = top + step
            while j in times and times[j] is None:
                j += step
            if 0 <= j < len(candidates) and j not in times:
                fresh.append(j)
        if not fresh:
            break
        for j in fresh:
            times[j] = price(candidates[j])
    # then the microbatch count of the fastest pipeline (faster than the single-stage plan or not),
    # halved while that is faster: fewer, larger microbatches make a larger bubble but cost less per
    # microbatch (sends' latency, smaller matmuls' efficiency, ZeRO's gathers and reductions)
    while best_c is not None:
        m = best_c.microbatches // 2
        batch = traced.global_batch
        if best_c.microbatches % 2 or m < best_c.pp or (batch // m) % (best_c.dp or 1):
            break
        before = best_c
        price(dataclasses.replace(best_c, microbatches=m), schedules=(best_c.schedule,))
        if best_c is before:
            break
    best = single
    if best_pipe is not None and (single is None or best_pipe.step_time_s < single.predicted.step_time_s * (1 - 1e-9)):
        best = best_pipe.assemble()  # (only the plan kept is assembled)
    if best is None:
        raise failure
    # every alternative weighed: the single-stage search's, then the pipelines'
    report = dataclasses.replace(best.solver, candidates=(single.solver.candidates if single is not None else ())
                                 + tuple(tried))
    notes = best.notes
    if best is not single:
        why = ("no single-stage plan fits" if single is None else
               f"{single.predicted.step_time_s / best.predicted.step_time_s:.2f}x the speed of the best single-stage plan "
               f"({single.predicted.step_time_s * 1e3:.1f} ms/step)")
        notes = notes + (f"pipelined: {why}",)
    return dataclasses.replace(best, solver=report, notes=notes)
