"""Whether the runtime's loss value rides the gradient sync (``GradSync.carry``) under a choice.

The runtime sums a step's microbatch loss values on each rank and reduces them once: in the
all-reduce of the gradient bucket that ends the float32 gradient buffer when that bucket syncs
over exactly the loss's first partial axis, else in an all-reduce of its own. The buffer ends
with the gradient of the first parameter the forward uses among those the buckets sync
(``grad_sync.backward_order``). This module applies the same rule to a plan's layouts, so
the step time counts the loss's own all-reduce only where the runtime issues one. The ILP's
objective and its local search take it as riding (whether it does is decided by another node's
layout, which the objective cannot see): charging it there had the ILP gather the logits to
avoid a reduction that costs nothing; the step time a plan predicts (``evaluate``) decides.
"""
from __future__ import annotations

import numpy as np
import torch

from autopar.layouts import DATA_AXIS_NAMES, Partial, Replicate

__all__ = ["loss_rides", "may_ride", "local_counts_reduction", "LOCAL_COUNT_BYTES"]

LOCAL_COUNT_BYTES = 8  # one float64 count per microbatch (exact past 2**24 tokens)


def may_ride(layouts, mesh_shape, axis_names) -> np.ndarray:
    """Per layout of the loss value, whether its first partial axis (of more than one device) is
    a data axis: where a gradient bucket may sync over it, so the ILP's objective takes the
    loss's reduction as riding (``EdgeTable.ilp_overlap_bwd``); ``loss_rides`` decides per plan."""
    data = {a for a, name in enumerate(axis_names) if name in DATA_AXIS_NAMES and mesh_shape[a] > 1}
    firsts = [next((a for a, p in enumerate(lay) if isinstance(p, Partial) and mesh_shape[a] > 1), None)
              for lay in layouts]
    return np.array([a is not None and a in data for a in firsts], dtype=bool)


def loss_rides(problem, choice: dict[str, int]) -> bool:
    """Whether the loss value rides the last gradient bucket (not under pipeline schedules, whose
    buckets and loss the runtime reduces apart; callers pricing those do not ask)."""
    traced = problem.traced
    policy = problem.ctx.policy
    mesh = problem.ctx.mesh_shape
    if traced is None or not traced.has_loss or (policy.mixed and policy.torch_reduce_dtype != torch.float32):
        return False
    out = next(n for n in traced.graph.nodes if n.op == "output")
    if len(out.args) != 1 or getattr(out.args[0], "op", None) is None:
        return False
    loss_layout = problem.strategy_of(out.args[0].name, choice).outs[0]
    partial = [a for a, p in enumerate(loss_layout) if isinstance(p, Partial) and mesh[a] > 1]
    if not partial:
        return False
    for name in _bucketable_params(problem):
        strategy = problem.strategy_of(name, choice)
        if strategy.zero_stage == 2:
            continue  # its gradient is reduce-scattered into a shard buffer, not bucketed
        # its gradient is summed over the axes it is whole on where the batch is split (the loss partial)
        synced = {a for a in partial if isinstance(strategy.outs[0][a], Replicate)}
        if synced:
            return synced == {partial[0]}
    return False


def _bucketable_params(problem) -> list[str]:
    """Trainable float32 parameter placeholders in the order the forward first uses them
    (memoised per problem context)."""
    memo = problem.ctx.reshard_memo
    key = ("loss-rider-order", id(problem.traced))
    if key not in memo:
        first_use: dict[str, int] = {}
        kept = set()
        for i, n in enumerate(problem.traced.graph.nodes):
            if n.op == "placeholder" and n.meta.get("autopar.kind") == "param" and n.meta.get("autopar.requires_grad") \
                    and n.meta["autopar.outputs"][0].dtype == torch.float32:
                kept.add(n.name)
            for a in n.all_input_nodes:
                if a.name in kept:
                    first_use.setdefault(a.name, i)
        memo[key] = sorted(first_use, key=first_use.get)
    return memo[key]


def local_counts_reduction(problem) -> tuple[int, float] | None:
    """(the 'dp' axis, bytes) of the all-reduce that sums the microbatches' target counts over the
    data-parallel ranks, or None where the runtime runs none: with local batches (each rank reads
    its own rows) and microbatches, a token-mean loss weighs each microbatch by its share of the
    count (``LossValue.microbatch_weights``), and each rank counts only its own rows."""
    from autopar.ir import is_local_batch
    from autopar.loss_rewrite import token_count_program
    from autopar.planner.meshes import axis_names

    traced = problem.traced
    if traced is None or problem.microbatches < 2 or not is_local_batch(traced.graph):
        return None
    names = axis_names(problem.ctx.mesh_shape)
    if "dp" not in names or problem.ctx.mesh_shape[names.index("dp")] < 2:
        return None
    if problem.token_count_found is None:
        problem.token_count_found = token_count_program(traced.gm) is not None
    return (names.index("dp"), float(LOCAL_COUNT_BYTES * problem.microbatches)) if problem.token_count_found else None
