"""``Measurer``, a part of ``ParallelModel``: ``measure_step`` runs one ``train_step`` while the storage
tracker (``memory_tracker``) counts this rank's memory by category and ``runtime.comm`` counts the
bytes of every collective, and returns them in a ``StepMeasurement`` beside the plan's prediction.

Invariants: the measurement counts the whole process, not only what autopar made: the state kept
across steps (parameters, gradients, optimizer state) is registered by category before the step
runs, then every other storage alive in the process is counted as ``unaccounted`` and named (the
user's original model under "the user's model", the step's inputs, anything the caller keeps),
and again after the step for storages made outside the dispatch mode; on CUDA the peak is the
caching allocator's (every allocation of the process). The cyclic garbage collector is collected
before and paused during the measured step, so memory is freed when references drop, every run
alike.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from autopar.api import cyclic_gc_paused
from autopar.memory_tracker import MemoryReport, MemoryTracker

__all__ = ["StepMeasurement", "Measurer", "CUDA_WITHOUT_TENSOR"]

CUDA_WITHOUT_TENSOR = "(CUDA allocations no Python tensor holds)"  # a holder name in unaccounted_by_holder


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


class Measurer:
    """Measures this rank's steps of one plan. Owns the storage tracker of the step being measured
    (``phase`` names the step's phases to it; without one they cost nothing)."""

    def __init__(self, *, plan, store, comm, device: torch.device, optimizer, user_model, stages=None):
        """``user_model``: the module given to ``compile`` where it is not the compiled model itself
        (its storages are named apart), else None; ``stages``: this rank's pipeline stages (None
        without pipelining)."""
        self.plan = plan
        self.store = store
        self.comm = comm
        self.device = device
        self.optimizer = optimizer
        self.user_model = user_model
        self.stages = stages
        self.tracker: MemoryTracker | None = None  # set while a step is measured

    def phase(self, name: str):
        """The step's phase ``name`` ("forward", "backward", "optimizer") under the tracker, if any."""
        return self.tracker.phase(name) if self.tracker is not None else contextlib.nullcontext()

    def step(self, run, inputs: tuple, target: Any) -> StepMeasurement:
        """Run ``run()`` (one checked ``train_step`` on ``inputs``, returning its loss) while
        measuring memory by category and the bytes of every collective, beside the prediction."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
        with self.tracked(inputs, target) as tracker:
            # on CUDA, allocations no Python tensor holds (cuBLAS workspaces, a C++ cache) are in
            # the allocator's count but in no storage the tracker saw: named apart
            hidden = int(torch.cuda.memory_allocated(self.device)) - tracker.current_bytes if cuda else 0
            self.comm.stats.reset()
            t0 = time.perf_counter()
            loss = run()
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
        # on CUDA the caching allocator's peak: every allocation of the process
        device_peak = int(torch.cuda.max_memory_allocated(self.device)) if cuda else None
        memory = tracker.report(device_peak)
        if hidden > 0:
            memory = dataclasses.replace(memory, unaccounted_by_holder={
                **memory.unaccounted_by_holder, CUDA_WITHOUT_TENSOR: hidden})
        pred = self.plan.predicted
        peak = pred.peak_memory_bytes
        if self.stages is not None:  # this rank's pipeline rank (the plan's figure is the worst rank's)
            peak = max(self.plan.stages[s].peak_memory_bytes for s in self.stages)
        return StepMeasurement(
            loss=float(loss), step_time_s=elapsed, predicted_step_time_s=pred.step_time_s,
            memory=memory, predicted_peak_bytes=peak,
            predicted_memory=dict(pred.memory_bytes), comm_bytes=self.comm.stats.snapshot(),
            predicted_comm_bytes=self.predicted_comm_bytes(),
        )

    def predicted_comm_bytes(self) -> dict:
        """The bytes per collective kind the plan predicts for this rank's step: its pipeline
        rank's (``Stage.comm_bytes``) under a pipeline plan, whose own figure is the busiest rank's."""
        if self.stages is not None:
            return dict(self.plan.stages[self.stages[0]].comm_bytes)
        return dict(self.plan.predicted.comm_bytes)

    @contextlib.contextmanager
    def tracked(self, inputs: tuple = (), target: Any = None):
        """Run a step under the storage tracker (``memory_tracker``), the state it keeps across
        steps registered by category first, then every other storage of the process as
        ``unaccounted`` (``inputs`` and ``target`` named as the step's inputs); yields the tracker."""
        tracker = MemoryTracker(count_unallocated=False)
        gc.collect()  # what earlier steps left to the cyclic collector is gone before we measure,
        with cyclic_gc_paused():  # and it cannot run mid-step: frees happen when references drop, every run alike
            with tracker:
                for category, tensors in self.store.persistent_tensors().items():
                    tracker.register(tensors, category)
                tracker.register(self._optimizer_state(), "optimizer_state")
                tracker.register_process(self.device.type, self._named_roots(inputs, target))
                self.tracker = tracker
                try:
                    yield tracker
                finally:
                    self.tracker = None
                tracker.register(self._optimizer_state(), "optimizer_state")
                tracker.register_process(self.device.type, self._named_roots(inputs, target))

    def _named_roots(self, inputs: tuple, target: Any) -> dict:
        """What the unaccounted storages are named after first: the module given to ``compile``
        (while it keeps full tensors of its own) and the step's batch."""
        batch = torch.nn.Module()
        for i, x in enumerate([*inputs, target]):
            if isinstance(x, torch.Tensor):
                batch.register_buffer(f"input{i}" if i < len(inputs) else "target", x, persistent=False)
        roots = {"the step's batch": batch}
        if self.user_model is not None:
            roots[f"the user's model ({type(self.user_model).__name__})"] = self.user_model
        return roots

    def _optimizer_state(self) -> list[torch.Tensor]:
        return [v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
