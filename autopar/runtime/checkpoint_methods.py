"""``ParallelModel``'s checkpoint methods (``save``, ``load``, ``load_latest``, ``track``, ...) and
its full (gathered) state dicts, apart from the step machinery; the work is
``runtime.checkpoint``'s ``Checkpointer``."""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.layouts import replicated
from autopar.resharding import reshard_steps_for
from autopar.runtime.checkpoint import Resumed
from autopar.runtime.checkpoint_files import step_dir
from autopar.runtime.collective_errors import collective_failures
from autopar.runtime.collectives import apply_steps
from autopar.stack_experts import unstack_entries

__all__ = ["CheckpointMethods"]


class CheckpointMethods:
    """Mixed into ``ParallelModel`` (which holds ``_checkpointer``, ``_checkpointing``, ``_tracked``,
    ``_pending_tracked``, ``_native_optimizer``, ``_pending_optimizer``, ``resumed``, ``step``; and, for
    ``full_state_dict``, ``store``, ``comm``, ``_traced``, ``_layouts``, ``_shapes``, ``_param_of_key``,
    ``_model_keys`` and ``_pp_group``)."""

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
        cfg = self._checkpointing
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
        if isinstance(obj, torch.optim.Optimizer):
            if self._fused:
                raise AutoparError("train_step's optimizer (pm.optimizer) is saved already; track() takes the optimizer of "
                                   "the torch-native loop (over pm.parameters())")
            self._native_optimizer = obj  # saved as DTensors (``checkpoint_state``), not as a pickled state
            self._note_optimizer(obj)
            if self._pending_optimizer is not None:  # a load already ran, without this optimizer
                self._checkpointer.load_optimizer(self._pending_optimizer)
            return obj
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise AutoparError(f"track({name!r}, ...) needs an object with state_dict() and load_state_dict(), got a "
                               f"{type(obj).__name__}")
        self._tracked[name] = obj
        self._restore_tracked(name, obj)
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

    def _restore_tracked(self, name: str, obj: Any) -> None:
        if name in self._pending_tracked:
            obj.load_state_dict(self._pending_tracked.pop(name))

    def _checkpoint_root(self, what: str) -> str:
        if self._checkpointing is None:
            raise AutoparError(f"{what}() needs a folder: pass it, or compile with checkpoint=autopar.Checkpointing(root)")
        return self._checkpointing.root

    def _after_state_load(self) -> None:
        """Parameters were overwritten in place (their shards): ZeRO-1/2 gathers them whole again."""
        self._zero.gather()

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
            state_dict = self._shards_of_full(state_dict)
        with torch.no_grad():
            result = torch.nn.Module.load_state_dict(self, state_dict, strict=strict)
        self._after_state_load()
        return result

    def _shards_of_full(self, state_dict) -> dict:
        """``state_dict`` with each plain full tensor that fills a DTensor of this model replaced by
        a DTensor of this rank's shard of it (cut locally: no communication)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        sd = dict(state_dict)
        for fqn, members in self._traced.stacked.items():  # per-expert entries -> the stacked parameter
            if fqn not in sd and all(m in sd and not isinstance(sd[m], DTensor) for m in members):
                sd[fqn] = torch.stack([sd.pop(m) for m in members])
        own = torch.nn.Module.state_dict(self, keep_vars=True)
        members = {m for group in self._traced.stacked.values() for m in group}
        for key in list(sd):
            if key not in own and (key in self._model_keys or key in members):
                del sd[key]  # another pipeline stage's (or a stacked expert's, given whole): not held here
        for key, value in sd.items():
            mine = own.get(key)
            if not isinstance(mine, DTensor) or isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
                continue
            if tuple(value.shape) != tuple(mine.shape):
                raise AutoparError(f"load_state_dict: {key} has shape {tuple(value.shape)} in the state dict, "
                                   f"{tuple(mine.shape)} in the model; load a state dict of this model")
            full = value.detach().to(device=mine.to_local().device, dtype=mine.dtype)
            sd[key] = distribute_tensor(full, mine.device_mesh, mine.placements, src_data_rank=None)
        return sd

    @torch.no_grad()
    def full_optimizer_state_dict(self) -> dict[str, torch.Tensor]:
        """train_step's optimizer state, gathered whole on every rank: ``"<fqn>/<state key>"`` ->
        tensor (what a checkpoint's ``optim/`` entries hold, as one device would)."""
        from torch.distributed.tensor import DTensor

        from autopar.runtime.checkpoint_state import optimizer_entries

        self._require_plan("full_optimizer_state_dict")
        if self.optimizer is None:
            raise AutoparError("full_optimizer_state_dict is train_step's optimizer state; compile with optimizer=")
        tensors, _ = optimizer_entries(self, self.optimizer)
        full = {k[len("optim/"):]: (t.full_tensor() if isinstance(t, DTensor) else t).to("cpu", copy=True)
                for k, t in sorted(tensors.items())}
        return unstack_entries(self._merged_over_stages(full), self._traced.stacked)

    def _local_state(self, ph: str) -> torch.Tensor:
        return self.store.slots[ph].local.detach() if ph in self.store.slots else self.store.buffers[ph]

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (gathered) copies under the user's ``model.state_dict()`` keys, on every rank.
        (``state_dict()``: the sharded DTensors, for torch.distributed.checkpoint.)"""
        self._require_plan("full_state_dict")
        self._sync_zero_params()
        full: dict[str, torch.Tensor] = {}
        ndim = len(self.comm.sizes)
        for ph, fqn in list(self._traced.param_fqns.items()) + list(self._traced.buffer_fqns.items()):
            if ph not in self._layouts:
                continue  # another pipeline stage's (gathered below)
            shape = self._shapes[ph]
            steps = reshard_steps_for(shape, self._layouts[ph], replicated(ndim), self.comm.sizes)
            # a copy: for a replicated tensor no step runs, and the live parameter would be returned
            full[fqn] = apply_steps(self._local_state(ph), steps, self.comm, shape).to("cpu", copy=True)
        full = unstack_entries(self._merged_over_stages(full), self._traced.stacked)
        return {k: full[self._param_of_key.get(k, k)] for k in self._model_keys if self._param_of_key.get(k, k) in full}

    def _merged_over_stages(self, mine: dict) -> dict:
        """``mine`` (this rank's stage's entries) merged with every other pipeline stage's, on every
        rank; as is without pipelining."""
        if self._pp_group is None:
            return mine
        parts: list = [None] * dist.get_world_size(self._pp_group)
        dist.all_gather_object(parts, mine, group=self._pp_group)
        return {k: v for part in parts for k, v in part.items()}
