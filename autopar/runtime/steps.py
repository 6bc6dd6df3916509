"""``StepRunner``, a part of ``ParallelModel``: the fused training step and the evaluation step
of one plan on this rank.

Invariants (the whole contract is in ``runtime.parallel_model``'s docstring):
* with ``plan.microbatches = m`` the batch runs as m slices whose gradients accumulate in the
  gradient buffers; the data-parallel reductions finish once, after the last slice's backward;
* after the last backward: the gradient reductions finish, the optimizer steps, ZeRO-1/2 pieces
  are gathered back into whole parameters, and the gradient buffers are zeroed;
* the step's loss is reduced once (``runtime.loss_value``) and returned as a 0-dim tensor, never
  read on the host;
* the phases (forward, backward, optimizer) are named to ``Measurer`` for ``measure_step``.

The runner reaches each part once per step or microbatch; per parameter it only reads the store's
dicts to feed the program (``args``).
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from autopar.errors import AutoparError
from autopar.layouts import Replicate, Shard
from autopar.runtime.collectives import active_mesh, shard_tensor
from autopar.runtime.prefetch import drain_gradient_reductions

if TYPE_CHECKING:
    from autopar.runtime.rank_program import RankProgram

__all__ = ["StepRunner"]


class StepRunner:
    """Runs the steps of one plan; holds no state of its own beyond its parts."""

    def __init__(self, *, plan, store, grad_sync, loss, measure, zero, comm, optimizer, pipeline, device: torch.device,
                 local: bool, train: "RankProgram | None", run):
        """``train``: ``train_step``'s program (None without ``optimizer=``); ``run(args, program=None)``:
        the model's program runner (``ParallelModel._run``), held through a ``weakref.WeakMethod``."""
        self.plan = plan
        self.store = store
        self.grad_sync = grad_sync
        self.loss = loss
        self.measure = measure
        self.zero = zero
        self.comm = comm
        self.optimizer = optimizer
        self.pipeline = pipeline
        self.device = device
        self.local = local
        self.train_program = train
        self._run = weakref.WeakMethod(run)

    def args(self, inputs: tuple, target: Any, prog: "RankProgram | None" = None, where: str = "train_step") -> list:
        """The program's arguments: this rank's parameters, buffers and shards of the batch."""
        prog = prog or self.train_program
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
                    if self.local and layout[0] == Shard(0):  # it arrives as this rank's rows on "dp"
                        layout = (Replicate(),) + tuple(layout[1:])
                    x = shard_tensor(x.to(self.device), layout, self.comm)
                args.append(x)
        return args

    def microbatches(self, inputs: tuple, target: Any) -> list[tuple[tuple, Any]]:
        m = self.plan.microbatches
        if m == 1:
            return [(inputs, target)]
        split = lambda t: t.chunk(m, dim=0) if isinstance(t, torch.Tensor) else [t] * m  # noqa: E731
        parts = [split(x) for x in inputs]
        targets = split(target) if target is not None else [None] * m
        return [(tuple(p[i] for p in parts), targets[i]) for i in range(m)]

    def train(self, inputs: tuple, target: Any) -> torch.Tensor:
        """One optimizer step on a checked batch; the global loss (a 0-dim tensor)."""
        self.store.grads.own()  # pm.optimizer.zero_grad() set .grad to None: the buffers' views again
        if self.pipeline is not None:
            return self._pipelined(inputs, target)
        run, loss_value, measure, sync = self._run(), self.loss, self.measure, self.grad_sync
        micro = self.microbatches(inputs, target)
        m = len(micro)
        weights = loss_value.microbatch_weights(micro, self.train_program)
        values, pending, riding = [], [], False
        with active_mesh(self.comm):
            for i, (x, t) in enumerate(micro):
                sync.arm(last_microbatch=i == m - 1)
                with measure.phase("forward"):
                    loss = run(self.args(x, t))
                    if isinstance(loss, (tuple, list)):
                        loss = loss[0]
                    values.append(loss.detach().reshape(1).float() * weights[i])
                    if i == m - 1:  # the step's values, summed here, reduced once (runtime.loss_value)
                        value, pending, riding = loss_value.reduce_riding(torch.cat(values).sum().reshape(1))
                with measure.phase("backward"):
                    (loss * (loss_value.grad_scale() * weights[i])).backward()
                del loss
            carried = []
            self.sync_and_step(lambda: carried.append(sync.carried()) if riding else None)
            for w in pending:
                w.wait()
            return loss_value.finish(carried[0] if riding else value)

    def sync_and_step(self, before_step=None) -> None:
        """After the step's last backward: finish the gradient reductions (then ``before_step``),
        step the optimizer, gather ZeRO-1/2 shards back into whole parameters, zero the gradient
        buffers."""
        with self.measure.phase("backward"):
            self.grad_sync.finish()
            drain_gradient_reductions(self.comm)
            if before_step is not None:
                before_step()
        with self.measure.phase("optimizer"):
            self.optimizer.step()
            self.store.gather_zero_params()
            self.zero.note()
        self.store.grads.zero()

    def _pipelined(self, inputs: tuple, target: Any) -> torch.Tensor:
        """``train`` of a pipeline plan: the schedule runs every microbatch's forward and backward
        (``runtime.pipeline``), then gradient sync over the stage's submesh and the optimizer step."""
        prog, pipeline = self.train_program, self.pipeline
        feed = dict(zip(prog.traced.input_names, inputs))
        if prog.traced.target_name is not None:
            feed[prog.traced.target_name] = target
        with active_mesh(self.comm):
            # a bucket is reduced once its gradients hold every microbatch (the rest after the schedule)
            self.grad_sync.hold(whole_zero2=pipeline.split_backward, rounds=self.plan.microbatches,
                                uses=pipeline.local_uses)
            with self.measure.phase("forward"):
                # the last stage's losses, each times its weight; empty on the other ranks
                losses = pipeline.step(feed, self.loss.microbatch_weights(self.microbatches(inputs, target), prog))
            self.sync_and_step(pipeline.sum_tied_grads)
            # the last stage's microbatch values, summed here and reduced once
            local = torch.cat([v.detach().reshape(1).float() for v in losses]).sum().reshape(1) if losses else None
            value, works = self.loss.reduce_async(local) if local is not None else (None, [])
            for w in works:
                w.wait()
            total = pipeline.broadcast_loss(self.loss.finish(value) if losses else torch.zeros(1))
        return total.reshape(())

    def evaluate(self, inputs: tuple, target: Any, prog: "RankProgram") -> float:
        """The global loss of ``prog`` (an evaluation program) on a checked batch."""
        run = self._run()
        micro = self.microbatches(inputs, target)
        weights = self.loss.microbatch_weights(micro, prog)
        total = 0.0
        with active_mesh(self.comm):
            for (x, t), weight in zip(micro, weights):
                loss = run(self.args(x, t, prog), prog.program)
                if isinstance(loss, (tuple, list)):
                    loss = loss[0]
                value, pending = self.loss.reduce_async(loss, prog.loss_layout)
                for w in pending:
                    w.wait()
                total += float(self.loss.finish(value, prog.loss_layout)) * float(weight)
        return total
