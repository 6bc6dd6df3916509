"""Saving and loading a ParallelModel's training state (``Checkpointing``, ``pm.save``, ``pm.load_latest``).

Invariants (the files: ``checkpoint_files``; what they hold: ``checkpoint_state``):

* a save happens at a step boundary on every rank (train_step every ``Checkpointing.every``
  steps, or ``pm.save``); its tensors are written by torch.distributed.checkpoint, so a
  checkpoint saved under one plan loads into any other plan and world size of the same model;
* an asynchronous save copies this rank's state to CPU at the step boundary (training then
  changes the live tensors freely) and writes it on a background thread, over a process group
  of its own, so its collectives never interleave with training's; at most one save is in
  flight: the next save, a load and ``close`` wait for it, and a failed background save is
  raised there;
* a save is complete only when rank 0 has written the manifest (every file's sha256, gathered
  from the rank that wrote it) and renamed ``step-<n>.partial`` to ``step-<n>``; a rank dying
  midway leaves the previous checkpoint the newest complete one;
* ``load`` verifies every file against the manifest (the ranks share the files), refuses a
  checkpoint of another model, loads without running pickled code, and reports what changed
  since the save (``Resumed``).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from autopar.errors import AutoparError
from autopar.runtime.agreement import decided_by_rank0
from autopar.runtime.launch import software_versions
from autopar.runtime.writable import describe_write_failure
from autopar.runtime.checkpoint_files import (
    CheckpointError, Manifest, SafeReader, complete_steps, partial_dir, prune, read_manifest, sha256_of, step_dir,
    verify, write_manifest,
)
from autopar.runtime.checkpoint_state import (
    check_weights_only, ensure_optimizer_state, model_entries, model_identity, optimizer_entries,
    optimizer_state_fqns, param_groups_of, param_index, restore_param_groups, restore_rng, rng_states,
)

__all__ = ["Checkpointing", "Checkpointer", "Resumed", "CheckpointError", "DamagedCheckpointWarning"]

EXTRAS = "extra-rank{}.pt"
SHARED_EXTRAS = "extra-shared.pt"  # what every rank may need (non-tensor optimizer states)
PLAN_FILE = "plan.json"


class DamagedCheckpointWarning(UserWarning):
    """The newest complete checkpoint is damaged: the previous one is loaded instead."""


@dataclass(frozen=True)
class Checkpointing:
    """Where and how often ``train_step`` saves, for ``autopar.compile(..., checkpoint=...)``.

    ``root``: a folder shared by every rank; each save is ``root/step-<step>/``. ``every``: save
    after every ``every``-th train_step (None: only ``pm.save``). ``keep``: complete checkpoints
    kept (older ones are deleted after a save completes). ``asynchronous``: write in the
    background (see the module docstring). ``resume``: at compile, continue from the newest
    complete checkpoint under ``root`` (the step, parameters, optimizer, RNG and tracked states);
    with ``resume=False`` a ``root`` that already holds checkpoints is refused rather than mixed."""
    root: str
    every: int | None = None
    keep: int = 3
    asynchronous: bool = True
    resume: bool = True

    def __post_init__(self):
        if not isinstance(self.root, (str, os.PathLike)) or not str(self.root):
            raise AutoparError(f"Checkpointing(root=...) must be a folder path, got {self.root!r}")
        object.__setattr__(self, "root", os.fspath(self.root))
        if self.every is not None and (not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1):
            raise AutoparError(f"Checkpointing(every={self.every!r}): save every how many steps, an integer >= 1 "
                               "(or None to save only with pm.save)")
        if not isinstance(self.keep, int) or isinstance(self.keep, bool) or self.keep < 1:
            raise AutoparError(f"Checkpointing(keep={self.keep!r}): how many complete checkpoints to keep, an integer >= 1")


@dataclass(frozen=True)
class Resumed:
    """What a load restored, and what differs from the run that saved it."""
    step: int
    path: str
    saved_world_size: int
    saved_mesh: str
    changes: tuple[str, ...]

    def describe(self) -> str:
        what = "; ".join(self.changes) if self.changes else "same world size and plan"
        return f"resumed from {self.path} at step {self.step} (saved on {self.saved_world_size} ranks, {self.saved_mesh}): {what}"


def describe_mesh(plan) -> str:
    parts = ([f"pp={plan.pipeline_degree}"] if len(plan.stages) > 1 else []) + [f"{a}={n}" for a, n in plan.mesh_axes]
    return " ".join(parts) + (f", {plan.microbatches} microbatches" if plan.microbatches > 1 else "")


class Checkpointer:
    """One ParallelModel's saves and loads (see the module docstring), a part of it: it owns the
    checkpointing config, the tracked objects, the loaded state still waiting for its object, and
    the save in flight. ``pm`` is read for what a checkpoint holds (the step, the plan, the state
    view, the optimizer); ``pm.step`` and ``pm.resumed`` are written back."""

    def __init__(self, pm):
        self.pm = pm
        self.config: Checkpointing | None = None  # compile(checkpoint=...): train_step saves, every ``config.every``
        self.resume_from: str | None = None  # compile's resume: a checkpoint folder to load once the plan exists
        self.tracked: dict[str, Any] = {}  # name -> object with state_dict()/load_state_dict()
        self.pending_tracked: dict[str, Any] = {}  # loaded states of objects not tracked yet
        self.native_optimizer = None  # track(name, optimizer): the torch-native loop's optimizer
        self.pending_optimizer: str | None = None  # a loaded checkpoint's folder whose optimizer state awaits track()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._group = None  # the background saves' process group, made at the first save
        self._plan_json: tuple[str, str] | None = None  # (fingerprint, JSON) of the plan last saved
        self._wrapped: dict = {}  # optimizer entry name -> (state tensor, its DTensor) (``optimizer_entries``)
        self._last_saved: tuple[Path, int] | None = None  # (root, step) of this model's last save
        self._early: Path | None = None  # a checkpoint whose step, RNG and tracked states compile restored
        self._intact: tuple[Path, Manifest] | None = None  # a checkpoint ``latest`` verified, for the load that follows

    # ------------------------------------------------------------------ saving
    def save(self, root: str | os.PathLike, *, asynchronous: bool = False, keep: int | None = None) -> Path:
        """Save the training state at the current step into ``root/step-<step>``; returns that path
        (complete once ``wait()`` returns, for an asynchronous save). Saving again the step this
        model last saved there returns that checkpoint; any other existing ``step-<n>`` is refused."""
        pm = self.pm
        self.wait()
        root = Path(root)
        step = pm.step
        final, partial = step_dir(root, step), partial_dir(root, step)
        # rank 0 decides from its view of the filesystem (a rank's own view can lag behind rank 0's
        # rename on a network filesystem), every rank takes its branch
        verdict = decided_by_rank0(lambda: _prepare(final, partial, self._last_saved == (root.resolve(), step)))
        if verdict == "saved":
            return final  # this step is saved already (train_step's save, then a last pm.save())
        if verdict is not None:
            raise CheckpointError(verdict)
        rank, world = dist.get_rank(), dist.get_world_size()
        # what can fail on one rank alone fails on every rank, before any collective of the save
        scalars, prepared = {}, None
        try:
            tensors = model_entries(pm._state)
            optimizer = self.optimizer()
            if optimizer is not None:
                opt_tensors, scalars = optimizer_entries(pm, optimizer, cache=self._wrapped)
                tensors.update(opt_tensors)
            extras = {"step": step, "rank": rank, "world_size": world, "rng": rng_states(pm._device),
                      "param_groups": param_groups_of(optimizer) if optimizer is not None else [],
                      "lr_scheduler": pm.lr_scheduler.state_dict() if pm.lr_scheduler is not None else None,
                      "tracked": {name: obj.state_dict() for name, obj in self.tracked.items()}}
            prepared = check_weights_only(extras, "the step's extras (tracked states, RNG)")
            check_weights_only(scalars, "the optimizer's non-tensor state")
            failure = None
        except CheckpointError as exc:
            failure = str(exc)
        every = _gathered_objects((failure, scalars))
        failures = [f"rank {r}: {f}" for r, (f, _) in enumerate(every) if f]
        if failures:
            raise CheckpointError("cannot save: " + "; ".join(failures))
        # a write failing here (a full disk) is raised on every rank after the save's collectives (``_write``)
        write_failure = _written(partial / EXTRAS.format(rank), prepared)
        if rank == 0 and write_failure is None:
            # non-tensor optimizer states of every rank's parameters, for whichever rank holds them after a re-plan
            shared = {fqn: v for _, part in every for fqn, v in part.items()}
            if self._plan_json is None or self._plan_json[0] != pm.plan.fingerprint:
                self._plan_json = (pm.plan.fingerprint, pm.plan.to_json())
            write_failure = (_written(partial / SHARED_EXTRAS, check_weights_only({"optimizer_scalars": shared}, "optimizer state"))
                             or _written(partial / PLAN_FILE, self._plan_json[1].encode()))
        manifest = Manifest(step=step, world_size=world, plan_fingerprint=pm.plan.fingerprint, mesh=describe_mesh(pm.plan),
                            model_class=pm._model_class, params=model_identity(pm._traced), files={},
                            versions=software_versions(),
                            optimizer=type(optimizer).__name__ if optimizer is not None else None,
                            batch_rows=_global_rows(pm))
        tensors = _first_replicas(tensors)
        self._last_saved = (root.resolve(), step)
        if asynchronous:
            staged = _staged(tensors)
            group = self._background_group()
            self._failure = None
            self._thread = threading.Thread(target=self._write, args=(staged, partial, final, manifest, group, keep,
                                                                      write_failure),
                                            name=f"autopar-checkpoint-{step}", daemon=True)
            self._thread.start()
        else:
            self._write(tensors, partial, final, manifest, None, keep, write_failure)
            self._raise_failure()
        return final

    def _write(self, tensors, partial: Path, final: Path, manifest: Manifest, group, keep: int | None,
               failure: str | None = None) -> None:
        """Write the tensors, then the manifest (rank 0) from every rank's file hashes; rename.
        Every rank runs the same collectives whatever fails where (``failure``: this rank's earlier
        write), and a failure on any rank is raised on every rank, naming the path."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        try:
            rank = dist.get_rank()
            try:  # DCP raises a failure of any rank's writes on every rank
                dcp.save(tensors, storage_writer=FileSystemWriter(str(partial)), process_group=group)
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - gathered below, raised on every rank
                failure = failure or _write_failure_text(partial, exc, rank)
            hashes = {}
            if failure is None:
                try:
                    mine = [p.name for p in partial.iterdir() if p.name.startswith(f"__{rank}_") or p.name == EXTRAS.format(rank)]
                    if rank == 0:
                        mine += [".metadata", PLAN_FILE, SHARED_EXTRAS]
                    hashes = {name: {"bytes": (partial / name).stat().st_size, "sha256": sha256_of(partial / name)}
                              for name in mine}
                except OSError as exc:
                    failure = f"rank {rank}: {describe_write_failure(partial, exc)}"
            every = _gathered_objects((failure, hashes), group)
            failures = dict.fromkeys(f for f, _ in every if f)  # DCP's failures: the same text on every rank
            if failures:
                raise CheckpointError(f"saving step {manifest.step} into {partial} failed: " + "; ".join(failures))

            def finish() -> str | None:  # rank 0: the manifest, the rename, the pruning
                files = {k: v for _, part in every for k, v in part.items()}
                try:
                    write_manifest(partial, dataclasses.replace(manifest, files=files))
                    os.replace(partial, final)
                except OSError as exc:
                    return f"saving step {manifest.step} failed on rank 0: {describe_write_failure(partial, exc)}"
                if keep is not None:
                    prune(final.parent, keep, manifest.step)
                return None

            # every rank returns once the checkpoint is complete (or raises rank 0's failure)
            problem = decided_by_rank0(finish, group)
            if problem:
                raise CheckpointError(problem)
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread by wait()
            self._failure = exc

    def _background_group(self):
        """A process group of the background saves' own (created once, on every rank, in step)."""
        if self._group is None:
            from autopar.runtime.launch import collective_timeout_s
            import datetime

            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=collective_timeout_s()))
        return self._group

    def wait(self) -> None:
        """Wait for the save in flight (if any); raise its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            exc, self._failure = self._failure, None
            if isinstance(exc, CheckpointError):
                raise exc
            raise CheckpointError(f"saving the checkpoint failed on rank {dist.get_rank()}: {type(exc).__name__}: {exc}") from exc

    # ------------------------------------------------------------------ loading
    def latest(self, root: str | os.PathLike) -> int | None:
        """The newest intact complete checkpoint's step under ``root``, the same on every rank (None:
        there is none). A damaged one (a file missing, truncated or altered, an unreadable manifest)
        is skipped with a ``DamagedCheckpointWarning`` naming it and why, for the previous one;
        every complete checkpoint damaged is a ``CheckpointError``."""
        steps = decided_by_rank0(lambda: complete_steps(root))
        damaged = []
        for step in reversed(steps):
            folder = step_dir(root, step)
            manifest, problem = self._inspect(folder)
            if problem is None:
                self._intact = (folder, manifest)  # the load that follows need not verify it again
                return step
            damaged.append(problem)
            if dist.get_rank() == 0:
                warnings.warn(f"{problem}; skipping it for the previous complete checkpoint", DamagedCheckpointWarning,
                              stacklevel=2)
        if damaged:
            raise CheckpointError(f"every complete checkpoint under {root} is damaged: " + "; ".join(damaged)
                                  + "; restore them, or start a new run in another root")
        return None

    def _inspect(self, folder: Path) -> tuple[Manifest | None, str | None]:
        """(manifest, None) when the checkpoint ``folder`` is intact, (None, what is wrong) when not:
        rank 0 reads the manifest, each rank verifies its share of the files, the verdict gathered."""
        folder = Path(folder)
        if self._intact is not None and self._intact[0] == folder:
            return self._intact[1], None

        def read() -> tuple[Manifest | None, str | None]:
            try:
                return read_manifest(folder), None
            except CheckpointError as exc:
                return None, str(exc)

        manifest, problem = decided_by_rank0(read)
        if problem is not None:
            return None, problem
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            mine = verify(folder, manifest, sorted(manifest.files)[rank::world])
        except OSError as exc:
            mine = [f"{exc.filename or folder} cannot be read: {exc.strerror or exc}"]
        problems = _gathered(mine)
        return (None, f"checkpoint {folder} is damaged: " + "; ".join(problems)) if problems else (manifest, None)

    def _verified(self, folder: Path) -> Manifest:
        """The manifest of the intact checkpoint ``folder`` (``CheckpointError`` on every rank if not)."""
        manifest, problem = self._inspect(folder)
        if problem is not None:
            raise CheckpointError(problem)
        return manifest

    def restore_early(self, folder: str | os.PathLike) -> None:
        """What a resume restores before the plan exists (at compile): the step, the RNG states and
        the tracked objects' states (restored as they are tracked), so that the batches drawn
        before the first step follow the checkpoint; ``load`` restores the rest."""
        folder = Path(folder)
        self._restore_run_state(self._read_extras(folder, self._verified(folder), verified=True), self.pm._builder.device)
        self._early = folder

    def load(self, folder: str | os.PathLike) -> Resumed:
        """Load the checkpoint in ``folder`` into the model, its optimizer and tracked objects."""
        import torch.distributed.checkpoint as dcp

        pm = self.pm
        self.wait()
        folder = Path(folder)
        t0 = time.perf_counter()
        manifest = self._verified(folder)
        self._intact = None
        rank = dist.get_rank()
        _check_same_model(manifest, model_identity(pm._traced), pm._model_class, folder)
        saved_keys = set(SafeReader(str(folder)).read_metadata().state_dict_metadata)
        target = model_entries(pm._state)
        optimizer = self.optimizer()
        if optimizer is not None:
            target.update(self._optimizer_target(optimizer, saved_keys))
        # else: the optimizer state waits for track(name, optimizer) (the native loop builds it later)
        absent = sorted(k for k in target if k not in saved_keys)
        problems = _gathered([f"checkpoint {folder} has no {absent[0]}" + (f" (and {len(absent) - 1} more entries)"
                              if len(absent) > 1 else "") + f"; it was saved with optimizer {manifest.optimizer}"]
                             if absent else [])
        if problems:
            raise CheckpointError(problems[0])
        dcp.load(target, storage_reader=SafeReader(str(folder)))
        pm._after_state_load()
        self.pending_optimizer = None if optimizer is not None or not optimizer_state_fqns(saved_keys) else str(folder)
        extras = self._read_extras(folder, manifest, verified=True)
        if self._early != folder:  # not restored at compile
            self._restore_run_state(extras, pm._device)
        self._early = None
        if optimizer is not None:
            self._restore_optimizer_extras(optimizer, extras)
        if pm.lr_scheduler is not None and extras.get("lr_scheduler") is not None:
            pm.lr_scheduler.load_state_dict(extras["lr_scheduler"])
        for name, obj in self.tracked.items():
            self.restore_tracked(name, obj)
        resumed = Resumed(manifest.step, str(folder), manifest.world_size, manifest.mesh,
                          tuple(self._changes(manifest)))
        if rank == 0:
            print(f"autopar: {resumed.describe()} in {time.perf_counter() - t0:.1f} s", flush=True)
        return resumed

    def _changes(self, manifest: Manifest) -> list[str]:
        pm, world = self.pm, dist.get_world_size()
        changes = []
        if manifest.world_size != world:
            changes.append(f"world size {manifest.world_size} -> {world}: re-planned, state resharded")
        batch = _batch_change(manifest.batch_rows, _global_rows(pm), pm._local, pm.data_parallel_size,
                              getattr(pm, "_loss_reduction", "mean"))
        if batch and (manifest.world_size != world or "changed" in batch):
            changes.append(batch)
        if manifest.plan_fingerprint != pm.plan.fingerprint:
            changes.append(f"plan {manifest.mesh} -> {describe_mesh(pm.plan)}")
        if dist.get_rank() >= manifest.world_size:
            changes.append("ranks beyond the saved world took rank 0's RNG and tracked states")
        return changes

    def _restore_run_state(self, extras: dict, device) -> None:
        """The step, the RNG states, and the tracked objects' states (each restored as it is tracked)."""
        self.pm.step = int(extras["step"])
        restore_rng(extras["rng"], device)
        self.pending_tracked = dict(extras["tracked"])

    def _read_extras(self, folder: Path, manifest: Manifest, verified: bool = False) -> dict:
        """This rank's extras (rank 0's beyond the saved world) and the shared ones, checked against
        the manifest first unless ``load`` has ``verified`` the folder already."""
        rank = dist.get_rank()
        names = [EXTRAS.format(rank if rank < manifest.world_size else 0), SHARED_EXTRAS]
        if not verified:  # gathered: a rank whose own file is damaged must not raise alone
            _raise_if_damaged(folder, _gathered(verify(folder, manifest, [n for n in names if n in manifest.files])))
        extras = torch.load(folder / names[0], weights_only=True)
        if (folder / SHARED_EXTRAS).is_file():
            extras.update(torch.load(folder / SHARED_EXTRAS, weights_only=True))
        return extras

    def _optimizer_target(self, optimizer, saved_keys: set[str]) -> dict:
        """The optimizer's entries to load into (its state created first where it has none)."""
        wanted = optimizer_state_fqns(saved_keys)
        ensure_optimizer_state(self.pm, optimizer, wanted)
        return optimizer_entries(self.pm, optimizer, only=wanted)[0]

    def load_optimizer(self, folder: str) -> None:
        """The optimizer part of ``load`` for an optimizer tracked after the load (native loop)."""
        import torch.distributed.checkpoint as dcp

        folder = Path(folder)
        optimizer = self.optimizer()
        saved_keys = set(SafeReader(str(folder)).read_metadata().state_dict_metadata)
        with torch.no_grad():
            dcp.load(self._optimizer_target(optimizer, saved_keys), storage_reader=SafeReader(str(folder)))
        manifest = decided_by_rank0(lambda: read_manifest(folder))  # verified at the load; its extras again here
        self._restore_optimizer_extras(optimizer, self._read_extras(folder, manifest))
        self.pending_optimizer = None

    def _restore_optimizer_extras(self, optimizer, extras: dict) -> None:
        restore_param_groups(optimizer, extras["param_groups"])
        index = param_index(self.pm)
        by_fqn = {index[id(p)][0]: p for g in optimizer.param_groups for p in g["params"] if id(p) in index}
        for fqn, values in extras.get("optimizer_scalars", {}).items():
            if fqn in by_fqn:
                optimizer.state[by_fqn[fqn]].update(values)

    def optimizer(self):
        """train_step's optimizer, or the native loop's one given to ``pm.track`` (None: neither)."""
        return self.pm.optimizer if self.pm.optimizer is not None else self.native_optimizer

    def restore_tracked(self, name: str, obj: Any) -> None:
        """Load the state a checkpoint holds for ``name`` into ``obj`` (once)."""
        if name in self.pending_tracked:
            obj.load_state_dict(self.pending_tracked.pop(name))

    def close(self) -> None:
        self.wait()


