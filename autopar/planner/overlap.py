"""The overlap model in floating point: how much of each communication window stays exposed.

``planner.ilp`` states the same model as linear constraints (its module docstring has the
formulas); ``planner.evaluate`` and ``planner.local_search`` compute it with these numbers.
"""
from __future__ import annotations

__all__ = ["OVERLAP_EFFICIENCY", "EXPOSED_FLOOR", "exposed_floor", "exposed_seconds"]

OVERLAP_EFFICIENCY = 0.8  # at most this share of a compute window hides communication
EXPOSED_FLOOR = 0.05  # at least this share of overlappable communication stays exposed (default)


def exposed_floor(cluster) -> float:
    """The exposed share of overlappable communication on ``cluster``: its calibrated
    ``Cluster.exposed_comm_share``, else ``EXPOSED_FLOOR``."""
    share = getattr(cluster, "exposed_comm_share", None)
    return EXPOSED_FLOOR if share is None else float(share)


def exposed_seconds(fwd: float, bwd: float, ovl_f: float, ovl_b: float, ovl_l: float, microbatches: int,
                    floor: float = EXPOSED_FLOOR) -> tuple[float, float]:
    """The overlap model in floating point: (exposed in the forward window, in the backward one)."""
    f = max(ovl_f - OVERLAP_EFFICIENCY * fwd, floor * ovl_f, 0.0)
    b = max(ovl_b + ovl_l - OVERLAP_EFFICIENCY * bwd, ovl_l - OVERLAP_EFFICIENCY / microbatches * bwd,
            floor * (ovl_b + ovl_l), 0.0)
    return f, b
