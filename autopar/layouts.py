"""Tensor layouts over a device mesh, in DTensor's placement vocabulary.

A *layout* is a tuple with one placement per mesh axis: ``Shard(dim)``, ``Replicate()`` or
``Partial(op)`` (op "sum" or "avg"), exactly torch's ``torch.distributed.tensor`` classes.

This module also fixes the gradient convention the whole project relies on (planner costs and
runtime collectives alike):

* the gradient of a tensor laid out ``Shard(d)`` on an axis is ``Shard(d)`` on that axis;
* the gradient of ``Replicate()`` is ``Replicate()`` (every rank holds the full gradient);
* the gradient of ``Partial(op)`` is ``Replicate()`` (scaled by ``1/n`` for ``avg``).

An op computing locally on shards produces, for an input it reads replicated on an axis where its
output is split (``Shard`` or ``Partial``), only a *partial* gradient: see ``local_grad_layout``.
"""
from __future__ import annotations

import math
import re
from typing import Iterable, Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "zero_gather_in_place",
    "Layout",
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "R",
    "replicated",
    "format_layout",
    "parse_layout",
    "format_placement",
    "parse_placement",
    "grad_layout",
    "local_grad_layout",
    "local_shape",
    "split_factor",
    "divides_evenly",
    "uneven_dims",
    "chunk_range",
    "state_dim",
    "state_layout",
    "DATA_AXIS_NAMES",
    "CONTEXT_AXIS_NAMES",
    "nests_only_data_axes",
]

Layout = tuple  # tuple[Placement, ...], one entry per mesh axis

R = Replicate()

# Mesh axes that carry data parallelism: a value may be sharded on the same dim over several of
# them (nested, ``[S(0), S(0)]``: cut on the outer axis, each piece cut again on the inner one, as
# DTensor cuts it). 'ep' is a data axis that also holds experts (``Constraints(ep=)`` smaller than
# ``dp``, see ``planner.meshes``); 'dp_shard' is the inner data axis of an HSDP mesh (ZeRO-3 shards
# there, parameters are replicated on 'dp'); on a ('dp', 'tp') mesh no dim is ever sharded twice.
DATA_AXIS_NAMES = ("dp", "ep", "dp_shard")
# Mesh axes that carry context parallelism: attention may split its queries along the sequence
# there, with the keys and values whole (gathered over the axis; ``strategies.rules.sdpa``).
CONTEXT_AXIS_NAMES = ("cp",)


def nests_only_data_axes(layout: Sequence[Placement], axis_names: Sequence[str]) -> bool:
    """Whether every dim ``layout`` shards on more than one axis is sharded on data axes only."""
    axes_of: dict[int, list[int]] = {}
    for a, p in enumerate(layout):
        if isinstance(p, Shard):
            axes_of.setdefault(p.dim, []).append(a)
    return all(len(axes) == 1 or all(axis_names[a] in DATA_AXIS_NAMES for a in axes) for axes in axes_of.values())


def replicated(ndim: int) -> Layout:
    """The all-``Replicate`` layout on a mesh with ``ndim`` axes."""
    return (R,) * ndim


