"""``autopar.compile``: plan (or take a plan), rewrite the graph, and build this rank's program."""
from __future__ import annotations

import copy
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from autopar.cluster import Cluster
from autopar.api import cyclic_gc_paused
from autopar.constraints import Constraints, with_annotations
from autopar.errors import AutoparError, ConstraintError
from autopar.plan import Plan
from autopar.runtime.launch import init_distributed
from autopar.runtime.parallel_model import ParallelModel
from autopar.trace import trace_model

__all__ = ["compile"]


def compile(
    model: torch.nn.Module,
    cluster: Cluster,
    example_inputs: Any,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[list], torch.optim.Optimizer],
    example_target: torch.Tensor | None = None,
    constraints: Constraints | None = None,
    plan: Plan | None = None,
    precision: str = "fp32",
    collective_timeout_s: float | None = None,
) -> ParallelModel:
    """Compile ``model`` into this rank's sharded training program. Call it in every process.

    ``optimizer`` maps a parameter list to a ``torch.optim.Optimizer``; ``loss_fn(output,
    target)`` returns a scalar. The process group is initialised here if needed (gloo on CPU,
    NCCL on CUDA, from the cluster spec).

    >>> # in a torchrun script:
    >>> # pm = autopar.compile(model, autopar.Cluster.local(), (idx,), example_target=tgt,
    >>> #                      loss_fn=loss, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    >>> # loss = pm.train_step(idx, target=tgt)
    """
    from autopar.cost_models.memory import describe_optimizer, precision_policy
    from autopar.passes import run_passes
    from autopar.passes.context import PassContext

    if example_target is None:
        raise AutoparError("compile needs example_target= (a target batch for loss_fn) to trace the training step")
    init_distributed(cluster.backend, cluster.world_size, collective_timeout_s)
    if cluster.device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if plan is not None and plan.world_size != cluster.world_size:
        raise ConstraintError(f"the plan is for {plan.world_size} devices but the cluster has {cluster.world_size}")
    policy = precision_policy(plan.precision if plan is not None else precision)
    autocast = policy.torch_compute_dtype if policy.mixed else None
    spec = describe_optimizer(optimizer, device.type)  # what the plan prices is the optimizer that runs
    with cyclic_gc_paused():  # as autopar.plan: tracing and search are GC-bound otherwise
        traced = trace_model(model, example_inputs, loss_fn=loss_fn, example_target=example_target,
                             device_type=cluster.device_type, autocast_dtype=autocast)
        if plan is None:
            plan = _plan_on_rank0(traced, cluster, with_annotations(constraints or Constraints(), model), policy, spec)
    loss_reduction = "mean"
    if plan.microbatches > 1:
        # the program runs one microbatch: trace again at that size (same graph, same node names)
        m = plan.microbatches
        loss_reduction = _loss_reduction(traced)
        inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        for x in list(inputs) + [example_target]:
            if isinstance(x, torch.Tensor) and x.shape[0] % m:
                raise ConstraintError(f"microbatches={m} does not divide the batch dim of an input of shape {tuple(x.shape)}")
        traced = trace_model(model, tuple(x[: x.shape[0] // m] if isinstance(x, torch.Tensor) else x for x in inputs),
                             loss_fn=loss_fn, example_target=example_target[: example_target.shape[0] // m],
                             device_type=cluster.device_type, autocast_dtype=autocast)
    _check_same_plan(plan)
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(a for a, _ in plan.mesh_axes)
    mesh = init_device_mesh(device.type, tuple(s for _, s in plan.mesh_axes), mesh_dim_names=names)
    ctx = PassContext.for_stage(plan, 0)
    program = run_passes(copy.deepcopy(traced.gm), ctx)
    return ParallelModel(plan=plan, traced=traced, program=program, device_mesh=mesh, model=model,
                         optimizer=optimizer, device=device, precision=plan.precision, loss_reduction=loss_reduction)


def _plan_on_rank0(traced, cluster: Cluster, constraints: Constraints, policy, spec) -> Plan:
    """Plan on rank 0 only and broadcast the plan: solvers stopped by a time limit need not agree,
    and every rank must run the same plan. A planning error on rank 0 is raised on every rank."""
    from autopar.planner.search import search_plan

    outcome: list = [None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = ("plan", search_plan(traced, cluster, constraints=constraints, precision=policy,
                                              optimizer=spec, _with_free=False).to_json())
        except AutoparError as exc:
            outcome[0] = ("error", type(exc).__name__, str(exc))
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0][0] == "error":
        import autopar.errors as errors

        raise getattr(errors, outcome[0][1], AutoparError)(outcome[0][2])
    return Plan.from_json(outcome[0][1])


_MEAN_REDUCTIONS = {"mean"}
_SUM_REDUCTIONS = {"sum"}
_LOSS_OPS = {"cross_entropy_loss", "nll_loss_nd", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss",
             "binary_cross_entropy_with_logits", "huber_loss"}


def _loss_reduction(traced) -> str:
    """How the loss reduces over the batch ("mean" or "sum"), from the reductions feeding the
    output; microbatch losses combine the same way. Anything else is refused, not guessed."""
    from autopar.strategies.rules import OpView, _op_name
    from autopar.trace import tensor_inputs

    out = next(n for n in traced.graph.nodes if n.op == "output")
    kinds, stack, seen = set(), list(tensor_inputs(out)), set()
    while stack:
        n = stack.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        name = _op_name(n)
        if name in _LOSS_OPS:
            red = OpView(n).arg("reduction", 1)
            kinds.add({1: "mean", 2: "sum"}.get(red, "none"))
        elif name in _MEAN_REDUCTIONS or name in _SUM_REDUCTIONS:
            kinds.add("mean" if name in _MEAN_REDUCTIONS else "sum")
        else:
            stack.extend(tensor_inputs(n))
    if len(kinds) != 1 or kinds == {"none"}:
        raise AutoparError(
            f"cannot tell how the loss reduces over the batch (found {sorted(kinds) or 'no reduction'}); "
            "gradient accumulation needs a mean or sum loss: use Constraints(microbatches=1)"
        )
    return kinds.pop()


def _check_same_plan(plan: Plan) -> None:
    """All ranks must run the same plan: compare fingerprints (a mismatch is a clear error)."""
    prints = [None] * dist.get_world_size()
    dist.all_gather_object(prints, plan.fingerprint)
    if len(set(prints)) != 1:
        raise AutoparError(f"ranks planned differently (plan fingerprints {sorted(set(prints))}); "
                           "pass the same plan= to every rank")
