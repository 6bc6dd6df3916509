"""Candidate strategies per graph node over a device mesh.

A ``Strategy`` fixes, for one node, the layout of each output, the layout each tensor input must
arrive in, and the layout of the gradient its local backward hands back for each input. The
planner picks one per node; resharding between a producer's output layout and a consumer's input
layout (and back for gradients) is an edge cost; the passes turn the same pairs into collectives.

Invariant: every strategy divides evenly (each sharded dim is divisible by its shard count) and
never shards one tensor dim on two mesh axes; the rest are listed in ``excluded`` with a reason.
One exception: a *parameter's storage* may be sharded unevenly (``torch.chunk`` cut, as DTensor
and FSDP2 do; ZeRO-3 of a weight with no dim divisible by the data-parallel degree). Ops never
accept uneven inputs, so such a parameter is always gathered (padded) before use.
"""
from __future__ import annotations

import itertools
import math
import operator
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.layouts import (
    CONTEXT_AXIS_NAMES,
    Layout,
    R,
    Replicate,
    Shard,
    divides_evenly,
    format_layout,
    local_grad_layout,
    nests_only_data_axes,
    state_dim,
)
from autopar.strategies.rules import AxisOption, OpView, rule_for, token_region
from autopar.trace import TensorMeta, tensor_inputs

__all__ = ["Strategy", "NodeStrategies", "enumerate_strategies", "UnknownOpWarning"]


class UnknownOpWarning(UserWarning):
    """An op without a sharding rule: it will run replicated (its cost is still counted)."""


@dataclass(frozen=True)
class Strategy:
    ins: tuple[Layout | None, ...]
    outs: tuple[Layout | None, ...]
    grad_ins: tuple[Layout | None, ...]
    zero_axes: tuple[int, ...] = ()  # params only: optimizer state (ZeRO-1/2) sharded on these axes
    zero_stage: int = 0  # with zero_axes: 1 (gradients whole) or 2 (gradients reduce-scattered too)

    def describe(self) -> str:
        outs = ", ".join(format_layout(o) if o is not None else "-" for o in self.outs)
        text = f"out {outs}"
        if any(i is not None for i in self.ins):
            text += " <- " + ", ".join(format_layout(i) if i is not None else "any" for i in self.ins)
        if self.zero_axes:
            text += f" ZeRO-{self.zero_stage} on axes {list(self.zero_axes)}"
        return text


@dataclass(frozen=True)
class NodeStrategies:
    node: str
    strategies: tuple[Strategy, ...]
    excluded: tuple[tuple[str, str], ...] = ()
    fallback: bool = False


def _valid_layout(layout: Layout | None, axis_names: Sequence[str] = (), nested: bool = False,
                  any_axes: bool = False) -> bool:
    """A dim is sharded on one axis, or (``nested``) on several data axes (``layouts.DATA_AXIS_NAMES``),
    or (``any_axes`` too) on several axes of any role."""
    if layout is None:
        return True
    dims = [p.dim for p in layout if isinstance(p, Shard)]
    return len(dims) == len(set(dims)) or (nested and (any_axes or nests_only_data_axes(layout, axis_names)))


def _is_region_expert(node: fx.Node) -> bool:
    """Whether ``node`` is an expert weight of a token-wise region (``autopar.regions``): the one
    parameter whose dim 0 (its experts) may be split over several mesh axes, nested, so an expert
    axis may borrow data and tensor ranks at once (``ir.region_expert_axis``)."""
    from autopar.regions import REGION_EXPERTS_KEY

    return any(node.name in u.meta.get(REGION_EXPERTS_KEY, ()) for u in node.users)


def _experts_nested(layout: Layout) -> bool:
    """Only dim 0 (the experts) is sharded on more than one axis."""
    dims = [p.dim for p in layout if isinstance(p, Shard)]
    return all(d == 0 for d in dims if dims.count(d) > 1)


