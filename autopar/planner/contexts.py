"""The CostContext a plan is priced under, memoised per process, and the element counts it is
sized by (a rank's per-element update and gradient-buffer costs depend on how many it holds:
``DeviceSpec.warm_elements``).

Invariant: ``cost_context`` returns the same object for equal inputs, so every plan of a model on
one mesh shares its memo of priced reshards.
"""
from __future__ import annotations

import math
import threading

from autopar.layouts import DATA_AXIS_NAMES
from autopar.planner.bounded_memo import BoundedMemo
from autopar.planner.costing import CostContext, param_state_bytes, rank_element_costs, updated_numel
from autopar.planner.meshes import axis_names
from autopar.planner.problem import Problem
from autopar.trace import TracedGraph

MEMO_LOCK = threading.RLock()  # the search's worker threads share the memos
MEMO_SIZE = 8  # entries per memo: a model planned again (other constraints, compile() after plan())

# Pure memos shared by every plan of the process, bounded (``BoundedMemo``). Here a CostContext
# per (mesh, cluster, precision, optimizer, counts), whose memo of reshard prices depends on tensor
# shapes and layouts only; ``search`` keeps its results per planning inputs. Planning a model
# again (with other constraints, or compile() after plan()) reuses them.
_CONTEXTS = BoundedMemo(MEMO_SIZE, MEMO_LOCK)


def memo(table: BoundedMemo, key, make):
    """``table``'s value for ``key``, made by ``make()`` when absent."""
    return table.get_or_make(key, make)


def cost_context(mesh, cluster, policy, optimizer, traced: TracedGraph | None = None,
                 rank_state_numel: float | None = None) -> CostContext:
    """The process's CostContext for these (its reshard prices are shared by every plan of a
    model with as many gradient bytes). ``rank_state_numel``: the parameter, gradient or optimizer
    elements a rank holds, the largest count of the three (default: the trainable parameters over
    the mesh's axes other than its data axes)."""
    grads = gradient_bytes(traced) if traced is not None else math.inf
    if rank_state_numel is None:
        rank_state_numel = estimated_state_numel(traced, mesh) if traced is not None else math.inf
    # keyed by the cluster less its device's memory, which no price reads: a pipeline stage's
    # submesh planned again with less memory shares the context (its reshard prices, its nodes')
    return memo(_CONTEXTS, (mesh, _without_memory(cluster), policy, optimizer, grads, rank_state_numel),
                 lambda: CostContext(mesh, axis_names(mesh), cluster, policy, optimizer, grads, rank_state_numel))


def _without_memory(cluster):
    """``cluster`` with its device's memory set to 0: a key, not a spec (no cost reads the memory;
    ``search`` and ``pipeline_search`` size budgets from the cluster they are given)."""
    import copy

    if cluster.device.memory_bytes == 0:
        return cluster
    device, view = copy.copy(cluster.device), copy.copy(cluster)
    object.__setattr__(device, "memory_bytes", 0)
    object.__setattr__(view, "device", device)
    return view


def estimated_state_numel(traced: TracedGraph, mesh) -> float:
    """A rank's parameter elements before a plan exists: the trainable ones over the mesh's axes
    other than its data axes."""
    split = math.prod(n for n, name in zip(mesh, axis_names(mesh)) if name not in DATA_AXIS_NAMES)
    return trainable_numel(traced) / split


def trainable_numel(traced: TracedGraph) -> float:
    """Elements of the model's trainable parameters."""
    return float(sum(m.numel for m in _trainable_metas(traced)))


def plan_state_numel(problem: Problem, choice: dict[str, int]) -> float:
    """The largest of a rank's counts of parameter, gradient and optimizer-updated elements under
    ``choice`` (a ZeRO-1 rank updates a quarter of what it holds, and streams all of it)."""
    params = grads = updated = 0.0
    for name, var in problem.nodes.items():
        node = var.node
        if node.meta.get("autopar.kind") == "param" and node.meta.get("autopar.requires_grad", True):
            meta, strategy = node.meta["autopar.outputs"][0], var.strategies[choice[name]]
            held = param_state_bytes(meta, strategy, problem.ctx)
            params += var.count * held["params"] / meta.itemsize
            grads += var.count * held["grads"] / meta.itemsize
            updated += var.count * updated_numel(meta, strategy, problem.ctx)
    return max(params, grads, updated)


def update_costs_moved(ctx: CostContext, numel: float) -> bool:
    """Whether a rank updating ``numel`` elements pays per element more than 2% from what ``ctx``
    priced (``DeviceSpec.warm_elements``)."""
    device = ctx.cluster.device
    if device.warm_elements is None:
        return False
    before, after = rank_element_costs(ctx), rank_element_costs(ctx, numel)
    return any(abs(a - b) > 0.02 * max(abs(b), 1e-30) for pb, pa in zip(before, after) for b, a in zip(pb, pa))


def _trainable_metas(traced: TracedGraph):
    """The TensorMeta of each of the model's trainable parameters."""
    return (n.meta["autopar.outputs"][0] for n in traced.graph.nodes
            if n.op == "placeholder" and n.meta.get("autopar.kind") == "param"
            and n.meta.get("autopar.requires_grad", True) and n.meta["autopar.outputs"][0] is not None)


def gradient_bytes(traced: TracedGraph) -> float:
    """Bytes of the model's trainable parameters' gradients (``CostContext.grad_bytes``)."""
    return float(sum(m.nbytes for m in _trainable_metas(traced)))
