"""Cluster specification: devices, links and topology, as frozen validated data.

A :class:`Cluster` is ``nodes`` identical nodes of ``devices_per_node`` identical devices. Ranks
are numbered node-major: ranks ``[k * devices_per_node, (k + 1) * devices_per_node)`` live on
node ``k``. All numbers are in SI units: FLOP/s, bytes, bytes/s, seconds. Link bandwidth is *per
device, per direction* -- what one device can push into that fabric -- so a node whose NIC is
shared by its 8 GPUs must be described with ``nic_bandwidth / 8`` (a DGX has one NIC per GPU).

Specs are data: nothing here is measured at planning time except :meth:`Cluster.local`, which
reads this machine's RAM once at construction. Calibration produces a new spec.

Example:
    >>> from autopar.cluster import Cluster
    >>> c = Cluster.preset("dgx-h100", nodes=4)
    >>> c.world_size
    32
    >>> Cluster.from_json(c.to_json()) == c
    True
"""

from __future__ import annotations

import dataclasses
import json
import functools
import math
import numbers
import os
import pathlib
import statistics
from dataclasses import dataclass
from typing import Any

from autopar.cost_models.hardware import PRESETS as _PRESETS
from autopar.errors import ClusterSpecError
from autopar.spec_fields import check_float, check_int, check_name, check_rows, is_fraction, is_real

__all__ = ["Cluster", "DeviceSpec", "LinkSpec", "PeakFlops", "calibration_path"]

SCHEMA_VERSION = 1
# The most devices a cluster may have (the largest hold ~10**5): more is a typo (nodes=10**30)
MAX_WORLD_SIZE = 2**24
# The least achieved share of peak FLOP/s a spec may state: less means the peak is not the device's
MIN_MATMUL_EFFICIENCY = 0.01
MIN_ATTENTION_EFFICIENCY = 0.001

_DEVICE_TYPES = ("cuda", "cpu")
_BACKENDS = ("nccl", "gloo")
# Accepted spellings -> PeakFlops field. Torch's "float32" means plain fp32: pass "tf32"
# explicitly when torch.backends.cuda.matmul.allow_tf32 (or matmul precision "high") is on.
_FLOPS_DTYPES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
}


@dataclass(frozen=True)
class PeakFlops:
    """Dense peak FLOP/s of one device per dtype (tensor-core rates where the device has them)."""

    fp32: float
    tf32: float
    bf16: float
    fp16: float

    def __post_init__(self) -> None:
        for f in ("fp32", "tf32", "bf16", "fp16"):
            hint = "use the dense (not sparsity) datasheet figure in FLOP/s, e.g. 312e12"
            object.__setattr__(self, f, check_float("PeakFlops", f, getattr(self, f), hint))

    def for_dtype(self, dtype: Any) -> float:
        """Peak FLOP/s for ``dtype``: "fp32", "tf32", "bf16", "fp16", torch names or dtypes.

        >>> PeakFlops(1.0, 2.0, 3.0, 4.0).for_dtype("bfloat16")
        3.0
        """
        key = str(dtype).removeprefix("torch.")
        if key not in _FLOPS_DTYPES:
            raise ClusterSpecError(
                f"no peak FLOP/s for dtype {dtype!r}; known dtypes: {sorted(_FLOPS_DTYPES)}"
            )
        return getattr(self, _FLOPS_DTYPES[key])