def _uneven_reason(meta: TensorMeta, layout: Layout, mesh_shape, axis_names) -> str | None:
    if divides_evenly(meta.shape, layout, mesh_shape):
        return None
    parts = []
    for p, n, name in zip(layout, mesh_shape, axis_names):
        if isinstance(p, Shard) and p.dim < len(meta.shape):
            parts.append(f"dim {p.dim} (size {meta.shape[p.dim]}) over axis '{name}' of size {n}")
    return "does not divide evenly: " + "; ".join(parts)


def _combine(per_axis: Sequence[AxisOption], n_in: int, n_out: int) -> tuple[tuple, tuple]:
    ins = tuple(
        None if any(o.ins[i] is None for o in per_axis) else tuple(o.ins[i] for o in per_axis)
        for i in range(n_in)
    )
    outs = tuple(tuple(o.outs[j] for o in per_axis) for j in range(n_out))
    return ins, outs


def _is_all_r(option: AxisOption) -> bool:
    return all(p is None or isinstance(p, Replicate) for p in option.ins + option.outs)


def _placeholder_options(meta: TensorMeta, kind: str, axis_size: int) -> list[tuple[object, bool]]:
    """Per-axis options for a graph input: (placement, zero-sharded?)."""
    opts: list[tuple[object, bool]] = [(R, False)]
    if kind == "buffer" or axis_size == 1:
        return opts
    if kind == "param" and axis_size > 1:
        opts.append((R, True))
    opts += [(Shard(d), False) for d, s in enumerate(meta.shape) if s > 1]
    return opts


def enumerate_strategies(
    node: fx.Node, mesh_shape: Sequence[int], axis_names: Sequence[str], *, warn: bool = True
) -> NodeStrategies:
    """All valid strategies of ``node`` on a mesh of ``mesh_shape`` (axis names for messages)."""
    kind = node.meta.get("autopar.kind")
    metas: tuple[TensorMeta | None, ...] = node.meta["autopar.outputs"]
    ndim = len(mesh_shape)
    excluded: list[tuple[str, str]] = []

    if kind in ("param", "buffer", "input", "target"):
        meta = metas[0]
        if meta is None:  # a non-tensor input (None for an optional argument): nothing to place
            return NodeStrategies(node.name, (Strategy((), (None,), ()),), ())
        per_axis = [_placeholder_options(meta, kind, n) for n in mesh_shape]
        strategies = []
        experts = kind == "param" and _is_region_expert(node)
        for combo in itertools.product(*per_axis):
            layout = tuple(p for p, _ in combo)
            zero = tuple(a for a, (_, z) in enumerate(combo) if z)
            # parameters never nest, but a token region's experts over several axes
            if not (_valid_layout(layout, axis_names, nested=kind != "param")
                    or (experts and _experts_nested(layout) and divides_evenly(meta.shape, layout, mesh_shape))):
                continue
            reason = _uneven_reason(meta, layout, mesh_shape, axis_names)
            if reason and kind != "param":
                excluded.append((format_layout(layout), reason))
                continue
            if not zero:
                strategies.append(Strategy((), (layout,), ()))
            elif state_dim(meta.shape, layout) is None:
                excluded.append((format_layout(layout) + " ZeRO", "no whole dim left to shard the optimizer state on"))
            else:  # ZeRO-1 keeps whole gradients; ZeRO-2 reduce-scatters them as well
                strategies += [Strategy((), (layout,), (), zero, 1), Strategy((), (layout,), (), zero, 2)]
        return NodeStrategies(node.name, tuple(strategies), tuple(excluded))

    all_r = tuple((R,) * ndim for _ in tensor_inputs(node))
    replicated = Strategy(
        ins=all_r,
        outs=tuple((R,) * ndim if m is not None else None for m in metas),
        grad_ins=all_r,
    )
    rule = rule_for(node)
    if rule is None:
        if warn and node.target is not operator.getitem:
            module = node.meta.get("autopar.module", "")
            warnings.warn(
                f"autopar has no sharding rule for {node.target} (node '{node.name}' in module "
                f"'{module or '<root>'}'); it runs replicated on every device.",
                UnknownOpWarning,
                stacklevel=2,
            )
        return NodeStrategies(node.name, (replicated,), (), fallback=True)

    sig = _op_signature(node, tuple(mesh_shape), tuple(axis_names))
    hit = _OP_STRATEGIES.get(sig)
    if hit is None:
        hit = _OP_STRATEGIES[sig] = _op_strategies(node, rule, metas, tuple(mesh_shape), tuple(axis_names))
    return NodeStrategies(node.name, *hit)


