"""The program's communication as registered ``torch.library`` ops, for compiled programs.

Declared here (schema, fake kernel, autograd formula); the runtime registers the implementations
(``runtime.compiled_ops``). ``runtime.compiled_program`` rewrites a per-rank program's ``reshard``,
``reshard_start``/``reshard_finish`` and ``gather_param_start``/``gather_param_finish`` calls into
these ops, so ``torch.compile`` traces the program as one graph: each op is one node whose output
shape the fake kernel gives, and AOTAutograd puts the conjugate op into the backward graph.

* ``autopar::reshard(x, src, dst, grad_src, grad_dst, shape, sizes, coords, dtype, reduce_dtype,
  site)``: ``x`` (cast to ``dtype``) moved from layout ``src`` to ``dst`` on a mesh of ``sizes``
  where this rank sits at ``coords``; its gradient goes back by ``reshard(grad_src -> grad_dst)``
  (in ``reduce_dtype``, scaled by 1/n on each axis where a ``Partial(avg)`` was resolved), as the
  eager ``runtime.collectives.reshard``. Never an alias of ``x`` (a custom op's output may not be).
* ``autopar::gather_param(x, axis, dim, size, sizes, coords, dtype, reduce_dtype, grad_all_reduce,
  site)``: the all-gather of parameter shard ``x`` along ``dim`` over mesh axis ``axis``, as the
  padded receive buffer (the gathered dim first, each shard padded to ``ceil(size / n)`` rows);
  its gradient is ``autopar::reduce_grad``: one sum reduce-scatter over ``axis`` then sum
  all-reduces over ``grad_all_reduce`` (HSDP), cut to the shard's rows.
* ``autopar::all_reduce(x, axes, sizes, coords, site)``: ``x`` summed over the mesh axes
  ``axes`` (a new tensor); its gradient is the same sum of the output's gradient (every rank's
  output depends on every rank's input). The batch-norm statistics of a split batch use it.

Invariant: the fake kernels compute exactly the shapes the implementations return (both follow
``resharding.reshard_steps_for`` and ``layouts.chunk_range``).
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from autopar.layouts import Partial, chunk_range, parse_layout
from autopar.resharding import reshard_steps_for

__all__ = ["RESHARD", "GATHER_PARAM", "REDUCE_GRAD", "ALL_REDUCE", "reshard_local_shape", "reshard_steps"]

_LIB = torch.library.Library("autopar", "DEF")  # the ops' namespace: registered while this module lives
_LIB.define("reshard(Tensor x, str src, str dst, str? grad_src, str? grad_dst, int[]? shape, int[] sizes, int[] coords, "
            "ScalarType? dtype, ScalarType? reduce_dtype, str? site) -> Tensor")
_LIB.define("gather_param(Tensor x, int axis, int dim, int? size, int[] sizes, int[] coords, ScalarType? dtype, "
            "ScalarType? reduce_dtype, int[] grad_all_reduce, str? site) -> Tensor")
_LIB.define("reduce_grad(Tensor g, int axis, int length, int[] grad_all_reduce, int[] sizes, int[] coords, "
            "str? site) -> Tensor")
_LIB.define("all_reduce(Tensor x, int[] axes, int[] sizes, int[] coords, str? site) -> Tensor")

RESHARD = torch.ops.autopar.reshard.default
GATHER_PARAM = torch.ops.autopar.gather_param.default
REDUCE_GRAD = torch.ops.autopar.reduce_grad.default
ALL_REDUCE = torch.ops.autopar.all_reduce.default


@functools.lru_cache(maxsize=4096)
def reshard_steps(src: str, dst: str, shape: tuple | None, sizes: tuple) -> tuple:
    """The steps of ``src -> dst`` (layout strings) on a mesh of ``sizes`` (a bounded cache)."""
    return tuple(reshard_steps_for(shape, parse_layout(src), parse_layout(dst), sizes))


def reshard_local_shape(local: Sequence[int], steps, sizes: Sequence[int], coords: Sequence[int],
                        shape: Sequence[int] | None) -> list[int]:
    """The local shape ``runtime.collectives.apply_steps`` returns for a local tensor of shape
    ``local``: each step's effect on it (``shape``: the global shape, for uneven dims)."""
    out = list(local)
    for s in steps:
        n, coord = sizes[s.axis], coords[s.axis]
        if n == 1:
            continue
        if s.kind in ("slice", "reduce_scatter"):
            out[s.dim] = chunk_range(out[s.dim], n, coord)[1]
        elif s.kind == "all_gather":
            uneven = shape is not None and shape[s.dim] % n != 0
            out[s.dim] = shape[s.dim] if uneven else out[s.dim] * n
        elif s.kind == "all_to_all":
            out[s.dim] //= n
            out[s.src_dim] *= n
    return out


