"""Run the plan's recomputed blocks under activation checkpointing.

``outline_recompute_pass`` cuts the per-rank program into runs of consecutive nodes that belong to
one block instance (``blocks.3``: a node belongs to the instance its ``autopar.module`` path
starts with) with ``torch.fx.passes.split_module`` (original order and node names kept), and
wraps each run of a recomputed instance in ``Checkpointed``: non-reentrant
``torch.utils.checkpoint``, which keeps only the run's inputs for backward and runs the run's
forward again there (collectives included, under the same autocast state).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from autopar.ir import RECOMPUTE_KEY
from autopar.passes.context import PassContext

__all__ = ["outline_recompute_pass", "Checkpointed"]


class Checkpointed(torch.nn.Module):
    """``inner`` run under non-reentrant activation checkpointing."""

    def __init__(self, inner: fx.GraphModule):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False)


def _instance_of(module: str, instances: tuple[str, ...]) -> str | None:
    for p in instances:
        if module == p or module.startswith(p + "."):
            return p
    return None


def _stage_of(gm: fx.GraphModule, plan) -> dict[str, int]:
    """Each node's pipeline stage, as ``split_stages`` will place it (empty for one stage)."""
    if len(plan.stages) < 2:
        return {}
    from autopar.passes.split_stages import stage_of_nodes

    planned = {n.name: s.index for s in plan.stages for n in s.nodes}
    return stage_of_nodes(gm, planned, set())


def outline_recompute_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Requires: the plan's ``recompute_blocks`` name block instances by module prefix.
    Guarantees: every node of a recomputed instance runs inside a ``Checkpointed`` submodule
    (``gm.meta[RECOMPUTE_KEY]`` lists their names); no submodule spans two pipeline stages; the
    program computes what it computed before;
    ``gm.meta`` is carried over. A program with nothing to recompute is returned unchanged.
    Why: the planner priced these blocks' activations as recomputed, not kept.
    """
    instances = tuple(ctx.plan.recompute_blocks)
    if not instances:
        gm.meta[RECOMPUTE_KEY] = ()
        return gm
    run_of: dict[str, int] = {}
    run_instance: dict[int, str | None] = {}
    run, current = 0, object()
    # a pipeline plan: runs end at stage boundaries too (``split_stages`` places each outlined
    # run in the stage of the nodes it holds)
    stage_of = _stage_of(gm, ctx.plan)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        inst = _instance_of(node.meta.get("autopar.module", ""), instances)
        key = (stage_of.get(node.name), inst)
        if key != current:
            run += 1
            current = key
            run_instance[run] = inst
        run_of[node.name] = run
    meta = dict(gm.meta)
    split = split_module(gm, None, lambda n: run_of[n.name], keep_original_order=True, keep_original_node_name=True)
    split.meta.update(meta)
    wrapped = []
    for name, child in list(split.named_children()):
        if name.startswith("submod_") and run_instance.get(int(name.split("_", 1)[1])) is not None:
            setattr(split, name, Checkpointed(child))
            wrapped.append(name)
    split.meta[RECOMPUTE_KEY] = tuple(wrapped)
    return split