def _per_element_pair(name: str, value, meaning: str) -> tuple[float, float] | None:
    """A ``DeviceSpec`` field of two seconds-per-element figures, as floats (None stays None)."""
    if value is None:
        return None
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(is_real(v) for v in value)):
        raise ClusterSpecError(f"DeviceSpec.{name} must be ({meaning}), both >= 0, or None; got {value!r}")
    return float(value[0]), float(value[1])


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU process): compute peaks, memory capacity and bandwidth."""

    name: str
    peak_flops: PeakFlops
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    # achieved fraction of peak in large matmuls for this device and software stack (calibrated);
    # None: the cost model's default (cost_models.compute.MATMUL_EFFICIENCY)
    matmul_efficiency: float | None = None
    # the same for attention kernels; None: matmul_efficiency scaled as cost_models.compute does
    attention_efficiency: float | None = None
    # measured attention (``scaled_dot_product_attention``) beyond ``op_overhead``: (forward
    # seconds per (batch, head) pair, forward seconds per FLOP, backward seconds per pair, backward
    # seconds per forward FLOP). A CPU kernel loops over the pairs: at a small transformer's shapes
    # (seq 32, head dim 16) that loop, not the FLOPs, set the time, and its backward took 2.3-2.8x
    # the forward. None: attention_efficiency's roofline, the backward 2.5x the forward's FLOPs
    attention_costs: tuple[float, float, float, float] | None = None
    # seconds every executed op costs whatever its size (host dispatch, kernel launch; the
    # intercept of ``autopar calibrate``'s compute fit); None: 0, the presets' large-op model
    op_overhead: float | None = None
    # the same for each op of the optimizer's per-parameter update (no autograd: cheaper)
    update_op_overhead: float | None = None
    # the optimizer's update per parameter element: (seconds, more seconds per state tensor), e.g.
    # SGD's time per element and Adam's = first + 2 * second; None: streamed at memory bandwidth
    update_element_s: tuple[float, float] | None = None
    # a parameter's gradient buffer per element: (seconds to zero it, seconds to add a gradient
    # into it in place), once per step and once per microbatch; None: streamed at memory bandwidth
    grad_buffer_element_s: tuple[float, float] | None = None
    # the last two measured where a rank holds few elements, its parameters, gradients and states
    # then in cache (on 4 CPU processes, AdamW took 2.1-2.3 ns per element at 0.25M elements a
    # rank, 4.6-4.9 at 2M, 7.0-8.1 at 8M): (elements a rank held there, elements a rank held for
    # ``update_element_s`` and ``grad_buffer_element_s``, the update's seconds per element, per
    # element and state, a gradient's zeroing and accumulation per element); a rank holding a
    # count between the two (``CostContext.rank_state_numel``: the largest of its parameter,
    # gradient and optimizer elements) is priced between them: by ``shared_cache_bytes`` where
    # known, else log-linearly in the count. None: every count at the two fields' figures
    warm_elements: tuple[float, float, float, float, float, float] | None = None
    # bytes of the last-level cache that a node's ranks share (a CPU socket's L3, read by
    # ``autopar calibrate``); the optimizer's and gradient buffers' per-element costs are then
    # warm while the node's ranks' parameters, gradients and optimizer states fill at most half of
    # it, cold from all of it on, linear between (``planner.costing.element_costs``): on 2
    # processes sharing a 300 MiB L3, the 8.4M-parameter MLP's AdamW step at 4.2M elements a rank
    # (134 MB on the node) ran at the warm figures, at 8.4M (268 MB) at the cold ones, where the
    # per-rank log-linear rule had priced the 4.2M rank 70% of the way to cold. None: unknown
    shared_cache_bytes: float | None = None
    # measured per op name (the traced graph's, e.g. "gelu", "layer_norm"): (name, forward seconds
    # per element, backward seconds per element), sorted by name; such an op is priced by its
    # elements (the largest of its inputs and outputs) instead of the roofline
    op_costs: tuple[tuple[str, float, float], ...] = ()
    # measured fp32 matmuls: (m, k, n, seconds) over a grid of shapes (``autopar calibrate``); a
    # matmul is then priced at the efficiency interpolated from its shape (cost_models.compute)
    matmul_table: tuple[tuple[int, int, int, float], ...] = ()
    # the same grid in nn.Linear's forward layout, ``x @ W.T`` with the weight stored [n, k]: a
    # library's GEMM can run a transposed operand at another speed (on a CPU, a few rows against
    # a 4 MiB weight ran 2x slower so); empty: linears are priced by ``matmul_table``
    linear_table: tuple[tuple[int, int, int, float], ...] = ()
    # measured fp32 convolutions (``autopar calibrate`` on CPU processes): (m, k, n, forward
    # seconds, backward seconds) over a grid of their implicit GEMM's shapes (m: batch x output
    # pixels, k: input channels x kernel elements, n: output channels); a convolution is then priced
    # at the efficiency interpolated from its shape (``cost_models.compute.conv_time``): on 4 CPU
    # processes a 3x3 convolution of 8 channels ran at a few percent of the matmul rate its FLOPs
    # had been priced at. Empty: convolutions are priced by their FLOPs, as matmuls
    conv_table: tuple[tuple[int, int, int, float, float], ...] = ()
    # host seconds per collective the runtime issues, besides the collective: its reshard's
    # autograd node, buffers and layout copies (``autopar calibrate``, on CPU processes only, where
    # host and device are one and this time is on the critical path; a GPU's host runs ahead).
    # Priced with each collective; the monitor, which times the host blocked in collectives,
    # counts it in the step's compute
    collective_host_s: float = 0.0
    # and per byte of a reshard's collective (nccl-tests' size): its layout copies on the host
    # (``planner.costing``; a gradient bucket's all-reduce in place has none)
    collective_host_byte_s: float = 0.0

    def op_cost(self, name: str) -> tuple[float, float] | None:
        """(forward, backward) seconds per element measured for op ``name``; None: not measured."""
        for op, fwd, bwd in self.op_costs:
            if op == name:
                return fwd, bwd
        return None

    def __post_init__(self) -> None:
        check_name("DeviceSpec", self.name)
        if self.attention_efficiency is not None and not (is_fraction(self.attention_efficiency)
                                                          and self.attention_efficiency >= MIN_ATTENTION_EFFICIENCY):
            raise ClusterSpecError(
                f"DeviceSpec.attention_efficiency must be in (0, 1] (at least {MIN_ATTENTION_EFFICIENCY}) or None, got "
                f"{self.attention_efficiency!r}; it is the achieved fraction of peak FLOP/s in attention (fix "
                "peak_flops, or measure the device with `autopar calibrate`)"
            )
        if self.attention_costs is not None:
            a = self.attention_costs
            if not (isinstance(a, (tuple, list)) and len(a) == 4 and all(is_real(v) for v in a) and a[1] + a[3] > 0):
                raise ClusterSpecError(
                    f"DeviceSpec.attention_costs must be (forward s per (batch, head), forward s per FLOP, backward s "
                    f"per (batch, head), backward s per forward FLOP), each >= 0 and a FLOP's not both 0, or None; "
                    f"got {a!r}")
            object.__setattr__(self, "attention_costs", tuple(float(v) for v in a))
        object.__setattr__(self, "update_element_s", _per_element_pair(
            "update_element_s", self.update_element_s, "seconds per element, seconds per element per optimizer state"))
        object.__setattr__(self, "grad_buffer_element_s", _per_element_pair(
            "grad_buffer_element_s", self.grad_buffer_element_s,
            "seconds per element to zero a gradient, seconds per element to add one into it"))
        if self.warm_elements is not None:
            w = self.warm_elements
            if not (isinstance(w, (tuple, list)) and len(w) == 6 and all(is_real(v) for v in w) and 0 < w[0] < w[1]):
                raise ClusterSpecError(
                    f"DeviceSpec.warm_elements must be (elements a rank holds where warm, where cold (larger), "
                    f"then four seconds per element >= 0: update, per state, zero, add) or None; got {w!r}")
            object.__setattr__(self, "warm_elements", tuple(float(v) for v in w))
        if self.shared_cache_bytes is not None:
            if not (is_real(self.shared_cache_bytes) and self.shared_cache_bytes > 0):
                raise ClusterSpecError(f"DeviceSpec.shared_cache_bytes must be bytes > 0 or None, got "
                                       f"{self.shared_cache_bytes!r}; it is the last-level cache a node's ranks share")
            object.__setattr__(self, "shared_cache_bytes", float(self.shared_cache_bytes))
        object.__setattr__(self, "op_costs", check_rows(
            "DeviceSpec", "op_costs", self.op_costs,
            lambda r: len(r) == 3 and isinstance(r[0], str) and r[0] and all(is_real(v) for v in r[1:]),
            lambda r: (r[0], float(r[1]), float(r[2])),
            "(op name, forward s per element >= 0, backward s per element >= 0)"))
        for table in ("matmul_table", "linear_table"):
            object.__setattr__(self, table, check_rows(
                "DeviceSpec", table, getattr(self, table),
                lambda r: len(r) == 4 and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1
                                              for v in r[:3]) and is_real(r[3], strict=True),
                lambda r: (int(r[0]), int(r[1]), int(r[2]), float(r[3])), "(m, k, n, seconds > 0)", unique=False))
        object.__setattr__(self, "conv_table", check_rows(
            "DeviceSpec", "conv_table", self.conv_table,
            lambda r: len(r) == 5 and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1
                                          for v in r[:3]) and all(is_real(v, strict=True) for v in r[3:]),
            lambda r: (int(r[0]), int(r[1]), int(r[2]), float(r[3]), float(r[4])),
            "(m, k, n, forward seconds > 0, backward seconds > 0)", unique=False))
        if not is_real(self.collective_host_s, high=1.0):
            raise ClusterSpecError(f"DeviceSpec.collective_host_s must be seconds in [0, 1), got "
                                   f"{self.collective_host_s!r}; it is the host's time per collective")
        object.__setattr__(self, "collective_host_s", float(self.collective_host_s))
        if not is_real(self.collective_host_byte_s, high=1e-6):
            raise ClusterSpecError(f"DeviceSpec.collective_host_byte_s must be seconds per byte in [0, 1e-6), got "
                                   f"{self.collective_host_byte_s!r}; it is the host's time per byte of a collective")
        object.__setattr__(self, "collective_host_byte_s", float(self.collective_host_byte_s))
        for attr in ("op_overhead", "update_op_overhead"):
            ovh = getattr(self, attr)
            if ovh is not None and not is_real(ovh, high=1.0):
                raise ClusterSpecError(
                    f"DeviceSpec.{attr} must be a number of seconds in [0, 1) or None, got {ovh!r}; it is the "
                    "fixed cost of one executed op (e.g. 5e-6)"
                )
        if self.matmul_efficiency is not None and not is_fraction(self.matmul_efficiency):
            raise ClusterSpecError(
                f"DeviceSpec.matmul_efficiency must be in (0, 1], got {self.matmul_efficiency!r}; "
                "it is the achieved fraction of peak FLOP/s in large matmuls"
            )
        if self.matmul_efficiency is not None and self.matmul_efficiency < MIN_MATMUL_EFFICIENCY:
            raise ClusterSpecError(
                f"DeviceSpec.matmul_efficiency must be at least {MIN_MATMUL_EFFICIENCY}, got {self.matmul_efficiency!r}: "
                "it is the achieved fraction of peak FLOP/s in large matmuls (0.75 is typical), and below 1% the "
                "peak_flops are not this device's; fix peak_flops, or measure the device with `autopar calibrate`"
            )
        if not isinstance(self.peak_flops, PeakFlops):
            raise ClusterSpecError(
                f"DeviceSpec.peak_flops must be a PeakFlops, got {type(self.peak_flops).__name__}"
            )
        check_int("DeviceSpec", "memory_bytes", self.memory_bytes,
                   "pass the device memory in bytes as an int, e.g. 80 * 10**9")
        mbw = check_float("DeviceSpec", "memory_bandwidth", self.memory_bandwidth,
                           "pass the memory bandwidth in bytes/s, e.g. 2.039e12")
        object.__setattr__(self, "memory_bandwidth", mbw)


@dataclass(frozen=True)
class LinkSpec:
    """A fabric as seen by one device: bandwidth per direction (bytes/s) and per-hop latency (s).

    ``efficiency``: the achieved fraction of ``bandwidth`` in large collectives on this fabric
    with a given software stack (collective library, framework bucketing and scheduling),
    calibrated from a measured run; None means the datasheet bandwidth is achieved (the presets).

    ``rails`` (inter-node links): how many of a node's NICs carry a collective at once when its
    group has several ranks on each node (a ZeRO/FSDP gather over every rank). None: each such
    rank drives its own NIC (NCCL's multi-channel rings on a rail-optimised fabric, the
    presets); 1: the group's traffic leaves a node through one NIC (a single ring crossing each
    node once). Calibrated from a measured run; a group with one rank per node is unaffected.
    """

    bandwidth: float
    latency: float
    efficiency: float | None = None
    rails: float | None = None
    # measured per collective kind on this fabric (``autopar calibrate``): (kind, latency per hop
    # in s, bus bandwidth in bytes/s), sorted by kind; a kind listed here is priced with its own
    # pair instead of (latency, effective_bandwidth)
    collectives: tuple[tuple[str, float, float], ...] = ()
    # measured times (``autopar calibrate``): (kind, ranks, bytes as nccl-tests count them,
    # seconds), sorted; a collective of a kind and group size measured at two sizes or more is
    # priced by interpolating them (``measured_time``), which follows a library's protocol
    # switches that one latency and bandwidth cannot
    collective_table: tuple[tuple[str, int, float, float], ...] = ()

    def __post_init__(self) -> None:
        self._check_collectives()
        bw = check_float("LinkSpec", "bandwidth", self.bandwidth,
                          "pass bytes/s per device per direction, e.g. 300e9 for NVLink 3")
        lat = check_float("LinkSpec", "latency", self.latency,
                           "pass seconds per message hop, e.g. 5e-6")
        if self.efficiency is not None and not is_fraction(self.efficiency):
            raise ClusterSpecError(
                f"LinkSpec.efficiency must be in (0, 1] or None, got {self.efficiency!r}; it is the "
                "achieved fraction of the link bandwidth in large collectives"
            )
        if self.rails is not None:
            ok = isinstance(self.rails, numbers.Real) and not isinstance(self.rails, bool)
            if not ok or not math.isfinite(self.rails) or self.rails < 1:
                raise ClusterSpecError(
                    f"LinkSpec.rails must be a number >= 1 or None, got {self.rails!r}; it is how "
                    "many of a node's NICs one collective drives at once"
                )
        object.__setattr__(self, "bandwidth", bw)
        object.__setattr__(self, "latency", lat)

    def _check_collectives(self) -> None:
        from autopar.cost_models.communication import COLLECTIVE_KINDS

        object.__setattr__(self, "collectives", check_rows(
            "LinkSpec", "collectives", self.collectives,
            lambda r: len(r) == 3 and r[0] in COLLECTIVE_KINDS and is_real(r[1]) and is_real(r[2], strict=True),
            lambda r: (str(r[0]), float(r[1]), float(r[2])),
            f"(kind, latency s >= 0, bandwidth bytes/s > 0) with kind one of {list(COLLECTIVE_KINDS)}"))
        object.__setattr__(self, "collective_table", check_rows(
            "LinkSpec", "collective_table", self.collective_table,
            lambda r: len(r) == 4 and r[0] in COLLECTIVE_KINDS and isinstance(r[1], numbers.Integral)
            and not isinstance(r[1], bool) and r[1] >= 2 and is_real(r[2], strict=True) and is_real(r[3], strict=True),
            lambda r: (str(r[0]), int(r[1]), float(r[2]), float(r[3])),
            f"(kind, ranks >= 2, bytes > 0, seconds > 0) with kind one of {list(COLLECTIVE_KINDS)}", unique=False))

    def measured_time(self, kind: str, ranks: int, nbytes: float) -> float | None:
        """Seconds of ``kind`` over ``ranks`` ranks at ``nbytes`` from ``collective_table``:
        log-log interpolation between the measured sizes (``_measured_sizes``: one time per size,
        each capped by the larger sizes'), the smallest size's time below them, and above them the
        last two sizes' marginal cost per byte; None where fewer than two sizes of this kind and
        group size were measured, or above them where the last two give no cost per byte (the
        fitted model then prices it)."""
        rows = _measured_sizes(self.collective_table, kind, ranks)
        if len(rows) < 2:
            return None
        if nbytes <= rows[0][0]:
            return rows[0][1]
        for (b0, t0), (b1, t1) in zip(rows, rows[1:]):
            if nbytes <= b1:
                w = math.log(nbytes / b0) / math.log(b1 / b0)
                return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
        (b0, t0), (b1, t1) = rows[-2], rows[-1]
        if t1 <= t0:
            return None  # no cost per byte left to extrapolate by: the fitted latency and bandwidth
        return t1 + (nbytes - b1) * (t1 - t0) / (b1 - b0)

    def collective(self, kind: str) -> tuple[float, float]:
        """(latency per hop, bandwidth) that ``kind`` achieves on this fabric: its measured pair
        where calibrated, else (latency, effective_bandwidth)."""
        for k, lat, bw in self.collectives:
            if k == kind:
                return lat, bw
        return self.latency, self.effective_bandwidth

    @property
    def effective_bandwidth(self) -> float:
        """Bytes/s per device per direction that collectives achieve (bandwidth x efficiency)."""
        return self.bandwidth * (1.0 if self.efficiency is None else float(self.efficiency))


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` identical devices, ranks numbered node-major.

    Invariants: every count >= 1, every rate/size > 0 and finite, ``device_type`` in
    {"cuda", "cpu"}, ``backend`` in {"nccl", "gloo"} and "nccl" only with "cuda".
    """

    name: str
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    device_type: str = "cuda"
    backend: str = "nccl"
    sources: tuple[str, ...] = ()
    # The share of overlappable communication that stays exposed however much compute there is to
    # hide it behind (a window's first gather and last reduce, stream contention, the
    # framework's prefetch depth), of all but its waiting (``planner.overlap``: a collective's
    # latency can hide where its bytes cannot). None: the planner's default (``planner.overlap.EXPOSED_FLOOR``);
    # calibrated from a measured run of a given software stack.
    exposed_comm_share: float | None = None
    # The share of overlappable communication's waiting (its latency) that stays exposed beside
    # compute: 0 where something progresses a collective while the ranks compute (a GPU's
    # streams); 1 where nothing does (gloo processes on every core). None: 0. Measured by
    # ``autopar calibrate`` (``calibration.comm_probes.probe_waiting``; ``planner.overlap``).
    exposed_latency_share: float | None = None
    # The routing assumption for dropless expert parallelism: the tokens the busiest rank's experts
    # receive over the mean (max / mean); 1.0 is balanced routing. Prices the exchanged rows'
    # time and the experts' compute of the busiest rank (bytes are predicted balanced).
    expert_imbalance: float = 1.0
    # Seconds a collective waits, beyond its own time, for ranks that reach it at different times
    # after compute (host scheduling, launch jitter; processes sharing cores time-slice): paid
    # once per blocking collective call (``blocking_collective_time``; an asynchronous one hides
    # it). 0 for the presets; measured by ``autopar calibrate``.
    collective_skew_s: float = 0.0
    # Seconds a pipeline stage spends per microbatch beyond its compute and its messages: the
    # schedule's actions (torch.distributed.pipelining's bookkeeping, receive buffers, autograd
    # calls), which a CPU process pays in full. 0 for the presets; measured by ``autopar calibrate``.
    pipeline_microbatch_s: float = 0.0

    def __post_init__(self) -> None:
        check_name("Cluster", self.name)
        check_int("Cluster", "nodes", self.nodes, "a cluster needs at least one node")
        check_int(
            "Cluster", "devices_per_node", self.devices_per_node,
            "a cluster with zero devices per node has nothing to run on; pass the number of "
            "GPUs (or CPU processes) per node, e.g. 8",
        )
        if self.nodes * self.devices_per_node > MAX_WORLD_SIZE:
            raise ClusterSpecError(f"Cluster has {self.nodes} nodes x {self.devices_per_node} devices = {self.nodes * self.devices_per_node} "
                                   f"devices, more than autopar plans for ({MAX_WORLD_SIZE:,}); pass the real nodes= and devices per node")
        for f, cls in (("device", DeviceSpec), ("intra_node", LinkSpec), ("inter_node", LinkSpec)):
            if not isinstance(getattr(self, f), cls):
                raise ClusterSpecError(
                    f"Cluster.{f} must be a {cls.__name__}, got {type(getattr(self, f)).__name__}"
                )
        if self.device_type not in _DEVICE_TYPES:
            raise ClusterSpecError(
                f"Cluster.device_type must be one of {_DEVICE_TYPES}, got {self.device_type!r}"
            )
        if self.backend not in _BACKENDS:
            raise ClusterSpecError(
                f"Cluster.backend must be one of {_BACKENDS}, got {self.backend!r}"
            )
        if self.backend == "nccl" and self.device_type != "cuda":
            raise ClusterSpecError(
                f"Cluster.backend 'nccl' needs device_type 'cuda', got {self.device_type!r}; "
                "use backend='gloo' for CPU devices"
            )
        if not isinstance(self.sources, (list, tuple)) or not all(
            isinstance(s, str) for s in self.sources
        ):
            raise ClusterSpecError(
                f"Cluster.sources must be a sequence of strings, got {self.sources!r}"
            )
        if self.intra_node.rails is not None:
            raise ClusterSpecError(
                f"Cluster.intra_node.rails is {self.intra_node.rails!r}, but rails describe how a collective "
                "leaves a node (NICs); set inter_node.rails and leave intra_node.rails None"
            )
        for name, what in (("exposed_comm_share", "overlappable communication"),
                           ("exposed_latency_share", "overlappable communication's waiting (latency)")):
            share = getattr(self, name)
            if share is not None and not (isinstance(share, numbers.Real) and not isinstance(share, bool)
                                          and 0.0 <= float(share) <= 1.0):
                raise ClusterSpecError(
                    f"Cluster.{name} must be in [0, 1] or None, got {share!r}; it is the share of {what} "
                    "that stays exposed"
                )
        for name, meaning in (("collective_skew_s", "what a collective waits for ranks that arrive at different "
                                                     "times (e.g. 1e-4)"),
                              ("pipeline_microbatch_s", "what a pipeline stage spends per microbatch beyond compute "
                                                        "and messages (e.g. 2e-4)")):
            seconds = getattr(self, name)
            if not is_real(seconds, high=1.0):
                raise ClusterSpecError(
                    f"Cluster.{name} must be a number of seconds in [0, 1), got {seconds!r}; it is {meaning}")
            object.__setattr__(self, name, float(seconds))
        imb = self.expert_imbalance
        if not (isinstance(imb, numbers.Real) and not isinstance(imb, bool) and math.isfinite(imb) and imb >= 1.0):
            raise ClusterSpecError(
                f"Cluster.expert_imbalance must be a number >= 1 (the busiest expert rank's tokens over the mean; "
                f"1.0 is balanced routing), got {imb!r}")
        from autopar.cluster_json import check_calibrated_world

        check_calibrated_world(self)
        object.__setattr__(self, "sources", tuple(self.sources))
        object.__setattr__(self, "nodes", int(self.nodes))
        object.__setattr__(self, "devices_per_node", int(self.devices_per_node))

    @property
    def world_size(self) -> int:
        """Total number of devices (ranks)."""
        return self.nodes * self.devices_per_node

    @classmethod
    def preset(cls, name: str, nodes: int = 1) -> Cluster:
        """A named system: "dgx-a100", "dgx-h100" or "dgx-h200" (data in cost_models.hardware)."""
        key = name.lower() if isinstance(name, str) else None
        if key not in _PRESETS:
            raise ClusterSpecError(
                f"unknown cluster preset {name!r}; known presets: {', '.join(sorted(_PRESETS))}"
            )
        p = _PRESETS[key]
        d = p["device"]
        device = DeviceSpec(
            name=d["name"],
            peak_flops=PeakFlops(fp32=d["fp32"], tf32=d["tf32"], bf16=d["bf16"], fp16=d["fp16"]),
            memory_bytes=d["memory_bytes"],
            memory_bandwidth=d["memory_bandwidth"],
            matmul_efficiency=d.get("matmul_efficiency"),
        )
        return cls(
            name=key,
            nodes=nodes,
            devices_per_node=p["devices_per_node"],
            device=device,
            intra_node=LinkSpec(**p["intra_node"]),
            inter_node=LinkSpec(**p["inter_node"]),
            device_type="cuda",
            backend="nccl",
            sources=tuple(p["sources"]),
        )

    @classmethod
    def local(cls, n: int | None = None, calibrated: bool = True) -> Cluster:
        """``n`` CPU processes on this machine over gloo (``n`` defaults to ``$WORLD_SIZE``).

        The device numbers are a rough engineering model of one CPU process -- 50 GFLOP/s for
        every float dtype (no tensor cores; bf16/fp16 are not faster than fp32 on most CPUs),
        10 GB/s memory bandwidth, this machine's RAM / n of memory (read once, here), and a
        loopback link of 2 GB/s with 50 us latency -- unless ``autopar calibrate --nproc n`` has
        measured this machine: then its spec (``calibration_path(n)``), with RAM / n of memory
        (``calibrated=False``: the uncalibrated model even so).
        """
        if n is None:
            env = os.environ.get("WORLD_SIZE")
            if env is None:
                raise ClusterSpecError(
                    "Cluster.local() needs the number of processes: pass n (e.g. "
                    "Cluster.local(4)) or run under torchrun, which sets WORLD_SIZE"
                )
            try:
                n = int(env)
            except ValueError:
                raise ClusterSpecError(
                    f"WORLD_SIZE must be an integer, got {env!r}; pass n to Cluster.local(n)"
                ) from None
        n = check_int("Cluster.local", "n", n, "pass the number of CPU processes, e.g. 4")
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, OSError, ValueError):  # non-POSIX: assume 8 GiB
            ram = 8 * 2**30
        from autopar.cluster_json import calibrated_local

        spec = calibrated_local(n, max(1, ram // n)) if calibrated else None
        if spec is not None:
            return spec
        loopback = LinkSpec(bandwidth=2e9, latency=50e-6)
        return cls(
            name="local",
            nodes=1,
            devices_per_node=n,
            device=DeviceSpec(
                name="cpu-process",
                peak_flops=PeakFlops(fp32=50e9, tf32=50e9, bf16=50e9, fp16=50e9),
                memory_bytes=max(1, ram // n),
                memory_bandwidth=10e9,
            ),
            intra_node=loopback,
            inter_node=loopback,
            device_type="cpu",
            backend="gloo",
            sources=("engineering estimate of one CPU process; replace by calibration",),
        )

    def with_nodes(self, nodes: int) -> Cluster:
        """The same cluster with ``nodes`` nodes (validated)."""
        return dataclasses.replace(self, nodes=nodes)

    def to_json(self) -> str:
        """Deterministic JSON (sorted keys) carrying ``"schema_version": 1``."""
        d = dataclasses.asdict(self)
        d["sources"] = list(self.sources)
        d["schema_version"] = SCHEMA_VERSION
        return json.dumps(d, sort_keys=True, indent=2)

    @classmethod
    def from_json(cls, s: str) -> Cluster:
        """Inverse of :meth:`to_json`; any bad, missing or unknown field raises ClusterSpecError."""
        from autopar.cluster_json import cluster_from_json

        return cluster_from_json(s)


@functools.lru_cache(maxsize=64)
def _measured_sizes(table: tuple, kind: str, ranks: int) -> tuple[tuple[float, float], ...]:
    """(bytes, seconds) of ``kind`` over ``ranks`` ranks in ``LinkSpec.collective_table``, by size:
    a size measured twice counts once (its median), and a message takes no longer than any larger
    one (a noisy small size is capped by the sizes above it). Cached: the planner prices many
    collectives against one table."""
    times: dict[float, list[float]] = {}
    for k, p, b, t in table:
        if k == kind and p == ranks:
            times.setdefault(b, []).append(t)
    rows = [(b, statistics.median(ts)) for b, ts in sorted(times.items())]
    for i in range(len(rows) - 2, -1, -1):
        rows[i] = (rows[i][0], min(rows[i][1], rows[i + 1][1]))
    return tuple(rows)


def calibration_path(n: int, device_type: str = "cpu") -> pathlib.Path:
    """Where ``autopar calibrate --nproc n`` writes this machine's spec and ``Cluster.local(n)``
    reads it: ``$AUTOPAR_CALIBRATION_DIR/local-{n}.json``, by default under ``~/.cache/autopar/calibration``
    (the measurements depend on n: n processes share the machine's cores and memory). Its GPUs'
    spec (``--backend nccl``): ``local-cuda-{n}.json`` beside it, which ``Cluster.from_json`` reads."""
    root = os.environ.get("AUTOPAR_CALIBRATION_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "autopar", "calibration")
    return pathlib.Path(root) / (f"local-{int(n)}.json" if device_type == "cpu" else f"local-{device_type}-{int(n)}.json")