def _avg_axes(src: str, dst: str) -> list[int]:
    """Axes where a Partial(avg) is resolved: its gradient is scaled by 1/n there."""
    return [a for a, (p, q) in enumerate(zip(parse_layout(src), parse_layout(dst)))
            if isinstance(p, Partial) and p.reduce_op == "avg" and p != q]


def _key(shape) -> tuple | None:
    return tuple(shape) if shape is not None else None


@torch.library.register_fake("autopar::reshard")
def _reshard_fake(x, src, dst, grad_src, grad_dst, shape, sizes, coords, dtype, reduce_dtype, site):
    steps = reshard_steps(src, dst, _key(shape), tuple(sizes))
    return x.new_empty(reshard_local_shape(x.shape, steps, sizes, coords, shape), dtype=dtype or x.dtype)


def _reshard_setup(ctx, inputs, output):
    x, src, dst, grad_src, grad_dst, shape, sizes, coords, dtype, reduce_dtype, site = inputs
    ctx.args = (src, dst, grad_src, grad_dst, shape, sizes, coords, reduce_dtype, site, x.dtype)


def _reshard_backward(ctx, g):
    src, dst, grad_src, grad_dst, shape, sizes, coords, reduce_dtype, site, in_dtype = ctx.args
    if grad_src is None or grad_dst is None:
        return (None,) * 11
    g = g.contiguous()
    if reduce_dtype is not None:
        g = g.to(reduce_dtype)
    out = RESHARD(g, grad_src, grad_dst, None, None, shape, sizes, coords, None, None,
                  f"{site}, backward" if site else None)
    for a in _avg_axes(src, dst):
        out = out / sizes[a]
    return (out.to(in_dtype),) + (None,) * 10


torch.library.register_autograd("autopar::reshard", _reshard_backward, setup_context=_reshard_setup)


@torch.library.register_fake("autopar::gather_param")
def _gather_fake(x, axis, dim, size, sizes, coords, dtype, reduce_dtype, grad_all_reduce, site):
    n = sizes[axis]
    rows = x.shape[dim] if size is None else -(-size // n)
    rest = [d for i, d in enumerate(x.shape) if i != dim]
    return x.new_empty([n * rows] + rest, dtype=dtype or x.dtype)


def _gather_setup(ctx, inputs, output):
    x, axis, dim, size, sizes, coords, dtype, reduce_dtype, grad_all_reduce, site = inputs
    ctx.args = (axis, dim, x.shape[dim], reduce_dtype, grad_all_reduce, sizes, coords, site, x.dtype)


def _gather_backward(ctx, g):
    axis, dim, length, reduce_dtype, grad_all_reduce, sizes, coords, site, in_dtype = ctx.args
    g = g.contiguous()
    if reduce_dtype is not None:
        g = g.to(reduce_dtype)
    shard = REDUCE_GRAD(g, axis, length, grad_all_reduce, sizes, coords, site)
    return (shard.movedim(0, dim).to(in_dtype),) + (None,) * 9


torch.library.register_autograd("autopar::gather_param", _gather_backward, setup_context=_gather_setup)


@torch.library.register_fake("autopar::reduce_grad")
def _reduce_grad_fake(g, axis, length, grad_all_reduce, sizes, coords, site):
    return g.new_empty([length] + list(g.shape[1:]))


@torch.library.register_fake("autopar::all_reduce")
def _all_reduce_fake(x, axes, sizes, coords, site):
    return torch.empty_like(x)


def _all_reduce_setup(ctx, inputs, output):
    x, axes, sizes, coords, site = inputs
    ctx.args = (axes, sizes, coords, f"{site}, backward" if site else None)


def _all_reduce_backward(ctx, g):
    axes, sizes, coords, site = ctx.args
    return (ALL_REDUCE(g.contiguous(), axes, sizes, coords, site),) + (None,) * 4


torch.library.register_autograd("autopar::all_reduce", _all_reduce_backward, setup_context=_all_reduce_setup)
