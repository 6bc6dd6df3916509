"""The host's own time per collective the runtime issues (``DeviceSpec.collective_host_s``, and
``collective_host_byte_s`` per byte): a reshard's autograd node, its buffers and layout copies
(``runtime.collectives``), timed with the network left out. Part of ``autopar calibrate``'s
measurements (``calibration.microbench``), on CPU processes only, where host and device are one.
"""
from __future__ import annotations

import statistics

import torch

from autopar.calibration.timing import MicrobenchSpec, per_op_spread, progress

__all__ = ["collective_host_s", "host_time_fit", "HOST_ROWS"]

# the reshards timed: (src, dst, grad src, grad dst, the local input's shape for group size p and
# `rows` rows, collectives per forward + backward)
_HOST_RESHARDS = (("[S(2)]", "[R]", "[R]", "[S(2)]", lambda p, rows: (rows, 16, 16), 1),  # gather; backward slices
                  ("[P(sum)]", "[R]", "[R]", "[R]", lambda p, rows: (rows, 16, 16 * p), 1),  # a row-parallel output
                  ("[R]", "[R]", "[P(sum)]", "[R]", lambda p, rows: (rows, 16, 16 * p), 1),  # a column-parallel input
                  ("[S(0)]", "[S(2)]", "[S(2)]", "[S(0)]", lambda p, rows: (rows, 16, 16 * p), 2))  # all-to-all both ways
# each reshard at two sizes: 8 and 256 rows (8 KiB and 256 KiB of input per group member; a layout
# copy costs its bytes: on 2 processes, a gather of 8 KiB per rank took 80 us of the host, of
# 128 KiB 145 us, of 512 KiB 474 us)
HOST_ROWS = (8, 256)


class _NullNetwork:
    """A one-axis ``MeshComm`` stand-in whose collectives move nothing (an output keeps what its
    buffer held: the collective's own copy is in its measured time), so a reshard through it
    costs only what the host does."""

    def __init__(self, size: int, coord: int):
        from autopar.runtime.comm import CollectiveLog, CommStats

        self.sizes, self.coords, self.stats, self.log = (size,), (coord,), CommStats(), CollectiveLog()
        self.step_cache: dict = {}

    def all_reduce(self, t, axis, *, async_op=False):
        return None

    def all_gather(self, out, inp, axis, *, async_op=False):
        return None

    reduce_scatter = all_to_all = all_gather


def collective_host_s(spec: MicrobenchSpec, device: torch.device, barrier, world: int) -> dict:
    """The host's seconds per collective besides the collective, and per byte of it:
    ``{"collective_host_s": ..., "collective_host_byte_s": ...}``. Each of ``_HOST_RESHARDS`` at
    each of ``HOST_ROWS`` is timed forward and backward through ``_NullNetwork``, less the same
    loss on an input of its shape alone, all in passes over every one of them
    (``timing.per_op_spread``), every rank at once as ranks that share cores run. Per
    reshard, the slope over its two sizes is its time per byte it copies
    (``planner.costing.reshard_copy_bytes``, ``_copied_bytes``), what is left at the smaller its
    time per collective; each figure is the median over the reshards. On 4
    processes on 2 cores the per-collective time read 84-118 us (38 us on 2), against 2-4 ms of
    the collectives themselves."""
    import torch.distributed as dist

    from autopar.runtime.collectives import active_mesh, reshard

    progress("the host's own time per collective")
    comm = _NullNetwork(world, dist.get_rank())
    cases = [(r, rows) for r in _HOST_RESHARDS for rows in HOST_ROWS]
    inputs = {shape: torch.randn(shape, device=device, requires_grad=True)
              for shape in dict.fromkeys(r[4](world, rows) for r, rows in cases)}
    alone = [lambda x=x: x.sum().backward() for x in inputs.values()]
    reshards = [lambda x=inputs[shape(world, rows)], src=src, dst=dst, gsrc=gsrc, gdst=gdst:
                reshard(x, src, dst, gsrc, gdst).sum().backward()
                for (src, dst, gsrc, gdst, shape, _), rows in cases]
    per_call = [_copied_bytes(r, rows, world) / r[5] for r, rows in cases]  # bytes copied per collective
    with active_mesh(comm):
        seconds = per_op_spread(alone + reshards, device, spec.repeats, barrier)
    base = dict(zip(inputs, seconds[:len(alone)]))
    host = [max(t - base[r[4](world, rows)], 0.0) / r[5] for (r, rows), t in zip(cases, seconds[len(alone):])]
    n = len(HOST_ROWS)  # per reshard: its smaller and larger size
    return host_time_fit([(host[i], host[i + 1], per_call[i], per_call[i + 1]) for i in range(0, len(cases), n)])


def _copied_bytes(reshard, rows: int, world: int) -> float:
    """The layout copies (``planner.costing.reshard_copy_bytes``) of one of ``_HOST_RESHARDS``,
    forward and backward, on one axis of ``world`` ranks: what the cost model will price."""
    from autopar.layouts import Shard, parse_layout
    from autopar.planner.costing import reshard_copy_bytes

    src, dst, gsrc, gdst, shape, _ = reshard
    full = list(shape(world, rows))
    for placement in parse_layout(src):  # the input's global shape
        if isinstance(placement, Shard):
            full[placement.dim] *= world
    return sum(sum(reshard_copy_bytes(tuple(full), 4.0, parse_layout(a), parse_layout(b), (world,)))
               for a, b in ((src, dst), (gsrc, gdst)))


def host_time_fit(points: list[tuple[float, float, float, float]]) -> dict:
    """Per reshard, (seconds per collective at the smaller size, at the larger, bytes copied per
    collective at each): its slope per byte (never below 0) and what is left at the smaller size
    (never below 0); the median of each over the reshards (pure).

    >>> fit = host_time_fit([(1e-4, 3e-4, 1e3, 1e5), (2e-4, 2e-4, 1e3, 1e5), (1e-4, 5e-4, 1e3, 1e5)])
    >>> round(fit["collective_host_s"] * 1e6, 2), round(fit["collective_host_byte_s"] * 1e9, 3)
    (97.98, 2.02)
    """
    slopes, fixed = [], []
    for t_small, t_large, b_small, b_large in points:
        slope = max((t_large - t_small) / (b_large - b_small), 0.0) if b_large > b_small else 0.0
        slopes.append(slope)
        fixed.append(max(t_small - slope * b_small, 0.0))
    return {"collective_host_s": statistics.median(fixed), "collective_host_byte_s": statistics.median(slopes)}
