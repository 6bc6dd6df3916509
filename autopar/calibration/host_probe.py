"""The host's own time per collective the runtime issues (``DeviceSpec.collective_host_s``): a
reshard's autograd node, its buffers and layout copies (``runtime.collectives``), timed with the
network left out. Part of ``autopar calibrate``'s measurements (``calibration.microbench``), on
CPU processes only, where host and device are one.
"""
from __future__ import annotations

import statistics

import torch

from autopar.calibration.microbench import MicrobenchSpec, _per_op_spread, _progress

__all__ = ["collective_host_s"]

# the reshards timed: (src, dst, grad src, grad dst, the local input's shape as a function of the
# group size p, collectives per forward + backward)
_HOST_RESHARDS = (("[S(2)]", "[R]", "[R]", "[S(2)]", lambda p: (8, 16, 16), 1),  # gather; backward slices
                  ("[P(sum)]", "[R]", "[R]", "[R]", lambda p: (8, 16, 16 * p), 1),  # a row-parallel output
                  ("[R]", "[R]", "[P(sum)]", "[R]", lambda p: (8, 16, 16 * p), 1),  # a column-parallel input
                  ("[S(0)]", "[S(2)]", "[S(2)]", "[S(0)]", lambda p: (8, 16, 16 * p), 2))  # all-to-all both ways


class _NullNetwork:
    """A one-axis ``MeshComm`` stand-in whose collectives move nothing: each fills its output
    from its input on this rank, so a reshard through it costs only what the host does."""

    def __init__(self, size: int, coord: int):
        from autopar.runtime.comm import CommStats

        self.sizes, self.coords, self.stats = (size,), (coord,), CommStats()
        self.step_cache: dict = {}

    def all_reduce(self, t, axis, *, async_op=False):
        return None  # the sum stays this rank's

    def all_gather(self, out, inp, axis, *, async_op=False):
        n = min(out.numel(), inp.numel())  # as much of the output as this rank's input fills
        out.view(-1)[:n].copy_(inp.reshape(-1)[:n])

    reduce_scatter = all_to_all = all_gather


def collective_host_s(spec: MicrobenchSpec, device: torch.device, barrier, world: int) -> float:
    """Seconds the host spends per collective besides the collective: the median over
    ``_HOST_RESHARDS``, each timed forward and backward through ``_NullNetwork`` less the same
    loss on an input of its shape alone (each shape's once), all in passes over every one of them
    (``microbench._per_op_spread``). Every rank at once, as ranks that share cores run. On 4
    processes on 2 cores it read 84-118 us (38 us on 2), against 2-4 ms of the collectives
    themselves; the GPT's tensor-parallel step, its collectives left out, ran 0.25-0.3 ms per
    collective above its predicted compute (the rest is not traced)."""
    import torch.distributed as dist

    from autopar.runtime.collectives import active_mesh, reshard

    _progress("the host's own time per collective")
    comm = _NullNetwork(world, dist.get_rank())
    inputs = {shape: torch.randn(shape, device=device, requires_grad=True)
              for shape in dict.fromkeys(r[4](world) for r in _HOST_RESHARDS)}
    alone = [lambda x=x: x.sum().backward() for x in inputs.values()]
    reshards = [lambda x=inputs[shape(world)], src=src, dst=dst, gsrc=gsrc, gdst=gdst:
                reshard(x, src, dst, gsrc, gdst).sum().backward()
                for src, dst, gsrc, gdst, shape, _ in _HOST_RESHARDS]
    with active_mesh(comm):
        seconds = _per_op_spread(alone + reshards, device, spec.repeats, barrier)
    base = dict(zip(inputs, seconds[:len(alone)]))
    return statistics.median(max(t - base[shape(world)], 0.0) / count
                             for (*_, shape, count), t in zip(_HOST_RESHARDS, seconds[len(alone):]))
