"""The one place the runtime talks to torch.distributed: a mesh's process groups, and every
collective the program runs, with the bytes each kind moves counted per step.

Only public c10d calls are used (``all_reduce``, ``all_gather_into_tensor`` / ``all_gather_single``,
``reduce_scatter_tensor`` / ``reduce_scatter_single``, ``all_to_all_single``): they exist in torch
2.11-2.13 and run on gloo and NCCL. Every collective of a training step goes through
``MeshComm``, so ``MeshComm.stats`` is the process-group-level count the plan's predicted bytes
are compared with.

Bytes follow nccl-tests' "size" convention, the same the planner prices with: all-reduce the
buffer, all-gather the gathered (output) buffer, reduce-scatter the input buffer, all-to-all the
send buffer; padded sizes where a dim is sharded unevenly. A mesh axis of size 1 runs nothing.

Host values and device groups (ready for NCCL): an NCCL group carries CUDA tensors only, so a
value the host computed (a loss, a count, a flag) crosses a mesh group as a tensor on the model's
device, and Python objects cross through torch's object collectives (``agreement``, which pick
the group's device themselves). autopar initialises NCCL as ``"cpu:gloo,cuda:nccl"``
(``launch.init_distributed``), so the default group and the groups derived from it (the device
mesh's) also take host tensors, but the runtime does not rely on it: a user's own NCCL-only group
works alike. The collectives of the runtime and the device of their tensors:

* ``MeshComm`` (reshards, gradient sync and ZeRO gathers, batch norm statistics, expert dispatch
  and its counts, tied-gradient sums, the loss's all-reduce, the target counts of local batches):
  tensors on the model's device;
* the pipeline: torch's sends of activations and gradients (device buffers) and the loss's
  broadcast over the pipeline group (``PipelineRunner.broadcast_loss``: a device tensor);
* the input check's all-gather of checksums on the default group: a device tensor;
* replicas made equal from rank 0 (``param_store``): the model's tensors, on its device;
* plans, shapes, versions, checkpoint manifests and agreed decisions: object collectives;
* the checkpoint's background saves: their own gloo group (host tensors, a host thread);
* the test harness ``parity._mean_over_ranks``: an object all-gather.

No wait depends on gloo's behaviour: only collectives on CPU tensors are polled (``polls``); on
CUDA ``wait()`` orders the stream and returns (NCCL reports a failure from its watchdog, not as
an exception of the call), and the seconds counted are the host's (a lower bound there).

Invariant: a ``MeshComm`` built from a device mesh holds no process group, only group *names*,
looked up when a collective runs: after the user's ``destroy_process_group`` nothing of autopar
keeps a gloo group (and its worker threads) alive. One that is kept alive into interpreter
shutdown can abort the process: its worker thread, destroying a finished work, releases a tensor
that needs the GIL while the main thread is finalizing, and exits inside a destructor
(``std::terminate``; seen about once in 40 two-process runs under CPU contention, traced with a
core dump).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["MeshComm", "CommStats", "CollectiveLog", "set_site", "collective_site", "COLLECTIVE_KINDS", "WAIT_ENV",
           "POLL_WINDOW_S", "wait_for", "polls", "POLLED_KINDS", "backend_for", "runs_nccl"]

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names
# warn); 2.11 has only the old ones
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# How a rank waits for a collective on CPU tensors: "poll" (the default) asks the work whether it
# has completed and yields the CPU between asks, for up to POLL_WINDOW_S, then blocks; "block"
# waits inside torch at once. A thread blocked in gloo's wait sleeps until gloo's worker wakes it,
# and on a virtual machine a sleeping CPU can wake a timer tick late: on 2 gloo processes of a
# 2-core VM a 128 KiB all-reduce took 76-204 us at its median and 3-4 ms at its 90th percentile
# blocked (mean 0.95-1.9 ms), 82-90 us and 0.1-1.9 ms polled (mean 0.34-0.44 ms); on 4 processes
# 3.3-3.8 ms against 0.38-1.1 ms mean. Yielding, not spinning: the rank's own gloo threads and,
# where ranks share cores, the other ranks' compute run in the meantime (a pure spin took the
# gloo thread's CPU: 1.0-3.6 ms mean). MPI and NCCL wait by polling likewise. Past the window
# a rank blocks, so one that waits for a dead or late peer does not burn a core until the timeout.
WAIT_ENV = "AUTOPAR_COLLECTIVE_WAIT"
POLL_WINDOW_S = 0.05
# the kinds whose work completes on its own: gloo's reduce_scatter_tensor reports completion only
# once waited for (torch 2.11 and 2.13: polled for a second, never), so it is always waited for
POLLED_KINDS = frozenset({"all_reduce", "all_gather", "all_to_all"})


def backend_for(device_type: str, group=None) -> str | None:
    """The backend that runs ``group``'s collectives on ``device_type`` tensors ("gloo", "nccl",
    ...; default: the default group), None where it has none (an NCCL-only group and "cpu").
    Read from the group's "device:backend" pairs: ``dist.get_backend`` names a multi-backend
    group by its whole string ("cpu:gloo,cuda:nccl"), which no single name compares equal to."""
    pairs = dict(p.split(":", 1) for p in str(dist.get_backend_config(group)).split(",") if ":" in p)
    return pairs.get(device_type)


def runs_nccl(group=None) -> bool:
    """Whether ``group`` (default: the default group) runs CUDA tensors' collectives on NCCL."""
    return dist.is_initialized() and backend_for("cuda", group) == "nccl"


