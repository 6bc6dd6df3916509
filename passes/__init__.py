"""Graph rewrites that apply a Plan: pure ``verb_object_pass(gm, ctx) -> GraphModule`` functions.

``pipeline.run_passes`` runs ``pipeline.PASSES`` in order, lints after each and regenerates the
module's code once at the end (a pass edits the graph only).
"""
from autopar.passes.pipeline import PASSES, run_passes

__all__ = ["PASSES", "run_passes"]
