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
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from autopar.api import cyclic_gc_paused
from autopar.errors import AutoparError, InputMismatchError
from autopar.ir import GRAD_SYNC_KEY, LOSS_LAYOUT_KEY, gather_param_start, reshard
from autopar.layouts import Partial, chunk_range, parse_layout, replicated
from autopar.resharding import reshard_steps_for
from autopar.runtime.collectives import active_mesh, apply_steps, gather_dim, shard_tensor
from autopar.runtime.collective_errors import collective_failures
from autopar.runtime.comm import MeshComm
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.input_checks import (
    CHECK_INPUTS_MODES, FIRST_CHECKED_STEPS, check_inputs_mode, checksum, example_spec, mismatch, refuse_uneven_inputs,
)
from autopar.runtime.memory import MemoryReport, MemoryTracker
from autopar.runtime.param_store import ParamStore
from autopar.runtime.prefetch import drain_gradient_reductions
from autopar.trace import TensorMeta

__all__ = ["ParallelModel", "StepMeasurement", "CHECK_INPUTS_MODES", "FIRST_CHECKED_STEPS"]


@dataclass(frozen=True)
class _Program:
    """A per-rank program with what running it needs (training, or evaluation in eval mode)."""

    plan: Any
    traced: Any
    program: fx.GraphModule
    loss_reduction: str
    input_layouts: dict
    loss_layout: Any

    @property
    def placeholders(self) -> list[str]:
        return [n.name for n in self.program.graph.nodes if n.op == "placeholder"]

    @classmethod
    def of(cls, plan, traced, program: fx.GraphModule, loss_reduction: str) -> "_Program":
        """With the layouts the plan gives the inputs and target, and the loss's layout."""
        layouts = {n.name: n.outs[0] for n in plan.stages[0].nodes if n.outs and n.outs[0] != "-"}
        inputs = {name: parse_layout(layouts[name]) for name in traced.input_names + [traced.target_name] if name}
        loss = parse_layout(program.meta[LOSS_LAYOUT_KEY]) if LOSS_LAYOUT_KEY in program.meta else None
        return cls(plan, traced, program, loss_reduction, inputs, loss)


@dataclass(frozen=True)
class StepMeasurement:
    """One measured training step on this rank, beside the plan's prediction.

    ``comm_bytes`` / ``predicted_comm_bytes``: bytes per collective kind in the step (nccl-tests
    size convention, see ``runtime.comm``). ``memory``: measured bytes by category;
    ``predicted_memory``: the plan's figures for the same categories."""

    loss: float
    step_time_s: float
    predicted_step_time_s: float
    memory: MemoryReport
    predicted_peak_bytes: float
    predicted_memory: dict = field(default_factory=dict)
    comm_bytes: dict = field(default_factory=dict)
    predicted_comm_bytes: dict = field(default_factory=dict)

    def table(self) -> str:
        lines = [self.memory.table(self.predicted_memory, self.predicted_peak_bytes), ""]
        lines.append(f"{'collective':<16} {'measured B':>14} {'predicted B':>14}")
        for k in sorted(set(self.comm_bytes) | set(self.predicted_comm_bytes)):
            lines.append(f"{k:<16} {self.comm_bytes.get(k, 0):>14,} {int(self.predicted_comm_bytes.get(k, 0)):>14,}")
        lines.append(f"step time {self.step_time_s * 1e3:.2f} ms (predicted {self.predicted_step_time_s * 1e3:.2f} ms)")
        return "\n".join(lines)