def _from_rank0(value):
    """Rank 0's ``value``, on every rank."""
    box = [value]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _prepare(final: Path, partial: Path, saved_here: bool) -> str | None:
    """Rank 0's verdict before a save: "saved" (``saved_here``: this model's last save was this
    step there, and it is complete), a problem to raise, or None after preparing ``partial``."""
    if saved_here and final.is_dir():
        return "saved"
    if final.exists():
        return (f"{final} already exists: a checkpoint of step {final.name[len('step-'):]} was saved before (by another "
                "run, or before a load of an older step); save into another root, or remove it")
    try:
        shutil.rmtree(partial, ignore_errors=True)  # a save of this step that died
        partial.mkdir(parents=True)
    except OSError as exc:
        return f"cannot save: {describe_write_failure(partial, exc)}"
    return None


def _written(path: Path, data: bytes) -> str | None:
    """Write ``data`` to ``path``; what failed (naming this rank and the path), or None."""
    try:
        path.write_bytes(data)
    except OSError as exc:
        return f"rank {dist.get_rank()}: {describe_write_failure(path, exc)}"
    return None


def _write_failure_text(partial: Path, exc: BaseException, rank: int) -> str:
    """A failure of DCP's save (each failed rank's cause, the same text on every rank) or of this rank's write."""
    if isinstance(exc, CheckpointException):
        return "; ".join(_write_failure_text(partial, e, r) for r, (e, _) in sorted(exc.failures.items()))
    if isinstance(exc, OSError):
        return f"rank {rank}: {describe_write_failure(partial, exc)}"
    return f"rank {rank}: writing {partial} failed: {type(exc).__name__}: {exc}"


