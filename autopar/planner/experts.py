"""Mixture-of-experts layers, recognised from the graph (not from a module class).

An *expert weight* is a parameter of three or more dims stacked over experts: a contraction
(``einsum``, ``bmm``, ``matmul``) consumes it with its dim 0 as a batch dim (kept in the output,
shared with another operand, not summed over), in a graph that routes tokens (a ``topk``).
Expert parallelism (``Constraints(ep=k)``) shards those weights' dim 0 over a mesh axis of size
``k``; the tokens move to their experts by the all-to-all of the reshard into the expert
computation (GShard), which the planner prices as any other reshard.

The expert axis is a mesh axis of size ``k``: 'dp' or 'tp' ('dp' first: experts borrow the
data-parallel devices, as GShard and DeepSpeed-MoE place them), or, with ``k`` smaller than the
data parallelism, the 'ep' axis of a ('dp', 'ep') mesh (``planner.meshes``): the batch is split
over both axes and each expert is held by ``dp`` groups of ``k`` ranks. Where no axis has ``k``
ranks, dropless experts (token regions, ``autopar.regions``) may borrow several axes
(``expert_axes``): on dp=2 x tp=2, ep=4 nests each expert weight's dim 0 over 'dp' then 'tp', the
region's tokens split over both, and its rows go by all-to-all among those axes' ranks as one
group (``ir.region_expert_axis``, ``runtime.expert_dispatch``), priced over that group's shape
(``sync_pricing.axes_group``). Experts contracted by einsum/bmm keep one axis (their reshards do
not nest parameters).

Without ``ep`` the search proposes expert meshes itself (``free_expert_meshes``): for each
('dp', 'tp') mesh, the ('dp', 'ep'[, 'tp']) mesh whose 'ep' axis is the largest number of data
ranks that divides every expert layer's experts and keeps the all-to-alls inside a node (``ep``
times ``tp`` ranks divide the devices of a node); the ILP then prices it beside the others (the
all-to-all over the 'ep' group's shape, ``cost_models.communication.axis_group``).
"""
from __future__ import annotations

import math

import torch.fx as fx

from autopar.constraints import Constraints
from autopar.errors import ConstraintError
from autopar.node_view import op_name
from autopar.planner.meshes import axis_names, describe, expert_data_mesh, shard_axis

__all__ = ["expert_params", "expert_axes", "check_experts", "expert_module_lists", "expert_counts",
           "free_expert_meshes"]

_CONTRACTIONS = ("einsum", "bmm", "matmul")


def _dim0_is_batch(user: fx.Node, param: fx.Node) -> bool:
    """Whether ``user`` (a contraction) treats ``param``'s dim 0 as a batch dim."""
    name = op_name(user)
    if name == "einsum":
        equation, operands = user.args[0], list(user.args[1])
        if param not in operands:
            return False
        lhs, out = equation.replace(" ", "").split("->")
        specs = lhs.split(",")
        label = specs[operands.index(param)][0]
        return label in out and sum(label in s for s in specs) >= 2
    ndim = len(param.meta["autopar.outputs"][0].shape)
    return name in ("bmm", "matmul") and ndim >= 3 and param in user.args[:2]


def expert_params(graph: fx.Graph) -> dict[str, str]:
    """Parameter node name -> fqn of every expert weight (none when nothing routes tokens): the
    stacked weights of einsum / bmm experts, and those of dropless token regions
    (``autopar.regions``: weights only its grouped matmuls use)."""
    from autopar.regions import REGION_EXPERTS_KEY

    if not any(n.op == "call_function" and op_name(n) == "topk" for n in graph.nodes):
        return {}
    out = {}
    for n in graph.nodes:
        region_experts = set(n.meta.get(REGION_EXPERTS_KEY, ()))
        out.update({a.name: a.meta["autopar.fqn"] for a in n.all_input_nodes if a.name in region_experts})
    for n in graph.nodes:
        if n.meta.get("autopar.kind") != "param":
            continue
        meta = n.meta["autopar.outputs"][0]
        if meta is None or len(meta.shape) < 3 or meta.shape[0] < 2:
            continue
        if any(u.op == "call_function" and op_name(u) in _CONTRACTIONS and _dim0_is_batch(u, n) for u in n.users):
            out[n.name] = n.meta["autopar.fqn"]
    return out