# op strategies by ``_op_signature``: the layers of a model repeat the same ops on the same shapes
_OP_STRATEGIES: dict[tuple, tuple] = {}


def _op_signature(node: fx.Node, mesh_shape: tuple, axis_names: tuple) -> tuple:
    """Everything a rule reads (``OpView``): the op, its non-tensor arguments, each tensor
    argument's metadata and which arguments are the same tensor, its outputs' metadata."""
    first: dict[fx.Node, int] = {}

    def arg(a):
        if isinstance(a, fx.Node):
            outs = a.meta.get("autopar.outputs") or ()
            return ("T", first.setdefault(a, len(first)), outs[0] if len(outs) == 1 else None)
        return a

    args = pytree.tree_map(arg, (node.args, node.kwargs))
    return (node.target, repr(args), node.meta["autopar.outputs"], mesh_shape, axis_names)


def _op_strategies(node: fx.Node, rule, metas, mesh_shape: tuple, axis_names: tuple) -> tuple[tuple, tuple]:
    """(strategies, excluded) of an op with a rule (``enumerate_strategies``)."""
    ndim = len(mesh_shape)
    n_out = len(metas)
    trivial_axes = [a for a, n in enumerate(mesh_shape) if n == 1]
    excluded: list[tuple[str, str]] = []
    view = OpView(node)
    n_in = len(view.inputs)
    options = [o for o in rule(view) if len(o.ins) == n_in and len(o.outs) == n_out]
    options.append(AxisOption((R,) * n_in, (R,) * n_out))
    seen = set()
    strategies = []
    for per_axis in itertools.product(options, repeat=ndim):
        ins, outs = _combine(per_axis, n_in, n_out)
        outs = tuple(o if m is not None else None for o, m in zip(outs, metas))
        key = (ins, outs)
        if key in seen:
            continue
        seen.add(key)
        # a token region's tokens (and experts) may be split over axes of any role
        if not all(_valid_layout(x, axis_names, nested=True, any_axes=rule is token_region) for x in ins + outs):
            continue
        if any(not _is_all_r(per_axis[a]) for a in trivial_axes):
            continue  # a size-1 axis only carries Replicate
        if any(o.context and axis_names[a] not in CONTEXT_AXIS_NAMES for a, o in enumerate(per_axis)):
            continue  # context parallelism (attention split along the sequence) only on a context axis
        # nested shards of one dim cut it into the product of their axes (conservatively: of every
        # axis whose option counts groups)
        nested = not all(_valid_layout(x) for x in ins + outs)  # a dim sharded on several axes
        ways = math.prod(mesh_shape[a] for a, o in enumerate(per_axis) if o.divides) if nested else 0
        bad = next((a for a, o in enumerate(per_axis) if o.divides and o.divides % (ways or mesh_shape[a])), None)
        if bad is not None:
            excluded.append((f"out {', '.join(format_layout(o) for o in outs if o is not None)}",
                             f"axis '{axis_names[bad]}' of size {mesh_shape[bad]} does not divide {per_axis[bad].divides} groups"))
            continue
        reason = None
        for meta, layout in list(zip(view.in_metas, ins)) + list(zip(metas, outs)):
            if meta is not None and layout is not None:
                reason = _uneven_reason(meta, layout, mesh_shape, axis_names)
                if reason:
                    break
        if reason:
            excluded.append((f"out {', '.join(format_layout(o) for o in outs if o is not None)}", reason))
            continue
        ref_out = next((o for o in outs if o is not None), (R,) * ndim)
        grads = tuple(None if i is None else local_grad_layout(i, ref_out) for i in ins)
        strategies.append(Strategy(ins, outs, grads))
    return tuple(strategies), tuple(excluded)

