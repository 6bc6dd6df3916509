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

Planning, the programs and the steps are here; the other methods are mixins, one module per job:
``checkpoint_methods``, ``input_check_methods``, ``measure_methods``, ``native_loop_methods``.
"""
from __future__ import annotations

import atexit
import contextlib
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from autopar.errors import AutoparError
from autopar.ir import GRAD_SYNC_KEY, gather_param_start, reshard
from autopar.layouts import Replicate, Shard
from autopar.runtime.collectives import active_mesh, shard_tensor
from autopar.runtime.checkpoint import Checkpointer, Checkpointing, Resumed
from autopar.runtime.checkpoint_methods import CheckpointMethods
from autopar.runtime.collective_errors import collective_failures
from autopar.runtime.comm import CollectiveLog, MeshComm
from autopar.runtime.copyable_state import copyable_state_dict_hook
from autopar.runtime.expert_dispatch import expert_group_axes
from autopar.runtime.grad_sync import GradSync, backward_order
from autopar.runtime.dtensor_params import StateView, drop_registered, placeholder, register_stacked, register_tree, tied_keys
from autopar.runtime.pipeline import PipelineRunner, stage_state_names
from autopar.runtime.input_check_methods import InputCheckMethods
from autopar.runtime.loss_value_methods import LossValueMethods
from autopar.runtime.input_checks import (
    CHECK_INPUTS_MODES, FIRST_CHECKED_STEPS, Example, check_inputs_mode, refuse_uneven_inputs,
)
from autopar.runtime.measure_methods import MeasureMethods, StepMeasurement
from autopar.memory_tracker import MemoryTracker
from autopar.runtime.native_loop_methods import NativeLoopMethods
from autopar.runtime.param_store import ParamStore
from autopar.runtime.shard_init import initialise_deferred
from autopar.runtime.prefetch import drain_gradient_reductions
from autopar.runtime.rank_program import RankProgram
from autopar.trace import TensorMeta

__all__ = ["ParallelModel", "StepMeasurement", "CHECK_INPUTS_MODES", "FIRST_CHECKED_STEPS"]


class ParallelModel(CheckpointMethods, InputCheckMethods, LossValueMethods, MeasureMethods, NativeLoopMethods,
                    torch.nn.Module):
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
        self._calls = {"eval_step": 0, "forward": 0}  # train_step counts in ``step``
        self.collective_log = CollectiveLog()  # what this model's collectives serve; the last one (errors name it)
        self.plan = None
        self.step = 0
        self.optimizer = None
        self.lr_scheduler = None  # compile(lr_scheduler=...): stepped by train_step after each optimizer step
        self._programs: dict[str, RankProgram] = {}
        self._state: StateView | None = None
        self._pipeline: PipelineRunner | None = None  # pipeline plans: this rank's stage and schedule
        self._pp_group = None
        self._zero_versions: dict[str, int] = {}
        self._zero12_of, self._zero12 = None, False  # (store, whether any rank holds ZeRO-1/2 slots)
        self._backward_mesh = False  # the native loop's backward pass entered the plan's mesh
        self._backward_running = False  # a native-loop backward pass through this model has started
        self._optimizer_watch = None  # the native loop's check of the user's optimizers (a torch hook)
        self._checked_optimizers: "weakref.WeakSet" = weakref.WeakSet()
        self._tracker: MemoryTracker | None = None  # set by measure_step
        self._checkpointer = Checkpointer(self)
        self._checkpointing: Checkpointing | None = None  # compile(checkpoint=...): train_step saves
        self._monitor = None  # compile(monitor=...): a runtime.monitor.StepMonitor, records every train_step
        self._resume_from = None  # a checkpoint folder to load once the plan exists
        self._tracked: dict[str, Any] = {}  # name -> object with state_dict()/load_state_dict()
        self._pending_tracked: dict[str, Any] = {}  # loaded states of objects not tracked yet
        self._native_optimizer = None  # track(name, optimizer): the torch-native loop's optimizer
        self._pending_optimizer = None  # a loaded checkpoint's folder whose optimizer state awaits track()
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
        if self._fused:
            self.optimizer = b.optimizer(self.store.optimizer_params())
            self.lr_scheduler = b.lr_scheduler(self.optimizer) if b.lr_scheduler is not None else None
        self._note_optimizer(self.optimizer if self._fused else self._native_optimizer)
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
        self._pipeline = None
        if pipelined:
            self._pipeline = PipelineRunner(
                plan=plan, traced=traced, program=program, pp_rank=self._stage, pp_group=self._pp_group, store=self.store,
                comm=self.comm, device=self._device, run=weakref.WeakMethod(self._run), input_layouts=prog.input_layouts,
                loss_scale=self._loss_grad_scale(),  # times each microbatch's weight (PipelineRunner.step)
                stage_ranks=stage_ranks)
        self._note_zero_versions()
        b.attached(self)  # the user's module follows this tree; the original full tensors are released
        if self._resume_from is not None:
            folder, self._resume_from = self._resume_from, None
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
        parts = [self._stop_watching_optimizers]
        if self.plan is not None:
            parts += [self._leave_backward_mesh, self._grad_sync.close, self.comm.close]
            if self._pipeline is not None:
                parts.append(self._pipeline.close)
        parts.append(self._checkpointer.close)  # the save in flight completes (or its failure is raised)
        _LIVE.discard(self)
        _all_then_first_failure(parts)

    def __enter__(self) -> "ParallelModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ steps
    def _args(self, inputs: tuple, target: Any, prog: "RankProgram | None" = None, where: str = "train_step") -> list:
        prog = prog or self._train
        names = prog.traced.input_names
        if len(inputs) != len(names):
            raise AutoparError(f"{where} got {len(inputs)} inputs; the model was compiled with {len(names)}")
        feed = dict(zip(names, inputs))
        if prog.traced.target_name is not None:
            if target is None:
                raise AutoparError("train_step needs target= (the loss_fn's second argument)")
            feed[prog.traced.target_name] = target
        args = []
        slots, buffers = self.store.slots, self.store.buffers
        for ph in prog.placeholders:
            if ph in slots:
                args.append(slots[ph].local)
            elif ph in buffers:
                args.append(buffers[ph])
            else:
                x = feed[ph]
                if isinstance(x, torch.Tensor):
                    layout = prog.input_layouts[ph]
                    if self._local and layout[0] == Shard(0):  # it arrives as this rank's rows on "dp"
                        layout = (Replicate(),) + tuple(layout[1:])
                    x = shard_tensor(x.to(self._device), layout, self.comm)
                args.append(x)
        return args

    def _run(self, args, program: fx.GraphModule | None = None):
        from autopar.runtime.param_regather import regather_saved_params

        program = program if program is not None else self.program
        # saved-tensor hooks only where a parameter is gathered (ZeRO-3) and autograd records:
        # they cost a Python call per saved tensor
        regather = self._gathers_params and torch.is_grad_enabled()
        with regather_saved_params() if regather else contextlib.nullcontext():
            if self._policy.mixed:
                with torch.autocast(self._device.type, dtype=self._policy.torch_compute_dtype):
                    return program(*args)
            return program(*args)

    def _phase(self, name: str):
        return self._tracker.phase(name) if self._tracker is not None else contextlib.nullcontext()

    def _microbatches(self, inputs: tuple, target: Any) -> list[tuple[tuple, Any]]:
        m = self.plan.microbatches
        if m == 1:
            return [(inputs, target)]
        split = lambda t: t.chunk(m, dim=0) if isinstance(t, torch.Tensor) else [t] * m  # noqa: E731
        parts = [split(x) for x in inputs]
        targets = split(target) if target is not None else [None] * m
        return [(tuple(p[i] for p in parts), targets[i]) for i in range(m)]

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
            self._check_batch("train_step", inputs, target, self.step, self._train)
        return self._checked_train_step(inputs, target)

    def _checked_train_step(self, inputs: tuple, target: Any) -> torch.Tensor:
        """``train_step`` on a batch already checked."""
        cuda = self._device.type == "cuda" and self._monitor is not None
        if cuda:
            torch.cuda.reset_peak_memory_stats(self._device)
        before = self.comm.stats.totals() if self._monitor is not None else None
        # off CUDA the monitor measures every n-th step's memory under the storage tracker
        tracked = (not cuda and self._monitor is not None and self._tracker is None
                   and self._monitor.tracks_memory(self.step + 1))
        t0 = time.perf_counter()
        with collective_failures("train_step", self.collective_log), self._memory_tracked() if tracked else contextlib.nullcontext() as tracker:
            total = self._train_step(inputs, target)
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
                                 dict(memory.category_peaks) if tracked else None, self._predicted_comm_bytes())
        cfg = self._checkpointing
        if cfg is not None and cfg.every and self.step % cfg.every == 0:
            self.save(asynchronous=cfg.asynchronous)
        return total

    def _train_step(self, inputs: tuple, target: Any) -> torch.Tensor:
        self.store.own_grads()  # pm.optimizer.zero_grad() set .grad to None: the buffers' views again
        if self._pipeline is not None:
            return self._pipelined_train_step(inputs, target)
        micro = self._microbatches(inputs, target)
        m = len(micro)
        weights = self._microbatch_weights(micro, self._train)
        values, pending, riding = [], [], False
        with active_mesh(self.comm):
            for i, (x, t) in enumerate(micro):
                self._grad_sync.arm(last_microbatch=i == m - 1)
                with self._phase("forward"):
                    loss = self._run(self._args(x, t))
                    if isinstance(loss, (tuple, list)):
                        loss = loss[0]
                    values.append(loss.detach().reshape(1).float() * weights[i])
                    if i == m - 1:  # the step's values, summed here, reduced once (loss_value_methods)
                        value, pending, riding = self._reduce_loss_riding(torch.cat(values).sum().reshape(1))
                with self._phase("backward"):
                    (loss * (self._loss_grad_scale() * weights[i])).backward()
                del loss
            carried = []
            self._sync_and_step(lambda: carried.append(self._grad_sync.carried()) if riding else None)
            for w in pending:
                w.wait()
            return self._finish_loss(carried[0] if riding else value)

    def _sync_and_step(self, before_step=None) -> None:
        """After the step's last backward: finish the gradient reductions (then ``before_step``),
        step the optimizer, gather ZeRO-1/2 shards back into whole parameters, zero the gradient
        buffers."""
        with self._phase("backward"):
            self._grad_sync.finish()
            drain_gradient_reductions(self.comm)
            if before_step is not None:
                before_step()
        with self._phase("optimizer"):
            self.optimizer.step()
            self.store.gather_zero_params()
            self._note_zero_versions()
        self.store.zero_grads()

    def _pipelined_train_step(self, inputs: tuple, target: Any) -> torch.Tensor:
        """``train_step`` of a pipeline plan: the schedule runs every microbatch's forward and backward
        (``runtime.pipeline``), then gradient sync over the stage's submesh and the optimizer step."""
        feed = dict(zip(self._train.traced.input_names, inputs))
        if self._train.traced.target_name is not None:
            feed[self._train.traced.target_name] = target
        with active_mesh(self.comm):
            # a bucket is reduced once its gradients hold every microbatch (the rest after the schedule)
            self._grad_sync.hold(whole_zero2=self._pipeline.split_backward, rounds=self.plan.microbatches,
                                 uses=self._pipeline.local_uses)
            with self._phase("forward"):
                # the last stage's losses, each times its weight; empty on the other ranks
                losses = self._pipeline.step(feed, self._microbatch_weights(self._microbatches(inputs, target), self._train))
            self._sync_and_step(self._pipeline.sum_tied_grads)
            # the last stage's microbatch values, summed here and reduced once
            local = torch.cat([v.detach().reshape(1).float() for v in losses]).sum().reshape(1) if losses else None
            value, works = self._reduce_loss_async(local) if local is not None else (None, [])
            for w in works:
                w.wait()
            total = self._pipeline.broadcast_loss(self._finish_loss(value) if losses else torch.zeros(1))
        return total.reshape(())

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
            self._check_batch("eval_step", inputs, target, self._calls["eval_step"], prog)
            total = self._eval_step(inputs, target, prog)
        self._calls["eval_step"] += 1
        return total

    def _eval_step(self, inputs: tuple, target: Any, prog: "RankProgram") -> float:
        micro = self._microbatches(inputs, target)
        weights = self._microbatch_weights(micro, prog)
        total = 0.0
        with active_mesh(self.comm):
            for (x, t), weight in zip(micro, weights):
                loss = self._run(self._args(x, t, prog), prog.program)
                if isinstance(loss, (tuple, list)):
                    loss = loss[0]
                value, pending = self._reduce_loss_async(loss, prog.loss_layout)
                for w in pending:
                    w.wait()
                total += float(self._finish_loss(value, prog.loss_layout)) * float(weight)
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
