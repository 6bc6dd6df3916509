"""Free gathered parameters after forward use and gather them again for backward (ZeRO-3/FSDP).

An op that consumes an all-gathered parameter saves it for backward (a linear saves the
transposed view ``weight.t()``); kept alive, every layer's full weights would sit in memory until
backward and ZeRO-3 would save nothing. ``regather_saved_params`` installs
``saved_tensors_hooks``: when autograd saves any tensor whose *storage* is that of a gathered
parameter (the tensor itself, a view, a transpose), only the local shard and the view's geometry
are kept, and backward gathers again and re-applies the geometry. This is FSDP's
``reshard_after_forward``; the planner prices the second gather.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

__all__ = ["regather_saved_params", "remember_gathered_param"]

# storage id of a gathered parameter -> (weakref to that storage, local shard, replay function)
_GATHERED: dict[int, tuple] = {}
_ACTIVE = [0]  # nesting depth of regather_saved_params (remember nothing outside it)


def remember_gathered_param(gathered: torch.Tensor, local: torch.Tensor, replay) -> None:
    """Called by ``reshard`` for parameter gathers: how to rebuild ``gathered`` from ``local``.
    Outside ``regather_saved_params`` (e.g. a checkpointed block recomputed in backward) nothing
    is remembered: nothing would ever forget it."""
    if not _ACTIVE[0]:
        return
    st = gathered.untyped_storage()
    _GATHERED[st._cdata] = (weakref.ref(st), local, replay)


class _Regather:
    __slots__ = ("local", "replay", "size", "stride", "offset")

    def __init__(self, local, replay, t: torch.Tensor):
        self.local, self.replay = local, replay
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


def _pack(t: torch.Tensor):
    if not _GATHERED or t.layout != torch.strided:
        return t
    st = t.untyped_storage()
    entry = _GATHERED.get(st._cdata)
    if entry is not None and entry[0]() is st:
        return _Regather(entry[1], entry[2], t)
    return t


def _unpack(obj):
    if isinstance(obj, _Regather):
        with torch.no_grad():
            full = obj.replay(obj.local)
        return full.as_strided(obj.size, obj.stride, obj.offset)
    return obj


@contextlib.contextmanager
def regather_saved_params():
    _ACTIVE[0] += 1
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _ACTIVE[0] -= 1
        if not _ACTIVE[0]:
            _GATHERED.clear()
