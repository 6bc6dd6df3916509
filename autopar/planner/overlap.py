"""The overlap model in floating point: how much of each communication window stays exposed.

``planner.ilp`` states the same model as linear constraints (its module docstring has the
formulas); ``planner.evaluate`` and ``planner.local_search`` compute it with these numbers.
"""
from __future__ import annotations

__all__ = ["OVERLAP_EFFICIENCY", "EXPOSED_FLOOR", "exposed_floor", "exposed_latency", "exposed_seconds"]

OVERLAP_EFFICIENCY = 0.8  # at most this share of a compute window hides communication
EXPOSED_FLOOR = 0.05  # at least this share of overlappable communication stays exposed (default)


def exposed_floor(cluster) -> float:
    """The exposed share of overlappable communication's bytes on ``cluster`` (its latency can
    hide: ``exposed_seconds``): its calibrated ``Cluster.exposed_comm_share``, else
    ``EXPOSED_FLOOR``."""
    share = getattr(cluster, "exposed_comm_share", None)
    return EXPOSED_FLOOR if share is None else float(share)


def exposed_latency(cluster) -> float:
    """The exposed share of overlappable communication's waiting (its latency) on ``cluster``:
    its calibrated ``Cluster.exposed_latency_share`` (``calibration.comm_probes.probe_waiting``),
    else 0 (the waiting hides: a GPU's collectives progress on their own streams)."""
    share = getattr(cluster, "exposed_latency_share", None)
    return 0.0 if share is None else float(share)


def exposed_seconds(fwd: float, bwd: float, ovl_f: float, ovl_b: float, ovl_l: float, microbatches: int,
                    floor: float = EXPOSED_FLOOR, lat_f: float = 0.0, lat_b: float = 0.0,
                    lat_l: float = 0.0, lat_share: float = 0.0) -> tuple[float, float]:
    """The overlap model in floating point: (exposed in the forward window, in the backward one).

    ``lat_*``: the waiting part of each window's seconds (``costing.reshard_latency``). At least
    ``floor`` of the rest, the time spent moving bytes, stays exposed: on CPU ranks that fill
    every core (``exposed_comm_share`` 1.0) the bytes move on the cores compute runs on, and only
    the waiting hides (measured on 2 processes, 2 cores: an asynchronous gradient sync saved 17-20
    ms of the MLP's step against the same collectives waited at once, its buckets' latency 12-23
    ms). At least ``lat_share`` of the waiting stays exposed too (``exposed_latency``): where
    nothing progresses a collective while the ranks compute, the waiting does not hide either
    (2 and 4 gloo processes on 2 cores: a 4 KiB all-reduce issued before 3x its time of compute
    was exposed in full in the median pass, ``calibration.comm_probes.probe_waiting``).

    >>> exposed_seconds(1.0, 1.0, 0.5, 0.0, 0.0, 1, floor=1.0, lat_f=0.2)
    (0.3, 0.0)
    >>> exposed_seconds(1.0, 1.0, 0.5, 0.0, 0.0, 1, floor=1.0, lat_f=0.2, lat_share=1.0)
    (0.5, 0.0)
    """
    f = max(ovl_f - OVERLAP_EFFICIENCY * fwd, floor * (ovl_f - lat_f) + lat_share * lat_f, 0.0)
    b = max(ovl_b + ovl_l - OVERLAP_EFFICIENCY * bwd, ovl_l - OVERLAP_EFFICIENCY / microbatches * bwd,
            floor * (ovl_b - lat_b + ovl_l - lat_l) + lat_share * (lat_b + lat_l), 0.0)
    return f, b
