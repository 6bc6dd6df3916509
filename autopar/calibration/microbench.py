"""The measurements ``autopar calibrate`` fits: run on every rank at once, on the real backend.

Every rank measures at the same time, so the figures include what the ranks of a training run
share (on a CPU machine: its cores and memory bandwidth; on a node: its PCIe and NICs). What is
measured, per rank (``measure_rank``):

* matmuls (``torch.mm``) over a grid of shapes, per dtype: (flops, seconds);
* attention (``scaled_dot_product_attention``, causal) over a few shapes: (flops, seconds);
* a streaming op (``torch.add(a, b, out=c)``) over sizes: (bytes read + written, seconds);
* each collective the runtime issues (through ``runtime.comm.MeshComm``, as the program does) over
  message sizes, on the whole world and, with 4 or more ranks, on pairs: (group size, bytes in
  nccl-tests' convention, seconds);
* overlap: a collective alone, a block of matmuls alone, then both with the collective in flight.

Times are per op, averaged over back-to-back repetitions after a barrier (the barrier's skew is
spread over the repetitions); each measurement is the median of ``repeats`` such runs.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["MicrobenchSpec", "measure_rank", "MATMUL_SHAPES"]

# (m, k, n): from dispatch-bound to compute-bound on one CPU core
MATMUL_SHAPES = ((16, 64, 64), (64, 64, 256), (128, 256, 256), (256, 256, 1024), (256, 1024, 1024),
                 (512, 1024, 2048))
_ATTENTION_SHAPES = ((2, 4, 32, 16), (4, 4, 128, 32), (4, 8, 256, 64))  # (batch, heads, seq, head dim)
_STREAM_NUMELS = (256, 4096, 65536, 1 << 20, 1 << 22)
_COMM_BYTES = (4 << 10, 32 << 10, 256 << 10, 1 << 21, 1 << 23)
_COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class MicrobenchSpec:
    """``repeats``: runs per measurement (their median is kept); ``quick``: the smallest grids
    (tests); ``dtypes``: matmul dtypes measured beside fp32; ``backend``: "gloo" (CPU processes)
    or "nccl" (one GPU per process)."""

    repeats: int = 5
    quick: bool = False
    dtypes: tuple[str, ...] = ("bfloat16",)
    backend: str = "gloo"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _per_op(fn: Callable[[], object], device: torch.device, repeats: int, min_s: float = 2e-3,
            barrier: Callable[[], None] | None = None) -> float:
    """Median over ``repeats`` of the seconds per call of ``fn``, each run calling it back to back
    enough times to last about ``min_s`` (the count chosen once, from a first call)."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    one = max(time.perf_counter() - t0, 1e-7)
    calls = max(1, min(200, int(min_s / one)))
    if barrier is not None:  # every rank runs the same count: take the largest
        calls = barrier(calls)
    runs = []
    for _ in range(repeats):
        if barrier is not None:
            barrier(None)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        runs.append((time.perf_counter() - t0) / calls)
    return statistics.median(runs)


def _agreed_barrier():
    """A barrier that, given a count, returns the largest count of every rank."""
    import torch.distributed as dist

    def barrier(count):
        if count is None:
            dist.barrier()
            return None
        t = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    return barrier


def _progress(text: str) -> None:
    """One line on rank 0's stderr: what is being measured (calibration takes tens of seconds)."""
    import os
    import sys

    if os.environ.get("RANK", "0") == "0":
        print(f"  calibrate: {text}", file=sys.stderr, flush=True)


def _compute(spec: MicrobenchSpec, device: torch.device, barrier) -> dict:
    _progress("matmuls, attention and streaming ops")
    shapes = MATMUL_SHAPES[:4] if spec.quick else MATMUL_SHAPES
    out: dict = {"matmul": {}, "attention": [], "stream": []}
    for dtype_name in ("float32",) + tuple(spec.dtypes):
        dtype = getattr(torch, dtype_name)
        rows = []
        for m, k, n in shapes:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            rows.append((2.0 * m * k * n, _per_op(lambda: torch.mm(a, b), device, spec.repeats, barrier=barrier)))
        out["matmul"][dtype_name] = rows
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for b, h, s, d in _ATTENTION_SHAPES[:2] if spec.quick else _ATTENTION_SHAPES:
        q, k, v = (torch.randn(b, h, s, d, device=device) for _ in range(3))
        flops = 4.0 * b * h * s * s * d * 0.5  # causal: as planner.costing counts it
        out["attention"].append((flops, _per_op(lambda: sdpa(q, k, v, is_causal=True), device, spec.repeats,
                                                barrier=barrier)))
    for numel in _STREAM_NUMELS[:4] if spec.quick else _STREAM_NUMELS:
        x, y, z = (torch.randn(numel, device=device) for _ in range(3))
        out["stream"].append((3.0 * numel * 4, _per_op(lambda: torch.add(x, y, out=z), device, spec.repeats,
                                                       barrier=barrier)))
    return out