@functools.cache
def _wait_mode() -> str:
    mode = os.environ.get(WAIT_ENV, "poll").strip().lower()
    if mode not in ("poll", "block"):
        raise ValueError(f"{WAIT_ENV}={mode!r}: use 'poll' (yield the CPU between checks, the default) or 'block' "
                         "(wait inside torch)")
    return mode


def polls(kind: str, t: torch.Tensor) -> bool:
    """Whether a ``kind`` collective on ``t`` is waited for by polling (``POLLED_KINDS`` on CPU
    tensors, unless ``WAIT_ENV`` says "block"); a GPU's host does not wait for the device's
    collectives anyway."""
    return kind in POLLED_KINDS and t.device.type == "cpu" and _wait_mode() == "poll"


def wait_for(work, poll: bool = True):
    """``work.wait()``, polled first for up to ``POLL_WINDOW_S`` when ``poll`` (see ``WAIT_ENV``).
    A work that failed (a timeout, a lost peer) completes and its ``wait`` raises as before."""
    if poll and not work.is_completed():
        deadline = time.perf_counter() + POLL_WINDOW_S
        while not work.is_completed() and time.perf_counter() < deadline:
            os.sched_yield()
    return work.wait()


@dataclass
class CommStats:
    """Bytes, calls and seconds blocked per collective kind since the last ``reset``.

    Seconds blocked: the host's time inside a synchronous collective and inside ``wait()`` of an
    asynchronous one, i.e. the communication the step did not overlap. On gloo that is the
    collective's exposed time; with NCCL the host does not wait for the stream, so it is a lower
    bound (CUDA events would measure the device side)."""

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)

    def record(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.seconds.clear()

    def totals(self) -> tuple[dict, dict]:
        """(bytes, seconds blocked) per kind so far."""
        return dict(self.bytes), dict(self.seconds)

    def since(self, before: tuple[dict, dict]) -> tuple[dict, dict]:
        """(bytes, seconds blocked) per kind since ``before`` (a ``totals()``), kinds with none left out."""
        (b0, s0), (b1, s1) = before, self.totals()
        return ({k: v - b0.get(k, 0) for k, v in b1.items() if v - b0.get(k, 0)},
                {k: v - s0.get(k, 0.0) for k, v in s1.items() if v - s0.get(k, 0.0) > 0})

    def snapshot(self) -> dict[str, int]:
        return {k: int(self.bytes[k]) for k in COLLECTIVE_KINDS if self.calls[k]}


def _resolve(name: str):
    """The live process group called ``name`` (a registry lookup; private in torch 2.11-2.13)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(name)
    except Exception:  # noqa: BLE001 - destroyed or unknown: say so plainly
        raise RuntimeError(f"process group {name!r} no longer exists (was destroy_process_group called?)") from None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class CollectiveLog:
    """One model's record for its error messages: ``site``, what the collectives being issued
    serve (a reshard's plan node, a gradient sync, the loss; None: unnamed), and ``last``, the
    last collective it issued (what a timeout names: ``collective_errors``). Shared by the
    model's ``MeshComm`` and its axis views; written from autograd threads too, so ``last`` is
    replaced whole, never updated in place."""

    site: str | None = None
    last: dict = field(default_factory=dict)

    def describe(self) -> str | None:
        """The last collective, in words (its kind, bytes, mesh axis, ranks, plan node); None
        before any."""
        last = self.last
        if not last:
            return None
        try:  # the group as the mesh holds it: its name (resolved here, not per collective) or itself
            group = _resolve(last["group"]) if isinstance(last["group"], str) else last["group"]
            ranks = dist.get_process_group_ranks(group)
        except Exception:  # noqa: BLE001 - the group is gone: leave the ranks out
            ranks = None
        who = f" (ranks {ranks})" if ranks is not None else ""
        at = f" for {last['site']}" if last.get("site") else ""
        return f"{last['kind']} of {last['nbytes']:,} bytes over mesh axis {last['axis']}{who}{at}"


def set_site(comm: "MeshComm", site: str | None) -> None:
    """Name what ``comm``'s next collectives serve (a reshard's plan node; None: unnamed)."""
    comm.log.site = site


@contextlib.contextmanager
def collective_site(comm: "MeshComm", site: str):
    """Name what the collectives ``comm`` issues inside serve (gradient sync, a ZeRO gather, the
    loss), then restore the previous name."""
    log = comm.log
    old, log.site = log.site, site
    try:
        yield
    finally:
        log.site = old


class _TimedWork:
    """An asynchronous collective's work handle whose ``wait()`` counts the time blocked."""

    __slots__ = ("_work", "_kind", "_stats", "_poll")

    def __init__(self, work, kind: str, stats: CommStats, poll: bool = False):
        self._work, self._kind, self._stats, self._poll = work, kind, stats, poll

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            if args or kwargs:  # a timeout of the caller's: torch's own wait
                return self._work.wait(*args, **kwargs)
            return wait_for(self._work, self._poll)
        finally:
            self._stats.seconds[self._kind] += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._work, name)


