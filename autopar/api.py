"""``autopar.plan``: trace a model and plan it on a cluster.

Also the argument checks ``plan`` and ``compile`` share (``check_model_args``, ``trace_checked``,
``check_fits_cluster``): every bad input is refused here with an autopar error naming what is
wrong and what fixes it, before a raw error from torch or the solver can surface, and before a
long search is spent on a request no plan can serve.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import math
import sys
import time
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.cluster import Cluster
from autopar.constraints import Constraints, with_annotations
from autopar.cost_models.memory import OptimizerSpec, PrecisionPolicy, optimizer_spec, precision_policy
from autopar.errors import ClusterSpecError, ConstraintError, TraceError
from autopar.layouts import Shard, parse_placement
from autopar.plan import Plan
from autopar.planner.ilp import SolverConfig
from autopar.planner.search import search_plan
from autopar.trace import TracedGraph, trace_model

__all__ = ["plan", "check_model_args", "trace_checked", "check_fits_cluster"]


def plan(
    model: torch.nn.Module,
    cluster: Cluster,
    example_inputs: Any,
    *,
    loss_fn: Callable | None = None,
    example_target: torch.Tensor | None = None,
    precision: str | PrecisionPolicy = "fp32",
    optimizer: str | OptimizerSpec = "adamw",
    constraints: Constraints | None = None,
    solver: SolverConfig | None = None,
    device_type: str | None = None,
    verbose: bool = False,
    compare_free: bool = True,
) -> Plan:
    """Plan ``model`` for ``cluster``: which parallelism each op uses, and what it will cost.

    ``example_inputs`` give shapes only (meta tensors are fine). Annotations made with
    ``autopar.annotate`` are merged into ``constraints``. ``precision``: "fp32", "bf16-mixed" or
    a ``PrecisionPolicy``; ``optimizer``: a name ("sgd", "sgd-momentum", "adam", "adamw") or an
    ``OptimizerSpec`` (``autopar.compile`` measures the optimizer it is given).
    ``compare_free``: under constraints, also search without them and record that plan's predicted
    step time (``plan.free_step_time_s``, ``plan.override_cost_s``); ``False`` skips that second
    search (what ``autopar.compile`` does): the chosen plan is the same either way.

    >>> import torch, autopar
    >>> m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    >>> p = autopar.plan(m, autopar.Cluster.local(2), torch.randn(32, 64))
    >>> sorted(p.mesh)
    ['dp', 'tp']
    """
    check_cluster_arg(cluster)
    constraints = constraints if constraints is not None else Constraints()
    if not isinstance(constraints, Constraints):
        raise ConstraintError(f"constraints must be autopar.Constraints, got {type(constraints).__name__}")
    check_model_args(model, example_inputs, loss_fn, example_target)
    constraints = with_annotations(constraints, model)
    policy = precision_policy(precision)
    optimizer_spec(optimizer)  # an unknown name is refused before tracing, not after
    _check_solver(solver)
    if not isinstance(compare_free, bool):
        raise ConstraintError(f"compare_free must be True or False, got {compare_free!r}")
    if device_type not in (None, "cpu", "cuda"):
        raise ConstraintError(f"device_type must be 'cpu', 'cuda' or None (the tracing device), got {device_type!r}")
    with cyclic_gc_paused():
        t0 = time.perf_counter()
        traced = trace_checked(model, example_inputs, loss_fn=loss_fn, example_target=example_target,
                               device_type=device_type or "cpu",
                               autocast_dtype=policy.torch_compute_dtype if policy.mixed else None)
        trace_s = time.perf_counter() - t0
        check_fits_cluster(traced, cluster, constraints)
        progress = _Progress(verbose)
        result = search_plan(traced, cluster, constraints=constraints, precision=precision, optimizer=optimizer,
                             solver=solver or SolverConfig(), progress=progress, _with_free=compare_free)
        progress.done()
    result.timings["trace_s"] = trace_s
    return result


def check_cluster_arg(cluster: Any) -> None:
    if not isinstance(cluster, Cluster):
        raise ClusterSpecError(
            f"cluster must be an autopar.Cluster (e.g. Cluster.preset('dgx-h100', nodes=2) or Cluster.local(4)), "
            f"got {type(cluster).__name__}"
        )


def _check_solver(solver: Any) -> None:
    if solver is None:
        return
    if not isinstance(solver, SolverConfig):
        raise ConstraintError(f"solver must be an autopar.SolverConfig (e.g. SolverConfig(time_limit_s=60)), got {type(solver).__name__}")
    t = solver.time_limit_s
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise ConstraintError(f"SolverConfig.time_limit_s must be a positive number of seconds, got {t!r}")
    g = solver.proof_gap
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g < 1:
        raise ConstraintError(f"SolverConfig.proof_gap must be a relative gap in [0, 1) (e.g. 1e-3: 0.1%), got {g!r}")
    if isinstance(solver.threads, bool) or not isinstance(solver.threads, int) or solver.threads < 1:
        raise ConstraintError(f"SolverConfig.threads must be an integer >= 1, got {solver.threads!r}")
    if not isinstance(solver.backend, str) or not solver.backend:
        raise ConstraintError(f"SolverConfig.backend must be an OR-Tools MIP backend name such as 'CBC' or 'SCIP', got {solver.backend!r}")


def _name_of(fn: Any) -> str:
    """How to call a user function in a message: ``mse_loss``, ``CrossEntropyLoss``, ``<lambda>``."""
    if isinstance(fn, functools.partial):
        return _name_of(fn.func)
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return name.rsplit("<locals>.", 1)[-1]


def _describe(value: Any) -> str:
    """A value as a message shows it: "a float32 tensor of shape (16, 64)", "a tuple of 2 values"."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{'an' if dtype[0] in 'aeiou' else 'a'} {dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_describe(v) for v in value[:3]) + (", ..." if len(value) > 3 else "")
        return f"a {type(value).__name__} of {len(value)} values ({inner})"
    if isinstance(value, dict):
        return f"a dict with keys {list(value)[:6]}"
    return f"{type(value).__name__} {value!r}"[:120]