def _global_rows(pm) -> int | None:
    """The rows of the global batch the model was compiled for (its first tensor input's batch dim)."""
    for spec in pm._primary.example.inputs:
        shape = getattr(spec, "shape", None)
        if shape:
            return int(shape[0])
    return None


def _batch_change(saved: int | None, rows: int | None, local: bool, shares: int, reduction: str) -> str | None:
    """What a resume means for the global batch (rows per step, over all ranks): kept or changed,
    and, changed, what that does to the gradient and the learning rate."""
    if rows is None:
        return None
    share = f": pass each rank its 1/{shares} share ({rows // shares} rows)" if local and shares > 1 else ""
    if saved is None:
        return f"the global batch is {rows} rows (the checkpoint does not record the saved run's){share}"
    if saved == rows:
        return f"the global batch kept at {rows} rows{share}"
    ratio = f"{rows}/{saved}"
    effect = (f"each step's gradient is now a sum over {rows} rows, {ratio} times the saved run's: divide the learning "
              f"rate by {ratio} to keep its step size" if reduction == "sum" else
              f"each step's gradient is now a mean over {rows} rows instead of {saved} (the same scale, "
              f"{'less' if rows > saved else 'more'} noise): to follow the saved run's schedule per row seen, scale the "
              f"learning rate (linearly: by {ratio}) and the remaining steps by {saved}/{rows}")
    return f"the global batch changed from {saved} to {rows} rows{share}; {effect}"