def _collective_call(comm, kind: str, nbytes: int, axis: int, device: torch.device) -> Callable[[], object]:
    """One ``kind`` of ``nbytes`` (nccl-tests' size) on ``comm``'s ``axis``, as a closure."""
    p = comm.sizes[axis]
    numel = max(p, nbytes // 4 // p * p)
    full = torch.randn(numel, device=device)
    part = torch.empty(numel // p, device=device)
    if kind == "all_reduce":
        return lambda: comm.all_reduce(full, axis)
    if kind == "all_gather":
        return lambda: comm.all_gather(full, part, axis)
    if kind == "reduce_scatter":
        return lambda: comm.reduce_scatter(part, full, axis)
    out = torch.empty_like(full)
    return lambda: comm.all_to_all(out, full, axis)


def _meshes(world: int, device: torch.device):
    """(group size, MeshComm, axis): the whole world and, with 4 or more ranks, pairs."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.comm import MeshComm

    meshes = [(world, MeshComm.from_device_mesh(init_device_mesh(device.type, (world,), mesh_dim_names=("w",))), 0)]
    if world >= 4 and world % 2 == 0:
        pairs = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("outer", "pair"))
        meshes.append((2, MeshComm.from_device_mesh(pairs), 1))
    return meshes


def _collectives(spec: MicrobenchSpec, device: torch.device, barrier, world: int) -> dict:
    sizes = _COMM_BYTES[:4] if spec.quick else _COMM_BYTES
    _progress(f"collectives ({', '.join(_COMM_KINDS)}) over {world} ranks" + (" and pairs" if world >= 4 else ""))
    out: dict = {k: [] for k in _COMM_KINDS}
    for p, comm, axis in _meshes(world, device):
        for kind in _COMM_KINDS:
            for nbytes in sizes:
                call = _collective_call(comm, kind, nbytes, axis, device)
                seconds = _per_op(call, device, spec.repeats, barrier=barrier)
                out[kind].append((p, float(max(p, nbytes // 4 // p * p) * 4), seconds))
    return out


def _overlap(spec: MicrobenchSpec, device: torch.device, barrier, world: int) -> dict:
    """Seconds of a block of matmuls, of an all-reduce, and of both with the all-reduce in flight
    (issued asynchronously, waited after the matmuls), as the runtime overlaps gradient sync."""
    import torch.distributed as dist

    _progress("overlap of an all-reduce with compute")
    buf = torch.randn((1 << 21) // 4, device=device)  # 2 MiB
    a = torch.randn(256, 256, device=device)

    def comm():
        dist.all_reduce(buf)

    t_comm = _per_op(comm, device, spec.repeats, barrier=barrier)
    t_mm = _per_op(lambda: torch.mm(a, a), device, 3, barrier=barrier)
    n_mm = max(1, int(t_comm / t_mm))

    def compute():
        for _ in range(n_mm):
            torch.mm(a, a)

    def both():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    return {"comm_s": t_comm, "compute_s": _per_op(compute, device, spec.repeats, barrier=barrier),
            "together_s": _per_op(both, device, spec.repeats, barrier=barrier)}


def measure_rank(spec: MicrobenchSpec) -> dict:
    """This rank's measurements (run under ``autopar.launch`` or torchrun on every rank at once;
    initialises the process group on ``spec.backend`` unless one exists)."""
    import os

    import torch.distributed as dist

    from autopar.runtime.launch import init_distributed

    if spec.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    init_distributed(spec.backend, int(os.environ.get("WORLD_SIZE", "1")))
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    barrier = _agreed_barrier() if world > 1 else None
    out = {"world": world, "device_type": device.type, "compute": _compute(spec, device, barrier)}
    if world > 1:
        out["collectives"] = _collectives(spec, device, barrier, world)
        out["overlap"] = _overlap(spec, device, barrier, world)
    return out
