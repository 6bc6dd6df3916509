"""Sizes that depend on tensor values, inside a module that is token-wise as a whole.

A mixture-of-experts layer often computes each expert on the tokens routed to it::

    for e, expert in enumerate(self.experts):
        rows = torch.where(choice == e)[0]
        out = out.index_add(0, rows, expert(x[rows]))

How many rows each expert gets depends on the routing, so no static shape describes those ops,
and fake tensors without a shape environment refuse them. Traced with one
(``torch.fx.experimental.symbolic_shapes.ShapeEnv``), each such size is an *unbacked* symbol.
The layer as a whole is still token-wise (each token's output depends on that token alone), so
``regions.outline_token_regions`` outlines the module holding them into one node that runs the
module's own forward on each device's tokens: the planner never sees an unknown size. This
module marks the nodes with such sizes (``DATA_DEPENDENT_KEY``) and gives each unbacked size a
planning estimate (``size_hints``): a ``torch.where`` / ``nonzero`` over a mask of N elements,
one of k such calls in its module, is taken to select N / k of them (routing spread evenly; the
planner prices the module's compute from these).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

__all__ = ["DATA_DEPENDENT_KEY", "mark_data_dependent", "size_hints", "dim_value"]

DATA_DEPENDENT_KEY = "autopar.data_dependent"  # node.meta: a value whose shape depends on tensor values

_SELECTORS = ("aten.where.default", "aten.nonzero.default")


def _vals(node: fx.Node) -> list:
    val = node.meta.get("val")
    return [v for v in (val if isinstance(val, (list, tuple)) else (val,)) if isinstance(v, torch.Tensor)]


def _unbacked(t: torch.Tensor) -> bool:
    return any(not isinstance(d, int) for d in t.shape)


def mark_data_dependent(graph: fx.Graph) -> bool:
    """Mark every node with a value of data-dependent shape; whether there is any."""
    found = False
    for n in graph.nodes:
        if any(_unbacked(v) for v in _vals(n)):
            n.meta[DATA_DEPENDENT_KEY] = True
            found = True
    return found


def size_hints(graph: fx.Graph, module_of) -> dict:
    """Unbacked symbol -> its planning estimate (see the module docstring); ``module_of(node)``:
    the module path a node runs in."""
    selectors = [n for n in graph.nodes if n.op == "call_function" and str(n.target) in _SELECTORS]
    per_module: dict[str, int] = {}
    for n in selectors:
        per_module[module_of(n)] = per_module.get(module_of(n), 0) + 1
    hints = {}
    for n in selectors:
        mask = n.args[0].meta.get("val")
        out = _vals(n)
        if not isinstance(mask, torch.Tensor) or not out or _unbacked(mask):
            continue
        expr = out[0].shape[0]
        if isinstance(expr, torch.SymInt) and expr.node.expr.is_Symbol:
            hints[expr.node.expr] = max(1, math.ceil(mask.numel() / per_module[module_of(n)]))
    return hints


def dim_value(d, hints: dict) -> int:
    """A static dim as is; a data-dependent one by ``hints`` (1 for a symbol it does not know)."""
    import sympy

    if isinstance(d, int):
        return d
    expr = sympy.sympify(sympy.sympify(d.node.expr).xreplace(hints))
    if expr.free_symbols:
        expr = expr.xreplace({s: 1 for s in expr.free_symbols})
    return max(0, int(expr))
