"""Collective communication cost model: alpha-beta rings, hierarchical across nodes.

A group of ``p`` ranks with ``r`` ranks on each of ``m = ceil(p / r)`` nodes. ``B``/``a`` are a
link's per-device, per-direction bandwidth and per-hop latency (``cluster.intra_node`` or
``cluster.inter_node``). Meaning of ``nbytes`` per kind (all in bytes):

============== ============================================== ===============================
kind           nbytes                                         one-level ring time
============== ============================================== ===============================
all_reduce     the buffer (same size in and out)              2(p-1)/p * n/B + 2(p-1) a
all_gather     the gathered (full) output; a rank holds n/p   (p-1)/p * n/B + (p-1) a
reduce_scatter the full (unscattered) input; a rank gets n/p  (p-1)/p * n/B + (p-1) a
all_to_all     the bytes each rank holds before the exchange  (p-1)/p * n/B + (p-1) a [1]
broadcast      the broadcast buffer                           n/B + (p-1) a [2]
send_recv      the message                                    n/B + a
============== ============================================== ===============================

[1] each rank sends (p-1)/p of its data through its own link, in p-1 pairwise steps.
[2] pipelined (chunked) chain, as NCCL's ring broadcast.

Groups spanning nodes (``m > 1``). On a DGX every GPU owns a NIC, and link bandwidth is
specified per device, so the ``r`` ranks of a node can drive ``r`` NICs ("rails") at once:
nothing is shared between them and other groups' ranks use their own NICs. Hence:

* ``r == 1``: a flat ring over the inter-node link.
* all_reduce: intra reduce-scatter (n over r ranks) + inter all-reduce of n/r on r parallel
  rails of m ranks + intra all-gather (Horovod's hierarchical all-reduce).
* all_gather: inter all-gather of the rail's n/r on r parallel rails + intra all-gather of n;
  reduce_scatter is its mirror image (same time).
* all_to_all: each rank sends (r-1)/p * n over NVLink and (p-r)/p * n over its own NIC; both are
  posted at once on disjoint links, so the time is the max of the two.
* A stack that does not drive every rank's NIC at once (``LinkSpec.rails`` = k < r, calibrated)
  puts the inter-node phase of the node's r ranks on k NICs: its time grows by r / k.
* broadcast: a pipelined chain bottlenecked by the inter-node link, (m-1) inter and (p-m)
  intra hops (rare in training: initial weight sync).
* send_recv: over the inter-node link.

A group whose ranks are unevenly spread is modelled as if every node held ``r`` of them
(``r`` = the largest count on a node: conservative). ``B`` is a link's effective bandwidth:
the datasheet value times ``LinkSpec.efficiency`` (None in the presets: NCCL-ideal rings; set by
calibration from a measured run of a given software stack); a kind that ``autopar calibrate``
measured on a link (``LinkSpec.collectives``) uses its own latency and bus bandwidth instead,
and at a group size measured at several sizes (``LinkSpec.collective_table``) the measured times
themselves, interpolated.
A blocking call (``blocking_collective_time``) also pays ``Cluster.collective_skew_s`` once: the
wait for ranks that reach it at different times after compute (0 in the presets; measured by
``autopar calibrate``). A zero-byte collective and a group of one rank cost 0.

Example:
    >>> from autopar.cluster import Cluster
    >>> c = Cluster.preset("dgx-a100")
    >>> t = collective_time("all_reduce", 2**30, CommGroup(8, 8), c)
    >>> abs(t - (2 * 7 / 8 * 2**30 / 300e9 + 14 * 3.4e-6)) < 1e-12
    True
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.errors import AutoparError

if TYPE_CHECKING:  # only for annotations: keeps autopar.cluster -> cost_models acyclic
    from autopar.cluster import Cluster, LinkSpec

__all__ = ["COLLECTIVE_KINDS", "CommGroup", "axis_group", "blocking_collective_time", "collective_latency",
           "collective_time"]

COLLECTIVE_KINDS = (
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv",
)


@dataclass(frozen=True)
class CommGroup:
    """The shape of a process group: ``size`` ranks, ``ranks_per_node`` of them on each node.

    Invariants: ``1 <= ranks_per_node <= size``; nodes spanned = ``ceil(size / ranks_per_node)``.
    """

    size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        for f in ("size", "ranks_per_node"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise AutoparError(f"CommGroup.{f} must be an integer >= 1, got {v!r}")
        if self.ranks_per_node > self.size:
            raise AutoparError(
                f"CommGroup.ranks_per_node ({self.ranks_per_node}) exceeds the group size "
                f"({self.size}); use ranks_per_node=min(size, ranks of the group per node)"
            )

    @property
    def nodes(self) -> int:
        """Number of nodes the group spans."""
        return -(-self.size // self.ranks_per_node)


def axis_group(mesh_shape: tuple[int, ...], axis: int, devices_per_node: int) -> CommGroup:
    """Group shape of the ranks differing only in coordinate ``axis`` of a device mesh.

    Ranks are laid out row-major over the mesh (last axis fastest) and fill node 0 first
    (rank ``k`` on node ``k // devices_per_node``). ``ranks_per_node`` is the largest number of
    a group's ranks sharing a node, over all groups along ``axis``.

    >>> axis_group((4, 8), 1, 8), axis_group((4, 8), 0, 8)
    (CommGroup(size=8, ranks_per_node=8), CommGroup(size=4, ranks_per_node=1))
    """
    shape = tuple(mesh_shape)
    if not shape or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                            for s in shape):
        raise AutoparError(f"mesh_shape must be a non-empty tuple of ints >= 1, got {mesh_shape!r}")
    if not isinstance(axis, int) or not -len(shape) <= axis < len(shape):
        raise AutoparError(f"mesh axis {axis!r} out of range for mesh of shape {shape}")
    if not isinstance(devices_per_node, int) or devices_per_node < 1:
        raise AutoparError(f"devices_per_node must be an integer >= 1, got {devices_per_node!r}")
    return _axis_group(shape, axis % len(shape), devices_per_node)


@functools.lru_cache(maxsize=1024)
def _axis_group(shape: tuple[int, ...], axis: int, dpn: int) -> CommGroup:
    size = shape[axis]
    stride = math.prod(shape[axis + 1:])
    world = math.prod(shape)
    busiest = 1
    for base in range(world):
        if (base // stride) % size:  # visit each group once, from its coordinate-0 rank
            continue
        per_node: dict[int, int] = {}
        for k in range(size):
            node = (base + k * stride) // dpn
            per_node[node] = per_node.get(node, 0) + 1
        busiest = max(busiest, max(per_node.values()))
    return CommGroup(size=size, ranks_per_node=busiest)


def _ring(kind: str, n: float, p: int, link: LinkSpec) -> float:
    """One-level time of ``kind`` over ``p`` ranks on one link type: measured at this group size
    (``LinkSpec.measured_time``), else alpha-beta."""
    if p == 1:
        return 0.0
    measured = link.measured_time(kind, p, n) if link.collective_table else None
    if measured is not None:
        return measured
    a, bw = link.collective(kind)
    if kind == "all_reduce":
        return 2 * (p - 1) / p * n / bw + 2 * (p - 1) * a
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (p - 1) / p * n / bw + (p - 1) * a
    if kind == "broadcast":
        return n / bw + (p - 1) * a
    return n / bw + a  # send_recv


def collective_time(kind: str, nbytes: float, group: CommGroup, cluster: Cluster) -> float:
    """Seconds for one collective of ``kind`` over ``group`` on ``cluster`` (see module doc), with
    the host's own time per collective (``DeviceSpec.collective_host_s``; a reshard's layout
    copies per byte are ``planner.costing``'s)."""
    if kind not in COLLECTIVE_KINDS:
        raise AutoparError(
            f"unknown collective kind {kind!r}; known kinds: {list(COLLECTIVE_KINDS)}"
        )
    if not (isinstance(nbytes, (int, float)) and math.isfinite(nbytes) and nbytes >= 0):
        raise AutoparError(f"collective_time: nbytes must be a finite number >= 0, got {nbytes!r}")
    if not isinstance(group, CommGroup):
        raise AutoparError(f"collective_time: group must be a CommGroup, got {group!r}")
    p, r, m = group.size, group.ranks_per_node, group.nodes
    if r > cluster.devices_per_node or m > cluster.nodes:
        raise AutoparError(
            f"{group} does not fit on cluster {cluster.name!r} with {cluster.nodes} node(s) of "
            f"{cluster.devices_per_node} devices; shrink the group or add nodes"
        )
    if p == 1 or nbytes == 0:
        return 0.0
    return _time(kind, float(nbytes), p, r, m, cluster) + cluster.device.collective_host_s


def blocking_collective_time(kind: str, nbytes: float, group: CommGroup, cluster: Cluster) -> float:
    """``collective_time`` of a collective the program waits for where it issues it: it also
    waits for the ranks that reach it last (``Cluster.collective_skew_s``, once per call). An
    asynchronous one, issued ahead and waited later, hides that wait behind compute."""
    t = collective_time(kind, nbytes, group, cluster)
    return t + cluster.collective_skew_s if t > 0 else 0.0


def collective_latency(kind: str, group: CommGroup, cluster: Cluster) -> float:
    """The part of ``collective_time`` that is waiting, not moving bytes: the fabric's time for
    a collective of one byte (the latency terms; the smallest calibrated size where measured),
    without the host's own time. Behind compute it can hide even where the bytes cannot (a
    CPU rank's collective moves them with the cores compute uses: ``planner.overlap``)."""
    if group.size == 1:
        return 0.0
    return _time(kind, 1.0, group.size, group.ranks_per_node, group.nodes, cluster)


def _time(kind: str, n: float, p: int, r: int, m: int, cluster: Cluster) -> float:
    """``collective_time`` on the fabric, before the ranks' skew."""
    intra, inter = cluster.intra_node, cluster.inter_node
    if m == 1:
        return _ring(kind, n, p, intra)
    if r == 1 or kind == "send_recv":
        return _ring(kind, n, p, inter)
    rails = r if inter.rails is None else min(r, float(inter.rails))  # NICs in use per node
    if kind == "all_reduce":
        return (_ring("reduce_scatter", n, r, intra) + _ring("all_reduce", n / rails, m, inter)
                + _ring("all_gather", n, r, intra))
    if kind in ("all_gather", "reduce_scatter"):
        return _ring(kind, n / rails, m, inter) + _ring(kind, n, r, intra)
    if kind == "all_to_all":
        (a_intra, bw_intra), (a_inter, bw_inter) = intra.collective(kind), inter.collective(kind)
        t_intra = (r - 1) / p * n / bw_intra + (r - 1) * a_intra
        t_inter = (p - r) / p * n * (r / rails) / bw_inter + (p - r) * a_inter
        return max(t_intra, t_inter)
    # broadcast: pipelined chain, bottleneck inter-node bandwidth
    return n / inter.effective_bandwidth + (m - 1) * inter.latency + (p - m) * intra.latency