def expert_module_lists(graph: fx.Graph) -> list[str]:
    """Module paths of lists of experts written as modules (``experts.0``, ``experts.1``, ... with
    equally shaped weights) inside a module that routes tokens (a ``topk`` there, or an outlined
    token region: ``autopar.data_dependent``)."""
    from autopar.regions import TokenRegion

    routers = {n.meta.get("autopar.module", "") for n in graph.nodes if n.op == "call_function" and (
        isinstance(n.target, TokenRegion) or op_name(n) == "topk")}
    members: dict[tuple[str, str], dict[int, tuple]] = {}
    for n in graph.nodes:
        if n.meta.get("autopar.kind") != "param":
            continue
        parts = n.meta.get("autopar.fqn", "").split(".")
        for i, part in enumerate(parts):
            prefix = ".".join(parts[:i])
            if part.isdigit() and any(prefix.startswith(r + ".") for r in routers if r):
                key = (prefix, ".".join(parts[i + 1:]))
                members.setdefault(key, {})[int(part)] = tuple(n.meta["autopar.outputs"][0].shape)
    return sorted({prefix for (prefix, _), shapes in members.items() if len(shapes) >= 2 and len(set(shapes.values())) == 1})


def _computed_in_region(graph: fx.Graph, prefix: str) -> bool:
    """Whether the parameters of the experts under ``prefix`` feed an outlined token region."""
    from autopar.regions import TokenRegion

    return any(n.op == "call_function" and isinstance(n.target, TokenRegion)
               and any(a.meta.get("autopar.fqn", "").startswith(prefix + ".") for a in n.all_input_nodes)
               for n in graph.nodes)


def expert_axes(mesh: tuple[int, ...], ep: int | None, nested: bool = True) -> tuple[int, ...]:
    """The mesh axes experts are sharded on for ``Constraints(ep=ep)`` (() without an expert axis):
    the 'ep' axis where the mesh has one, else the first axis of size ``ep`` ('dp' first), else
    (``nested``: dropless experts, whose dim 0 may nest) the first set of axes, in mesh order, whose
    sizes multiply to ``ep``: an expert axis borrowing data and tensor ranks, its all-to-all group
    their ranks together."""
    import itertools

    if not ep or ep == 1:
        return ()
    names = axis_names(mesh)
    if "ep" in names:
        a = names.index("ep")
        return (a,) if mesh[a] == ep else ()
    for a, size in enumerate(mesh):
        if size == ep:
            return (a,)
    if nested:
        split = [a for a, size in enumerate(mesh) if size > 1]
        for k in range(2, len(split) + 1):
            for axes in itertools.combinations(split, k):
                if math.prod(mesh[a] for a in axes) == ep:
                    return axes
    return ()


def _region_experts(graph: fx.Graph) -> set[str]:
    """Names of the expert weights of token-wise regions (dropless experts, ``autopar.regions``)."""
    from autopar.regions import REGION_EXPERTS_KEY

    return {name for n in graph.nodes for name in n.meta.get(REGION_EXPERTS_KEY, ())}


def expert_counts(graph: fx.Graph) -> dict[str, int]:
    """fqn -> number of experts (dim 0) of every expert weight (``expert_params``)."""
    experts = expert_params(graph)
    return {experts[n.name]: n.meta["autopar.outputs"][0].shape[0] for n in graph.nodes if n.name in experts}


def free_expert_meshes(graph: fx.Graph, meshes: list[tuple[int, ...]], devices_per_node: int) -> list[tuple[int, ...]]:
    """The expert meshes the free search adds to ``meshes`` (module docstring): for each
    ('dp', 'tp') mesh of ``dp`` data ranks, ('dp', 'ep'[, 'tp']) with 'ep' the largest divisor of
    every expert layer's experts with ``1 < ep < dp`` and ``ep * tp`` dividing ``devices_per_node``
    (the all-to-all group inside a node: ranks are laid out row-major, 'tp' innermost). None when
    the graph has no expert weights (other models' searches are unchanged)."""
    counts = set(expert_counts(graph).values())
    if not counts:
        return []
    common = math.gcd(*counts)
    out = []
    for mesh in meshes:
        if axis_names(mesh) != ("dp", "tp") or shard_axis(mesh) is not None:
            continue
        data, tp = mesh
        fits = [ep for ep in range(2, data) if common % ep == 0 and data % ep == 0 and devices_per_node % (ep * tp) == 0]
        if fits:
            out.append(expert_data_mesh(data, max(fits), tp=tp))
    return [m for m in out if m not in meshes]


