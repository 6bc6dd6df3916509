"""Mean losses over the targets that count, exact however the batch is split.

``cross_entropy(x, t, reduction="mean", ignore_index=-100)`` (Hugging Face's causal-LM loss, and
every padded fine-tuning batch) divides by the number of targets that are not ignored. Split over
ranks, a mean per shard averaged over the shards is wrong whenever the shards hold different
numbers of such targets. This rewrite states the mean as what it is, a sum over a count:
``cross_entropy(..., reduction="sum") / (t != ignore_index).sum()``. Both parts are sums, so
every rank computes its part, the planner's reductions add them up, and the division runs on
the totals: the same number as on one device, whichever dims the plan splits.

Applied at trace time, before planning (the planner prices what runs). Only the unweighted,
unsmoothed form is rewritten (with class weights or label smoothing torch's mean divides by
something else); the rewritten division carries ``LOSS_REDUCTION_KEY`` = "mean", so gradient
accumulation combines microbatch losses as means. Split into microbatches, the batch's mean is
each microbatch's mean weighted by its share of the count, not by 1/m: ``token_count_program``
hands the runtime the count as a program of the batch, which it evaluates per microbatch.
"""
from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["exact_token_mean", "token_count_program", "LOSS_REDUCTION_KEY"]

LOSS_REDUCTION_KEY = "autopar.loss_reduction"  # on a node that ends a loss: how it reduces over the batch

_aten = torch.ops.aten
# op -> (index of reduction, index of ignore_index, index of label_smoothing or None, defaults)
_MEAN_LOSSES = {
    _aten.cross_entropy_loss.default: (3, 4, 5, (None, 1, -100, 0.0)),
    _aten.nll_loss_nd.default: (3, 4, None, (None, 1, -100)),
    _aten.nll_loss.default: (3, 4, None, (None, 1, -100)),
}


def exact_token_mean(gm: fx.GraphModule) -> int:
    """Rewrite every mean-reduced, unweighted target loss in ``gm`` as sum / count of the targets
    not ignored (see the module docstring). Returns how many were rewritten. Only the graph is
    rewritten: the caller regenerates ``gm``'s code (``trace_model`` does once, at its end; about
    30 us a node)."""
    done = 0
    for node in list(gm.graph.nodes):
        spec = _MEAN_LOSSES.get(node.target) if node.op == "call_function" else None
        if spec is None:
            continue
        red_i, ign_i, smooth_i, defaults = spec
        args = list(node.args) + [None] * (red_i + 3 - len(node.args))
        full = [args[k + 2] if k + 2 < len(node.args) else defaults[k] for k in range(len(defaults))]
        for k, name in enumerate(("weight", "reduction", "ignore_index", "label_smoothing")[: len(defaults)]):
            if name in node.kwargs:
                full[k] = node.kwargs[name]
        weight, reduction, ignore = full[0], full[1], full[2]
        smoothing = full[3] if smooth_i is not None else 0.0
        if reduction != 1 or weight is not None or smoothing:
            continue
        x, t = node.args[0], node.args[1]
        if not all(isinstance(a, fx.Node) and "val" in a.meta for a in (x, t)):
            continue
        summed_args = (x, t, None, 2, ignore) + ((0.0,) if smooth_i is not None else ())
        with gm.graph.inserting_before(node):
            total = gm.graph.call_function(node.target, summed_args)
            valid = gm.graph.call_function(_aten.ne.Scalar, (t, ignore))
            count = gm.graph.call_function(_aten.sum.default, (valid,))
            mean = gm.graph.call_function(_aten.div.Tensor, (total, count))
        xv, tv = x.meta["val"], t.meta["val"]
        values = {total: node.target(xv, tv, None, 2, ignore, *((0.0,) if smooth_i is not None else ()))}
        values[valid] = _aten.ne.Scalar(tv, ignore)
        values[count] = _aten.sum.default(values[valid])
        values[mean] = _aten.div.Tensor(values[total], values[count])
        for new, val in values.items():
            new.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
            new.meta["val"] = val
        mean.meta[LOSS_REDUCTION_KEY] = "mean"
        node.replace_all_uses_with(mean)
        gm.graph.erase_node(node)
        done += 1
    return done


def token_count_program(gm: fx.GraphModule) -> fx.GraphModule | None:
    """When ``gm``'s loss is a mean over a count of the batch alone (``exact_token_mean``'s sum /
    count, the program's only output): the count as a program of the batch inputs it reads
    (placeholders in ``gm``'s order, the rest of the batch not taken). Evaluated on a
    microbatch's whole tensors it gives that microbatch's count; None for any other loss."""
    from autopar.ir import batch_only_values

    graph = gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    loss = out.args[0] if len(out.args) == 1 else None
    if not isinstance(loss, fx.Node) or loss.meta.get(LOSS_REDUCTION_KEY) != "mean" or len(loss.args) != 2:
        return None
    count = loss.args[1]
    if not isinstance(count, fx.Node) or count.name not in batch_only_values(graph):
        return None
    needed, todo = set(), [count]
    while todo:
        n = todo.pop()
        if n.name not in needed:
            needed.add(n.name)
            todo.extend(n.all_input_nodes)
    made = fx.Graph()
    env: dict[str, fx.Node] = {}
    for n in graph.nodes:
        if n.name in needed:
            env[n.name] = made.node_copy(n, lambda a: env[a.name])
    made.output(env[count.name])
    return fx.GraphModule(gm, made)
