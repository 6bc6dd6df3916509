"""Send values across pipeline stage boundaries in pieces, where the plan says so.

A pipeline plan's ``Stage.send_layouts`` names values its stage sends on in a layout other than
their planned one (``planner.boundary_choice.boundary_sender``: a value replicated or partially summed
over a mesh axis crosses as that axis's pieces, each rank sending ``1/n`` of it). Here each such
value gets one ``reshard`` into pieces in the sending stage, and one back into its planned layout
in each later stage that uses it; those stages' uses read their own. The gradients go the reverse
way. Whatever uses the value in its own stage still reads the original.

Invariants: every stage's consumers see the value in its planned layout; what crosses each
boundary is the value in pieces; run on a rank's program after ``run_passes`` (a value computed
inside an outlined recompute block is found as the top-level node that returns it), before
``split_stages`` (which gets the stages of the new nodes in the returned ``planned``).
"""
from __future__ import annotations

import operator

import torch.fx as fx

from autopar.ir import reshard
from autopar.layouts import format_layout, grad_layout, parse_layout
from autopar.passes.analysis import outlined_graph
from autopar.passes.split_stages import shared_state, stage_of_nodes

__all__ = ["insert_boundary_sends"]


def _top_level(program: fx.GraphModule, name: str) -> tuple[fx.Node, fx.Node] | None:
    """(the top-level node whose value is traced node ``name``, the node that computes it: itself,
    or inside an outlined block the node its submodule returns); None if the program has neither."""
    for n in program.graph.nodes:
        if n.name == name:
            return n, n
    for n in program.graph.nodes:
        if n.op != "call_module" or (graph := outlined_graph(program, n)) is None:
            continue
        value = next(o for o in graph.nodes if o.op == "output").args[0]
        values = value if isinstance(value, (tuple, list)) else (value,)
        for i, v in enumerate(values):
            if not (isinstance(v, fx.Node) and v.name == name):
                continue
            if not isinstance(value, (tuple, list)):
                return n, v
            for u in n.users:
                if u.op == "call_function" and u.target is operator.getitem and u.args[1] == i:
                    return u, v
    return None


def insert_boundary_sends(program: fx.GraphModule, plan, planned: dict[str, int],
                          state: set[str]) -> dict[str, int]:
    """Rewrite ``program`` in place (see the module docstring); ``planned``: the plan's stage of
    each traced node, ``state``: the parameter and buffer placeholders. Returns ``planned`` with
    the inserted nodes' stages."""
    sends = [(s.index, name, layout) for s in plan.stages for name, layout in s.send_layouts]
    if not sends:
        return planned
    planned = dict(planned)
    stage = stage_of_nodes(program, planned, state, shared_state(plan))
    placements = plan.nodes
    for s, name, pieces in sends:
        found = _top_level(program, name)
        placed = placements.get(name)
        if found is None or placed is None or not placed.outs:
            raise ValueError(f"internal: stage {s} sends '{name}' in pieces, but the program has no such planned value")
        node, inner = found
        later: dict[int, list[fx.Node]] = {}
        for u in node.users:
            if stage[u.name] > s:
                later.setdefault(stage[u.name], []).append(u)
        if not later:
            continue
        whole = placed.outs[0]
        grads = bool(inner.meta.get("autopar.needs_grad", False))
        g_whole = format_layout(grad_layout(parse_layout(whole))) if grads else None
        g_pieces = format_layout(grad_layout(parse_layout(pieces))) if grads else None
        site = f"the pipeline send of '{name}' in pieces"
        meta = {"autopar.kind": "reshard", "autopar.serves": name, "autopar.outputs": inner.meta.get("autopar.outputs"),
                "autopar.needs_grad": inner.meta.get("autopar.needs_grad", False),
                "autopar.module": inner.meta.get("autopar.module", "")}
        # names of their own: ``planned`` is keyed by name, and outlined blocks' inner graphs
        # have reshard nodes of their own (``reshard_3``) that a generated name could repeat
        with program.graph.inserting_after(node):
            sent = program.graph.create_node("call_function", reshard, (node, whole, pieces, g_pieces, g_whole),
                                             {"site": site}, name=f"{name}_sent_in_pieces")
        sent.meta.update(meta, **{"autopar.boundary_layout": pieces})
        planned[sent.name] = s
        at = sent
        for t in sorted(later):  # each later stage that uses it gathers it back for itself
            with program.graph.inserting_after(at):
                received = program.graph.create_node("call_function", reshard, (sent, pieces, whole, g_whole, g_pieces),
                                                     {"site": f"{site}, received by stage {t}"},
                                                     name=f"{name}_received_by_stage_{t}")
            received.meta.update(meta, **{"autopar.boundary_layout": whole})
            planned[received.name] = t
            for u in later[t]:
                u.replace_input_with(node, received)
            at = received
    program.graph.lint()
    program.recompile()
    return planned