class MeshComm:
    """Per mesh axis: process group, size and this rank's coordinate; and the collectives."""

    def __init__(self, groups: Sequence, sizes: Sequence[int], coords: Sequence[int],
                 stats: CommStats | None = None, log: CollectiveLog | None = None, flat: dict | None = None):
        self.groups = tuple(groups)  # process groups, or their names (looked up per collective)
        # tuple of axes -> the group (or its name) of the ranks differing only on those axes, its
        # ranks in row-major order of their coordinates (an expert axis borrowing several axes)
        self.flat = dict(flat or {})
        self.sizes = tuple(int(s) for s in sizes)
        self.coords = tuple(int(c) for c in coords)
        self.stats = stats if stats is not None else CommStats()
        self.log = log if log is not None else CollectiveLog()  # what the collectives serve, the last one
        self.step_cache: dict = {}  # (src, dst, shape) -> reshard steps on this mesh
        self.pending_gathers: dict = {}  # storage of a receive buffer -> gather under way (runtime.prefetch)
        self.pending_grads: list = []  # gradient reduce-scatters under way (runtime.prefetch)
        # split-backward pipeline schedules: a gathered parameter's shard gets a (zero) gradient
        # edge from its gather, so torch's weight pass reaches the gather (runtime.prefetch)
        self.shard_grad_edges = False

    @classmethod
    def from_device_mesh(cls, mesh, log: CollectiveLog | None = None, flat_axes=()) -> "MeshComm":
        """``flat_axes``: tuples of axes that collectives run over as one group (made here, on every
        rank in the same order: ``DeviceMesh._flatten``, private in torch 2.11-2.13)."""
        names = mesh.mesh_dim_names
        from autopar.runtime.launch import time_out_as_default

        flat = {}
        for axes in sorted(set(tuple(a) for a in flat_axes)):
            group = mesh[tuple(names[a] for a in axes)]._flatten().get_group()
            time_out_as_default(group)
            flat[axes] = group.group_name
        return cls(
            groups=tuple(mesh.get_group(n).group_name for n in names),
            sizes=tuple(mesh.size(i) for i in range(len(names))),
            coords=tuple(mesh.get_local_rank(n) for n in names),
            log=log,
            flat=flat,
        )

    def size_of(self, axis) -> int:
        """Ranks along mesh axis ``axis``, or along a tuple of axes (their product)."""
        return self.sizes[axis] if isinstance(axis, int) else math.prod(self.sizes[a] for a in axis)

    def axis_view(self, axis: int) -> "MeshComm":
        """A one-axis mesh over ``axis`` sharing this mesh's statistics and log."""
        return MeshComm((self.groups[axis],), (self.sizes[axis],), (self.coords[axis],), self.stats, self.log)

    def close(self) -> None:
        """Forget the process groups (call before ``destroy_process_group``)."""
        self.groups = (None,) * len(self.sizes)
        self.flat = {k: None for k in self.flat}
        self.step_cache.clear()
        self.pending_gathers.clear()
        self.pending_grads.clear()

    # ------------------------------------------------------------------ collectives
    def _group(self, axis):
        g = self.groups[axis] if isinstance(axis, int) else self.flat[tuple(axis)]
        if g is None:
            raise RuntimeError("this autopar model was closed: its process groups are released")
        return _resolve(g) if isinstance(g, str) else g

    def _run(self, kind: str, nbytes: int, call, out: torch.Tensor | None, inp: torch.Tensor, axis: int,
             async_op: bool):
        """Count and issue one collective on ``axis`` (a tuple of axes: over their flattened group,
        ``flat``; on a one-rank axis: ``out`` takes ``inp``)."""
        if self.size_of(axis) == 1:
            if out is not None:
                out.copy_(inp)
            return None
        self.stats.record(kind, nbytes)
        args = (inp,) if out is None else (out, inp)
        group = self._group(axis)
        self.log.last = dict(kind=kind, nbytes=int(nbytes), axis=axis,
                             group=self.groups[axis] if isinstance(axis, int) else self.flat[tuple(axis)], site=self.log.site)
        poll = polls(kind, inp)
        t0 = time.perf_counter()
        work = call(*args, group=group, async_op=async_op or poll)
        if poll and not async_op and work is not None:
            wait_for(work)
            work = None
        self.stats.seconds[kind] += time.perf_counter() - t0
        return _TimedWork(work, kind, self.stats, poll) if async_op and work is not None else work

    def all_reduce(self, t: torch.Tensor, axis: int, *, async_op: bool = False):
        """Sum ``t`` in place over ``axis``."""
        return self._run("all_reduce", _nbytes(t), dist.all_reduce, None, t, axis, async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, axis: int, *, async_op: bool = False):
        """Concatenate every rank's ``inp`` (equal sizes) along dim 0 into ``out``."""
        return self._run("all_gather", _nbytes(out), _all_gather_single, out, inp, axis, async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, axis: int, *, async_op: bool = False):
        """Sum ``inp`` over ``axis``; this rank keeps block ``coord`` of dim 0 in ``out``."""
        return self._run("reduce_scatter", _nbytes(inp), _reduce_scatter_single, out, inp, axis, async_op)

    def all_to_all_v(self, out: torch.Tensor, inp: torch.Tensor, axis: int, out_splits: list[int],
                     in_splits: list[int]):
        """Rows ``in_splits[k]`` of ``inp`` (in order) go to rank k; ``out`` takes ``out_splits[k]``
        rows from rank k (variable sizes: a dropless expert dispatch)."""
        call = functools.partial(dist.all_to_all_single, output_split_sizes=out_splits, input_split_sizes=in_splits)
        return self._run("all_to_all", _nbytes(inp), call, out, inp, axis, False)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, axis: int, *, async_op: bool = False):
        """Block k of ``inp``'s dim 0 goes to rank k; block k of ``out`` comes from rank k."""
        return self._run("all_to_all", _nbytes(inp), dist.all_to_all_single, out, inp, axis, async_op)
