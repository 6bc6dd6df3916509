"""Rewrite in-place ops on temporaries into their out-of-place forms, in the traced graph.

Why: the sharded program hands an op the local shard of its input, and that shard often comes
out of a collective or a local slice (a view autograd forbids writing to: "Output 0 of _Reshard
is a view and is being modified inplace"). Models write ``out += identity`` and
``ReLU(inplace=True)`` everywhere; out-of-place, the same program is correct on any layout.

Why by hand, not ``torch.func.functionalize``: that works below pre-dispatch and would
decompose the high-level ops (``linear``, ``scaled_dot_product_attention``) the planner keys its
rules on. Here only the safe case is rewritten, and everything else is left as traced:

* the mutated tensor is an intermediate value (not a parameter, buffer or user input: those
  updates are state, e.g. BatchNorm's ``num_batches_tracked += 1``);
* it is not a view of anything, and nothing views it (a write through an alias would be lost);

then ``y = op_(x, ...)`` becomes ``y = op(x, ...)`` and every later reader of ``x`` reads ``y``.
Readers before the op keep reading ``x`` (they saw the old value in the eager program too).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

__all__ = ["functionalize_inplace", "written_inputs", "written_edges"]


def _schema(node: fx.Node):
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


def _mutates_first_arg(node: fx.Node) -> bool:
    schema = _schema(node)
    if schema is None or not schema.arguments:
        return False
    info = schema.arguments[0].alias_info
    return bool(info is not None and info.is_write)


def written_inputs(node: fx.Node) -> frozenset[int]:
    """Positions, in ``trace.tensor_inputs(node)`` order, of the tensor arguments ``node`` writes
    in place (what its schema marks ``Tensor(a!)``). The planner never reshards these: the op
    would write into the copy and the tensor everyone else reads would not change."""
    schema = _schema(node)
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write} if schema else set()
    if not written:
        return frozenset()
    names = [a.name for a in schema.arguments]
    out, pos = set(), 0
    for key, value in [(names[i] if i < len(names) else None, v) for i, v in enumerate(node.args)] + list(node.kwargs.items()):
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, fx.Node):
                if key in written:
                    out.add(pos)
                pos += 1
    return frozenset(out)


def written_edges(graph: fx.Graph) -> dict[str, frozenset[int]]:
    """Per node name, the positions of its tensor inputs whose storage is written in place: by the
    node itself (``written_inputs``) or, for an op returning a view of its input, through that
    view later. Moving such an input to another layout hands the op a copy, and the write would
    miss the tensor the rest of the graph reads: the planner prices these moves out and the
    passes refuse them."""
    from autopar.traced_graph import tensor_inputs

    out: dict[str, set[int]] = {}
    for n in graph.nodes:
        for w in written_inputs(n):
            consumer, pos = n, w
            while True:
                out.setdefault(consumer.name, set()).add(pos)
                a = tensor_inputs(consumer)[pos]
                if not _returns_alias(a) or a.target is operator.getitem or not tensor_inputs(a):
                    break
                consumer, pos = a, 0  # a view (or an in-place result) aliases its first input
    return {k: frozenset(v) for k, v in out.items()}


def _returns_alias(node: fx.Node) -> bool:
    """The node's output may share storage with an input (a view, or an in-place op's result)."""
    if node.op == "call_function" and node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and _returns_alias(node.args[0])
    schema = _schema(node)
    if schema is None:
        return False
    return any(r.alias_info is not None for r in schema.returns)


def _out_of_place(node: fx.Node):
    """The functional overload of an in-place op (``aten.add_.Tensor`` -> ``aten.add.Tensor``)."""
    packet = node.target.overloadpacket
    name = packet.__name__
    if not name.endswith("_") or name.startswith("_"):
        return None
    functional = getattr(torch.ops.aten, name[:-1], None)
    overload = node.target._overloadname
    if functional is None or not hasattr(functional, overload):
        return None
    return getattr(functional, overload)


def functionalize_inplace(gm: fx.GraphModule) -> int:
    """Rewrite the safe in-place ops of ``gm`` (see the module docstring); returns how many."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    rewritten = 0
    for node in list(gm.graph.nodes):
        if not _mutates_first_arg(node) or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        target = node.args[0]
        if target.op != "call_function" or _returns_alias(target):
            continue
        if any(u is not node and _returns_alias(u) for u in target.users):
            continue
        functional = _out_of_place(node)
        if functional is None:
            continue
        node.target = functional
        for user in list(target.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(target, node)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten
