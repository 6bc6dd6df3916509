"""The parts of ``ParallelModel`` that serve the torch-native loop (``pm(x)``, ``loss.backward()``,
the user's optimizer): ``BackwardPass`` (the hooks that start this rank's backward at the first
gradient reaching an output and finish the plan's gradient reductions at its end),
``ZeroRegather`` (ZeRO-1/2's gathering back of parameters the user's optimizer updated) and
``OptimizerWatch`` (the check of the user's optimizers). The sharded forward is
``ParallelModel.forward``.

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
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.errors import AutoparError
from autopar.runtime.agreement import any_rank
from autopar.runtime.collective_errors import collective_failures
from autopar.runtime.collectives import active_mesh, enter_mesh, leave_mesh
from autopar.runtime.comm import collective_site
from autopar.runtime.prefetch import drain_gradient_reductions

__all__ = ["BackwardPass", "OptimizerWatch", "ZeroRegather"]


class BackwardPass:
    """This rank's backward through the program in the native loop, started by the first gradient
    reaching an output of the model. Owns whether a pass is running and whether it entered the
    plan's mesh (``running``, ``in_mesh``)."""

    def __init__(self, *, store, grad_sync, state, comm, collective_log, watch: "OptimizerWatch"):
        self.store = store
        self.grad_sync = grad_sync
        self.state = state  # the StateView: its DTensors' ``.grad`` is what the user sees
        self.comm = comm
        self.collective_log = collective_log
        self.watch = watch
        self.running = False  # a backward pass through this model has started
        self.in_mesh = False  # the running pass entered the plan's mesh

    def average_local_losses(self, outputs: list) -> None:
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

    def arm(self, outputs: list) -> None:
        """Hook the first gradient that reaches an output of this model in each backward pass: it
        starts this rank's backward through the program (``begin``) and queues its end
        (``end``). One start per backward pass and model, however many forwards feed it
        (``f(pm(x1)) + f(pm(x2))``: a second start mid-pass would drop the gradients already
        written); a graph kept with ``retain_graph=True`` starts again at its next backward, as one
        device accumulates again. A pass that raised never ran its end: the next forward outside
        a backward clears the mark."""
        from torch.autograd import Variable

        if self.running and torch._C._current_graph_task_id() == -1:
            self.running = False  # the last backward raised before its end ran
        me = weakref.ref(self)

        def end():
            bp = me()
            if bp is not None:
                bp.running = False
                bp.end()

        def start(grad):
            bp = me()
            if bp is not None and not bp.running:
                if torch.is_grad_enabled():  # backward(create_graph=True) / autograd.grad(..., create_graph=True)
                    raise AutoparError(
                        "backward with create_graph=True (double backward: a gradient penalty, a Hessian-vector "
                        "product) is not supported on a compiled model: its collectives and gradient buffers are "
                        "first order, so second-order terms would be lost. Run backward without create_graph, or "
                        "compute the second-order term on a model that is not compiled")
                bp.begin()
                bp.running = True
                Variable._execution_engine.queue_callback(end)
            return grad

        for t in outputs:
            t.register_hook(start)

    def begin(self) -> None:
        self.store.grads.own()  # a .grad the user replaced is a buffer's view again
        cleared = set(self.state.user_grads_cleared())
        trainable = [ph for ph, s in self.store.slots.items() if s.trainable]
        sync = self.grad_sync
        if len(cleared) == len(trainable):
            sync.arm(last_microbatch=True)
            # the buckets' gradients are written by backward, not zeroed first (GradSync.start_empty)
            taken = sync.start_empty()
            for ph in trainable:
                if ph not in taken:
                    self.store.grads.zero_of(ph)
        else:
            for ph in cleared:
                self.store.grads.zero_of(ph)
            sync.prepare_accumulation()
            sync.arm(last_microbatch=True)
        # recomputed blocks and the expert exchanges' backward communicate over the plan's mesh
        self.leave_mesh()
        enter_mesh(self.comm)
        self.in_mesh = True

    def leave_mesh(self) -> None:
        """Leave the plan's mesh if this pass entered it (and did not leave it: a pass that failed)."""
        if self.in_mesh:
            self.in_mesh = False
            leave_mesh(self.comm)

    def end(self) -> None:
        try:
            with collective_failures("backward", self.collective_log), active_mesh(self.comm):
                self.grad_sync.finish()
                drain_gradient_reductions(self.comm)
        finally:
            self.leave_mesh()
        self.state.publish_grads()
        self.watch.start()


