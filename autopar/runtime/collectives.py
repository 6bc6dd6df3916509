"""Resharding collectives on local tensors, with the conjugate communication in backward.

``reshard(x, src, dst, grad_src, grad_dst)`` is what the passes insert into the per-rank program
at every layout change. Forward applies ``reshard_steps(src, dst)``; backward applies
``reshard_steps(grad_src, grad_dst)`` to the incoming gradient (``grad_src`` is the layout the
consumer's local backward produces, ``grad_dst`` the producer's gradient layout, see
``autopar.layouts``). Both directions use the same step implementations.

Only public c10d calls are used (``all_reduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``): they exist unchanged in torch 2.11-2.13 and run
on gloo and NCCL. The process groups come from the ``MeshComm`` made active by the runtime.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from autopar.layouts import Layout, Partial, chunk_range, parse_layout
from autopar.resharding import ReshardStep, reshard_steps_for

__all__ = ["MeshComm", "active_mesh", "reshard", "apply_steps", "shard_tensor"]


@dataclass
class MeshComm:
    """Per mesh axis: process group, size, and this rank's coordinate."""

    groups: tuple
    sizes: tuple[int, ...]
    coords: tuple[int, ...]

    @classmethod
    def from_device_mesh(cls, mesh) -> "MeshComm":
        names = mesh.mesh_dim_names
        return cls(
            groups=tuple(mesh.get_group(n) for n in names),
            sizes=tuple(mesh.size(i) for i in range(len(names))),
            coords=tuple(mesh.get_local_rank(n) for n in names),
        )


_ACTIVE: list[MeshComm] = []


@contextlib.contextmanager
def active_mesh(comm: MeshComm):
    """Make ``comm`` the mesh that ``reshard`` nodes communicate over (nested use allowed)."""
    _ACTIVE.append(comm)
    try:
        yield comm
    finally:
        _ACTIVE.pop()


def _comm() -> MeshComm:
    if not _ACTIVE:
        raise RuntimeError("autopar reshard ran outside a ParallelModel step (no active mesh)")
    return _ACTIVE[-1]


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names
# warn); 2.11 has only the old ones
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _slice(x: torch.Tensor, dim: int, n: int, coord: int) -> torch.Tensor:
    """Shard ``coord`` of ``n`` along ``dim``, cut as ``torch.chunk`` / DTensor do (the last
    shards of a dim that does not divide evenly are short or empty)."""
    start, length = chunk_range(x.shape[dim], n, coord)
    return x.narrow(dim, start, length).contiguous()


def _pad_dim0(front: torch.Tensor, rows: int) -> torch.Tensor:
    if front.shape[0] == rows:
        return front
    pad = front.new_zeros((rows - front.shape[0],) + tuple(front.shape[1:]))
    return torch.cat([front, pad])