def format_placement(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    if isinstance(p, Replicate):
        return "R"
    raise TypeError(f"unknown placement {p!r}")


_PLACEMENT_RE = re.compile(r"^\s*(?:(R)|S\((-?\d+)\)|P\((sum|avg)\))\s*$")


def parse_placement(text: str) -> Placement:
    """Inverse of :func:`format_placement` ("R", "S(1)", "P(sum)", "P(avg)")."""
    m = _PLACEMENT_RE.match(text)
    if not m:
        raise ValueError(f"bad placement {text!r}: expected 'R', 'S(<dim>)', 'P(sum)' or 'P(avg)'")
    if m.group(1):
        return R
    if m.group(2) is not None:
        return Shard(int(m.group(2)))
    return Partial(m.group(3))


def format_layout(layout: Sequence[Placement]) -> str:
    return "[" + ", ".join(format_placement(p) for p in layout) + "]"


def parse_layout(text: str) -> Layout:
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        raise ValueError(f"bad layout {text!r}: expected e.g. '[S(0), R]'")
    inner = body[1:-1].strip()
    return tuple(parse_placement(t) for t in inner.split(",")) if inner else ()


def grad_layout(layout: Sequence[Placement]) -> Layout:
    """The layout a tensor's gradient is kept in (see module docstring)."""
    return tuple(R if isinstance(p, Partial) else p for p in layout)


def local_grad_layout(in_layout: Sequence[Placement], out_layout: Sequence[Placement]) -> Layout:
    """Layout of the gradient an op's *local* backward produces for one input.

    Per axis: a ``Shard`` input gets a ``Shard`` gradient, a ``Partial`` input a ``Replicate`` one,
    and a ``Replicate`` input gets ``Partial(sum)`` when the op's output is split on that axis
    (each rank saw only its part of the output) and ``Replicate`` when the op ran redundantly.
    """
    out = []
    for p_in, p_out in zip(in_layout, out_layout):
        if isinstance(p_in, Replicate):
            out.append(R if isinstance(p_out, Replicate) else Partial("sum"))
        elif isinstance(p_in, Partial):
            out.append(R)
        else:
            out.append(p_in)
    return tuple(out)


def split_factor(layout: Sequence[Placement], mesh_shape: Sequence[int]) -> int:
    """How many ways the work on a tensor in ``layout`` is divided (product over non-R axes)."""
    return math.prod(n for p, n in zip(layout, mesh_shape) if not isinstance(p, Replicate))


def _shard_counts(layout: Sequence[Placement], mesh_shape: Sequence[int], ndim: int) -> list[int]:
    counts = [1] * ndim
    for p, n in zip(layout, mesh_shape):
        if isinstance(p, Shard):
            counts[p.dim] *= n
    return counts


def divides_evenly(shape: Sequence[int], layout: Sequence[Placement], mesh_shape: Sequence[int]) -> bool:
    """True when every sharded dim of ``shape`` divides by the number of shards it is cut into."""
    for p in layout:
        if isinstance(p, Shard) and not (0 <= p.dim < len(shape)):
            return False
    return all(s % c == 0 for s, c in zip(shape, _shard_counts(layout, mesh_shape, len(shape))))


def local_shape(shape: Sequence[int], layout: Sequence[Placement], mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Per-rank shape of a tensor of global ``shape``; where a dim does not divide evenly, the
    largest shard's (``torch.chunk`` sizes, as DTensor), which is also the padded collective size."""
    counts = _shard_counts(layout, mesh_shape, len(shape))
    return tuple(-(-s // c) for s, c in zip(shape, counts))


def local_numel(shape: Sequence[int], layout: Sequence[Placement], mesh_shape: Sequence[int]) -> int:
    """Elements of the local shard (``local_shape``) of a tensor of global ``shape``."""
    return math.prod(local_shape(shape, layout, mesh_shape))


def uneven_dims(shape: Sequence[int], layouts: Iterable[Sequence[Placement] | None],
                mesh_shape: Sequence[int]) -> frozenset[tuple[int, int]]:
    """``(axis, dim)`` pairs where one of ``layouts`` shards ``dim`` of ``shape`` on ``axis`` unevenly.

    Only parameter storage layouts (ZeRO-3 / FSDP-style, always gathered before use) may be uneven;
    they are never nested (one dim sharded on two axes), so a dim's global size is what each step sees.
    """
    out = set()
    for layout in layouts:
        for a, p in enumerate(layout or ()):
            if isinstance(p, Shard) and 0 <= p.dim < len(shape) and shape[p.dim] % mesh_shape[a]:
                out.add((a, p.dim))
    return frozenset(out)


def chunk_range(size: int, n: int, coord: int) -> tuple[int, int]:
    """(start, length) of shard ``coord`` of ``n`` along a dim of ``size``, as ``torch.chunk``
    and DTensor's ``Shard`` cut it: chunks of ``ceil(size / n)``, the last ones short or empty."""
    c = -(-size // n)
    start = min(coord * c, size)
    return start, max(0, min(c, size - start))


def sharded_dims(layout: Iterable[Placement]) -> set[int]:
    return {p.dim for p in layout if isinstance(p, Shard)}


def state_dim(shape: Sequence[int], layout: Sequence[Placement]) -> int | None:
    """The dim along which ZeRO-1/2 shards a parameter's optimizer state (and ZeRO-2 gradient) on
    its zero axes: the first dim larger than 1 that ``layout`` leaves whole (dim 0 when it can);
    None when there is none (then the state cannot be ZeRO-sharded).
    Planner and runtime both ask here, so the state they price is the state that is kept."""
    taken = sharded_dims(layout)
    for d, s in enumerate(shape):
        if d not in taken and s > 1:
            return d
    return None


def zero_gather_in_place(local: Sequence[int], dim: int | None, zero_axes: Iterable[int],
                         mesh_shape: Sequence[int]) -> bool:
    """Whether ZeRO-1/2's all-gather of an updated parameter (``local``: its shape on this rank
    before the ZeRO cut, ``dim``: its ``state_dim``) writes straight into the parameter: one zero
    axis cutting dim 0 evenly, so every rank's shard is one contiguous block of it, its own block
    the very storage its optimizer updated (as FSDP2's all-gather takes its input from its output
    buffer). Otherwise the runtime gathers into a buffer and copies back, which the planner prices.
    Planner and runtime both ask here."""
    axes = tuple(zero_axes)
    return len(axes) == 1 and dim == 0 and len(local) > 0 and local[0] % mesh_shape[axes[0]] == 0


def state_layout(shape: Sequence[int], layout: Sequence[Placement], zero_axes: Iterable[int]) -> Layout | None:
    """``layout`` with ``Shard(state_dim)`` on each zero axis: how ZeRO-1/2 state is laid out (as
    DTensor describes it; uneven dims padded as ``torch.chunk`` cuts them). None: not shardable."""
    axes = tuple(zero_axes)
    if not axes:
        return tuple(layout)
    d = state_dim(shape, layout)
    if d is None:
        return None
    out = list(layout)
    for a in axes:
        out[a] = Shard(d)
    return tuple(out)
