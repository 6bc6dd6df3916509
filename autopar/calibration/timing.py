"""Timing on every rank at once, for the calibration probes: windows of back-to-back calls
between barriers on the slowest rank (``per_op``), taken in passes over a table of points
(``per_op_spread``) or again between the later parts of a calibration (``SpreadProbe``).
``microbench`` runs the probes; the probes (``comm_probes``, ``host_probe``, ``training_probe``)
time with these.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["MicrobenchSpec", "SpreadProbe", "per_op", "per_op_spread", "spread_runs", "agreed_barrier", "progress",
           "sync"]


@dataclass(frozen=True)
class MicrobenchSpec:
    """``repeats``: runs per measurement (their median is kept); ``quick``: the smallest grids
    (tests); ``dtypes``: matmul dtypes measured beside fp32; ``backend``: "gloo" (CPU processes)
    or "nccl" (one GPU per process)."""

    repeats: int = 5
    quick: bool = False
    dtypes: tuple[str, ...] = ("bfloat16",)
    backend: str = "gloo"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_op(fn: Callable[[], object], device: torch.device, repeats: int, barrier, min_s: float = 0.02,
            min_calls: int = 1) -> float:
    """Median over ``repeats`` of the seconds per call of ``fn`` on the slowest rank: each run
    calls it back to back for about ``min_s``, and at least ``min_calls`` times (every rank the
    same count), between two barriers, less what the barriers alone take. The window is long
    enough for the processes that share a core to take turns inside it, so what they share is
    in the figure."""
    return per_op_spread([fn], device, repeats, barrier, min_s, min_calls)[0]


def per_op_spread(fns: list[Callable[[], object]], device: torch.device, repeats: int, barrier,
                   min_s: float = 0.02, min_calls: int = 1) -> list[float]:
    """``per_op`` of each of ``fns``, its ``repeats`` windows taken in as many passes over all of
    them: each figure's median spans the whole measurement, not a moment of it. A shared machine's
    speed moves from second to second (a 4 KiB all-reduce of 2 of 4 processes read 1.6 to 3.6 ms
    over 100 s, in runs of 20 calls 3 s apart): windows back to back all land in one moment."""
    return [statistics.median(r) for r in spread_runs(fns, device, repeats, barrier, min_s, min_calls)[1]]


def spread_runs(fns: list[Callable[[], object]], device: torch.device, repeats: int, barrier,
                 min_s: float = 0.02, min_calls: int = 1) -> tuple[list[int], list[list[float]]]:
    """(calls per window of each of ``fns``, its ``repeats`` windows' seconds per call), the
    windows taken in passes over all of them (``per_op_spread``'s, before their medians)."""
    calls = [_calls_for(fn, device, barrier, min_s, min_calls) for fn in fns]
    runs: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        _pass(fns, calls, runs, device, barrier)
    return calls, runs


def _pass(fns: list[Callable[[], object]], calls: list[int], runs: list[list[float]], device: torch.device,
          barrier) -> None:
    """One window of each of ``fns`` (``calls`` calls each), its seconds per call appended to ``runs``."""
    idle = statistics.median(_window(lambda: None, 0, device, barrier) for _ in range(3))
    for fn, n, out in zip(fns, calls, runs):
        w = _window(fn, n, device, barrier)
        # the barriers' own time is taken off each window, at most half of it: on a shared
        # machine their jitter can exceed a short window's work, and a run is never priced at nothing
        out.append(max(w - idle, w / 2) / n)


class SpreadProbe:
    """Windows of a few probes taken again between the later parts of a calibration
    (``sample``): each figure's median spans the whole measurement, not the seconds of its own
    part. The figures that price a dispatch-bound model (an op's cost in a training step) moved
    most between calibrations: 13.0 and 18.2 us per op on 2 processes an hour apart, 33 and 56
    us on 4, while the GPT plans they priced ran within 10% of each other."""

    def __init__(self, device: torch.device, barrier):
        self.device, self.barrier = device, barrier
        self.fns: list[Callable[[], object]] = []
        self.calls: list[int] = []
        self.runs: list[list[float]] = []
        self.names: list[str] = []

    def add(self, name: str, fn: Callable[[], object], repeats: int, min_s: float) -> None:
        """Time ``fn`` now (``repeats`` windows of about ``min_s``), and again at each ``sample``."""
        calls, runs = spread_runs([fn], self.device, repeats, self.barrier, min_s)
        self.names.append(name)
        self.fns.append(fn)
        self.calls += calls
        self.runs += runs

    def sample(self) -> None:
        """One more window of every probe (every rank calls it at the same points)."""
        if self.fns:
            _pass(self.fns, self.calls, self.runs, self.device, self.barrier)

    def windows(self, name: str) -> list[float]:
        """Every window's seconds per call of probe ``name``, in the order they were taken."""
        return list(self.runs[self.names.index(name)])

    def medians(self) -> dict[str, float]:
        """Seconds per call of each probe: the median of all its windows."""
        return {name: statistics.median(r) for name, r in zip(self.names, self.runs)}


def _calls_for(fn: Callable[[], object], device: torch.device, barrier, min_s: float, min_calls: int) -> int:
    """How many calls of ``fn`` fill ``min_s`` (at least ``min_calls``), the largest count of any rank."""
    fn()
    sync(device)
    singles = []
    for _ in range(3):  # one call's time, from the median of three (one slow call would shorten every window)
        t0 = time.perf_counter()
        fn()
        sync(device)
        singles.append(time.perf_counter() - t0)
    one = max(statistics.median(singles), 1e-7)
    return barrier(max(min_calls, min(100_000, int(min_s / one))))  # every rank runs the largest count


def _window(fn: Callable[[], object], calls: int, device: torch.device, barrier) -> float:
    """Seconds from one barrier to the next with ``calls`` calls of ``fn`` between them."""
    barrier(None)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    barrier(None)
    return time.perf_counter() - t0


def agreed_barrier(world: int):
    """A barrier that, given a count, returns the largest count of every rank (one rank: no-op).
    On gloo it is an all-reduce waited for as the runtime waits (``runtime.comm.wait_for``): a
    rank that slept in ``dist.barrier`` could wake a timer tick late, and every timing window
    ends at a barrier (on a 2-core VM, 2 processes' table read a 128 KiB all-reduce at 1.26 ms
    between sleeping barriers, where it averaged 0.34-0.52 ms in long loops)."""
    import torch.distributed as dist

    from autopar.runtime.comm import polls, runs_nccl, wait_for

    polled = world > 1 and not runs_nccl() and polls("all_reduce", torch.empty(0, dtype=torch.int64))

    def barrier(count):
        if world == 1:
            return count
        if count is None and not polled:  # NCCL, or AUTOPAR_COLLECTIVE_WAIT=block: torch's own barrier
            dist.barrier()
            return None
        t = torch.tensor([0 if count is None else count], dtype=torch.int64)
        wait_for(dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True), polled)
        return None if count is None else int(t.item())

    return barrier


def progress(text: str) -> None:
    """One line on rank 0's stderr: what is being measured (calibration takes tens of seconds)."""
    import os
    import sys

    if os.environ.get("RANK", "0") == "0":
        print(f"  calibrate: {text}", file=sys.stderr, flush=True)
