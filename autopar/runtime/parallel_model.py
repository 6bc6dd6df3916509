"""``ParallelModel``: the per-rank program of a plan, its parameters, and the training step.

Invariants:
* every rank holds exactly its local shard of each parameter (``ParamStore``), and after
  ``train_step``'s backward every gradient is reduced as the plan says: in the program's
  ``reshard`` edges (tensor parallel, ZeRO-3 reduce-scatter) or by ``GradSync`` (data-parallel
  all-reduce in bucket views, ZeRO-2 reduce-scatter);
* ZeRO-1/2 parameters stay whole for compute; the optimizer updates their ``Shard(state_dim)``
  view and the shards are all-gathered back after the step;
* the step runs in three named phases (forward, backward, optimizer), which ``measure_step``
  uses to report memory by category beside the plan's prediction;
* ``close()`` (or leaving a ``with`` block) removes every hook and drops every process group
  reference this object holds;
* every step checks its batch against the compiled example (number of inputs, each one's shape
  and dtype, non-tensor values): the program was traced and planned for exactly that batch;
* ``check_inputs`` ("first", the default: the first ``FIRST_CHECKED_STEPS`` steps; "always"; or
  "never"; ``AUTOPAR_DEBUG=1`` makes it "always") compares a checksum of every input across the
  ranks, which must all hold the same global batch;
* a collective that times out or loses a peer inside a step is raised as ``CollectiveError``
  saying that the ranks did not all run the step (instead of gloo's bare message).

The torch-native loop (``pm(x)``, ``loss.backward()``, the user's optimizer):
* the module's parameters and buffers are DTensors over the plan's mesh under the user's names,
  sharing storage with the store's shards (``runtime.dtensor_params``); placeholders until the
  plan exists, swapped in place when it is made;
* each ``pm(x)`` hands over outputs replicated (global batches) or as this rank's rows (local
  batches), as the plan priced; the first gradient reaching them starts this rank's backward
  (cleared gradients start from zero, kept ones accumulate), and the end of the backward pass
  finishes every planned reduction and sets each parameter's ``.grad`` DTensor;
* ZeRO-1/2 parameters the user's optimizer updated (their DTensor's version counter moved) are
  gathered back into whole parameters before the next forward (and before ``full_state_dict``).

Planning, the programs and the steps are here. The rest is done by parts, each a small object
that owns its state (``ARCHITECTURE.md``): ``ParamStore`` (shards), ``GradSync`` (reductions),
``LossValue`` (``runtime.loss_value``), ``BatchChecker`` (``runtime.batch_checks``),
``BackwardPass``, ``ZeroRegather`` and ``OptimizerWatch`` (``runtime.native_loop``), ``Measurer``
(``runtime.measure``), ``Checkpointer`` (``runtime.checkpoint``; the full state dicts:
``runtime.state_dicts``) and ``StepMonitor`` (``runtime.monitor``). The public methods delegate.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import time
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.errors import AutoparError, InputMismatchError
from autopar.ir import GRAD_SYNC_KEY, gather_param_start, reshard
from autopar.layouts import Shard
from autopar.runtime.collectives import active_mesh
from autopar.runtime.checkpoint import Checkpointer, Resumed
from autopar.runtime.checkpoint_files import step_dir
from autopar.runtime.collective_errors import collective_failures
from autopar.runtime.comm import CollectiveLog, MeshComm
from autopar.runtime.copyable_state import copyable_state_dict_hook
from autopar.runtime.expert_dispatch import expert_group_axes
from autopar.runtime.grad_sync import GradSync, backward_order
from autopar.runtime.dtensor_params import StateView, drop_registered, placeholder, register_stacked, register_tree, tied_keys
from autopar.runtime.pipeline import PipelineRunner, stage_state_names
from autopar.runtime.batch_checks import BatchChecker, missing_target
from autopar.runtime.loss_value import LossValue
from autopar.runtime.input_checks import (
    CHECK_INPUTS_MODES, FIRST_CHECKED_STEPS, Example, check_inputs_mode, refuse_uneven_inputs,
)
from autopar.runtime.measure import Measurer, StepMeasurement
from autopar.memory_tracker import MemoryReport
from autopar.runtime.native_loop import BackwardPass, OptimizerWatch, ZeroRegather
from autopar.runtime.param_store import ParamStore
from autopar.runtime.shard_init import initialise_deferred
from autopar.runtime.steps import StepRunner
from autopar.runtime.state_dicts import full_optimizer_state_dict, full_state_dict, shards_of_full
from autopar.runtime.rank_program import RankProgram
from autopar.trace import TensorMeta

__all__ = ["ParallelModel", "StepMeasurement", "CHECK_INPUTS_MODES", "FIRST_CHECKED_STEPS"]


class ParallelModel(torch.nn.Module):
    """A model compiled for this rank. Build it with ``autopar.compile``.

    Two ways to train it: ``train_step`` (compiled with ``optimizer=``: the loss inside the plan,
    fastest), or the torch-native loop: ``loss = loss_fn(pm(x), y); loss.backward();
    opt.step()`` with any optimizer over ``pm.parameters()`` (DTensors over the plan's mesh).
    Until the plan exists (made at the first call when compile got no example inputs) ``plan`` is
    None and the parameters are placeholders (``runtime.dtensor_params``)."""

    def __init__(self, *, model: torch.nn.Module, builder, check_inputs: str | None = None):
        """``builder``: what plans and builds programs for this model (``runtime.compile``)."""
        super().__init__()
        self._check_mode = check_inputs_mode(check_inputs)
        self._builder = builder
        self._fused = builder.optimizer is not None
        self._local = builder.local  # each rank passes its own shard of the batch
        self._model_class = type(model).__name__
        self.collective_log = CollectiveLog()  # what this model's collectives serve; the last one (errors name it)
        self.plan = None
        self.step = 0
        self.optimizer = None
        self.lr_scheduler = None  # compile(lr_scheduler=...): stepped by train_step after each optimizer step
        self._programs: dict[str, RankProgram] = {}
        self._state: StateView | None = None
        self._pipeline: PipelineRunner | None = None  # pipeline plans: this rank's stage and schedule
        self._pp_group = None
        self._watch = OptimizerWatch(originals=builder.original_params, model_class=self._model_class)
        self._checkpointer = Checkpointer(self)  # owns the checkpointing config and the tracked objects
        self._monitor = None  # compile(monitor=...): a runtime.monitor.StepMonitor, records every train_step
        self.resumed: Resumed | None = None  # what the last load restored
        mesh = builder.placeholder_mesh()
        self._tensors = register_tree(self, model, lambda name, t, is_param: (
            torch.nn.Parameter(placeholder(t, mesh), requires_grad=t.requires_grad) if is_param else placeholder(t, mesh)))
        self.register_state_dict_post_hook(copyable_state_dict_hook)  # deepcopy(pm.state_dict()) on every rank
        _LIVE.add(self)
        _EXIT_STATE["used"] = True

    def _attach(self, plan, traced, program: fx.GraphModule, loss_reduction: str, example: tuple | None) -> None:
        """Take the plan: build this rank's shards, the gradient sync and the DTensor parameters."""
        from autopar.cost_models.memory import precision_policy

        kind = "step" if self._fused else "forward"
        prog = RankProgram.of(plan, traced, program, loss_reduction, example)
        # before any collective (every rank refuses alike): a batch share no rank can hold evenly
        refuse_uneven_inputs(plan, prog)
        b = self._builder
        pipelined = len(plan.stages) > 1
        if pipelined and not self._fused:
            raise AutoparError(
                f"the plan pipelines the model over {len(plan.stages)} stages, which runs in train_step only for now: "
                "compile with optimizer= (a factory) and train with pm.train_step(...), or plan without pp")
        self.plan = plan
        self.device_mesh = b.mesh(plan)
        self._pp_group, self._stage = None, None
        stage_ranks = None
        if pipelined:  # this rank's stage submesh; the pipeline's own axis joins the stages
            names = self.device_mesh.mesh_dim_names
            stage_ranks = self.device_mesh.mesh.movedim(names.index("pp"), 0).reshape(
                self.device_mesh.mesh.shape[names.index("pp")], -1).tolist()
            self._pp_group = self.device_mesh.get_group("pp")
            self._stage = self.device_mesh.get_local_rank("pp")
            self.device_mesh = self.device_mesh[tuple(a for a, _ in plan.mesh_axes)]
        self.comm = MeshComm.from_device_mesh(self.device_mesh, self.collective_log, expert_group_axes(plan))
        self._traced = traced
        self._device = b.device
        self._policy = precision_policy(plan.precision)
        self._loss_reduction = loss_reduction  # how microbatch losses combine: "mean" or "sum"
        self._model_keys = list(b.model.state_dict().keys())
        self._shapes = {n.name: tuple(n.meta["autopar.outputs"][0].shape) for n in traced.graph.nodes
                        if n.op == "placeholder" and (n.meta.get("autopar.outputs") or (None,))[0] is not None}
        self._param_of_key = tied_keys(b.model)
        deferred = program.meta.get(GRAD_SYNC_KEY, {})
        self.store = ParamStore(plan=plan, traced=traced, model=b.source if b.source is not None else b.model, comm=self.comm, device=self._device,
                                order=backward_order(program, deferred),
                                only=stage_state_names(plan, traced, self._stage) if pipelined else None)
        self._layouts = dict(self.store.layouts)  # parameters and buffers as stored
        self._gathers_params = any(
            n.target is gather_param_start or n.target is reshard and n.kwargs.get("param")
            for g in program.modules() if isinstance(g, fx.GraphModule) for n in g.graph.nodes if n.op == "call_function")
        self._grad_sync = GradSync(self.store, deferred, self.comm,
                                   self._policy.torch_reduce_dtype if self._policy.mixed else None)
        self._loss = LossValue(comm=self.comm, grad_sync=self._grad_sync, plan=plan, device=self._device, local=self._local,
                               train_layout=prog.loss_layout if self._fused else None)
        if self._fused:
            self.optimizer = b.optimizer(self.store.optimizer_params())
            self.lr_scheduler = b.lr_scheduler(self.optimizer) if b.lr_scheduler is not None else None
        self._note_optimizer(self.optimizer if self._fused else self._checkpointer.native_optimizer)
        self._state = StateView(self.store, traced, self.device_mesh)
        initialise_deferred(self.store, traced, b.model, self.device_mesh, b.init)  # meta tensors, shard by shard
        for name, current in self._tensors.items():
            if self._state.holds(self._param_of_key.get(name, name)):
                self._state.swap_into(self._param_of_key.get(name, name), current)
            else:  # another pipeline stage's: not this rank's parameter (nor under a tied name)
                for alias in [name] + [k for k, v in self._param_of_key.items() if v == name]:
                    drop_registered(self, alias)
        if traced.stacked:  # experts the trace merged: the stacked DTensors take the per-expert ones' place
            register_stacked(self, self._tensors, self._param_of_key, self._state, traced.stacked)
        self._programs[kind] = prog
        self._checks = BatchChecker(mode=self._check_mode, local=self._local, device=self._device, comm=self.comm,
                                    plan=plan, data_split=self._data_split())
        self._pipeline = None
        if pipelined:
            self._pipeline = PipelineRunner(
                plan=plan, traced=traced, program=program, pp_rank=self._stage, pp_group=self._pp_group, store=self.store,
                comm=self.comm, device=self._device, run=weakref.WeakMethod(self._run), input_layouts=prog.input_layouts,
                loss_scale=self._loss.grad_scale(),  # times each microbatch's weight (PipelineRunner.step)
                stage_ranks=stage_ranks)
        user_model = b.model if isinstance(b.model, torch.nn.Module) and b.model is not self else None
        self._measure = Measurer(plan=plan, store=self.store, comm=self.comm, device=self._device, optimizer=self.optimizer,
                                 user_model=user_model, stages=self._pipeline.mine if pipelined else None)
        self._backward = BackwardPass(store=self.store, grad_sync=self._grad_sync, state=self._state, comm=self.comm,
                                      collective_log=self.collective_log, watch=self._watch)
        self._zero = ZeroRegather(store=self.store, state=self._state, comm=self.comm)
        self._steps = StepRunner(plan=plan, store=self.store, grad_sync=self._grad_sync, loss=self._loss, measure=self._measure,
                                 zero=self._zero, comm=self.comm, optimizer=self.optimizer, pipeline=self._pipeline,
                                 device=self._device, local=self._local, train=prog if self._fused else None, run=self._run)
        b.attached(self)  # the user's module follows this tree; the original full tensors are released
        if self._checkpointer.resume_from is not None:
            folder, self._checkpointer.resume_from = self._checkpointer.resume_from, None
            self.resumed = self._checkpointer.load(folder)

    def _apply(self, fn, recurse: bool = True):
        """``pm.to()``, ``.half()``, ``.cuda()``...: a no-op where nothing changes, else refused
        (``runtime.module_moves``: the program keeps reading the plan's shards as they are)."""
        from autopar.runtime.module_moves import apply_or_refuse

        return apply_or_refuse(self, fn, self._builder.device, "pm")

    @property
    def program(self) -> fx.GraphModule:
        """The program the plan was made for (``train_step``'s, or the forward of ``pm(x)``)."""
        self._require_plan("program")
        return self._primary.program

    @property
    def _primary(self) -> "RankProgram":
        return self._programs["step" if self._fused else "forward"]

    @property
    def _train(self) -> "RankProgram":  # the fused training step's program
        return self._programs["step"]

    def _require_plan(self, what: str) -> None:
        if self.plan is None:
            raise AutoparError(f"{what} needs the plan, which is made at the first call (pm(*inputs) or train_step); "
                               "call the model once, or compile with example_inputs= to plan ahead")

    def _require_target(self, where: str, inputs: tuple, target: Any) -> None:
        """Before anything is traced for a step with the compiled ``loss_fn``: its target is given
        (by keyword). Raised alike on every rank where every rank calls alike."""
        if target is None and self._builder.loss_fn is not None:
            raise InputMismatchError(missing_target(where, len(inputs), self._builder.model))

    def _ensure_planned(self, inputs: tuple, target: Any) -> None:
        """Plan from this call's batch if no plan exists yet (``autopar.compile`` without examples)."""
        if self.plan is not None:
            return
        with collective_failures("planning", self.collective_log):
            plan, traced, program, reduction = self._builder.primary(inputs, target)
        self._attach(plan, traced, program, reduction, None)

    def _program_for(self, kind: str, inputs: tuple, target: Any) -> "RankProgram":
        """The program of ``kind`` ("step", "step-eval", "forward", "forward-eval"), built at its first
        use with every parameter pinned where the plan stores it (the shards serve every program)."""
        prog = self._programs.get(kind)
        if prog is None and self._pipeline is not None:
            raise AutoparError(
                f"the plan pipelines the model over {len(self.plan.stages)} stages; only train_step runs it for now "
                "(no evaluation or forward-only program yet): evaluate with a plan without pp, or call the module "
                "autopar.compile sharded in place under torch.no_grad() (model(x) runs its own forward on every rank, "
                "each module's weights fetched from its stage)")
        if prog is None:
            # traced at the planned batch's shapes (the call's batch is then checked against them)
            inputs, target = _stand_ins(self._primary.example, inputs, target)
            with collective_failures("planning", self.collective_log):
                built = self._builder.pinned(self.plan, kind, inputs, target)
            prog = RankProgram.of(*built, None)
            refuse_uneven_inputs(prog.plan, prog)
            self._programs[kind] = prog
        return prog

    # ------------------------------------------------------------------ the batch split
    @property
    def data_parallel_size(self) -> int:
        """How many different batch shards the plan reads (ranks holding the same shard share it)."""
        self._require_plan("data_parallel_size")
        return self._data_split()[0]

    @property
    def data_parallel_rank(self) -> int:
        """Which batch shard this rank reads (0 .. data_parallel_size - 1)."""
        self._require_plan("data_parallel_rank")
        return self._data_split()[1]

    def _data_split(self) -> tuple[int, int]:
        """(size, rank) of the split of the inputs' batch dim over the mesh axes."""
        prog = self._primary
        axes = set()
        for name in prog.traced.input_names:
            lay = prog.input_layouts.get(name)
            if lay is not None:
                axes |= {a for a, p in enumerate(lay) if isinstance(p, Shard) and p.dim == 0 and self.comm.sizes[a] > 1}
        size, rank = 1, 0
        for a in sorted(axes):
            size, rank = size * self.comm.sizes[a], rank * self.comm.sizes[a] + self.comm.coords[a]
        return size, rank

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Remove hooks and release process-group references (then destroy_process_group is safe).
        Models still open at interpreter exit are closed then (``_close_all``)."""
        parts = [self._watch.close]
        if self.plan is not None:
            backward = self.__dict__.get("_backward")  # None where _attach raised before building it
            parts += ([backward.leave_mesh] if backward is not None else []) + [self._grad_sync.close, self.comm.close]
            if self._pipeline is not None:
                parts.append(self._pipeline.close)
        parts.append(self._checkpointer.close)  # the save in flight completes (or its failure is raised)
        _LIVE.discard(self)
        _all_then_first_failure(parts)

    def __enter__(self) -> "ParallelModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ checkpoints (runtime.checkpoint)
    def save(self, root: str | None = None, *, step: int | None = None, asynchronous: bool = False) -> str:
        """Save the training state (parameters, optimizer, step, RNG, tracked objects) into
        ``root/step-<step>`` on every rank (``runtime.checkpoint``); returns that folder. ``root``
        defaults to compile's ``Checkpointing.root``. Asynchronous: complete after ``wait_saved()``.
        ``step``: set ``pm.step`` first (the torch-native loop counts its own steps; train_step counts)."""
        self._require_plan("save")
        if step is not None:
            if not isinstance(step, int) or step < 0:
                raise AutoparError(f"save(step={step!r}): the step is an integer >= 0")
            self.step = step
        cfg = self._checkpointer.config
        root = root if root is not None else self._checkpoint_root("save")
        # ``keep`` prunes the run's own root only, never a folder given for one save
        keep = cfg.keep if cfg is not None and os.path.abspath(root) == os.path.abspath(cfg.root) else None
        with collective_failures("checkpoint", self.collective_log):
            return str(self._checkpointer.save(root, asynchronous=asynchronous, keep=keep))

    def wait_saved(self) -> None:
        """Wait for an asynchronous save in flight; raise ``CheckpointError`` if it failed."""
        self._checkpointer.wait()

    def load(self, folder: str) -> "Resumed":
        """Load the checkpoint ``folder`` (one ``step-<n>``), resharded into this plan."""
        self._require_plan("load")
        with collective_failures("checkpoint", self.collective_log):
            self.resumed = self._checkpointer.load(folder)
        return self.resumed

    def load_latest(self, root: str | None = None) -> int | None:
        """Load the newest complete checkpoint under ``root``; its step, or None when there is none."""
        self._require_plan("load_latest")
        root = root if root is not None else self._checkpoint_root("load_latest")
        self._checkpointer.wait()  # a save in flight is the newest once complete
        step = self._checkpointer.latest(root)
        if step is None:
            return None
        self.load(str(step_dir(root, step)))
        return step

    def track(self, name: str, obj: Any) -> Any:
        """Save ``obj.state_dict()`` with every checkpoint under ``name`` (an LR scheduler, a
        ``StatefulDataLoader``, anything with ``state_dict``/``load_state_dict``), and restore it at
        once if a checkpoint already loaded holds it. Returns ``obj``."""
        ckpt = self._checkpointer
        if isinstance(obj, torch.optim.Optimizer):
            if self._fused:
                raise AutoparError("train_step's optimizer (pm.optimizer) is saved already; track() takes the optimizer of "
                                   "the torch-native loop (over pm.parameters())")
            ckpt.native_optimizer = obj  # saved as DTensors (``checkpoint_state``), not as a pickled state
            self._note_optimizer(obj)
            if ckpt.pending_optimizer is not None:  # a load already ran, without this optimizer
                ckpt.load_optimizer(ckpt.pending_optimizer)
            return obj
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise AutoparError(f"track({name!r}, ...) needs an object with state_dict() and load_state_dict(), got a "
                               f"{type(obj).__name__}")
        ckpt.tracked[name] = obj
        ckpt.restore_tracked(name, obj)
        return obj

    def _note_optimizer(self, optimizer) -> None:
        """The plan's summary names the optimizer the loop steps; a warning says where the plan
        priced another (the torch-native loop's plan prices AdamW's state)."""
        if optimizer is None or self.plan is None:
            return
        from autopar.report import note_optimizer

        note = note_optimizer(self.plan, optimizer)
        if note:
            warnings.warn(note, stacklevel=3)

    def _checkpoint_root(self, what: str) -> str:
        if self._checkpointer.config is None:
            raise AutoparError(f"{what}() needs a folder: pass it, or compile with checkpoint=autopar.Checkpointing(root)")
        return self._checkpointer.config.root

    def _after_state_load(self) -> None:
        """Parameters were overwritten in place (their shards): ZeRO-1/2 gathers them whole again."""
        self._zero.gather()

    # ------------------------------------------------------------------ state dicts (runtime.state_dicts)
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``torch.nn.Module.load_state_dict`` taking DTensors (``pm.state_dict()``, as
        torch.distributed.checkpoint loads them) or plain full tensors (one device's
        ``model.state_dict()``, ``pm.full_state_dict()``): each rank copies its shard out of each
        full tensor, as DCP's ``set_model_state_dict(..., full_state_dict=True)`` does. Full
        entries of another pipeline stage's parameters are skipped, and per-expert ones of experts
        the plan stacks are stacked. ZeRO-1/2's whole copies are gathered again afterwards."""
        from torch.distributed.tensor import DTensor

        self._require_plan("load_state_dict")
        if assign:
            raise AutoparError("load_state_dict(assign=True) would put plain tensors where the plan keeps its DTensor "
                               "shards; load without assign (the values are copied into the shards)")
        if any(isinstance(v, torch.Tensor) and not isinstance(v, DTensor) for v in state_dict.values()):
            state_dict = shards_of_full(self, state_dict)
        with torch.no_grad():
            result = torch.nn.Module.load_state_dict(self, state_dict, strict=strict)
        self._after_state_load()
        return result

    def full_optimizer_state_dict(self) -> dict[str, torch.Tensor]:
        """train_step's optimizer state, gathered whole on every rank: ``"<fqn>/<state key>"`` ->
        tensor (what a checkpoint's ``optim/`` entries hold, as one device would)."""
        self._require_plan("full_optimizer_state_dict")
        if self.optimizer is None:
            raise AutoparError("full_optimizer_state_dict is train_step's optimizer state; compile with optimizer=")
        return full_optimizer_state_dict(self)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (gathered) copies under the user's ``model.state_dict()`` keys, on every rank.
        (``state_dict()``: the sharded DTensors, for torch.distributed.checkpoint.)"""
        self._require_plan("full_state_dict")
        self._zero.sync()
        return full_state_dict(self)

    # ------------------------------------------------------------------ steps
    def _run(self, args, program: fx.GraphModule | None = None):
        from autopar.runtime.param_regather import regather_saved_params

        program = program if program is not None else self.program
        if self._builder.compiled_programs is not None:  # compile=True (``runtime.compiled_program``)
            return self._builder.compiled_programs.run(self, program, args)
        # saved-tensor hooks only where a parameter is gathered (ZeRO-3) and autograd records:
        # they cost a Python call per saved tensor
        regather = self._gathers_params and torch.is_grad_enabled()
        with regather_saved_params() if regather else contextlib.nullcontext():
            if self._policy.mixed:
                with torch.autocast(self._device.type, dtype=self._policy.torch_compute_dtype):
                    return program(*args)
            return program(*args)


    def train_step(self, *inputs: torch.Tensor, target: Any = None, **kwargs) -> torch.Tensor:
        """One optimizer step on the global batch ``inputs`` (identical on every rank).

        With ``plan.microbatches = m`` the batch runs as m slices whose gradients accumulate
        (data-parallel all-reduces happen once, after the last slice). Returns the global loss
        (the same value on every rank) as a detached float32 0-dim tensor on the model's device:
        the step reads no value on the host (no ``.item()``, no device sync); ``float(loss)`` or
        ``loss.item()`` reads it when wanted (``check_inputs`` compares the ranks' batches on the
        host in the first steps only; ``monitor=`` reads every step's loss to record it).

        The batch must match the compiled example (number of inputs, shapes, dtypes) or
        ``InputMismatchError`` is raised, as it is when the ranks hold different batches (compared
        on the first steps, see ``check_inputs``). Every rank must call ``train_step`` the same
        number of times: a rank whose peers do not join a collective gets ``CollectiveError``
        after the collective timeout (``collective_timeout_s``).
        """
        inputs = self._builder.bind(inputs, kwargs)
        if not self._fused:
            raise AutoparError(
                "train_step needs the optimizer: compile with optimizer= (e.g. optimizer=lambda ps: "
                "torch.optim.AdamW(ps, lr=1e-3)); without it, train in your own loop: loss = loss_fn(pm(x), y); "
                "loss.backward(); opt.step() with opt = torch.optim.AdamW(pm.parameters(), ...)")
        self._ensure_planned(inputs, target)
        with collective_failures("train_step", self.collective_log):
            self._checks.check("train_step", inputs, target, self._train, self.step)
        return self._checked_train_step(inputs, target)

    def _checked_train_step(self, inputs: tuple, target: Any) -> torch.Tensor:
        """``train_step`` on a batch already checked."""
        cuda = self._device.type == "cuda" and self._monitor is not None
        if cuda:
            torch.cuda.reset_peak_memory_stats(self._device)
        before = self.comm.stats.totals() if self._monitor is not None else None
        # off CUDA the monitor measures every n-th step's memory under the storage tracker
        tracked = (not cuda and self._monitor is not None and self._measure.tracker is None
                   and self._monitor.tracks_memory(self.step + 1))
        t0 = time.perf_counter()
        with collective_failures("train_step", self.collective_log), self._measure.tracked() if tracked else contextlib.nullcontext() as tracker:
            total = self._steps.train(inputs, target)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.step += 1
        if self._monitor is not None:
            if cuda:
                torch.cuda.synchronize(self._device)
            wall = time.perf_counter() - t0
            memory = tracker.report() if tracked else None
            peak = int(torch.cuda.max_memory_allocated(self._device)) if cuda else memory.peak_bytes if tracked else None
            self._monitor.record(self.plan, dist.get_world_size() if dist.is_initialized() else 1, self.step,
                                 wall, float(total), inputs, peak, self.comm.stats.since(before),
                                 dict(memory.category_peaks) if tracked else None, self._measure.predicted_comm_bytes())
        cfg = self._checkpointer.config
        if cfg is not None and cfg.every and self.step % cfg.every == 0:
            self.save(asynchronous=cfg.asynchronous)
        return total

    def forward(self, *args, **kwargs):
        """The sharded forward: returns what the model returns, each tensor whole on every rank (as
        one device would hold it), ready for the user's loss; ``loss.backward()`` then runs the
        plan's backward and gradient sync and sets every parameter's ``.grad`` (a DTensor;
        ``runtime.native_loop``).

        Every rank calls it with the same global batch; in ``eval()`` mode it runs the model's
        evaluation graph (planned at its first use), under ``torch.no_grad()`` without autograd."""
        inputs = self._builder.bind(args, kwargs)
        if self._fused and self.training and torch.is_grad_enabled():
            raise AutoparError(
                "this model was compiled with optimizer= for train_step (the loss inside the plan): train it with "
                "pm.train_step(...); pm(x) serves evaluation here (pm.eval() or torch.no_grad()). For your own training "
                "loop, compile without optimizer= and build the optimizer over pm.parameters()")
        self._ensure_planned(inputs, None)
        self._backward.leave_mesh()  # a backward pass that failed midway never left it
        kind = "forward" if self.training else "forward-eval"
        prog = self._program_for(kind, inputs, None)
        with collective_failures("forward", self.collective_log):
            self._checks.check("forward", inputs, None, prog)
            self._zero.sync()
            with active_mesh(self.comm):
                out = self._run(self._steps.args(inputs, None, prog, where="forward"), prog.program)
        self._checks.counted("forward")
        leaves = list(out) if isinstance(out, (list, tuple)) else [out]
        if torch.is_grad_enabled():
            needs = [(t, rows) for t, rows in zip(leaves, prog.rows_mask) if isinstance(t, torch.Tensor) and t.requires_grad]
            if self._local:
                self._backward.average_local_losses(needs)
            self._backward.arm([t for t, _ in needs])
        return pytree.tree_unflatten(leaves, prog.traced.out_spec) if prog.traced.out_spec is not None else out

    def _sync_zero_params(self) -> None:
        """ZeRO-1/2 parameters the user's optimizer updated, gathered whole (``ZeroRegather.sync``)."""
        self._zero.sync()

    def measure_step(self, *inputs: torch.Tensor, target: Any = None) -> StepMeasurement:
        """Run one ``train_step`` (it trains) while measuring this rank's memory by category and
        the bytes of every collective, and return them beside the plan's prediction
        (``runtime.measure``).

        Measure after at least one step: optimizers such as Adam create their state lazily in
        the first step, which would show up as step temporaries then."""
        if not self._fused:
            raise AutoparError("measure_step measures train_step: compile with optimizer= to use it")
        self._ensure_planned(inputs, target)
        with collective_failures("train_step", self.collective_log):  # outside the measurement: the check is not the step's
            self._checks.check("train_step", inputs, target, self._train, self.step)
        return self._measure.step(lambda: self._checked_train_step(inputs, target), inputs, target)

    def measure_memory(self, *inputs: torch.Tensor, target: Any = None) -> MemoryReport:
        """``measure_step(...).memory``: this rank's memory during one training step, by category."""
        return self.measure_step(*inputs, target=target).memory

    @torch.no_grad()
    def eval_step(self, *inputs: torch.Tensor, target: Any = None, **kwargs) -> float:
        """The global loss on ``inputs`` with the model in ``eval()`` mode (BatchNorm running
        statistics, no dropout), without gradients. Call it on every rank. The first call traces
        and plans the evaluation graph (parameters stay where training keeps them)."""
        inputs = self._builder.bind(inputs, kwargs)
        if not self._fused:
            raise AutoparError("eval_step runs the compiled loss: compile with loss_fn= and optimizer= (train_step's "
                               "path), or evaluate in your own loop: pm.eval(); with torch.no_grad(): loss_fn(pm(x), y)")
        self._require_target("eval_step", inputs, target)
        self._ensure_planned(inputs, target)
        prog = self._program_for("step-eval", inputs, target)
        with collective_failures("eval_step", self.collective_log):
            self._checks.check("eval_step", inputs, target, prog)
            total = self._steps.evaluate(inputs, target, prog)
        self._checks.counted("eval_step")
        return total

_LIVE: "weakref.WeakSet[ParallelModel]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At interpreter exit, before finalization: close every open model, then release the GIL for
    a moment.

    Why the pause: a gloo worker thread that finishes the script's last collective (typically a
    final ``dist.barrier()``) releases the works it captured; releasing a tensor that has a Python
    object needs the GIL. If the main thread holds the GIL into finalization, that thread is made
    to exit while inside a C++ destructor and the process aborts ("terminate called without an
    active exception"; traced with a core dump: ``ProcessGroupGloo::runLoop`` ->
    ``~AsyncBarrierWork`` -> ``~AsyncAllgatherWork`` -> ``decref_pyobject`` ->
    ``gil_scoped_acquire`` -> ``pthread_exit``). About 1 run in 40 under CPU contention did; the
    pause lets the thread take the GIL and finish first."""
    try:
        _all_then_first_failure([pm.close for pm in list(_LIVE)])  # one model's failure does not skip the others
    finally:
        if _EXIT_STATE["used"]:  # closed by the user or just now: its last collective may still be finishing
            time.sleep(_EXIT_PAUSE_S)


def _all_then_first_failure(calls: list) -> None:
    """Call each of ``calls``, even after one raised; then raise the first failure (if any)."""
    first = None
    for call in calls:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - raised below, after the others ran
            first = first or exc
    if first is not None:
        raise first


_EXIT_PAUSE_S = 0.05
_EXIT_STATE = {"used": False}  # set once any ParallelModel was built in this process


def _stand_ins(ex: Example, inputs: tuple, target: Any) -> tuple[tuple, Any]:
    """Meta tensors (and constants) of the planned example, for tracing another program over the
    same shards; the call's own batch where the example does not say (or differs in arity)."""
    def one(spec, given):
        if isinstance(spec, TensorMeta):
            return torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        return spec.value if spec is not None else given

    if len(ex.inputs) != len(inputs):
        return inputs, target
    made = tuple(one(spec, x) for spec, x in zip(ex.inputs, inputs))
    return made, (one(ex.target, target) if ex.has_target and target is not None else target)
