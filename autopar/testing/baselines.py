"""Hand-parallelised training steps that autopar is compared with, on the same processes.

Each constructor takes a plain model (already equal on every rank), wraps it the way a user of
that technique would, and returns a ``Setup``: one training step on the *global* batch (each
rank picks its part) that returns the global loss as a float on every rank, as autopar's
``train_step`` does, plus what can be measured about its communication.

* ``naive_dp``: "just add devices". Every rank holds the whole model, gradients and optimizer
  state; after backward every gradient is all-reduced one tensor at a time and averaged. No
  bucketing, no overlap with backward: the communication is all exposed, and timed exactly.
* ``ddp``: torch ``DistributedDataParallel`` (bucketed all-reduces overlapped with backward),
  ``gradient_as_bucket_view=True`` so that its gradient buckets are the ``.grad`` tensors (and
  are seen by the memory tracker; the default keeps a second, hidden copy). Its exposed
  communication is measured by difference: the same step under ``no_sync()``.
* ``fsdp2``: torch FSDP2 ``fully_shard`` on every block (each element of a ``ModuleList``; the
  leaf modules of a ``ModuleDict`` element, which has no forward) and on the root.
* ``tensor_parallel``: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``
  Megatron pairs, where the model's structure has a hand-written plan (``hand_tp_plan``).

``replicated_state_fit`` is the pre-check that refuses naive data parallelism (and DDP) when the
replicated parameters, gradients and optimizer state alone exceed a device's memory, from the
real parameter sizes and the real optimizer's state count. ``measure_setup_memory`` measures one
step's peak with the same ``MemoryTracker`` that ``ParallelModel.measure_step`` uses.
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from autopar.api import cyclic_gc_paused
from autopar.errors import AutoparError
from autopar.runtime.memory import MemoryReport, MemoryTracker

__all__ = ["Setup", "ReplicaFit", "eager_step", "naive_dp", "ddp", "fsdp2", "fsdp2_units", "hand_tp_plan",
           "tensor_parallel", "replicated_state_fit", "measure_setup_memory", "rank_rows",
           "make_replicas_equal"]

MIB = 2.0**20


@dataclass
class Setup:
    """One way of training the model on this rank.

    ``step()``: one optimizer step on the global batch, returning the global loss (every rank).
    ``comm_s()``: seconds this rank has been blocked in communication so far (None: not
    measurable for this setup; ``comm_note`` says why). ``without_comm``: the same step with its
    gradient communication switched off, timed beside it to measure the exposed communication by
    difference (DDP's ``no_sync``). ``persistent()``: the tensors kept across steps, by memory
    category, for ``measure_setup_memory`` (None: the setup measures itself, as autopar's
    ``measure_step`` does)."""

    name: str
    step: Callable[[], float]
    persistent: Callable[[], dict] | None = None
    comm_s: Callable[[], float] | None = None
    without_comm: Callable[[], float] | None = None
    comm_note: str = ""


@dataclass(frozen=True)
class ReplicaFit:
    """Whether a whole replica's training state fits one device: parameters, gradients (same
    dtype) and ``optimizer_states`` optimizer tensors per parameter, before any activation."""

    param_count: int
    param_bytes: int
    optimizer_states: int
    needed_bytes: int
    available_bytes: int

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.available_bytes

    def describe(self) -> str:
        verdict = "fits" if self.fits else "does not fit: refused"
        return (f"a whole replica needs {self.needed_bytes / MIB:,.1f} MiB per device for parameters, gradients and "
                f"optimizer state ({self.param_count:,} parameters, {self.param_bytes / MIB:,.1f} MiB x "
                f"(2 + {self.optimizer_states} optimizer states)), before any activation; the device has "
                f"{self.available_bytes / MIB:,.1f} MiB: {verdict}")


def replicated_state_fit(model: torch.nn.Module, make_optimizer: Callable[[list], Any],
                         memory_bytes: int) -> ReplicaFit:
    """The naive data-parallel pre-check: parameter bytes of ``model`` x (1 parameter + 1 gradient +
    the number of parameter-sized state tensors the optimizer built by ``make_optimizer`` keeps,
    measured on probe parameters) against ``memory_bytes``.

    >>> fit = replicated_state_fit(torch.nn.Linear(1024, 1024), lambda ps: torch.optim.AdamW(ps), 8 * 2**20)
    >>> fit.needed_bytes, fit.fits
    (16793600, False)
    """
    from autopar.cost_models.memory import describe_optimizer

    params = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    states = describe_optimizer(make_optimizer).states
    return ReplicaFit(count, nbytes, states, nbytes * (2 + states), int(memory_bytes))


def make_replicas_equal(model: torch.nn.Module) -> None:
    """Broadcast rank 0's parameters and buffers: replicas start equal whatever the ranks' seeds."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t, src=0)


