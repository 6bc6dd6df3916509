"""Graph rewrites that apply a Plan: pure ``verb_object_pass(gm, ctx) -> GraphModule`` functions.

``pipeline.run_passes`` runs ``pipeline.PASSES`` in order and lints after each.
"""
from autopar.passes.pipeline import PASSES, run_passes

__all__ = ["PASSES", "run_passes"]
