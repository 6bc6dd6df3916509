"""Agreement: the one way a rank's local decision becomes every rank's decision before a collective.

A rank that decides from local state (a file exists, a version counter moved, a cache hit, a
clock ran out) and then runs, or skips, a collective can split the ranks: one waits in a
collective the others never enter, and the run hangs until the timeout or fails on a later step.
Every such branch goes through one of these functions, so all ranks take the same branch:

* ``decided_by_rank0(decide)``: rank 0 calls ``decide()`` and every rank returns its value
  (filesystem state, a plan, a damaged-or-not verdict);
* ``any_rank(flag)`` / ``every_rank(flag)``: a boolean that is true where one (or every) rank says
  so (a version counter moved on some rank, all ranks hit a cache);
* ``gathered(obj)``: every rank's value, in rank order, on every rank (to name which rank differs).

Host values travel as Python objects over the group's object collectives, which place them on the
device the backend needs (torch's ``*_object`` collectives; on NCCL the current CUDA device), so
the same calls work on gloo and NCCL. A world of one process (or no process group) runs nothing.

The runtime's agreed branches (audited; keep this list current):

* ``checkpoint.Checkpointer.save``: whether ``step-<n>`` already exists (and was this model's own
  last save) and the preparation of the partial folder: rank 0 decides;
* ``checkpoint.Checkpointer`` load: the newest complete checkpoint, its manifest and whether it is
  damaged: rank 0 reads and decides, falling back to the previous complete one;
* ``checkpoint`` save/load failures that can happen on one rank (preparing tensors, writing or
  reading files, a full disk): gathered, so that every rank raises; rank 0's manifest and rename
  (the end of every save, so no rank runs ahead of a late rename): rank 0 decides;
* ``native_loop``: whether a ZeRO-1/2 parameter was updated by the user's optimizer (its
  version counter moved) before re-gathering: ``any_rank``;
* ``compile``: the plan (made on rank 0), the shapes of the first batch, the software versions;
* writability of the folders at start (``runtime.writable``): the checkpoint root on every rank,
  gathered; the monitoring folder (rank 0 writes it): rank 0 decides.
* ``param_store`` / ``shard_init``: which tensors are on the meta device (initialised in place, not
  broadcast) and the init's base seed, and under ``init="skip"`` which buffers no state dict holds
  (the init's only targets; none: no init runs): rank 0 decides; an init failure or a tensor left
  uninitialised on one rank: gathered, so that every rank raises;
* ``in_place``: whether a ``model(x)`` batch under ``no_grad`` has the compiled shapes (the program)
  or not (the model's own forward, eagerly): ``every_rank`` (skipped with ``check_inputs="never"``);
* ``batch_checks``: a batch one rank refuses, or rows that differ within a data shard (local
  batches too): the ranks' checks are all-gathered on the checked steps, so every rank raises.
* ``weights``: what a weights folder holds (DCP or files: ``dcp.load`` is a collective): rank 0
  decides; a source that does not read or weights that do not fit: gathered, every rank raises;
  ``save_weights``' file failures on rank 0 (which keeps gathering): rank 0 decides at the end.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch.distributed as dist

__all__ = ["decided_by_rank0", "any_rank", "every_rank", "gathered", "world_of"]

T = TypeVar("T")


def world_of(group=None) -> int:
    """The number of ranks in ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _rank(group=None) -> int:
    return dist.get_rank(group) if world_of(group) > 1 else 0


def decided_by_rank0(decide: Callable[[], T], group=None) -> T:
    """Rank 0 of ``group`` (default: all ranks) calls ``decide()``; every rank returns its result.

    An exception raised by ``decide`` on rank 0 is re-raised on every rank (as the same exception
    on rank 0, as a ``RuntimeError`` naming it on the others), never a hang."""
    if world_of(group) == 1:
        return decide()
    box: list[Any] = [None]
    failure: BaseException | None = None
    if _rank(group) == 0:
        try:
            box[0] = ("ok", decide())
        except Exception as exc:  # noqa: BLE001 - every rank must learn that rank 0 failed
            failure = exc
            box[0] = ("error", f"{type(exc).__name__}: {exc}")
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    kind, value = box[0]
    if kind == "error":
        if failure is not None:
            raise failure
        raise RuntimeError(f"rank 0 failed while deciding for every rank: {value}")
    return value


def gathered(obj: T, group=None) -> list[T]:
    """Every rank's ``obj`` (of ``group``, default all), in rank order, on every rank."""
    n = world_of(group)
    if n == 1:
        return [obj]
    every: list[Any] = [None] * n
    dist.all_gather_object(every, obj, group=group)
    return every


def any_rank(flag: bool, group=None) -> bool:
    """True on every rank where ``flag`` is true on at least one rank."""
    return any(gathered(bool(flag), group))


def every_rank(flag: bool, group=None) -> bool:
    """True on every rank where ``flag`` is true on all ranks."""
    return all(gathered(bool(flag), group))
