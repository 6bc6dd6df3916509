"""Compute cost model: a roofline over a :class:`~autopar.cluster.DeviceSpec`.

``time = max(flops / (peak * efficiency), bytes_moved / (memory_bandwidth * memory_efficiency))``

The efficiencies are the achievable fraction of datasheet peak for one *kernel* (not end-to-end
MFU, which also pays communication, pipeline bubbles and host overhead). They are module
constants so calibration against published end-to-end throughputs can replace them, and every
call may override them by argument. Sources of the starting values:

* ``MATMUL_EFFICIENCY = 0.75``: large cuBLAS GEMMs reach roughly 70-80% of tensor-core peak on
  A100/H100 (NVIDIA "Matrix Multiplication Background" performance guide); Megatron-LM reports
  52% *end-to-end* MFU for GPT-3 175B on A100 (Narayanan et al., SC'21, 163 of 312 TFLOP/s),
  consistent with ~75% kernel efficiency after communication and bubbles.
* ``ATTENTION_EFFICIENCY = 0.6``: FlashAttention-2 reaches 50-73% of A100 peak forward and
  backward (Dao, 2023, arXiv:2307.08691).
* ``MEMORY_EFFICIENCY = 0.8``: streaming kernels reach ~80-90% of HBM peak (STREAM/BabelStream
  style measurements on A100/H100).
* ``POINTWISE_EFFICIENCY = 0.5`` and ``OTHER_EFFICIENCY = 0.5``: pointwise and other non-matmul
  ops run on the vector units (CUDA cores), not tensor cores. Their FLOPs are counted against the
  fp32 peak whatever the dtype (half precision's 2x vector rate is ignored: conservative, and
  these ops are memory bound anyway), which also lets integer ops through. Engineering guesses.
  Convolutions run as implicit GEMMs: classify them as ``"matmul"`` (a device with a measured
  ``conv_table``, a CPU's: ``conv_time``).

Example:
    >>> from autopar.cluster import Cluster
    >>> a100 = Cluster.preset("dgx-a100").device
    >>> round(op_time(2 * 8192**3, 3 * 2 * 8192**2, a100, "bf16") * 1e3, 3)  # ms, compute bound
    4.699
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from autopar.errors import AutoparError

if TYPE_CHECKING:  # only for annotations: keeps autopar.cluster -> cost_models acyclic
    from autopar.cluster import DeviceSpec

__all__ = [
    "MATMUL_EFFICIENCY",
    "ATTENTION_EFFICIENCY",
    "POINTWISE_EFFICIENCY",
    "OTHER_EFFICIENCY",
    "MEMORY_EFFICIENCY",
    "OP_KINDS",
    "op_time",
    "matmul_time",
    "conv_time",
    "dtype_bytes",
]

MATMUL_EFFICIENCY = 0.75
ATTENTION_EFFICIENCY = 0.6
POINTWISE_EFFICIENCY = 0.5
OTHER_EFFICIENCY = 0.5
MEMORY_EFFICIENCY = 0.8

OP_KINDS = ("matmul", "attention", "pointwise", "other")
_TENSOR_CORE_KINDS = ("matmul", "attention")

_DTYPE_BYTES = {
    "float64": 8, "double": 8, "fp64": 8,
    "float32": 4, "float": 4, "fp32": 4, "tf32": 4,
    "bfloat16": 2, "bf16": 2,
    "float16": 2, "half": 2, "fp16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1,
    "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2, "short": 2,
    "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
}


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of ``dtype``: a torch/numpy dtype or a name ("bf16", "float32", ...).

    >>> dtype_bytes("bf16"), dtype_bytes("torch.float32")
    (2, 4)
    """
    if not isinstance(dtype, str) and isinstance(getattr(dtype, "itemsize", None), int):
        return dtype.itemsize  # torch.dtype and numpy dtypes know their size
    key = str(dtype).removeprefix("torch.")
    if key not in _DTYPE_BYTES:
        raise AutoparError(f"unknown dtype {dtype!r}; known dtypes: {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[key]


def _efficiency(kind: str) -> float:
    # Looked up at call time so that patching a module constant takes effect.
    return {
        "matmul": MATMUL_EFFICIENCY,
        "attention": ATTENTION_EFFICIENCY,
        "pointwise": POINTWISE_EFFICIENCY,
        "other": OTHER_EFFICIENCY,
    }[kind]


def _check_nonneg(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise AutoparError(f"op_time: {name} must be a finite number >= 0, got {value!r}")


def _check_fraction(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0 < value <= 1):
        raise AutoparError(f"op_time: {name} must be in (0, 1], got {value!r}")


def op_time(
    flops: float,
    bytes_moved: float,
    device: DeviceSpec,
    dtype: Any,
    kind: str = "matmul",
    *,
    efficiency: float | None = None,
    memory_efficiency: float | None = None,
) -> float:
    """Roofline time in seconds of one op on one device.

    ``flops``: floating-point operations (a multiply-add is 2). ``bytes_moved``: bytes read plus
    written in device memory. ``kind`` in :data:`OP_KINDS`: "matmul"/"attention" run at the
    tensor-core peak of ``dtype``; "pointwise"/"other" at the fp32 vector peak. ``efficiency``
    and ``memory_efficiency`` override the module constants for this call.
    """
    if kind not in OP_KINDS:
        raise AutoparError(f"op_time: unknown op kind {kind!r}; known kinds: {list(OP_KINDS)}")
    _check_nonneg("flops", flops)
    _check_nonneg("bytes_moved", bytes_moved)
    eff = _efficiency(kind) if efficiency is None else efficiency
    mem_eff = MEMORY_EFFICIENCY if memory_efficiency is None else memory_efficiency
    _check_fraction("efficiency", eff)
    _check_fraction("memory_efficiency", mem_eff)
    if kind in _TENSOR_CORE_KINDS:
        peak = device.peak_flops.for_dtype(dtype)
    else:
        dtype_bytes(dtype)  # validate the dtype name even though the vector rate ignores it
        peak = device.peak_flops.fp32
    compute = flops / (peak * eff)
    memory = bytes_moved / (device.memory_bandwidth * mem_eff)
    return max(compute, memory)


def matmul_time(m: int, k: int, n: int, device: DeviceSpec, dtype: Any, batch: int = 1,
                linear: bool = False) -> float:
    """Seconds of ``batch`` matmuls of [m, k] x [k, n] on a device with a measured shape table
    (``DeviceSpec.matmul_table``, fp32, from ``autopar calibrate``; with ``linear``, the right
    operand a weight stored [n, k] as nn.Linear's forward has it: ``DeviceSpec.linear_table``
    where measured): at the efficiency
    interpolated from the table (linearly in log efficiency over log m, log k, log n; a shape
    beyond the grid's largest takes its edge's), at ``dtype``'s peak; below the grid's smallest,
    the edge's time scaled by the elements the op reads and writes. A matmul's efficiency depends on its
    shape, not only its FLOPs: on a CPU a weight gradient whose inner dimension is a microbatch of
    8 rows runs at a fifth of a square matmul's rate.
    """
    if not device.matmul_table:
        raise AutoparError(f"matmul_time: device {device.name!r} has no measured matmul table; "
                           "run `autopar calibrate` or price with op_time")
    table = device.linear_table if linear and device.linear_table else device.matmul_table
    return _tabled_time(table, m, k, n, batch, device.peak_flops.fp32, device.peak_flops.for_dtype(dtype))


def conv_time(m: int, k: int, n: int, device: DeviceSpec, dtype: Any, backward: bool = False) -> float:
    """Seconds of a convolution whose implicit GEMM is [m, k] x [k, n] (m: batch x output pixels,
    k: input channels per group x kernel elements, n: output channels) on a device with a measured
    ``DeviceSpec.conv_table``: its forward (``backward``: the input's and the weight's gradients)
    at the efficiency interpolated from the table over (m, k, n), as ``matmul_time`` does from the
    matmul table (the backward's as if it were twice the forward's FLOPs). A CPU convolution's
    speed follows its channels, not its FLOPs: a 3x3 convolution of 8 channels on 4 processes
    sharing 2 cores ran at a few percent of the matmul rate.
    """
    if not device.conv_table:
        raise AutoparError(f"conv_time: device {device.name!r} has no measured convolution table; "
                           "run `autopar calibrate` or price with op_time")
    scale = 2.0 if backward else 1.0
    table = _conv_rows(device.conv_table, backward, scale)
    return scale * _tabled_time(table, m, k, n, 1, device.peak_flops.fp32, device.peak_flops.for_dtype(dtype))


@functools.lru_cache(maxsize=16)
def _conv_rows(table: tuple, backward: bool, scale: float) -> tuple:
    """(m, k, n, seconds per ``scale`` forward FLOPs) rows of ``conv_table``'s forward or backward."""
    return tuple((m, k, n, (b if backward else f) / scale) for m, k, n, f, b in table)


def _tabled_time(table: tuple, m: int, k: int, n: int, batch: int, table_peak: float, peak: float) -> float:
    """``batch`` [m, k] x [k, n] products priced from ``table``'s (m, k, n, seconds) rows: the
    efficiency (of ``table_peak``) interpolated at the shape, run at ``peak``; a dim below the
    grid's smallest priced there and scaled by the elements moved (``matmul_time``)."""
    dims, log_eff = _efficiency_grid(table, table_peak)
    # a dim below the grid's smallest: priced at that smallest, scaled by the elements moved (so
    # tiny a dim leaves the op bound by its other operands, as it runs: a weight gradient over 4
    # rows takes about the time of one over 8, not half of it)
    lowest = [float(np.exp(ax[0])) for ax in dims]
    shape = [max(float(v), 1.0) for v in (m, k, n)]
    at = [max(v, lo) for v, lo in zip(shape, lowest)]
    eff = float(np.exp(_interpolate(dims, log_eff, [np.log(v) for v in at])))
    seconds = 2.0 * batch * at[0] * at[1] * at[2] / (peak * eff)
    if at != shape:
        moved = lambda a, b, c: a * b + b * c + a * c  # noqa: E731 - both operands and the result
        seconds *= moved(*shape) / moved(*at)
    return seconds


@functools.lru_cache(maxsize=16)
def _efficiency_grid(table: tuple, peak: float) -> tuple[list[np.ndarray], np.ndarray]:
    """(log dims per axis, log efficiency on their grid) from (m, k, n, seconds) rows; a grid
    point that was not measured (a corner too large to time) takes the best measured efficiency."""
    axes = [sorted({row[i] for row in table}) for i in range(3)]
    eff = np.full([len(a) for a in axes], np.nan)
    for m, k, n, t in table:
        eff[axes[0].index(m), axes[1].index(k), axes[2].index(n)] = min(1.0, 2.0 * m * k * n / (t * peak))
    eff[np.isnan(eff)] = np.nanmax(eff)
    return [np.log(np.asarray(a, dtype=float)) for a in axes], np.log(eff)


def _interpolate(axes: list[np.ndarray], values: np.ndarray, point: list[float]) -> float:
    """Multilinear interpolation of ``values`` (on the grid ``axes``) at ``point``, clamped to the grid."""
    corners = []
    for ax, x in zip(axes, point):
        if len(ax) == 1:
            corners.append(((0, 1.0),))
            continue
        x = min(max(x, ax[0]), ax[-1])
        i = min(int(np.searchsorted(ax, x, side="right")) - 1, len(ax) - 2)
        w = (x - ax[i]) / (ax[i + 1] - ax[i])
        corners.append(((i, 1.0 - w), (i + 1, w)))
    total = 0.0
    for a in corners[0]:
        for b in corners[1]:
            for c in corners[2]:
                total += a[1] * b[1] * c[1] * values[a[0], b[0], c[0]]
    return total
