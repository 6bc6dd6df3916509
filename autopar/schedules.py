"""Facts about pipeline schedules that the planner prices and a plan's timeline draws: which
schedules run two stages per rank in a V, and how many microbatches of activations a rank holds
at its peak under each (``planner.stages`` and ``timeline`` use them)."""
from __future__ import annotations

__all__ = ["V_SCHEDULES", "in_flight"]

V_SCHEDULES = ("zbv", "dualpipev")  # two stages per rank in a V: rank r runs stages r and 2 pp - 1 - r


def in_flight(schedule: str, rank: int, ranks: int, microbatches: int, virtual: int = 1) -> float:
    """Microbatches whose activations rank ``rank`` holds at its peak, in units of one microbatch
    through all of the rank's stages: GPipe ``m``; 1F1B ``min(m, p - r)``; interleaved and
    interleaved zero bubble, torch's warm-up depth ``2 (p - 1 - r) + (v - 1) p + 1`` stage
    chunks, each ``1/v`` of the rank's stages; ZBV ``p`` (Qi et al.: ZB-V holds 2p chunks);
    DualPipeV ``p + 1/2`` (the DeepSeek-V3 report's ``PP + 1`` chunks of activations, two per rank)."""
    m, p, v, r = microbatches, ranks, virtual, rank
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, p - r))
    if schedule == "zbv":
        return float(min(m, p))
    if schedule == "dualpipev":
        return min(float(m), p + 0.5)
    return min(m * v, 2 * (p - 1 - r) + (v - 1) * p + 1) / v
