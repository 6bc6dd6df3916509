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
over both axes and each expert is held by ``dp`` groups of ``k`` ranks.
"""
from __future__ import annotations

import torch.fx as fx

from autopar.constraints import Constraints
from autopar.errors import ConstraintError
from autopar.node_view import op_name
from autopar.planner.meshes import axis_names, describe

__all__ = ["expert_params", "expert_axis", "check_experts", "expert_module_lists"]

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


def expert_axis(mesh: tuple[int, ...], ep: int | None) -> int | None:
    """The mesh axis experts are sharded on for ``Constraints(ep=ep)`` (None: no expert axis)."""
    if not ep or ep == 1:
        return None
    names = axis_names(mesh)
    if "ep" in names:
        a = names.index("ep")
        return a if mesh[a] == ep else None
    for a, size in enumerate(mesh):
        if size == ep:
            return a
    return None


def check_experts(graph: fx.Graph, c: Constraints, meshes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The meshes of ``meshes`` with an axis for ``c.ep`` (all of them without ``ep``); errors
    say what is wrong: no expert layers, a degree no mesh axis has, experts that do not divide."""
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
    fitting = [m for m in meshes if expert_axis(m, c.ep) is not None]
    if not fitting:
        shapes = ", ".join(describe(m) for m in meshes)
        raise ConstraintError(
            f"ep={c.ep}: the expert axis is one mesh axis of size {c.ep} (dp or tp, or an 'ep' axis inside dp), and no "
            f"allowed mesh has one ({shapes}); choose ep dividing the data-parallel degree, or set dp={c.ep} or tp={c.ep}")
    return fitting