def check_experts(graph: fx.Graph, c: Constraints, meshes: list[tuple[int, ...]],
                  devices_per_node: int | None = None) -> list[tuple[int, ...]]:
    """The meshes of ``meshes`` with an axis for ``c.ep`` (all of them without ``ep``, and with
    ``devices_per_node`` given and dp, ZeRO and HSDP left free, the expert meshes
    ``free_expert_meshes`` proposes beside them);
    errors say what is wrong: no expert layers, a degree no mesh axis has, experts that do not
    divide."""
    if c.ep is None and c.hsdp is None and c.dp is None and c.zero is None and not c.zero_params \
            and devices_per_node is not None:  # (as HSDP twins: with dp and ZeRO left free)
        return meshes + free_expert_meshes(graph, meshes, devices_per_node)
    if not c.ep or c.ep == 1:
        return meshes
    experts = expert_params(graph)
    listed = expert_module_lists(graph)
    in_region = [p for p in listed if _computed_in_region(graph, p)]
    if in_region:
        raise ConstraintError(
            f"ep={c.ep}: the experts {in_region[0]}.0 .. compute on the rows torch.where (or nonzero) picks, sizes that "
            "depend on the routing: autopar runs their module as one token-wise region (each device its own tokens, "
            "every expert whole; autopar.data_dependent), which it cannot split by expert. Expert parallelism needs "
            "the experts' weights stacked ([experts, ...]) and the tokens sorted by expert into grouped matmuls "
            "(torch.nn.functional.grouped_mm; Hugging Face: config._experts_implementation = 'grouped_mm'), or a "
            "fixed capacity (see examples/moe.py); or leave ep unset.")
    if listed:
        raise ConstraintError(
            f"ep={c.ep}: the experts {listed[0]}.0 .. are separate modules (an nn.ModuleList called in a loop) that "
            "autopar could not merge into one computation over stacked weights: it merges them where every expert "
            "runs the same linear and elementwise ops on its slice expert_in[e] of one tensor and the outputs are "
            "torch.stack-ed, and these differ from one another or read something else (autopar.stack_experts). "
            "They run data and tensor parallel; write them alike, or stack their weights ([experts, ...], see "
            "examples/moe.py), or leave ep unset.")
    if not experts:
        raise ConstraintError(
            f"ep={c.ep}: the model has no expert layers (weights stacked over experts, [experts, ...], used as the "
            "batch dim of an einsum/bmm in a graph that routes tokens with topk); expert parallelism needs them. "
            "Leave ep unset.")
    sizes = {}
    for n in graph.nodes:
        if n.name in experts:
            sizes[experts[n.name]] = n.meta["autopar.outputs"][0].shape[0]
    uneven = {f: e for f, e in sizes.items() if e % c.ep}
    if uneven:
        f, e = next(iter(uneven.items()))
        raise ConstraintError(f"ep={c.ep} does not divide the {e} experts of {f!r}; choose ep dividing {e}")
    nested = set(experts) <= _region_experts(graph)  # only dropless experts may nest over several axes
    fitting = [m for m in meshes if expert_axes(m, c.ep, nested)]
    if not fitting:
        shapes = ", ".join(describe(m) for m in meshes)
        raise ConstraintError(
            f"ep={c.ep}: the expert axis is one mesh axis of size {c.ep} (dp or tp, or an 'ep' axis inside dp), and no "
            f"allowed mesh has one ({shapes}); an expert axis over several mesh axes (e.g. ep=4 on dp=2 tp=2) needs "
            "dropless experts (grouped matmuls: torch.nn.functional.grouped_mm, see examples/moe.py), and these "
            f"experts are contracted by einsum/bmm; choose ep dividing the data-parallel degree, or set dp={c.ep} or "
            f"tp={c.ep}")
    return fitting
