"""``autopar.compile``: plan (or take a plan), rewrite the graph, and build this rank's program."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import os
import time
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from autopar.cluster import Cluster
from autopar.api import check_cluster_arg, check_fits_cluster, check_model_args, cyclic_gc_paused, trace_checked
from autopar.constraints import Constraints, with_annotations
from autopar.ir import is_local_batch, mark_local_batch
from autopar.loss_rewrite import LOSS_REDUCTION_KEY, token_count_program
from autopar.errors import AutoparError, ConstraintError, InputMismatchError, PlanFormatError, PlanMismatchError
from autopar.plan import Plan
from autopar.runtime.launch import device_mesh, init_distributed
from autopar.runtime.checkpoint import Checkpointing
from autopar.runtime.compiled_program import CompiledPrograms, check_compile_arg
from autopar.runtime.monitor import Monitoring, StepMonitor
from autopar.runtime.batch_checks import missing_target
from autopar.runtime.in_place import is_sharded_in_place, plain_state, shard_in_place
from autopar.runtime.parallel_model import ParallelModel
from autopar.runtime.shard_init import check_init_arg
from autopar.trace import model_class_name, trace_model

__all__ = ["compile"]


def compile(
    model: torch.nn.Module,
    cluster: Cluster,
    example_inputs: Any = None,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
    example_target: torch.Tensor | None = None,
    constraints: Constraints | None = None,
    plan: Plan | None = None,
    precision: str = "fp32",
    collective_timeout_s: float | None = None,
    check_inputs: str | None = None,
    batch: str = "global",
    checkpoint: Checkpointing | None = None,
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    monitor: Monitoring | None = None,
    init: Callable[[torch.nn.Module], Any] | str | None = None,
    compile: bool | str = False,
) -> ParallelModel:
    """Compile ``model`` into this rank's sharded program. Call it in every process.

    ``autopar.compile(model, cluster)`` is enough: it returns at once and plans at the first call
    from that batch's shapes (on rank 0, broadcast to all), as ``torch.compile`` compiles on
    first call. Train it in the torch-native loop: ``loss = loss_fn(pm(x), y); loss.backward();
    opt.step()``, with ``opt`` any ``torch.optim`` optimizer over ``pm.parameters()`` (DTensors;
    the plan prices AdamW's state for it). ``example_inputs`` (the model's positional inputs)
    plans here instead.

    The model is sharded in place (``runtime.in_place``, FSDP2's convention): from here on
    ``model`` holds ``pm``'s tensors (the plan's DTensors once it exists; no full copy is kept),
    so ``model.parameters()``, ``model.state_dict()`` and ``model(x)`` (the sharded program; under
    ``no_grad`` a batch of other shapes runs the model's own forward eagerly, every rank together,
    e.g. ``model.generate(...)``) work as on ``pm``; ``autopar.export_module(model)`` gives a plain
    one-device copy. A model can be compiled once.

    ``optimizer=`` (a factory: parameter list -> optimizer) selects the fused path,
    ``pm.train_step(*inputs, target=...)``, with the loss inside the plan: ``loss_fn(output,
    target)``, or with no ``loss_fn`` the loss the model returns itself (a scalar, or ``.loss``:
    Hugging Face's ``labels=``); ``example_target`` is loss_fn's target for planning ahead.

    The process group is initialised here if needed (gloo on CPU, NCCL on CUDA, from the cluster
    spec). ``collective_timeout_s``: how long a collective waits for the other ranks before the
    step fails (default ``$AUTOPAR_COLLECTIVE_TIMEOUT_S``, else 300 s; a group the user initialised
    keeps its own). ``check_inputs``: every call's batch must match the planned shapes and dtypes;
    the ranks also compare their batches (the same global batch; with local batches, the same rows
    within each data shard) on the first two calls ("first", the default), on every call
    ("always", also with ``AUTOPAR_DEBUG=1``) or never ("never").

    ``batch``: "global" (every rank passes the same global batch; the plan splits it) or "local"
    (each rank passes only its shard: ``pm.data_parallel_size`` shards, this rank's is number
    ``pm.data_parallel_rank``, ready for ``DistributedSampler(num_replicas=pm.data_parallel_size,
    rank=pm.data_parallel_rank)``). Local batches need ``example_inputs`` of the *global* batch (the
    plan decides how it is split) and are split over the mesh axis "dp" only; ``pm(x)`` then
    returns this rank's rows of every output with a batch dim, and ``loss.backward()`` averages
    the ranks' losses (as DDP does: with equal shards, the mean loss of the global batch).

    ``lr_scheduler=`` (a factory: optimizer -> scheduler, with ``optimizer=``): train_step steps it
    after each optimizer step (``pm.lr_scheduler``), and checkpoints save it.

    ``checkpoint=autopar.Checkpointing(root, every=N)``: train_step saves every N steps (in the
    background by default) and, with ``resume=True`` (the default), compile continues from the
    newest complete checkpoint under ``root``: ``pm.step`` is its step, and the parameters,
    optimizer state and RNG states are loaded (resharded if it was saved under another plan or
    world size) as soon as the plan exists: here with ``example_inputs``, else at the first call.
    Objects registered with ``pm.track(name, obj)`` (LR scheduler, data loader) are restored too.

    ``monitor=autopar.Monitoring(run_dir)``: every train_step's measured time, beside the plan's
    prediction, with tokens/s and MFU, is appended to ``run_dir/steps.jsonl`` (rank 0), and a run
    of steps far slower than predicted warns (``runtime.monitor``); ``autopar report run_dir``.

    A model built on ``torch.device("meta")`` is initialised where its shards live, by its own
    code, with no broadcast (``runtime.shard_init``): ``init=fn`` (``fn(model)`` initialises the
    model in place), else Hugging Face's ``_init_weights``, else ``model.init_weights()``
    (torchtitan's convention), else each module's ``reset_parameters()``. The values do not depend
    on the plan or the world size (each parameter's random ops are seeded from rank 0's
    ``torch.initial_seed()`` and its name). ``init="skip"`` leaves the parameters and persistent
    buffers uninitialised, for a loader that fills them (``autopar.load_weights``), and runs the
    same init for the buffers no state dict holds only (a rotary ``inv_freq``, ``freqs_cis``).
    ``init=fn`` with a model holding no meta tensor is refused.

    ``compile=True`` runs each per-rank program's forward and backward under ``torch.compile``
    (Inductor; or name the backend: "aot_eager", "eager"), the program's collectives as the IR's
    registered ops inside the graph (``runtime.compiled_program``); False (the default) runs it
    eagerly.

    >>> # in a torchrun script:
    >>> # pm = autopar.compile(model, autopar.Cluster.local())
    >>> # opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    >>> # loss = F.cross_entropy(pm(idx).flatten(0, 1), tgt.flatten()); loss.backward(); opt.step()
    """
    from autopar.cost_models.memory import describe_optimizer, optimizer_spec, precision_policy

    # every argument is checked before the process group starts (each rank checks the same inputs)
    check_cluster_arg(cluster)
    if is_sharded_in_place(model):
        raise AutoparError(
            f"this {model_class_name(model)} was compiled already (autopar.compile shards the model in place: its parameters "
            "are that plan's DTensors); keep using it, or compile a plain copy: autopar.compile(autopar.export_module(model), ...)")
    fused = optimizer is not None
    if isinstance(optimizer, str):
        raise ConstraintError(
            f"compile's optimizer= must be a factory, e.g. optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), not the "
            f"name {optimizer!r}: compile builds the optimizer over each rank's shards (names are for autopar.plan, which only prices them)"
        )
    if lr_scheduler is not None and (not fused or not callable(lr_scheduler)):
        raise AutoparError("lr_scheduler= is a factory (optimizer -> scheduler, e.g. lambda opt: "
                           "torch.optim.lr_scheduler.StepLR(opt, 100)) that train_step steps, so it needs optimizer= too"
                           if not fused else f"lr_scheduler= must be a factory (optimizer -> scheduler), got a "
                           f"{type(lr_scheduler).__name__}")
    if batch not in ("global", "local"):
        raise ConstraintError(f"batch must be 'global' (every rank passes the same global batch) or 'local' (each rank "
                              f"passes its own shard), got {batch!r}")
    if batch == "local" and example_inputs is None:
        raise AutoparError(
            "batch='local' needs a plan made ahead: pass example_inputs= with the shapes of the *global* batch (and "
            "example_target= for loss_fn); how the batch is split over the ranks (pm.data_parallel_size, "
            "pm.data_parallel_rank, for the DistributedSampler) is a decision of the plan")
    if not fused and (loss_fn is not None or example_target is not None):
        raise AutoparError(
            "loss_fn= and example_target= are for train_step, which also needs optimizer= (a factory); in the "
            "torch-native loop compute the loss on pm(x)'s output yourself: loss_fn(pm(x), y).backward()")
    if example_inputs is not None:
        check_model_args(model, example_inputs, loss_fn, example_target)
        if loss_fn is not None and example_target is None:
            raise AutoparError("compile got example_inputs and loss_fn but no example_target= (a target batch for "
                               "loss_fn) to trace the training step; pass it, or drop example_inputs to plan at the first call")
    else:
        check_model_args(model, (), loss_fn, None)
        if example_target is not None:
            raise AutoparError("example_target= without example_inputs=: pass both to plan ahead, or neither")
    _check_plan_args(plan, constraints, precision, collective_timeout_s, cluster)
    check_init_arg(init)
    backend = check_compile_arg(compile)
    if monitor is not None and not isinstance(monitor, Monitoring):
        raise AutoparError(f"monitor= takes autopar.Monitoring(run_dir), got a {type(monitor).__name__}")
    if not fused and constraints is not None and (constraints.microbatches or 1) > 1:
        raise ConstraintError(
            f"Constraints(microbatches={constraints.microbatches}) splits train_step's batch; in the torch-native loop "
            "accumulate gradients yourself (call backward on several batches before opt.step()), or compile with optimizer=")
    init_distributed(cluster.backend, cluster.world_size, collective_timeout_s)
    if cluster.device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    policy = precision_policy(plan.precision if plan is not None else precision)
    # what the plan prices is the optimizer that runs; the native loop's is built later: AdamW's
    # state (two tensors per parameter) is priced, what most training uses and the most SGD needs
    spec = describe_optimizer(optimizer, device.type) if fused else optimizer_spec("adamw")
    builder = _Builder(model=model, cluster=cluster, constraints=constraints, given_plan=plan, policy=policy,
                       spec=spec, device=device, loss_fn=loss_fn, optimizer=optimizer, local=batch == "local", lr_scheduler=lr_scheduler)
    builder.compiled_programs = CompiledPrograms(backend) if backend is not None else None
    builder.init = init  # meta models: how ``runtime.shard_init`` initialises the shards
    pm = ParallelModel(model=model, builder=builder, check_inputs=check_inputs)
    shard_in_place(model, pm, builder)  # model holds pm's tensors from here on (``runtime.in_place``)
    if checkpoint is not None:
        _set_up_checkpointing(pm, checkpoint)
    if monitor is not None:
        pm._monitor = StepMonitor(monitor, dist.get_rank() if dist.is_initialized() else 0)
    if example_inputs is not None:
        inputs = _as_tuple(example_inputs)
        built = builder.primary(inputs, example_target, agree=False)
        pm._attach(*built, (tuple(_meta_copy(x) for x in inputs), _meta_copy(example_target)))
    return pm


def _set_up_checkpointing(pm: ParallelModel, cfg: Checkpointing) -> None:
    """Remember where train_step saves; with ``resume``, the newest complete checkpoint to load
    (its step at once, its state when the plan exists); without, refuse a root already in use."""
    from autopar.runtime.checkpoint_files import CheckpointError, step_dir
    from autopar.runtime.writable import check_writable

    if not isinstance(cfg, Checkpointing):
        raise AutoparError(f"checkpoint= takes autopar.Checkpointing(root, every=...), got a {type(cfg).__name__}")
    pm._checkpointer.config = cfg
    check_writable(cfg.root, "checkpoint root", every_rank_writes=True, error=CheckpointError)  # before any work
    step = pm._checkpointer.latest(cfg.root)
    if step is None:
        return
    folder = step_dir(cfg.root, step)
    if not cfg.resume:
        raise AutoparError(f"{cfg.root} already holds checkpoints of a run (newest: {folder}); resume from it "
                           "(Checkpointing(resume=True)) or save into an empty root")
    pm._checkpointer.resume_from = str(folder)
    # the step, RNG and tracked states now (the batches drawn before the first step depend on
    # them); parameters and optimizer when the plan exists
    pm._checkpointer.restore_early(folder)


class _Builder:
    """What plans and builds the programs of one compiled model (``ParallelModel`` calls it at the
    first call, and for each further program: evaluation, the native forward next to train_step)."""

    def __init__(self, *, model, cluster: Cluster, constraints, given_plan, policy, spec, device, loss_fn, optimizer,
                 local: bool = False, lr_scheduler=None):
        self.local = local  # local batches: each rank passes its own shard (``ir.mark_local_batch``)
        self.model = model
        self.cluster = cluster
        self.constraints = constraints
        self.given_plan = given_plan
        self.policy = policy
        self.spec = spec
        self.device = device
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.autocast = policy.torch_compute_dtype if policy.mixed else None
        self.compiled_programs = None  # compile(compile=...): ``runtime.compiled_program.CompiledPrograms``
        self.init = None  # compile(init=...): a meta model's init (``runtime.shard_init``); "skip": buffers only
        self._signature = None
        # the model's original tensors: ``source`` (a shallow copy of its tree, ``runtime.in_place``)
        # holds them until the plan is attached, for the shards to be cut from; weakly remembered after
        self.source = None
        self.original_params = weakref.WeakSet(model.parameters())

    def attached(self, pm) -> None:
        """The plan is attached to ``pm``: the user's module follows its tree, ``source`` is released."""
        from autopar.runtime.in_place import attached

        attached(self.model, pm, self)

    def placeholder_mesh(self):
        return device_mesh(self.device.type, (dist.get_world_size(),), ("world",))

    def mesh(self, plan: Plan):
        axes = ((("pp", plan.pipeline_degree),) if len(plan.stages) > 1 else ()) + tuple(plan.mesh_axes)
        return device_mesh(self.device.type, tuple(s for _, s in axes), tuple(a for a, _ in axes))

    def _trace(self, inputs: tuple, target, with_loss: bool):
        own = with_loss and self.loss_fn is None
        traced = trace_checked(self.model, inputs, loss_fn=self.loss_fn if with_loss else None,
                               example_target=target if with_loss and self.loss_fn is not None else None,
                               device_type=self.cluster.device_type, autocast_dtype=self.autocast, own_loss=own,
                               to_user=not with_loss)
        if self.local:
            mark_local_batch(traced.graph, traced.global_batch)
        return traced

    def primary(self, inputs: tuple, target, agree: bool = True):
        """(plan, traced, program, loss reduction) of the program the plan is made for: train_step's
        (compiled with optimizer=) or the native forward's. ``agree``: first check that every rank
        holds a batch of the same shapes (planning at the first call plans from rank 0's)."""
        fused = self.optimizer is not None
        if fused and self.loss_fn is not None and target is None:
            raise InputMismatchError(missing_target("train_step", len(inputs), self.model))
        if agree:
            _agree_on_shapes(inputs, target)
        with plain_state(self.model), cyclic_gc_paused():  # as autopar.plan: tracing and search are GC-bound otherwise
            t0, c0 = time.perf_counter(), time.process_time()
            traced = self._trace(inputs, target, with_loss=fused)
            trace_s, trace_cpu_s = time.perf_counter() - t0, time.process_time() - c0
            plan = self.given_plan
            if plan is None:
                constraints = with_annotations(self.constraints or Constraints(), self.model)
                if not fused:
                    constraints = dataclasses.replace(constraints, microbatches=1)
                check_fits_cluster(traced, self.cluster, constraints)
                plan = _plan_on_rank0(traced, self.cluster, constraints, self.policy, self.spec)
                # this rank's phases, wall and CPU (``benchmarks/start_up.py``): planning's CPU is the
                # solve on rank 0, decoding rank 0's plan on the others
                plan.timings.update(trace_s=trace_s, plan_s=time.perf_counter() - t0, trace_cpu_s=trace_cpu_s,
                                    plan_cpu_s=time.process_time() - c0 - trace_cpu_s)
            else:
                check_plan_fits_model(plan, traced)
        _check_same_plan(plan)
        with plain_state(self.model), cyclic_gc_paused():  # the passes too: copying and rewriting the graph
            c1 = time.process_time()
            built = build_program(self.model, inputs, target, self.loss_fn, traced, plan, self.cluster.device_type,
                                  self.autocast, own_loss=fused and self.loss_fn is None)
            if self.given_plan is None:  # (a given plan is the user's object: left as it is)
                plan.timings["build_cpu_s"] = time.process_time() - c1
            return (plan,) + built

    def pinned(self, plan: Plan, kind: str, inputs: tuple, target):
        """(plan, traced, program, loss reduction) of another program over the same shards: the model
        traced in train or eval mode, with or without the loss ("step-eval", "forward",
        "forward-eval"), planned with every parameter pinned to the layout it is stored in."""
        from autopar.layouts import format_placement, parse_layout

        with_loss = kind.startswith("step")
        train = not kind.endswith("eval")
        was_training = self.model.training
        self.model.train(train)
        try:
            with plain_state(self.model), cyclic_gc_paused(), torch.no_grad() if not train else contextlib.nullcontext():
                traced = self._trace(inputs, target, with_loss)
        finally:
            self.model.train(was_training)
        sizes = dict(plan.mesh_axes)
        pins = {fqn: {axis: format_placement(p) for (axis, n), p in zip(plan.mesh_axes, parse_layout(pp.layout)) if n > 1}
                for fqn, pp in plan.params.items()}
        pins = {k: v for k, v in pins.items() if v}
        ep = sizes.get("ep")  # a ('dp', 'ep') mesh: data parallel over both axes (planner.meshes)
        shard = sizes.get("dp_shard")  # an HSDP ('dp', 'dp_shard') mesh: the same
        constraints = Constraints(dp=sizes.get("dp") * (ep or 1) * (shard or 1), tp=sizes.get("tp"), ep=ep, hsdp=shard,
                                  cp=sizes.get("cp"), microbatches=plan.microbatches if with_loss else 1,
                                  recompute=None if train else False, placements=pins)
        other = _plan_on_rank0(traced, self.cluster, constraints, self.policy, self.spec, baseline=False)
        with plain_state(self.model), cyclic_gc_paused():
            return (other,) + build_program(self.model, inputs, target, self.loss_fn if with_loss else None, traced, other,
                                            self.cluster.device_type, self.autocast, own_loss=with_loss and self.loss_fn is None)

    def bind(self, args: tuple, kwargs: dict) -> tuple:
        """The model's inputs as positional arguments: keyword arguments (``labels=``) go to their
        place in ``model.forward``'s signature, with the defaults of those skipped in between."""
        if not kwargs:
            return tuple(args)
        if self._signature is None:
            self._signature = inspect.signature(self.model.forward)
        params = list(self._signature.parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        names = [p.name for p in positional]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise AutoparError(
                f"{model_class_name(self.model)}.forward has no parameter {unknown[0]!r} that autopar can pass (it passes "
                f"inputs by position: {names[:8]}); pass the inputs positionally")
        last = max(names.index(k) for k in kwargs)
        if len(args) > last:
            raise AutoparError(f"{model_class_name(self.model)}.forward got {names[last]!r} both by position and by keyword")
        out = list(args)
        for p in positional[len(args): last + 1]:
            if p.name in kwargs:
                out.append(kwargs[p.name])
            elif p.default is not p.empty:
                out.append(p.default)
            else:
                raise AutoparError(f"{model_class_name(self.model)}.forward needs {p.name!r}: pass it")
        return tuple(out)


def _agree_on_shapes(inputs: tuple, target) -> None:
    """Planning at the first call plans from rank 0's batch: every rank must hold one of the same
    shapes and dtypes (the same global batch), or the ranks would run different programs."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return

    def spec(x):
        return (tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else ("value", repr(x)[:80])

    mine = [spec(x) for x in inputs] + ([spec(target)] if target is not None else [])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    differ = [r for r, e in enumerate(every) if e != every[0]]
    if differ:
        raise InputMismatchError(
            f"the ranks called the model with different batches at its first call (rank 0: {every[0]}, rank {differ[0]}: "
            f"{every[differ[0]]}); the plan is made from that call: every rank passes the same global batch")


def _check_plan_args(plan, constraints, precision, collective_timeout_s, cluster: Cluster) -> None:
    """What ``compile`` would otherwise ignore silently or fail on deep inside: a plan that is not a
    Plan, settings a given plan already fixes, a timeout that is not a duration."""
    from autopar.cost_models.memory import precision_policy

    if constraints is not None and not isinstance(constraints, Constraints):
        raise ConstraintError(f"constraints must be autopar.Constraints, got {type(constraints).__name__}")
    asked = precision_policy(precision)  # an unknown name is refused even when a plan is given
    t = collective_timeout_s
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0):
        raise ConstraintError(f"collective_timeout_s must be a positive number of seconds or None, got {t!r}")
    if plan is None:
        return
    if not isinstance(plan, Plan):
        hint = (" (that looks like a plan's JSON: pass autopar.Plan.from_json(text))" if isinstance(plan, str) else "")
        raise PlanFormatError(f"plan= must be an autopar.Plan, got {type(plan).__name__}{hint}")
    if plan.world_size != cluster.world_size:
        raise ConstraintError(f"the plan is for {plan.world_size} devices but the cluster has {cluster.world_size}; "
                              "re-plan for this cluster, or compile without plan= to plan here")
    if constraints is not None and not constraints.is_free():
        raise ConstraintError(
            f"compile got both plan= and constraints={constraints}; a plan already fixes every choice (it was made under "
            f"{plan.constraints}). Re-plan with autopar.plan(..., constraints=...), or pass only constraints= to plan here"
        )
    if precision != "fp32" and asked.name != plan.precision:
        raise ConstraintError(
            f"compile got precision={asked.name!r} but the plan was made for {plan.precision!r}; re-plan with "
            f"autopar.plan(..., precision={asked.name!r}), or drop precision= to train as planned"
        )


def check_plan_fits_model(plan: Plan, traced) -> None:
    """A given plan must describe this model: the same parameters with the same shapes, and a
    placement for every node of its training graph. Otherwise the passes would fail on the first
    missing name (or, worse, shard tensors by another model's shapes)."""
    have = {n.meta["autopar.fqn"]: tuple(n.meta["autopar.outputs"][0].shape)
            for n in traced.graph.nodes if n.meta.get("autopar.kind") == "param"}
    planned = {fqn: tuple(p.shape) for fqn, p in plan.params.items()}
    missing = [f for f in have if f not in planned]
    unexpected = [f for f in planned if f not in have]
    reshaped = [f"{f!r} is {have[f]} here but {planned[f]} in the plan" for f in have if f in planned and have[f] != planned[f]]
    nodes = plan.nodes
    unplanned = [n.name for n in traced.graph.nodes if n.op != "output" and n.name not in nodes]
    if not (missing or unexpected or reshaped or unplanned):
        return

    def some(names: list) -> str:
        return ", ".join(repr(x) for x in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    problems = []
    if missing:
        problems.append(f"{len(missing)} parameters of this model are not in the plan ({some(missing)})")
    if unexpected:
        problems.append(f"{len(unexpected)} planned parameters are not in this model ({some(unexpected)})")
    if reshaped:
        problems.append(f"{len(reshaped)} parameters changed shape ({'; '.join(reshaped[:3])})")
    if unplanned and not (missing or unexpected or reshaped):
        problems.append(f"its training graph has {len(unplanned)} steps the plan does not place ({some(unplanned)}): "
                        "the forward pass or the loss differs from the one planned")
    which = (f"a model of class {plan.model_class}, but this model is of class {traced.model_class}"
             if plan.model_class != traced.model_class else f"a different {plan.model_class}")
    raise PlanMismatchError(
        f"the plan was made for {which}: {'; '.join(problems)}. Re-plan for this model "
        "(autopar.plan(model, cluster, example_inputs, ...)), or compile without plan= to plan here"
    )


def build_program(model, inputs: tuple, target, loss_fn, traced, plan: Plan, device_type: str, autocast,
                  own_loss: bool = False):
    """This rank's program for ``plan``: (traced graph at the size the program runs, program, loss
    reduction over microbatches). With microbatches the model is traced again at one slice's size
    (same graph, same node names); the passes then apply the plan."""
    from autopar.passes import run_passes
    from autopar.passes.context import PassContext

    loss_reduction = "mean"
    traced_full = traced
    if plan.microbatches > 1:
        m = plan.microbatches
        loss_reduction = _loss_reduction(traced)
        weighed = token_count_program(traced.gm) is not None
        if any(n.meta.get(LOSS_REDUCTION_KEY) for n in traced.graph.nodes) and not weighed:
            # the runtime weighs each microbatch's mean by its share of the count where it can
            # compute the count per microbatch (``RankProgram.token_count``; local batches: summed over 'dp')
            warnings.warn(
                f"the loss is a mean over the targets not ignored (ignore_index) beside other terms; with "
                f"microbatches={m} each microbatch's mean is weighted 1/{m}, which is one device's loss only where every microbatch holds "
                "as many counted targets (a batch whose ignored targets or padding fall unevenly trains on a slightly "
                "different loss); use microbatches=1, or a sum loss divided by a fixed count", stacklevel=3)
        for x in list(inputs) + ([target] if target is not None else []):
            if isinstance(x, torch.Tensor) and x.shape[0] % m:
                raise ConstraintError(f"microbatches={m} does not divide the batch dim of an input of shape {tuple(x.shape)}")
        traced = trace_model(model, tuple(x[: x.shape[0] // m] if isinstance(x, torch.Tensor) else x for x in inputs),
                             loss_fn=loss_fn, example_target=target[: target.shape[0] // m] if target is not None else None,
                             device_type=device_type, autocast_dtype=autocast, own_loss=own_loss,
                             to_user=loss_fn is None and not own_loss)
        if is_local_batch(traced_full.graph):
            mark_local_batch(traced.graph, traced.global_batch)
    program = run_passes(copy.deepcopy(traced.gm), PassContext.for_plan(plan))
    return traced, program, loss_reduction


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _meta_copy(x):
    """A shape-and-dtype stand-in for an example input (tracing needs no values)."""
    return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x


def _plan_on_rank0(traced, cluster: Cluster, constraints: Constraints, policy, spec, baseline: bool = True) -> Plan:
    """Plan on rank 0 only and broadcast the plan: solvers stopped by a time limit need not agree,
    and every rank must run the same plan. A planning error on rank 0 is raised on every rank
    (the same autopar error; any other failure as a RuntimeError naming it), never a hang."""
    from autopar.planner.search import search_plan

    outcome: list = [None]
    failure = None
    if dist.get_rank() == 0:
        try:
            made = search_plan(traced, cluster, constraints=constraints, precision=policy, optimizer=spec,
                               _with_free=False, _with_baseline=baseline)
            outcome[0] = ("plan", made.to_json(), dict(made.timings))  # rank 0's planning phases, for every rank
        except Exception as exc:  # noqa: BLE001 - every rank must learn that planning failed
            failure = exc
            outcome[0] = ("error", type(exc).__name__ if isinstance(exc, AutoparError) else "", str(exc))
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0][0] == "error":
        if failure is not None:
            raise failure
        import autopar.errors as errors

        kind = getattr(errors, outcome[0][1], None) if outcome[0][1] else None
        if kind is None:
            raise RuntimeError(f"planning failed on rank 0: {outcome[0][2]}")
        raise kind(outcome[0][2])
    plan = Plan.from_json(outcome[0][1])
    plan.timings.update(outcome[0][2])
    return plan


_MEAN_REDUCTIONS = frozenset({"mean"})
_SUM_REDUCTIONS = frozenset({"sum"})
_LOSS_OPS = frozenset({"cross_entropy_loss", "nll_loss_nd", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss",
                       "binary_cross_entropy_with_logits", "huber_loss"})


def _loss_reduction(traced) -> str:
    """How the loss reduces over the batch ("mean" or "sum"), from the reductions feeding the
    output; microbatch losses combine the same way. Anything else is refused, not guessed."""
    from autopar.node_view import OpView, op_name
    from autopar.trace import tensor_inputs

    out = next(n for n in traced.graph.nodes if n.op == "output")
    kinds, stack, seen = set(), list(tensor_inputs(out)), set()
    while stack:
        n = stack.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        name = op_name(n)
        if n.meta.get(LOSS_REDUCTION_KEY):  # a loss rewritten as sum / count (``loss_rewrite``)
            kinds.add(n.meta[LOSS_REDUCTION_KEY])
        elif name in _LOSS_OPS:
            red = OpView(n).arg("reduction", 1)
            kinds.add({1: "mean", 2: "sum"}.get(red, "none"))
        elif name in _MEAN_REDUCTIONS or name in _SUM_REDUCTIONS:
            kinds.add("mean" if name in _MEAN_REDUCTIONS else "sum")
        else:
            stack.extend(tensor_inputs(n))
    if len(kinds) != 1 or kinds == {"none"}:
        raise AutoparError(
            f"cannot tell how the loss reduces over the batch (found {sorted(kinds) or 'no reduction'}); "
            "microbatches (gradient accumulation, pipelines) need a loss that is one mean or one sum over the "
            "samples, or splitting the batch changes its value (e.g. a mixture-of-experts auxiliary loss over the "
            "whole batch beside a mean cross-entropy): use Constraints(microbatches=1) without pp"
        )
    return kinds.pop()


def _check_same_plan(plan: Plan) -> None:
    """All ranks must run the same plan, and the same torch, autopar and Python versions: compare
    them. The fingerprint covers the plan's decisions (``autopar.plan``), so a plan changed or
    edited on one rank is refused here with a clear error on every rank, instead of deadlocking
    in the first step's collectives."""
    from autopar.runtime.launch import software_versions

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (plan.fingerprint, software_versions()))
    versions = [v for _, v in every]
    if any(v != versions[0] for v in versions):
        differ = [f"rank {r}: " + ", ".join(f"{k} {v[k]}" for k in v if v[k] != versions[0].get(k))
                  for r, v in enumerate(versions) if v != versions[0]]
        raise AutoparError(
            "ranks run different software: rank 0 has " + ", ".join(f"{k} {v}" for k, v in versions[0].items())
            + " but " + "; ".join(differ[:4]) + (f" and {len(differ) - 4} more ranks" if len(differ) > 4 else "")
            + "; install the same torch, autopar and Python on every node (collectives and plans differ between versions)")
    prints = [p for p, _ in every]
    if len(set(prints)) != 1:
        others = [f"{p} on rank {r}" for r, p in enumerate(prints) if p != prints[0]]
        shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more ranks" if len(others) > 4 else "")
        raise AutoparError(
            f"ranks planned differently: plan fingerprint {prints[0]} on rank 0 but {shown}; every rank must run "
            "the same plan: pass the same plan= to every rank (one Plan.from_json file, unchanged), or no plan= "
            "(rank 0 plans for all)"
        )