def rank_rows(batch_tensors: tuple, rank: int, world: int) -> tuple:
    """This rank's equal share of dim 0 of every tensor (the data-parallel split of a global batch)."""
    out = []
    for t in batch_tensors:
        n = t.shape[0]
        if n % world:
            raise AutoparError(f"the global batch of {n} rows does not split evenly over {world} ranks; use a batch "
                               f"that is a multiple of {world}")
        out.append(t[rank * n // world:(rank + 1) * n // world])
    return tuple(out)


class _Blocked:
    """Seconds blocked in communication, summed."""

    def __init__(self):
        self.seconds = 0.0

    def wait(self, work) -> None:
        t0 = time.perf_counter()
        work.wait()
        self.seconds += time.perf_counter() - t0


def eager_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, inputs: tuple,
               target: Any, *, global_loss: bool, after_backward: Callable[[], None] | None = None,
               blocked: _Blocked | None = None, context: Callable[[], Any] | None = None) -> Callable[[], float]:
    """A torch training step doing what autopar's ``train_step`` does: zero the gradients, forward,
    loss, backward, (``after_backward``), optimizer step, and return the global loss as a float on
    every rank. ``global_loss``: each rank saw part of the batch, so the loss is averaged over the
    ranks by an all-reduce started before backward and waited for after the step (as autopar
    reduces it); ``blocked`` counts that wait. ``context``: entered around forward and backward
    (DDP's ``no_sync``)."""

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with context() if context is not None else contextlib.nullcontext():
            loss = loss_fn(model(*inputs), target)
            value = loss.detach().clone()
            work = dist.all_reduce(value, async_op=True) if global_loss else None
            loss.backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()
        if work is not None:
            if blocked is not None:
                blocked.wait(work)
            else:
                work.wait()
            value /= dist.get_world_size()
        return float(value)

    return step


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank's memory holds); a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _persistent(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], dict]:
    def tensors() -> dict:
        params = [_local(t) for t in list(model.parameters()) + list(model.buffers())]
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        state = [_local(v) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return {"params": params, "grads": grads, "optimizer_state": state}

    return tensors


def naive_dp(model: torch.nn.Module, make_optimizer: Callable, loss_fn: Callable, inputs: tuple, target: Any) -> Setup:
    """Replicate everything; after backward all-reduce every gradient, one tensor at a time, then
    average. ``inputs`` / ``target``: the global batch (this rank trains on its rows)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    (*xs, t) = rank_rows(tuple(inputs) + (target,), rank, world)
    opt = make_optimizer(list(model.parameters()))
    blocked = _Blocked()
    params = [p for p in model.parameters() if p.requires_grad]

    def all_reduce_grads() -> None:
        t0 = time.perf_counter()
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad)
        blocked.seconds += time.perf_counter() - t0
        for p in params:
            if p.grad is not None:
                p.grad.div_(world)

    step = eager_step(model, opt, loss_fn, tuple(xs), t, global_loss=True, after_backward=all_reduce_grads,
                      blocked=blocked)
    return Setup("naive data parallel", step, _persistent(model, opt), comm_s=lambda: blocked.seconds,
                 comm_note="timed: the gradient all-reduces and the loss all-reduce's wait")


def ddp(model: torch.nn.Module, make_optimizer: Callable, loss_fn: Callable, inputs: tuple, target: Any,
        bucket_view: bool = True) -> Setup:
    """torch ``DistributedDataParallel`` on this rank's rows; ``bucket_view``: its gradient buckets
    are the ``.grad`` tensors (``gradient_as_bucket_view``; False: DDP's default, a second copy
    that the memory tracker does not see, allocated inside DDP's C++ reducer)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    (*xs, t) = rank_rows(tuple(inputs) + (target,), rank, world)
    wrapped = DDP(model, gradient_as_bucket_view=bucket_view)
    opt = make_optimizer(list(wrapped.parameters()))
    step = eager_step(wrapped, opt, loss_fn, tuple(xs), t, global_loss=True)
    alone = eager_step(wrapped, opt, loss_fn, tuple(xs), t, global_loss=True, context=wrapped.no_sync)
    return Setup("torch DDP", step, _persistent(wrapped, opt), without_comm=alone,
                 comm_note="by difference: 1 - (step under no_sync()) / (step)")


def fsdp2_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP2 shards one by one: every element of every ``ModuleList`` (for an element
    without a forward, a ``ModuleDict``, its children with parameters). The root is sharded last."""
    units = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            for item in module:
                if isinstance(item, torch.nn.ModuleDict):
                    units += [m for m in item.values() if any(True for _ in m.parameters())]
                else:
                    units.append(item)
    return units


def fsdp2(model: torch.nn.Module, make_optimizer: Callable, loss_fn: Callable, inputs: tuple, target: Any,
          mesh=None) -> Setup:
    """torch FSDP2: ``fully_shard`` on every block (``fsdp2_units``) and the root, on this rank's rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    (*xs, t) = rank_rows(tuple(inputs) + (target,), rank, world)
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (world,))
    for unit in fsdp2_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_optimizer(list(model.parameters()))
    step = eager_step(model, opt, loss_fn, tuple(xs), t, global_loss=True)
    return Setup("torch FSDP2 fully_shard", step, _persistent(model, opt),
                 comm_note="not measured: FSDP2 issues and waits for its all-gathers and reduce-scatters inside its "
                           "own hooks, and its gathers cannot be switched off to measure by difference")


def hand_tp_plan(model: torch.nn.Module, tp: int) -> tuple[dict | None, str]:
    """A hand-written Megatron tensor-parallel plan for ``model`` over ``tp`` ranks, or (None, why not).

    Known: ``examples.mlp.MLP`` (each layer's ``up`` column-wise, ``down`` row-wise). The example
    GPT has none: its attention projects q, k and v with one fused Linear and splits the result
    into ``n_head`` heads of the global width, so ``ColwiseParallel`` on it would hand each rank a
    mix of q, k and v columns; hand tensor parallelism needs the attention written per rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    kind = type(model).__module__ + "." + type(model).__qualname__
    if kind == "examples.mlp.MLP":
        hidden = model.layers[0]["up"].out_features
        if hidden % tp:
            return None, f"the hidden width {hidden} does not split over {tp} ranks"
        plan = {}
        for i in range(len(model.layers)):
            plan[f"layers.{i}.up"] = ColwiseParallel()
            plan[f"layers.{i}.down"] = RowwiseParallel()
        return plan, ""
    if kind == "examples.gpt.GPT":
        return None, ("fused qkv Linear split into heads of the global width: ColwiseParallel would mix q/k/v "
                      "columns per rank; hand TP needs the attention rewritten per rank")
    return None, f"no hand-written tensor-parallel plan for {type(model).__name__}"


def tensor_parallel(model: torch.nn.Module, make_optimizer: Callable, loss_fn: Callable, inputs: tuple, target: Any,
                    plan: dict, mesh=None) -> Setup:
    """``parallelize_module(model, mesh, plan)`` over every rank; each rank runs the global batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = mesh if mesh is not None else init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model, mesh, plan)
    opt = make_optimizer(list(model.parameters()))
    step = eager_step(model, opt, loss_fn, tuple(inputs), target, global_loss=False)
    return Setup("torch parallelize_module (Megatron TP)", step, _persistent(model, opt),
                 comm_note="not measured: its collectives run inside DTensor's redistributions in every op")


def measure_setup_memory(setup: Setup) -> MemoryReport:
    """One ``setup.step()`` (it trains) under the memory tracker (``MemoryTracker``), the tensors kept
    across steps registered by category first, as ``ParallelModel.measure_step`` measures autopar."""
    tracker = MemoryTracker(count_unallocated=False)
    gc.collect()
    kept = setup.persistent()
    with cyclic_gc_paused():
        with tracker:
            for category, tensors in kept.items():
                tracker.register(tensors, category)
            del kept, tensors  # the tracker holds weak references only: the step may free them
            setup.step()
            tracker.register(setup.persistent()["optimizer_state"], "optimizer_state")
    return tracker.report()
