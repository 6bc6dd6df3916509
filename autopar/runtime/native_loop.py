"""``ParallelModel``'s torch-native loop (``pm(x)``, ``loss.backward()``, the user's optimizer),
apart from the fused ``train_step``: the sharded forward, the hooks that start this rank's backward
at the first gradient reaching an output and finish the plan's gradient reductions at its end, and
ZeRO-1/2's gathering back of parameters the user's optimizer updated.

Invariants (the whole contract is in ``runtime.parallel_model``'s docstring): outputs are handed
over whole (global batches) or as this rank's rows (local batches), as the plan priced; cleared
gradients start from zero and kept ones accumulate, over any number of ``backward`` calls (a
graph kept with ``retain_graph=True`` runs the plan's reductions again each time); every
parameter's ``.grad`` DTensor is set once the backward pass ends; the backward pass runs under
the plan's mesh (recomputed blocks and expert exchanges communicate in it); a ZeRO-1/2 parameter
whose DTensor's version counter moved on some rank is gathered whole before the next forward.

Refused, naming the fix (every rank alike, before any collective): a backward with
``create_graph=True`` (the program's collectives and gradient buffers are first order), and a
step of an optimizer built before ``compile`` over the module's original parameters (which
``compile`` replaced with the plan's DTensors, ``runtime.in_place``: it would train nothing).
"""
from __future__ import annotations

import weakref

import torch
import torch.utils._pytree as pytree
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.errors import AutoparError
from autopar.runtime.agreement import any_rank
from autopar.runtime.collective_errors import collective_failures
from autopar.runtime.collectives import active_mesh, enter_mesh, leave_mesh
from autopar.runtime.comm import collective_site
from autopar.runtime.prefetch import drain_gradient_reductions

__all__ = ["NativeLoopMethods"]