def check_model_args(model: Any, example_inputs: Any, loss_fn: Any, example_target: Any, *,
                     needs_loss: bool = False) -> None:
    """The checks of ``plan``/``compile`` arguments that need no trace (cheap, before anything runs)."""
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"model must be a torch.nn.Module, got {type(model).__name__}; wrap a plain function in an nn.Module")
    if example_inputs is None:
        raise TraceError("example_inputs is required: a tensor or a tuple of tensors, the positional arguments of model.forward")
    if isinstance(example_inputs, dict):
        raise TraceError(
            f"example_inputs must be a tensor or a tuple of tensors, passed positionally to model.forward; got a dict "
            f"with keys {list(example_inputs)[:6]}. Pass a tuple in forward's argument order, e.g. "
            "(input_ids, attention_mask), or wrap the model in a module whose forward takes those tensors positionally"
        )
    if not isinstance(example_inputs, (torch.Tensor, tuple, list)):
        raise TraceError(
            f"example_inputs must be a tensor or a tuple of tensors (the positional arguments of model.forward), "
            f"got {_describe(example_inputs)}"
        )
    if needs_loss and loss_fn is None:
        raise TraceError("loss_fn is required: a function (model output, target) -> scalar loss tensor, "
                         "e.g. loss_fn=torch.nn.functional.cross_entropy")
    if loss_fn is not None and not callable(loss_fn):
        raise TraceError(f"loss_fn must be a function (model output, target) -> scalar loss tensor, got {_describe(loss_fn)}")
    if example_target is not None and loss_fn is None:
        raise TraceError("example_target was given without loss_fn, so nothing would read it: pass loss_fn= "
                         "(a function (model output, target) -> scalar loss), or drop example_target")
    if example_target is not None and not isinstance(example_target, torch.Tensor):
        raise TraceError(f"example_target must be a tensor (a target batch for loss_fn), got {_describe(example_target)}")
    params = list(model.parameters())
    if not params:
        raise TraceError(
            f"the model ({type(model).__name__}) has no parameters: there is nothing to train or to parallelize. "
            "If it has layers, register them as attributes or in an nn.ModuleList (a plain Python list of "
            "layers hides their parameters from PyTorch)"
        )
    if not any(p.requires_grad for p in params):
        raise TraceError(
            f"none of the {len(params)} parameters of the model ({type(model).__name__}) requires a gradient: there "
            "is nothing to train. Unfreeze the ones to train (p.requires_grad_(True))"
        )