class OptimizerWatch:
    """From the first backward on, every optimizer's first step is checked for the original
    module's parameters (``check``): torch's global step pre-hook, held through a weak reference
    to this watch; ``close`` removes it. Owns the hook and the optimizers checked already."""

    def __init__(self, *, originals, model_class: str):
        """``originals``: the module's original parameters (a weak set, ``compile``'s builder's)."""
        self.originals = originals
        self.model_class = model_class
        self.hook = None
        self.checked: "weakref.WeakSet" = weakref.WeakSet()

    def start(self) -> None:
        if self.hook is not None:
            return
        me = weakref.ref(self)

        def check(optimizer, _args, _kwargs):
            watch = me()
            if watch is not None:
                watch.check(optimizer)

        self.hook = register_optimizer_step_pre_hook(check)

    def close(self) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None

    def check(self, optimizer) -> None:
        """Refuse an optimizer over the user's original parameters (built before ``compile``, which
        replaced them in the module with the plan's DTensors): the compiled model trains those, so the originals never
        get a gradient and the step would silently train nothing. An optimizer whose original
        parameters do hold gradients (the module trained by itself, e.g. as a reference) is left be."""
        if optimizer in self.checked:
            return
        originals = {id(p) for p in self.originals if p.requires_grad}
        held = [p for group in optimizer.param_groups for p in group["params"] if id(p) in originals]
        if held and all(p.grad is None for p in held):
            raise AutoparError(
                f"{type(optimizer).__name__}.step(): this optimizer holds {len(held)} parameter(s) of the original "
                f"{self.model_class} (an optimizer built before autopar.compile, which replaced them with the plan's "
                "DTensors), which the compiled model does not train: its backward sets the gradients of model.parameters() "
                "and pm.parameters() (DTensors), so this step would change nothing. Build the optimizer after compile: "
                "opt = torch.optim.AdamW(model.parameters(), ...) (or pm.parameters(): the same tensors)")
        self.checked.add(optimizer)


class ZeroRegather:
    """ZeRO-1/2 parameters whole again after an optimizer updated their ``Shard(state_dim)``
    pieces. Owns the version counters last seen and whether any rank holds ZeRO-1/2 slots."""

    def __init__(self, *, store, state, comm):
        self.store = store
        self.state = state
        self.comm = comm
        self.versions: dict[str, int] = {}
        self.anywhere: bool | None = None  # whether ANY rank holds ZeRO-1/2 slots (agreed at the first sync)
        self.note()

    def _current(self) -> dict[str, int]:
        # the DTensor's own counter: in-place ops reach its local tensor below autograd's
        # ADInplaceOrView key (inside DTensor's dispatch), which leaves the local counter unmoved
        return {s.ph: self.state.params[s.fqn]._version for s in self.store.zero_slots()}

    def note(self) -> None:
        """The parameters are whole now (after a gather, or train_step's own step)."""
        self.versions = self._current()

    def gather(self) -> None:
        """Gather every ZeRO-1/2 parameter whole from its pieces (they were written: a load)."""
        with active_mesh(self.comm):
            self.store.gather_zero_params()
        self.note()

    def sync(self) -> None:
        """The native loop: the user's optimizer updated the ``Shard(state_dim)`` pieces (the
        DTensor parameters' version counters moved); gather them back into the whole parameters.
        Whether a counter moved is this rank's own state and the gather is a collective: every rank
        gathers where one rank's moved (``agreement.any_rank``)."""
        if self.anywhere is None:  # pipeline stages and expert groups hold different parameters, so a rank's own
            self.anywhere = any_rank(bool(self.store.zero_slots()))  # slots decide nothing alone
        if self.anywhere and any_rank(self._current() != self.versions):
            self.gather()
