"""The ordered pass list and its runner: lint and verify after every pass, name the culprit.

A pass edits ``gm.graph`` (and ``gm.meta``) and returns the module; it does not regenerate the
module's Python code: ``run_passes`` does that once, after the last pass (``recompile`` is linear in
the graph and cost about as much as all the passes' rewriting together, once per pass).
"""
from __future__ import annotations

from typing import Callable

import torch.fx as fx

from autopar.passes.cleanup import eliminate_dead_code_pass
from autopar.passes.context_attention import context_attention_pass
from autopar.passes.context import PassContext
from autopar.passes.defer_gradient_sync import defer_gradient_sync_pass
from autopar.passes.expert_dispatch import expert_dispatch_pass
from autopar.passes.insert_collectives import insert_collectives_pass
from autopar.passes.localize_shapes import localize_shapes_pass
from autopar.passes.outline_recompute import outline_recompute_pass
from autopar.passes.prefetch_param_gathers import prefetch_param_gathers_pass
from autopar.passes.sink_gradient_sums import sink_gradient_sums_pass
from autopar.passes.start_batch_collectives_early import start_batch_collectives_early_pass
from autopar.passes.sync_batch_norm import sync_batch_norm_pass

__all__ = ["PASSES", "run_passes", "PassError"]

PASSES: list[Callable[[fx.GraphModule, PassContext], fx.GraphModule]] = [
    localize_shapes_pass,
    sync_batch_norm_pass,
    expert_dispatch_pass,
    insert_collectives_pass,
    context_attention_pass,
    sink_gradient_sums_pass,
    defer_gradient_sync_pass,
    prefetch_param_gathers_pass,
    start_batch_collectives_early_pass,
    eliminate_dead_code_pass,
    outline_recompute_pass,
]


class PassError(RuntimeError):
    pass


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes=None) -> fx.GraphModule:
    for p in passes if passes is not None else PASSES:
        try:
            gm = p(gm, ctx)
            gm.graph.lint()
        except Exception as exc:  # noqa: BLE001 - re-raised with the pass named
            raise PassError(f"pass {p.__name__} failed: {type(exc).__name__}: {exc}") from exc
    gm.recompile()
    return gm
