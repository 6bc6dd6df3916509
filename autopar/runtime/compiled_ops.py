"""The implementations of the IR's program ops (``autopar.ir_ops``) on the active mesh.

Each runs its collectives through the active ``MeshComm`` (``collectives.current_mesh``), as the
eager ``reshard`` does: the same step implementations, the same bytes counted, the same site named
when a collective fails. Synchronous: an op returns its finished result (a compiled graph holds no
work handle). Registered once, at import, for CPU and CUDA tensors.
"""
from __future__ import annotations

import torch

from autopar.ir_ops import reshard_steps
from autopar.runtime.collectives import apply_steps, current_mesh
from autopar.runtime.comm import MeshComm, collective_site, set_site
from autopar.runtime.prefetch import start_gather

__all__ = ["mesh_of"]


def mesh_of(sizes, coords) -> MeshComm:
    """The active mesh, checked against the mesh the op was compiled for."""
    comm = current_mesh()
    if tuple(comm.sizes) != tuple(sizes) or tuple(comm.coords) != tuple(coords):
        raise RuntimeError(f"a compiled autopar op was built for mesh sizes {tuple(sizes)} at {tuple(coords)} but runs on "
                           f"{comm.sizes} at {comm.coords}")
    return comm


def _fresh(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``out``, copied where it shares ``x``'s storage (a custom op returns no alias of an input)."""
    return out.clone() if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else out


@torch.library.impl("autopar::reshard", ("cpu", "cuda"))
def _reshard(x, src, dst, grad_src, grad_dst, shape, sizes, coords, dtype, reduce_dtype, site):
    comm = mesh_of(sizes, coords)
    key = tuple(shape) if shape is not None else None
    set_site(comm, site)
    try:
        y = x.to(dtype) if dtype is not None else x
        return _fresh(apply_steps(y, reshard_steps(src, dst, key, tuple(sizes)), comm, key), x)
    finally:
        set_site(comm, None)


@torch.library.impl("autopar::gather_param", ("cpu", "cuda"))
def _gather_param(x, axis, dim, size, sizes, coords, dtype, reduce_dtype, grad_all_reduce, site):
    comm = mesh_of(sizes, coords)
    with collective_site(comm, f"the parameter gather of {site}" if site else "a parameter gather"):
        pend = start_gather(x.to(dtype) if dtype is not None else x, dim, comm, axis, size, async_op=False)
    return _fresh(pend.wait(), x)


@torch.library.impl("autopar::reduce_grad", ("cpu", "cuda"))
def _reduce_grad(g, axis, length, grad_all_reduce, sizes, coords, site):
    comm = mesh_of(sizes, coords)
    n = comm.sizes[axis]
    send = g.contiguous()
    out = torch.empty((send.shape[0] // n,) + tuple(send.shape[1:]), dtype=send.dtype, device=send.device)
    with collective_site(comm, f"the gradient reduce-scatter of {site}" if site else "a gradient reduce-scatter"):
        comm.reduce_scatter(out, send, axis)
    for a in grad_all_reduce:
        with collective_site(comm, f"the gradient all-reduce of {site}" if site else "a gradient all-reduce"):
            comm.all_reduce(out, a)
    return out[:length].clone() if length != out.shape[0] else out


@torch.library.impl("autopar::all_reduce", ("cpu", "cuda"))
def _all_reduce(x, axes, sizes, coords, site):
    comm = mesh_of(sizes, coords)
    out = x.contiguous().clone()
    with collective_site(comm, f"the all-reduce of {site}" if site else "an all-reduce"):
        for a in axes:
            comm.all_reduce(out, a)
    return out