class ParallelModel:
    """A model compiled for this rank. Build it with ``autopar.compile``."""

    def __init__(self, *, plan, traced, program: fx.GraphModule, device_mesh, model: torch.nn.Module,
                 optimizer: Callable, device: torch.device, precision: str, loss_reduction: str = "mean",
                 eval_program: Callable | None = None, example: tuple | None = None,
                 check_inputs: str | None = None):
        """``example``: (inputs, target) as compiled (tensors may be on the meta device), what every
        step's batch is checked against; ``check_inputs``: see the module docstring."""
        from autopar.cost_models.memory import precision_policy

        self._check_mode = check_inputs_mode(check_inputs)
        train = _Program.of(plan, traced, program, loss_reduction)
        # before any collective (every rank refuses alike): a batch share no rank can hold evenly
        refuse_uneven_inputs(plan, train)
        self._example = example_spec(traced, plan.microbatches, example)
        self._eval_calls = 0
        self.plan = plan
        self.program = program
        self.device_mesh = device_mesh
        self.comm = MeshComm.from_device_mesh(device_mesh)
        self.step = 0
        self._traced = traced
        self._device = device
        self._policy = precision_policy(precision)
        self._loss_reduction = loss_reduction  # how microbatch losses combine: "mean" or "sum"
        self._model_keys = list(model.state_dict().keys())
        self._gathers_params = any(
            n.target is gather_param_start or n.target is reshard and n.kwargs.get("param")
            for g in program.modules() if isinstance(g, fx.GraphModule) for n in g.graph.nodes if n.op == "call_function")
        self._shapes = {n.name: tuple(n.meta["autopar.outputs"][0].shape) for n in traced.graph.nodes
                        if n.op == "placeholder" and (n.meta.get("autopar.outputs") or (None,))[0] is not None}
        self._param_of_key = _tied_keys(model)
        deferred = program.meta.get(GRAD_SYNC_KEY, {})
        self.store = ParamStore(plan=plan, traced=traced, model=model, comm=self.comm, device=device,
                                order=_backward_order(program, deferred))
        self._layouts = dict(self.store.layouts)  # parameters and buffers as stored
        self._grad_sync = GradSync(self.store, deferred, self.comm,
                                   self._policy.torch_reduce_dtype if self._policy.mixed else None)
        self.optimizer = optimizer(self.store.optimizer_params())
        self._tracker: MemoryTracker | None = None
        self._eval_builder = eval_program
        self._eval: _Program | None = None
        self._train = train
        _LIVE.add(self)
        _EXIT_STATE["used"] = True

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Remove hooks and release process-group references (then destroy_process_group is safe).
        Models still open at interpreter exit are closed then (``_close_all``)."""
        self._grad_sync.close()
        self.comm.close()
        _LIVE.discard(self)

    def __enter__(self) -> "ParallelModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ steps
    def _args(self, inputs: tuple, target: Any, prog: "_Program | None" = None) -> list:
        prog = prog or self._train
        names = prog.traced.input_names
        if len(inputs) != len(names):
            raise AutoparError(f"train_step got {len(inputs)} inputs; the model was compiled with {len(names)}")
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
                    x = shard_tensor(x.to(self._device), prog.input_layouts[ph], self.comm)
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

    def train_step(self, *inputs: torch.Tensor, target: Any = None) -> float:
        """One optimizer step on the global batch ``inputs`` (identical on every rank).

        With ``plan.microbatches = m`` the batch runs as m slices whose gradients accumulate
        (data-parallel all-reduces happen once, after the last slice). Returns the global loss
        (the same value on every rank).

        The batch must match the compiled example (number of inputs, shapes, dtypes) or
        ``InputMismatchError`` is raised, as it is when the ranks hold different batches (compared
        on the first steps, see ``check_inputs``). Every rank must call ``train_step`` the same
        number of times: a rank whose peers do not join a collective gets ``CollectiveError``
        after the collective timeout (``collective_timeout_s``).
        """
        with collective_failures("train_step"):
            self._check_batch("train_step", inputs, target, self.step)
        return self._checked_train_step(inputs, target)

    def _checked_train_step(self, inputs: tuple, target: Any) -> float:
        """``train_step`` on a batch already checked."""
        with collective_failures("train_step"):
            total = self._train_step(inputs, target)
        self.step += 1
        return total

    def _train_step(self, inputs: tuple, target: Any) -> float:
        micro = self._microbatches(inputs, target)
        m = len(micro)
        weight = 1.0 / m if self._loss_reduction == "mean" else 1.0
        values, pending = [], []
        with active_mesh(self.comm):
            for i, (x, t) in enumerate(micro):
                self._grad_sync.arm(last_microbatch=i == m - 1)
                with self._phase("forward"):
                    loss = self._run(self._args(x, t))
                    if isinstance(loss, (tuple, list)):
                        loss = loss[0]
                    value, works = self._reduce_loss_async(loss)
                values.append(value)
                pending += works
                with self._phase("backward"):
                    (loss * (self._loss_grad_scale() * weight)).backward()
                del loss
            with self._phase("backward"):
                self._grad_sync.finish()
                drain_gradient_reductions(self.comm)
            with self._phase("optimizer"):
                self.optimizer.step()
                self._gather_zero_params()
            self.store.zero_grads()
            for w in pending:
                w.wait()
            return sum(float(self._finish_loss(v)) for v in values) * weight

    @torch.no_grad()
    def _gather_zero_params(self) -> None:
        """ZeRO-1/2: all-gather the updated ``Shard(state_dim)`` pieces back into the whole parameter."""
        for s in self.store.zero_slots():
            d = s.state_dim
            lengths = [s.local.shape[d]]  # the dim's length before each level of chunking
            for a in sorted(s.zero_axes)[:-1]:
                lengths.append(chunk_range(lengths[-1], self.comm.sizes[a], self.comm.coords[a])[1])
            x = s.opt.detach()
            for a, size in zip(reversed(sorted(s.zero_axes)), reversed(lengths)):
                x = gather_dim(x, d, self.comm, a, size if size % self.comm.sizes[a] else None)
            s.local.copy_(x)

    @torch.no_grad()
    def eval_step(self, *inputs: torch.Tensor, target: Any = None) -> float:
        """The global loss on ``inputs`` with the model in ``eval()`` mode (BatchNorm running
        statistics, no dropout), without gradients. Call it on every rank. The first call traces
        and plans the evaluation graph (parameters stay where training keeps them)."""
        with collective_failures("eval_step"):
            self._check_batch("eval_step", inputs, target, self._eval_calls)
            total = self._eval_step(inputs, target)
        self._eval_calls += 1
        return total

    def _eval_step(self, inputs: tuple, target: Any) -> float:
        if self._eval is None:
            if self._eval_builder is None:
                raise AutoparError("this ParallelModel was built without an evaluation program; use autopar.compile")
            prog = _Program.of(*self._eval_builder())
            refuse_uneven_inputs(prog.plan, prog)
            self._eval = prog
        prog = self._eval
        micro = self._microbatches(inputs, target)
        weight = 1.0 / len(micro) if prog.loss_reduction == "mean" else 1.0
        total = 0.0
        with active_mesh(self.comm):
            for x, t in micro:
                loss = self._run(self._args(x, t, prog), prog.program)
                if isinstance(loss, (tuple, list)):
                    loss = loss[0]
                value, pending = self._reduce_loss_async(loss, prog.loss_layout)
                for w in pending:
                    w.wait()
                total += float(self._finish_loss(value, prog.loss_layout))
        return total * weight

    # ------------------------------------------------------------------ batch checks
    def _batch_problem(self, where: str, inputs: tuple, target: Any) -> InputMismatchError | None:
        """What is wrong with this batch against the compiled example, or None."""
        ex = self._example
        if len(inputs) != len(ex.inputs):
            return InputMismatchError(
                f"{where} got {len(inputs)} inputs; the model was compiled with {len(ex.inputs)}: pass the inputs "
                "of the compiled example, in the same order")
        if ex.has_target and target is None:
            return InputMismatchError(f"{where} needs target= (the loss_fn's second argument)")
        pairs = [(f"input {i}", x, want) for i, (x, want) in enumerate(zip(inputs, ex.inputs))]
        if ex.has_target:
            pairs.append(("target", target, ex.target))
        for label, x, want in pairs:
            problem = mismatch(x, want)
            if problem is None:
                continue
            if isinstance(want, TensorMeta):
                fix = ("compile again with an example of this shape, or pad/drop the last batch (e.g. "
                       "DataLoader(drop_last=True)) so that every batch has the compiled shape")
            else:
                fix = "compile again with this value (a non-tensor input is a constant of the compiled program)"
            return InputMismatchError(
                f"{where}: {label} {problem}. The program was traced and planned for exactly the compiled example "
                f"(a model that branches on the batch size would silently keep the compiled branch): {fix}")
        return None

    def _check_batch(self, where: str, inputs: tuple, target: Any, step: int) -> None:
        """Raise if the batch does not match the compiled example; on the steps ``check_inputs``
        names, compare every input's checksum across the ranks (one small all-gather), so that a
        rank holding a different or mis-shaped batch is reported on every rank."""
        problem = self._batch_problem(where, inputs, target)
        due = self._check_mode == "always" or (self._check_mode == "first" and step < FIRST_CHECKED_STEPS)
        if due and dist.is_initialized() and dist.get_world_size() > 1:
            self._compare_across_ranks(where, inputs, target, problem, step)
        if problem is not None:
            raise problem

    def _compare_across_ranks(self, where: str, inputs: tuple, target: Any, problem, step: int) -> None:
        ex = self._example
        labels = [f"input {i}" for i in range(len(ex.inputs))] + (["target"] if ex.has_target else [])
        vec = [0] * (1 + 3 * len(labels))  # [local problem?, then per input: kind/shape/dtype, sum, weighted sum]
        if problem is not None:
            vec[0] = 1
        else:
            values = list(inputs) + ([target] if ex.has_target else [])
            for j, x in enumerate(values):
                vec[1 + 3 * j: 4 + 3 * j] = checksum(x)
        mine = torch.tensor(vec, dtype=torch.int64, device=self._device)  # NCCL gathers device tensors
        world = dist.get_world_size()
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine)  # the default group: every rank of the plan holds the same batch
        table = torch.stack(rows).cpu()
        if problem is not None:
            raise problem
        bad = [r for r in range(world) if int(table[r, 0]) != 0]
        if bad:
            raise InputMismatchError(
                f"{where} at step {step}: rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} got a batch that "
                "does not match the compiled example (its error names the input); every rank passes the same global "
                "batch, of the compiled shapes")
        for j, label in enumerate(labels):
            col = table[:, 1 + 3 * j: 4 + 3 * j]
            differ = [r for r in range(world) if not torch.equal(col[r], col[0])]
            if differ:
                raise InputMismatchError(
                    f"ranks hold different batches at step {step} (rank 0 vs rank {differ[0]} differ on {label}): in "
                    f"autopar every rank passes the same global batch to {where}, and the plan splits it over the "
                    "ranks; give every rank the same batches (the same data order and seed; no DistributedSampler "
                    "or per-rank sharding of the data)")

    # ------------------------------------------------------------------ measurement
    def measure_step(self, *inputs: torch.Tensor, target: Any = None) -> StepMeasurement:
        """Run one ``train_step`` (it trains) while measuring this rank's memory by category and
        the bytes of every collective, and return them beside the plan's prediction.

        Measure after at least one step: optimizers such as Adam create their state lazily in
        the first step, which would show up as step temporaries then."""
        with collective_failures("train_step"):  # outside the measurement: the check is not the step's
            self._check_batch("train_step", inputs, target, self.step)
        tracker = MemoryTracker()
        cuda = self._device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self._device)
            base = torch.cuda.memory_allocated(self._device)
        gc.collect()  # what earlier steps left to the cyclic collector is gone before we measure,
        with cyclic_gc_paused():  # and it cannot run mid-step: frees happen when references drop, every run alike
            with tracker:
                for category, tensors in self.store.persistent_tensors().items():
                    tracker.register(tensors, category)
                tracker.register(self._optimizer_state(), "optimizer_state")
                self.comm.stats.reset()
                self._tracker = tracker
                t0 = time.perf_counter()
                try:
                    loss = self._checked_train_step(inputs, target)
                finally:
                    self._tracker = None
                if cuda:
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
                tracker.register(self._optimizer_state(), "optimizer_state")
        device_peak = None
        if cuda:
            device_peak = int(torch.cuda.max_memory_allocated(self._device) - base + tracker.report().at_peak.get("params", 0))
        pred = self.plan.predicted
        return StepMeasurement(
            loss=loss, step_time_s=elapsed, predicted_step_time_s=pred.step_time_s,
            memory=tracker.report(device_peak), predicted_peak_bytes=pred.peak_memory_bytes,
            predicted_memory=dict(pred.memory_bytes), comm_bytes=self.comm.stats.snapshot(),
            predicted_comm_bytes=dict(pred.comm_bytes),
        )

    def measure_memory(self, *inputs: torch.Tensor, target: Any = None) -> MemoryReport:
        """``measure_step(...).memory``: this rank's memory during one training step, by category."""
        return self.measure_step(*inputs, target=target).memory

    def _optimizer_state(self) -> list[torch.Tensor]:
        return [v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]

    # ------------------------------------------------------------------ the loss value
    def _partial_axes(self, layout=None) -> list[tuple[int, str]]:
        layout = layout if layout is not None else self._train.loss_layout
        if layout is None:
            return []
        return [(a, p.reduce_op) for a, p in enumerate(layout) if isinstance(p, Partial) and self.comm.sizes[a] > 1]

    def _loss_grad_scale(self) -> float:
        """d(global loss)/d(local loss): 1/n for each axis the loss is averaged over."""
        scale = 1.0
        for a, op in self._partial_axes():
            if op == "avg":
                scale /= self.comm.sizes[a]
        return scale

    def _reduce_loss_async(self, loss: torch.Tensor, layout=None):
        value = loss.detach().clone().reshape(1).float()
        works = [self.comm.all_reduce(value, a, async_op=True) for a, _ in self._partial_axes(layout)[:1]]
        return value, [w for w in works if w is not None]

    def _finish_loss(self, value: torch.Tensor, layout=None) -> float:
        for a, _ in self._partial_axes(layout)[1:]:
            self.comm.all_reduce(value, a)
        for a, op in self._partial_axes(layout):
            if op == "avg":
                value = value / self.comm.sizes[a]
        return float(value)

    # ------------------------------------------------------------------ state
    def _local_state(self, ph: str) -> torch.Tensor:
        return self.store.slots[ph].local.detach() if ph in self.store.slots else self.store.buffers[ph]

    def state_dict(self) -> dict[str, Any]:
        """Sharded state (DTensors over the plan's mesh) under the user's ``model.state_dict()``
        keys, for torch.distributed.checkpoint."""
        by_name = {}
        for ph, fqn in list(self._traced.param_fqns.items()) + list(self._traced.buffer_fqns.items()):
            by_name[fqn] = self._dtensor(ph, self._local_state(ph))
        return {k: by_name[self._param_of_key.get(k, k)] for k in self._model_keys if self._param_of_key.get(k, k) in by_name}

    def _dtensor(self, ph: str, local: torch.Tensor):
        from torch.distributed.tensor import DTensor

        shape = self._shapes[ph]
        # uneven (ZeRO-3) shards need the global shape: DTensor cannot infer it from local sizes
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, self.device_mesh, list(self._layouts[ph]), run_check=False,
                                  shape=torch.Size(shape), stride=stride)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (gathered) copies under the user's ``model.state_dict()`` keys, on every rank."""
        full: dict[str, torch.Tensor] = {}
        ndim = len(self.comm.sizes)
        for ph, fqn in list(self._traced.param_fqns.items()) + list(self._traced.buffer_fqns.items()):
            shape = self._shapes[ph]
            steps = reshard_steps_for(shape, self._layouts[ph], replicated(ndim), self.comm.sizes)
            # a copy: for a replicated tensor no step runs, and the live parameter would be returned
            full[fqn] = apply_steps(self._local_state(ph), steps, self.comm, shape).to("cpu", copy=True)
        return {k: full[self._param_of_key.get(k, k)] for k in self._model_keys if self._param_of_key.get(k, k) in full}


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
    for pm in list(_LIVE):
        pm.close()
    if _EXIT_STATE["used"]:  # closed by the user or just now: its last collective may still be finishing
        time.sleep(_EXIT_PAUSE_S)


_EXIT_PAUSE_S = 0.05
_EXIT_STATE = {"used": False}  # set once any ParallelModel was built in this process


def _backward_order(program: fx.GraphModule, deferred: dict) -> list[str]:
    """Parameter placeholders in the order backward produces their gradients (reverse of first
    use), the data-parallel ones first so that their buckets are contiguous."""
    first_use: dict[str, int] = {}
    for i, n in enumerate(program.graph.nodes):
        for a in n.all_input_nodes:
            if a.op == "placeholder" and a.meta.get("autopar.kind") == "param":
                first_use.setdefault(a.name, i)
    params = [n.name for n in program.graph.nodes if n.op == "placeholder" and n.meta.get("autopar.kind") == "param"]
    order = sorted(params, key=lambda p: -first_use.get(p, -1))
    return [p for p in order if p in deferred] + [p for p in order if p not in deferred]


def _tied_keys(model: torch.nn.Module) -> dict[str, str]:
    """state_dict key -> the named_parameters/named_buffers name holding the same tensor."""
    canonical = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        canonical.setdefault(id(t), name)
    out = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        out[name] = canonical.get(id(t), name)
    return out
