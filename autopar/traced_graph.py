"""The traced graph's vocabulary: ``TracedGraph`` (what ``trace.trace_model`` returns),
``TensorMeta`` (a value's global shape and dtype, in ``node.meta["autopar.outputs"]``),
``tensor_inputs`` (a node's tensor arguments) and ``tensor_key`` (a fake tensor's identity).
Everything that reads a traced graph imports these from here; ``trace`` re-exports them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

__all__ = ["TensorMeta", "TracedGraph", "tensor_inputs", "tensor_key"]


@dataclass(frozen=True)
class TensorMeta:
    """Global (unsharded) shape and dtype of one tensor value in the graph."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_floating(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


@dataclass
class TracedGraph:
    """A traced training graph. ``gm`` computes the loss (or the model output when no loss).

    Placeholders come in this order: parameters, buffers, model inputs, then the target (if any).
    ``param_fqns``/``buffer_fqns`` map placeholder node names to ``state_dict`` keys, but for
    experts written as a list of modules (``autopar.stack_experts``): their weights are one
    placeholder per weight position, of fqn ``P.*.suffix``, and ``stacked`` maps that fqn to the
    member fqns (``P.0.suffix`` ..., stacked on dim 0 in that order).
    """

    gm: fx.GraphModule
    param_fqns: dict[str, str]
    buffer_fqns: dict[str, str]
    input_names: list[str]
    target_name: str | None
    has_loss: bool
    model_class: str
    num_params: int
    # without a loss: the model output's structure; ``gm`` returns its tensor leaves as a flat list
    # (``pytree.tree_unflatten(program(*args), out_spec)`` rebuilds what the model returned)
    out_spec: Any = None
    stacked: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    @property
    def global_batch(self) -> int | None:
        """Dim 0 of the first input with a shape (what data parallel splits); None if no input has one."""
        for name in self.input_names:
            m = self.node(name).meta["autopar.outputs"][0]
            if m is not None and m.shape:
                return m.shape[0]
        return None

    def node(self, name: str) -> fx.Node:
        for n in self.gm.graph.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


_INPUTS_KEY = "autopar.tensor_inputs"  # node.meta memo: (args, kwargs, inputs)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's fx-Node arguments in positional order, duplicates kept (``x * x`` gives two).

    Memoised in ``node.meta`` (so it dies with the graph) while the node's ``args``/``kwargs``
    objects stay the same (fx stores new ones on every rewrite); the planner asks tens of
    thousands of times per plan."""
    hit = node.meta.get(_INPUTS_KEY)
    if hit is not None and hit[0] is node.args and hit[1] is node.kwargs:
        return list(hit[2])
    found = [leaf for leaf in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(leaf, fx.Node)]
    node.meta[_INPUTS_KEY] = (node.args, node.kwargs, tuple(found))
    return found


def tensor_key(t: torch.Tensor) -> tuple:
    """What identifies a (fake) tensor value across detached views: storage, shape, strides, offset."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return (StorageWeakRef(t.untyped_storage()), tuple(t.shape), tuple(t.stride()), t.storage_offset())