def _gathered_objects(obj, group=None) -> list:
    """Every rank's ``obj`` (of ``group``, default all), in rank order, on every rank."""
    every: list[Any] = [None] * dist.get_world_size(group)
    if len(every) > 1:
        dist.all_gather_object(every, obj, group=group)
    else:
        every = [obj]
    return every


def _gathered(problems: list[str]) -> list[str]:
    """Every rank's problems, on every rank (so that all raise, or none)."""
    return sorted(p for part in _gathered_objects(problems) for p in part)


def _raise_if_damaged(folder: Path, problems: list[str]) -> None:
    if problems:
        raise CheckpointError(f"checkpoint {folder} is damaged: " + "; ".join(problems))


def _check_same_model(manifest: Manifest, mine: dict, model_class: str, folder: Path) -> None:
    saved = {k: list(v) for k, v in manifest.params.items()}
    if saved == mine:
        return
    only_saved = sorted(set(saved) - set(mine))
    only_mine = sorted(set(mine) - set(saved))
    reshaped = sorted(k for k in set(saved) & set(mine) if saved[k] != mine[k])
    details = []
    if only_saved:
        details.append(f"{len(only_saved)} tensors only in the checkpoint (e.g. {only_saved[0]})")
    if only_mine:
        details.append(f"{len(only_mine)} only in this model (e.g. {only_mine[0]})")
    if reshaped:
        k = reshaped[0]
        details.append(f"{len(reshaped)} of another shape or dtype (e.g. {k}: saved {saved[k]}, here {mine[k]})")
    raise CheckpointError(f"checkpoint {folder} is of another model (saved from a {manifest.model_class}, this is a "
                          f"{model_class}): " + "; ".join(details) + "; load it into the model that saved it")


def _first_replicas(tensors: dict) -> dict:
    """The entries this rank writes: each DTensor shard only from the rank at coordinate 0 of the
    axes it is replicated on (DCP would keep one copy anyway; dropping the others here spares
    their CPU copies and the planning). Plain tensors (scalar optimizer states) stay everywhere."""
    from torch.distributed.tensor import DTensor, Replicate

    out = {}
    for k, t in tensors.items():
        if isinstance(t, DTensor):
            coord = t.device_mesh.get_coordinate()
            if any(isinstance(p, Replicate) and c != 0 for p, c in zip(t.placements, coord)):
                continue
        out[k] = t
    return out


def _staged(tensors: dict) -> dict:
    """CPU copies of this rank's shards (DTensors stay DTensors over the same mesh, their local
    tensors copied: ``DTensor.to`` keeps a CUDA mesh's copy on the CPU, where ``from_local``
    would move it back): what an asynchronous save writes while training changes the live tensors."""
    return {k: t.detach().to("cpu", copy=True) for k, t in tensors.items()}
