"""Reading a traced node: ``OpView`` (an fx node's schema-bound arguments and tensor metadata) and
``op_name`` (its op's name). The sharding rules (``strategies``), the IR's helpers, the regions
and the planner read nodes through these.
"""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from autopar.trace import TensorMeta, tensor_inputs

__all__ = ["OpView", "op_name", "single_meta"]


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