class _LossProbe:
    """``loss_fn`` as it is traced, remembering whether it raised (and on what), so a failure in
    the loss is reported as the loss function's, not as the model's."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.failure: tuple[BaseException, str, str] | None = None

    def __call__(self, output, target):
        try:
            return self.fn(output, target)
        except Exception as exc:  # noqa: BLE001 - re-raised; only remembered here
            self.failure = (exc, _describe(output), _describe(target))
            raise


def trace_checked(model, example_inputs, *, loss_fn=None, example_target=None, device_type: str = "cpu",
                  autocast_dtype=None, own_loss: bool = False, to_user: bool = False) -> TracedGraph:
    """``trace_model``, with a loss function that fails named as the culprit, a loss that is not
    one scalar refused (training needs one number to differentiate), and what eager torch would
    refuse but fake tensors trace refused too: an empty batch, operands of mixed floating dtypes."""
    from autopar.trace import as_tuple
    from autopar.trace_errors import is_data_dependent, refuse_empty_batch, refuse_mixed_dtypes

    refuse_empty_batch(as_tuple(example_inputs))
    probe = _LossProbe(loss_fn) if loss_fn is not None else None
    try:
        traced = trace_model(model, example_inputs, loss_fn=probe, example_target=example_target,
                             device_type=device_type, autocast_dtype=autocast_dtype, own_loss=own_loss,
                             to_user=to_user)
    except TraceError as exc:
        if probe is None or probe.failure is None or is_data_dependent(probe.failure[0]):
            raise
        err, out, tgt = probe.failure
        name = _name_of(loss_fn)
        first = (str(err).splitlines() or [""])[0][:300].rstrip(".")
        raise TraceError(
            f"the loss function {name} failed: {type(err).__name__}: {first}. The model traced fine; "
            f"{name} was called with the model's output, {out}, and example_target, {tgt}. Make example_target "
            f"what {name} expects for that output (its shape, and its dtype: class indices are torch.long)"
        ) from exc
    refuse_mixed_dtypes(traced.graph, model, autocast_dtype)
    if loss_fn is not None:
        _check_scalar_loss(traced, _name_of(loss_fn))
    return traced


def _check_scalar_loss(traced: TracedGraph, name: str) -> None:
    out = next(n for n in traced.graph.nodes if n.op == "output")
    leaves = pytree.tree_leaves(out.args[0])
    nodes = [x for x in leaves if isinstance(x, fx.Node)]
    meta = nodes[0].meta.get("autopar.outputs", (None,))[0] if len(leaves) == 1 and nodes else None
    if meta is not None and meta.numel == 1 and meta.is_floating:
        return
    if len(leaves) != 1:
        got = f"{len(leaves)} values"
    elif meta is None:
        got = f"{type(leaves[0]).__name__} {leaves[0]!r}, not a tensor" if not nodes else "a value that is not a tensor"
    elif meta.numel != 1:
        got = f"a tensor of shape {list(meta.shape)}"
    else:
        dtype = str(meta.dtype).removeprefix("torch.")
        got = f"{'an' if dtype[0] in 'aeiou' else 'a'} {dtype} tensor, which has no gradient"
    raise TraceError(
        f"loss_fn must return a scalar: one floating-point number per step, the value training differentiates; "
        f"{name} returned {got}. Reduce it over the batch with .mean() or .sum() (or reduction='mean' in a torch loss)"
    )


def _divisors(n: int, limit: int = 64) -> str:
    return ", ".join(str(d) for d in range(1, min(n, limit) + 1) if n % d == 0)


def check_fits_cluster(traced: TracedGraph, cluster: Cluster, c: Constraints) -> None:
    """Refuse, before the search, what no plan can serve: pins naming dims a tensor does not have,
    microbatch and dp degrees that do not divide the batch, and a cluster too large for the model.

    The world-size bound: data parallel splits the batch at most ``batch`` ways (one sample per
    replica), and tensor parallel / ZeRO split a parameter at most ``d`` ways, ``d`` its largest
    dim. With the two mesh axes (dp x tp) no plan gives more than ``batch x max d`` devices
    distinct work; beyond that, devices only repeat others' work. Pipeline stages
    (``Constraints(pp=...)``) multiply the bound by their number.
    """
    from autopar.planner.search import mesh_candidates

    mesh_candidates(cluster, c)  # degrees that do not fit the cluster are named first (dp=3 on 4 devices)
    params = {n.meta["autopar.fqn"]: n.meta["autopar.outputs"][0].shape
              for n in traced.graph.nodes if n.meta.get("autopar.kind") == "param"}
    _check_pin_dims(traced, params, c)
    batch = traced.global_batch
    if batch is not None:
        m = c.microbatches
        if m is not None and batch % m:
            raise ConstraintError(
                f"microbatches={m} does not divide the batch of {batch} (every microbatch must be the same size); "
                f"use microbatches in {{{_divisors(batch)}}} or a batch that is a multiple of {m}"
            )
        if c.dp is not None and batch % c.dp:
            raise ConstraintError(
                f"dp={c.dp} cannot split the batch of {batch} evenly over its replicas; use a batch that is a "
                f"multiple of {c.dp}, or dp in {{{_divisors(batch)}}}"
            )
        if m is not None and c.dp is not None and (batch // m) % c.dp:
            raise ConstraintError(
                f"microbatches={m} with dp={c.dp}: each microbatch of {batch // m} samples cannot be split evenly over "
                f"dp={c.dp}; the batch must be a multiple of microbatches x dp = {m * c.dp}, or use fewer microbatches"
            )
    if not params:
        return
    fqn, shape = max(params.items(), key=lambda kv: max(kv[1], default=1))
    d = max(shape, default=1)
    b = batch or 1
    world = cluster.world_size
    pp = c.pp or 1
    if world <= b * d * pp:
        return
    most = b * d * pp
    per_node = cluster.devices_per_node
    if most >= per_node:
        fewer = (f"Cluster.preset({cluster.name!r}, nodes={most // per_node})" if cluster.name != "local"
                 else f"Cluster.local({most})")
        fewer = f"plan for at most {most:,} devices ({fewer})"
    else:
        fewer = f"plan for at most {most:,} devices"
    raise ClusterSpecError(
        f"a batch of {b:,} cannot keep {world:,} devices busy ({cluster.nodes:,} nodes x {per_node}): data parallel "
        f"splits the batch at most {b:,} ways (one sample per replica) and tensor parallel splits a parameter at most "
        f"{d:,} ways (the largest dim of any parameter: {fqn!r} of shape {tuple(shape)}), so at most {b:,} x {d:,} = "
        f"{most:,} devices get distinct work. Either {fewer}, or use a batch of at least {math.ceil(world / d):,}"
    )


def _check_pin_dims(traced: TracedGraph, params: dict, c: Constraints) -> None:
    """Every dim a pin shards exists in the tensors the pin matches."""
    import fnmatch

    from autopar.planner.constraint_filter import output_nodes_of

    def matches(name: str, pattern: str) -> bool:
        return name == pattern or fnmatch.fnmatchcase(name, pattern)

    def check(pattern: str, axes, what: str, name: str, shape) -> None:
        for axis, text in axes:
            p = parse_placement(text)
            if isinstance(p, Shard) and p.dim >= len(shape):
                dims = f"dims 0 to {len(shape) - 1}" if shape else "no dims: it is a scalar"
                choices = ", ".join(f"'S({i})'" for i in range(len(shape))) + (" or " if shape else "") + "'R'"
                raise ConstraintError(
                    f"{what} {pattern!r} shards dim {p.dim} on axis {axis!r}, but {name} has shape {tuple(shape)} "
                    f"({dims}); pin {choices}"
                )

    for pattern, axes in c.placements:
        for fqn, shape in params.items():
            if matches(fqn, pattern):
                check(pattern, axes, "placement pin", f"parameter {fqn!r}", shape)
    modules = sorted({n.meta.get("autopar.module", "") for n in traced.graph.nodes} - {""})
    for pattern, axes in c.outputs:
        if pattern == "":
            raise ConstraintError(
                "an output pin on the top-level model (annotate(model, output=...)) is not supported: its output "
                "goes to the loss. Pin the output of the submodule that produces it instead, e.g. "
                "annotate(model.head, output=...) for a last layer named head"
            )
        names = output_nodes_of(traced, pattern)
        if not names:
            raise ConstraintError(
                f"output pin for module {pattern!r} matches no module of the model that computes a value; "
                f"modules look like {modules[:4]}"
            )
        for name in sorted(names):
            meta = traced.node(name).meta["autopar.outputs"][0]
            if meta is not None:
                check(pattern, axes, "output pin", f"the output of module {pattern!r} (node {name!r})", meta.shape)


@contextlib.contextmanager
def cyclic_gc_paused():
    """Pause Python's cyclic garbage collector for the duration (reference counting still frees).

    Why: planning allocates millions of short-lived objects next to a large live object graph
    (the fx graph, fake tensors, strategy tables); each full collection rescans all of it. Paused,
    the GPT-3 175B plan takes about 20% and the Llama-3-8B plan about 40% less time, and the cyclic
    garbage made meanwhile (measured: peak RSS +1%) is collected by the next automatic pass.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _Progress:
    """Prints the candidate being solved when a solve runs longer than a second (or verbose)."""

    def __init__(self, verbose: bool):
        self.start = time.perf_counter()
        self.verbose = verbose
        self.shown = False

    def __call__(self, label: str) -> None:
        if self.verbose or time.perf_counter() - self.start > 1.0:
            print(f"autopar: solving {label} ...", file=sys.stderr, flush=True)
            self.shown = True

    def done(self) -> None:
        if self.shown:
            print(f"autopar: planned in {time.perf_counter() - self.start:.1f} s", file=sys.stderr, flush=True)
