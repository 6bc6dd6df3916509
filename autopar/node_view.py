"""Reading a traced node: ``OpView`` (an fx node's schema-bound arguments and tensor metadata),
``op_name`` (its op's name) and ``node_flops`` (its forward FLOPs). The sharding rules
(``strategies``), the IR's helpers, the regions and the planner read nodes through these.
"""
from __future__ import annotations

import math
from typing import Any

import torch.fx as fx

from autopar.meta_keys import REGION_FLOPS_KEY
from autopar.traced_graph import TensorMeta, tensor_inputs

__all__ = ["OpView", "op_name", "single_meta", "node_flops", "VIEW_OPS"]

# Ops that only re-describe memory (no data moved, no new storage).
VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "split",
    "split_with_sizes", "chunk", "unbind", "slice", "select", "narrow", "unsqueeze", "squeeze",
    "flatten", "unflatten", "alias", "detach", "getitem", "view_as", "swapaxes", "_reshape_alias",
}


class OpView:
    """Read-only view of an fx node for rules: schema-bound arguments and tensor metadata."""

    def __init__(self, node: fx.Node):
        self.node = node
        self.inputs = tensor_inputs(node)
        self.in_metas: list[TensorMeta | None] = [
            single_meta(n) for n in self.inputs
        ]
        self.out_metas: tuple[TensorMeta | None, ...] = node.meta["autopar.outputs"]
        self._bound = _bind(node)

    @property
    def out(self) -> TensorMeta:
        return self.out_metas[0]

    def arg(self, name: str, default: Any = None) -> Any:
        return self._bound.get(name, default)

    def input_index(self, arg_name: str) -> int | None:
        """Position in ``self.inputs`` of the tensor passed as ``arg_name`` (None if absent)."""
        val = self._bound.get(arg_name)
        if not isinstance(val, fx.Node):
            return None
        # positional occurrence order matches tensor_inputs order
        for i, n in enumerate(self.inputs):
            if n is val and self._occurrence_names[i] == arg_name:
                return i
        return None

    @property
    def _occurrence_names(self) -> list[str]:
        names = []
        for key, val in self._bound.items():
            vals = val if isinstance(val, (list, tuple)) else [val]
            names += [key for v in vals if isinstance(v, fx.Node)]
        return names


def single_meta(n: fx.Node) -> TensorMeta | None:
    outs = n.meta.get("autopar.outputs", ())
    return outs[0] if len(outs) == 1 else None


def _bind(node: fx.Node) -> dict[str, Any]:
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is None:
        return {f"arg{i}": a for i, a in enumerate(node.args)} | dict(node.kwargs)
    bound: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound



def op_name(node: fx.Node) -> str:
    """The name of ``node``'s op: its overload packet's (``aten.mm.default`` -> "mm"), else the target's."""
    t = node.target
    if hasattr(t, "overloadpacket"):
        return t.overloadpacket.__name__
    return getattr(t, "__name__", str(t))


def node_flops(node: fx.Node) -> tuple[float, str]:
    """Global forward FLOPs of ``node`` and its kind ("matmul", "attention", "pointwise", ...)."""
    if node.op != "call_function":
        return 0.0, "other"
    if REGION_FLOPS_KEY in node.meta:  # a token-wise region: its ops' forward FLOPs, mostly grouped matmuls
        return float(node.meta[REGION_FLOPS_KEY]), "matmul"
    name = op_name(node)
    outs = node.meta["autopar.outputs"]
    out = outs[0] if outs else None
    if out is None or name in VIEW_OPS:
        return 0.0, "other"
    op = OpView(node)
    if name == "linear":
        return 2.0 * out.numel * op.in_metas[0].shape[-1], "matmul"
    if name == "grouped_mm":  # every row times its group's [k, n] weight
        return 2.0 * out.numel * op.in_metas[0].shape[-1], "matmul"
    if name in ("mm", "bmm", "matmul", "addmm", "baddbmm"):
        a = op.in_metas[1] if name in ("addmm", "baddbmm") else op.in_metas[0]
        return 2.0 * out.numel * a.shape[-1], "matmul"
    if name in ("conv1d", "conv2d", "conv3d"):
        w = op.in_metas[1]
        return 2.0 * out.numel * math.prod(w.shape[1:]), "matmul"  # per output: C/g x kernel MACs
    if name == "einsum":
        eq = op.arg("equation").replace(" ", "").split("->")[0].split(",")
        sizes: dict[str, int] = {}
        for spec, m in zip(eq, op.in_metas):
            for c, s in zip(spec, m.shape if m else ()):
                sizes[c] = max(sizes.get(c, 1), s)
        return 2.0 * math.prod(sizes.values()), "matmul"
    if name == "scaled_dot_product_attention":
        q, k = op.in_metas[0], op.in_metas[1]
        b_h = math.prod(q.shape[:-2])
        flops = 4.0 * b_h * q.shape[-2] * k.shape[-2] * q.shape[-1]
        if op.arg("is_causal", False):
            flops *= 0.5  # flash kernels skip the masked upper triangle
        return flops, "attention"
    return float(out.numel), "pointwise"
