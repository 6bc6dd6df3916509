"""Dead-code elimination and lint."""
from __future__ import annotations

import torch.fx as fx

from autopar.passes.context import PassContext

__all__ = ["eliminate_dead_code_pass"]


def eliminate_dead_code_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Guarantees: no node whose value is unused (placeholders kept). Why: resharding and
    localisation can orphan nodes; dead collectives would still communicate."""
    gm.graph.eliminate_dead_code()
    return gm