class NativeLoopMethods:
    """Mixed into ``ParallelModel`` (which holds ``comm``, ``store``, ``training``, ``_builder``,
    ``_fused``, ``_local``, ``_calls``, ``_state``, ``_grad_sync``, ``_zero_versions``,
    ``_backward_mesh``, ``_optimizer_watch`` and ``_checked_optimizers``, and runs
    ``_ensure_planned``, ``_program_for``, ``_check_batch``, ``_args``, ``_run`` and
    ``ParamStore.gather_zero_params``)."""

    def forward(self, *args, **kwargs):
        """The sharded forward: returns what the model returns, each tensor whole on every rank (as
        one device would hold it), ready for the user's loss; ``loss.backward()`` then runs the
        plan's backward and gradient sync and sets every parameter's ``.grad`` (a DTensor).

        Every rank calls it with the same global batch; in ``eval()`` mode it runs the model's
        evaluation graph (planned at its first use), under ``torch.no_grad()`` without autograd."""
        inputs = self._builder.bind(args, kwargs)
        if self._fused and self.training and torch.is_grad_enabled():
            raise AutoparError(
                "this model was compiled with optimizer= for train_step (the loss inside the plan): train it with "
                "pm.train_step(...); pm(x) serves evaluation here (pm.eval() or torch.no_grad()). For your own training "
                "loop, compile without optimizer= and build the optimizer over pm.parameters()")
        self._ensure_planned(inputs, None)
        self._leave_backward_mesh()  # a backward pass that failed midway never left it
        kind = "forward" if self.training else "forward-eval"
        prog = self._program_for(kind, inputs, None)
        with collective_failures("forward", self.collective_log):
            self._checks.check("forward", inputs, None, prog)
            self._sync_zero_params()
            with active_mesh(self.comm):
                out = self._run(self._args(inputs, None, prog, where="forward"), prog.program)
        self._checks.counted("forward")
        leaves = list(out) if isinstance(out, (list, tuple)) else [out]
        if torch.is_grad_enabled():
            needs = [(t, rows) for t, rows in zip(leaves, prog.rows_mask) if isinstance(t, torch.Tensor) and t.requires_grad]
            if self._local:
                self._average_local_losses(needs)
            self._arm_backward([t for t, _ in needs])
        return pytree.tree_unflatten(leaves, prog.traced.out_spec) if prog.traced.out_spec is not None else out

    def _average_local_losses(self, outputs: list) -> None:
        """Local batches: each rank's loss is over its own rows, and training minimises their mean
        over the data shards (DDP's convention). So the gradient of this rank's rows is divided by
        the number of shards, and that of an output every rank holds whole (no batch dim) is
        averaged over the shards (it must be the same on every rank, as a replicated value's is)."""
        n = self.comm.sizes[0]
        if n == 1:
            return
        comm = self.comm

        def mean_over_shards(g):
            g = g.contiguous().clone()
            with collective_site(comm, "the mean over shards of an output's gradient"):
                comm.all_reduce(g, 0)
            return g / n

        for t, rows in outputs:
            t.register_hook((lambda g: g / n) if rows else mean_over_shards)

    def _arm_backward(self, outputs: list) -> None:
        """Hook the first gradient that reaches an output of this model in each backward pass: it
        starts this rank's backward through the program (``_begin_backward``) and queues its end
        (``_end_backward``). One start per backward pass and model, however many forwards feed it
        (``f(pm(x1)) + f(pm(x2))``: a second start mid-pass would drop the gradients already
        written); a graph kept with ``retain_graph=True`` starts again at its next backward, as one
        device accumulates again. A pass that raised never ran its end: the next forward outside
        a backward clears the mark."""
        from torch.autograd import Variable

        if self._backward_running and torch._C._current_graph_task_id() == -1:
            self._backward_running = False  # the last backward raised before its end ran
        me = weakref.ref(self)

        def end():
            pm = me()
            if pm is not None:
                pm._backward_running = False
                pm._end_backward()

        def start(grad):
            pm = me()
            if pm is not None and not pm._backward_running:
                if torch.is_grad_enabled():  # backward(create_graph=True) / autograd.grad(..., create_graph=True)
                    raise AutoparError(
                        "backward with create_graph=True (double backward: a gradient penalty, a Hessian-vector "
                        "product) is not supported on a compiled model: its collectives and gradient buffers are "
                        "first order, so second-order terms would be lost. Run backward without create_graph, or "
                        "compute the second-order term on a model that is not compiled")
                pm._begin_backward()
                pm._backward_running = True
                Variable._execution_engine.queue_callback(end)
            return grad

        for t in outputs:
            t.register_hook(start)

    def _begin_backward(self) -> None:
        self.store.own_grads()  # a .grad the user replaced is a buffer's view again
        cleared = set(self._state.user_grads_cleared())
        trainable = [ph for ph, s in self.store.slots.items() if s.trainable]
        sync = self._grad_sync
        if len(cleared) == len(trainable):
            sync.arm(last_microbatch=True)
            # the buckets' gradients are written by backward, not zeroed first (GradSync.start_empty)
            taken = sync.start_empty()
            for ph in trainable:
                if ph not in taken:
                    self.store.zero_grad_of(ph)
        else:
            for ph in cleared:
                self.store.zero_grad_of(ph)
            sync.prepare_accumulation()
            sync.arm(last_microbatch=True)
        # recomputed blocks and the expert exchanges' backward communicate over the plan's mesh
        self._leave_backward_mesh()
        enter_mesh(self.comm)
        self._backward_mesh = True

    def _leave_backward_mesh(self) -> None:
        if self._backward_mesh:
            self._backward_mesh = False
            leave_mesh(self.comm)

    def _end_backward(self) -> None:
        try:
            with collective_failures("backward", self.collective_log), active_mesh(self.comm):
                self._grad_sync.finish()
                drain_gradient_reductions(self.comm)
        finally:
            self._leave_backward_mesh()
        self._state.publish_grads()
        self._watch_user_optimizers()

    # ------------------------------------------------------------------ the user's optimizer
    def _watch_user_optimizers(self) -> None:
        """From the first backward on: every optimizer's first step is checked for the original
        module's parameters (``_check_user_optimizer``). torch's global step pre-hook, held
        through a weak reference; ``_stop_watching_optimizers`` (at ``close``) removes it."""
        if self._optimizer_watch is not None:
            return
        me = weakref.ref(self)

        def check(optimizer, _args, _kwargs):
            pm = me()
            if pm is not None:
                pm._check_user_optimizer(optimizer)

        self._optimizer_watch = register_optimizer_step_pre_hook(check)

    def _stop_watching_optimizers(self) -> None:
        if self._optimizer_watch is not None:
            self._optimizer_watch.remove()
            self._optimizer_watch = None

    def _check_user_optimizer(self, optimizer) -> None:
        """Refuse an optimizer over the user's original parameters (built before ``compile``, which
        replaced them in the module with the plan's DTensors): the compiled model trains those, so the originals never
        get a gradient and the step would silently train nothing. An optimizer whose original
        parameters do hold gradients (the module trained by itself, e.g. as a reference) is left be."""
        if optimizer in self._checked_optimizers:
            return
        originals = {id(p) for p in self._builder.original_params if p.requires_grad}
        held = [p for group in optimizer.param_groups for p in group["params"] if id(p) in originals]
        if held and all(p.grad is None for p in held):
            raise AutoparError(
                f"{type(optimizer).__name__}.step(): this optimizer holds {len(held)} parameter(s) of the original "
                f"{self._model_class} (an optimizer built before autopar.compile, which replaced them with the plan's "
                "DTensors), which the compiled model does not train: its backward sets the gradients of model.parameters() "
                "and pm.parameters() (DTensors), so this step would change nothing. Build the optimizer after compile: "
                "opt = torch.optim.AdamW(model.parameters(), ...) (or pm.parameters(): the same tensors)")
        self._checked_optimizers.add(optimizer)

    # ------------------------------------------------------------------ ZeRO-1/2 parameters
    def _zero_param_versions(self) -> dict[str, int]:
        # the DTensor's own counter: in-place ops reach its local tensor below autograd's
        # ADInplaceOrView key (inside DTensor's dispatch), which leaves the local counter unmoved
        return {s.ph: self._state.params[s.fqn]._version for s in self.store.zero_slots()}

    def _note_zero_versions(self) -> None:
        self._zero_versions = self._zero_param_versions()

    def _sync_zero_params(self) -> None:
        """ZeRO-1/2 in the native loop: the user's optimizer updated the ``Shard(state_dim)`` pieces
        (the DTensor parameters' version counters moved); gather them back into the whole parameters.
        Whether a counter moved is this rank's own state and the gather is a collective: every rank
        gathers where one rank's moved (``agreement.any_rank``)."""
        if self._zero12_of is not self.store:  # once per plan: whether ANY rank holds ZeRO-1/2 slots (pipeline
            # stages and expert groups hold different parameters, so a rank's own slots decide nothing alone)
            self._zero12_of, self._zero12 = self.store, any_rank(bool(self.store.zero_slots()))
        if not self._zero12:
            return
        if any_rank(self._zero_param_versions() != self._zero_versions):
            with active_mesh(self.comm):
                self.store.gather_zero_params()
            self._note_zero_versions()
