"""``LossValue``, a part of ``ParallelModel``: the step's loss value. The program returns this rank's loss, a sum or mean still
pending over the mesh axes of its layout (``ir.LOSS_LAYOUT_KEY``). A step's microbatch values
are summed on the rank and reduced once: riding the all-reduce of the last gradient bucket where
one is still to come over the loss's first axis (``GradSync.carry``), else all-reduced
asynchronously after the last forward, while backward runs; waited for after the step. The
planner prices one reduction per step in the backward window (``planner.problem``). Backward is
seeded with d(global loss)/d(local loss), so gradients are the global loss's.

No host reads: the loss value, the microbatches' token counts and their weights stay tensors
on their devices (``tests/test_host_syncs.py`` counts reads in a step); the caller reads the
loss when it wants the number.
"""
from __future__ import annotations

import torch

from autopar.layouts import Partial
from autopar.runtime.comm import collective_site

__all__ = ["LossValue"]


class LossValue:
    """The loss's reductions of one plan on this rank (no state of its own beyond its inputs)."""

    def __init__(self, *, comm, grad_sync, plan, device: torch.device, local: bool, train_layout=None):
        """``train_layout``: the layout of ``train_step``'s loss (``RankProgram.loss_layout``), the
        default of every method's ``layout``; ``local``: each rank passes its own batch shard."""
        self.comm = comm
        self.grad_sync = grad_sync
        self.plan = plan
        self.device = device
        self.local = local
        self.train_layout = train_layout

    def partial_axes(self, layout=None) -> list[tuple[int, str]]:
        """(mesh axis, reduce op) of each axis over which the loss is still partial."""
        layout = layout if layout is not None else self.train_layout
        if layout is None:
            return []
        return [(a, p.reduce_op) for a, p in enumerate(layout) if isinstance(p, Partial) and self.comm.sizes[a] > 1]

    def grad_scale(self) -> float:
        """d(global loss)/d(local loss): 1/n for each axis the loss is averaged over."""
        scale = 1.0
        for a, op in self.partial_axes():
            if op == "avg":
                scale /= self.comm.sizes[a]
        return scale

    def microbatch_weights(self, micro: list, prog) -> list:
        """Per microbatch, the weight of its loss in the step's: 1 for a sum; for a mean, its share
        of the count a token mean divides by (``RankProgram.token_count``, evaluated on each
        microbatch's whole tensors: the batch's mean whatever each holds; with local batches
        each rank's counts summed over 'dp'), else 1/m. Token-count weights are float32 0-dim
        tensors (counted in float64), never read on the host; the others Python floats."""
        m = len(micro)
        if prog.loss_reduction != "mean":
            return [1.0] * m
        counter = prog.token_count
        if counter is None:
            return [1.0 / m] * m
        names = [n.name for n in counter.graph.nodes if n.op == "placeholder"]
        counts = []
        for x, t in micro:
            feed = dict(zip(prog.traced.input_names, x))
            if prog.traced.target_name is not None:
                feed[prog.traced.target_name] = t
            counts.append(torch.as_tensor(counter(*(feed[name] for name in names))).to(torch.float64).reshape(()))
        counts = torch.stack([c.to(counts[0].device) for c in counts])
        if self.local and m > 1:
            counts = self._summed_over_data_ranks(counts)
        total = counts.sum()
        # an all-ignored batch (count 0) weighs its microbatches alike, as 1/m
        weights = torch.where(total > 0, counts / torch.where(total > 0, total, 1.0), 1.0 / m).float()
        return list(weights.unbind())

    def _summed_over_data_ranks(self, counts: torch.Tensor) -> torch.Tensor:
        """Local batches: each rank counted its own rows of every microbatch; a microbatch's count
        is their sum over the 'dp' axis (one all-reduce of m float64 values, priced by the plan:
        ``planner.loss_rider.local_counts_reduction``)."""
        if self.plan.mesh.get("dp", 1) == 1:
            return counts
        a = self.plan.mesh_axes_index("dp")
        summed = counts.to(self.device, torch.float64, copy=True)
        with collective_site(self.comm, "the microbatches' target counts"):
            self.comm.all_reduce(summed, a)
        return summed

    def reduce_riding(self, value: torch.Tensor):
        """(``value``, works, whether it rides the gradient sync): a step's summed train loss
        value, reduced over its first partial axis by the last gradient bucket's all-reduce
        (read it back with ``GradSync.carried()`` after ``finish()``), else asynchronously."""
        axes = self.partial_axes()
        if axes and self.grad_sync.carry(value, axes[0][0]):
            return value, [], True
        value, works = self.reduce_async(value)
        return value, works, False

    def reduce_async(self, loss: torch.Tensor, layout=None):
        value = loss.detach().clone().reshape(1).float()
        with collective_site(self.comm, "the loss's all-reduce"):
            works = [self.comm.all_reduce(value, a, async_op=True) for a, _ in self.partial_axes(layout)[:1]]
        return value, [w for w in works if w is not None]

    def finish(self, value: torch.Tensor, layout=None) -> torch.Tensor:
        """The global loss from this rank's partly reduced ``value``: a float32 0-dim tensor on its
        device (not read on the host)."""
        for a, _ in self.partial_axes(layout)[1:]:
            with collective_site(self.comm, "the loss's all-reduce"):
                self.comm.all_reduce(value, a)
        for a, op in self.partial_axes(layout):
            if op == "avg":
                value = value / self.comm.sizes[a]
        return value.reshape(())
