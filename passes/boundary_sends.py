"""Send values across pipeline stage boundaries in pieces, where the plan says so.

A pipeline plan's ``Stage.send_layouts`` names values its stage sends on in a layout other than
their planned one (``pipeline_search.boundary_sender``: a value replicated or partially summed
over a mesh axis crosses as that axis's pieces, each rank sending ``1/n`` of it). Here each such
value gets two ``reshard`` calls: planned layout -> pieces in the sending stage, pieces ->
planned layout in the first stage that uses it after; later stages' uses read the second. The
gradient goes the reverse way. Whatever uses it in its own stage still reads the original.

Invariants: every stage's consumers see the value in its planned layout; what crosses each
boundary is the value in pieces; run on a rank's program after ``run_passes``, before
``split_stages`` (which gets the stages of the two new nodes in the returned ``planned``).
"""
from __future__ import annotations

import torch.fx as fx

from autopar.ir import reshard
from autopar.layouts import format_layout, grad_layout, parse_layout
from autopar.passes.split_stages import stage_of_nodes

__all__ = ["insert_boundary_sends"]


def insert_boundary_sends(program: fx.GraphModule, plan, planned: dict[str, int],
                          state: set[str]) -> dict[str, int]:
    """Rewrite ``program`` in place (see the module docstring); ``planned``: the plan's stage of
    each traced node, ``state``: the parameter and buffer placeholders. Returns ``planned`` with
    the inserted nodes' stages."""
    sends = [(s.index, name, layout) for s in plan.stages for name, layout in s.send_layouts]
    if not sends:
        return planned
    planned = dict(planned)
    stage = stage_of_nodes(program, planned, state)
    nodes = {n.name: n for n in program.graph.nodes}
    placements = plan.nodes
    for s, name, pieces in sends:
        node = nodes.get(name)
        placed = placements.get(name)
        if node is None or placed is None or not placed.outs:
            raise ValueError(f"internal: stage {s} sends '{name}' in pieces, but the program has no such planned value")
        later = [u for u in node.users if stage[u.name] > s]
        if not later:
            continue
        whole = placed.outs[0]
        grads = bool(node.meta.get("autopar.needs_grad", False))
        g_whole = format_layout(grad_layout(parse_layout(whole))) if grads else None
        g_pieces = format_layout(grad_layout(parse_layout(pieces))) if grads else None
        site = f"the pipeline send of '{name}' in pieces"
        with program.graph.inserting_after(node):
            sent = program.graph.call_function(reshard, (node, whole, pieces, g_pieces, g_whole), {"site": site})
        with program.graph.inserting_after(sent):
            received = program.graph.call_function(reshard, (sent, pieces, whole, g_whole, g_pieces),
                                                   {"site": site + ", received"})
        for new, at, layout in ((sent, s, pieces), (received, min(stage[u.name] for u in later), whole)):
            new.meta.update({"autopar.kind": "reshard", "autopar.serves": name,
                             "autopar.outputs": node.meta.get("autopar.outputs"),
                             "autopar.needs_grad": node.meta.get("autopar.needs_grad", False),
                             "autopar.module": node.meta.get("autopar.module", ""),
                             "autopar.boundary_layout": layout})
            planned[new.name] = at
        for u in later:
            u.replace_input_with(node, received)
    program.graph.lint()
    program.recompile()
    return planned