def _all_gather(x: torch.Tensor, dim: int, n: int, group, size: int | None = None) -> torch.Tensor:
    """Concatenate the shards of ``dim``; ``size`` (the gathered length) when shards are uneven:
    each rank pads its shard to ``ceil(size / n)`` and the result is cut back to ``size``."""
    front = x.movedim(dim, 0).contiguous()
    rows = front.shape[0] if size is None else -(-size // n)
    front = _pad_dim0(front, rows)
    out = torch.empty((n * rows,) + tuple(front.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, front, group=group)
    if size is not None:
        out = out[:size]
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, n: int, group, coord: int = 0) -> torch.Tensor:
    """Sum over ranks, keeping shard ``coord`` of ``dim`` (``torch.chunk`` cut; a dim that does
    not divide evenly is padded to ``n * ceil(size / n)`` for the collective)."""
    front = x.movedim(dim, 0).contiguous()
    size = front.shape[0]
    rows = -(-size // n)
    front = _pad_dim0(front, n * rows)
    out = torch.empty((rows,) + tuple(front.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, front, group=group)
    if rows * n != size:
        out = out[: chunk_range(size, n, coord)[1]]
    return out.movedim(0, dim).contiguous()


def _all_to_all(x: torch.Tensor, src_dim: int, dim: int, n: int, group) -> torch.Tensor:
    # send chunk k along `dim` to rank k; what arrives from rank k is block k of `src_dim`
    chunks = torch.stack(x.chunk(n, dim=dim), dim=0).contiguous()
    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks, group=group)
    return torch.cat(out.unbind(0), dim=src_dim).contiguous()


def _one_step(x: torch.Tensor, step: ReshardStep, comm: MeshComm, shape: Sequence[int] | None = None) -> torch.Tensor:
    a = step.axis
    n, coord, group = comm.sizes[a], comm.coords[a], comm.groups[a]
    if n == 1:
        return x
    kind = step.kind
    if kind == "slice":
        return _slice(x, step.dim, n, coord)
    if kind == "to_partial":
        if step.op == "avg":
            return x
        return x if coord == 0 else torch.zeros_like(x)
    if kind == "scale":
        return x / n if step.op == "avg_to_sum" else x * n
    if kind == "all_reduce":
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out / n if step.op == "avg" else out
    if kind == "reduce_scatter":
        out = _reduce_scatter(x, step.dim, n, group, coord)
        return out / n if step.op == "avg" else out
    if kind == "all_gather":
        uneven = shape is not None and shape[step.dim] % n != 0
        return _all_gather(x, step.dim, n, group, shape[step.dim] if uneven else None)
    if kind == "all_to_all":
        return _all_to_all(x, step.src_dim, step.dim, n, group)
    raise AssertionError(f"unknown reshard step {kind}")


def apply_steps(x: torch.Tensor, steps: Sequence[ReshardStep], comm: MeshComm,
                shape: Sequence[int] | None = None) -> torch.Tensor:
    """Run ``steps`` on local tensor ``x``; ``shape`` (the global shape) is needed only when a
    gathered dim is sharded unevenly (``layouts.uneven_dims``)."""
    for step in steps:
        x = _one_step(x, step, comm, shape)
    return x


def _avg_axes(src: Layout, dst: Layout) -> list[int]:
    """Axes where a Partial(avg) is resolved: its gradient is scaled by 1/n there."""
    return [a for a, (p, q) in enumerate(zip(src, dst)) if isinstance(p, Partial) and p.reduce_op == "avg" and p != q]


class _Reshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd_steps, bwd_steps, grad_scale_axes, shape):
        comm = _comm()
        ctx.bwd_steps = bwd_steps
        ctx.grad_scale_axes = grad_scale_axes
        ctx.comm = comm
        ctx.shape = shape
        return apply_steps(x, fwd_steps, comm, shape)

    @staticmethod
    def backward(ctx, g):
        comm = ctx.comm
        out = apply_steps(g.contiguous(), ctx.bwd_steps, comm, ctx.shape) if ctx.bwd_steps is not None else None
        if out is not None:
            for a in ctx.grad_scale_axes:
                out = out / comm.sizes[a]
        return out, None, None, None, None


_STEP_CACHE: dict = {}


def _steps(src: str, dst: str, shape: tuple | None, sizes: tuple) -> tuple:
    key = (src, dst, shape, sizes)
    if key not in _STEP_CACHE:
        _STEP_CACHE[key] = tuple(reshard_steps_for(shape, parse_layout(src), parse_layout(dst), sizes))
    return _STEP_CACHE[key]


def reshard(x: torch.Tensor, src: str, dst: str, grad_src: str | None = None, grad_dst: str | None = None,
            shape: tuple | None = None) -> torch.Tensor:
    """Move local tensor ``x`` from layout ``src`` to ``dst`` (strings like "[S(0), R]").

    In backward the gradient goes from ``grad_src`` to ``grad_dst`` (None: no gradient flows).
    ``shape``: the global shape, given (by the passes) only where a layout shards a dim unevenly.
    """
    comm = _comm()
    fwd = _steps(src, dst, shape, comm.sizes)
    bwd = _steps(grad_src, grad_dst, shape, comm.sizes) if grad_src is not None and grad_dst is not None else None
    scale = _avg_axes(parse_layout(src), parse_layout(dst))
    if not x.requires_grad or bwd is None:
        return apply_steps(x, fwd, comm, shape)
    out = _Reshard.apply(x, fwd, bwd, scale, shape)
    if x.is_leaf and any(s.kind == "all_gather" for s in fwd):
        # a gathered parameter: let backward gather it again instead of keeping it (ZeRO-3)
        from autopar.runtime.param_regather import remember_gathered_param

        remember_gathered_param(out, x.detach(), lambda local: apply_steps(local, fwd, comm, shape))
    return out


def shard_tensor(full: torch.Tensor, layout: Layout, comm: MeshComm) -> torch.Tensor:
    """This rank's local piece of a full (replicated) tensor: slices only, no communication."""
    out = full
    for a, p in enumerate(layout):
        if hasattr(p, "dim") and comm.sizes[a] > 1:
            out = _slice(out, p.dim, comm.sizes[a], comm.coords[a])
    return out
