"""Free gathered parameters after forward use and gather them again for backward (ZeRO-3/FSDP).

An op that consumes an all-gathered parameter (a linear's weight) saves it for backward; kept
alive, every layer's full weights would sit in memory until backward and ZeRO-3 would save
nothing. ``regather_saved_params`` installs ``saved_tensors_hooks``: when autograd saves a tensor
that ``reshard`` produced by gathering a parameter, only the local shard is kept, and the gather
runs again when backward unpacks it. This is what FSDP's ``reshard_after_forward`` does; the
planner prices the second gather.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

__all__ = ["regather_saved_params", "remember_gathered_param"]

# id(gathered tensor) -> (weakref to it, local shard, replay function)
_GATHERED: dict[int, tuple] = {}


def remember_gathered_param(gathered: torch.Tensor, local: torch.Tensor, replay) -> None:
    """Called by ``reshard`` for parameter gathers: how to rebuild ``gathered`` from ``local``."""
    _GATHERED[id(gathered)] = (weakref.ref(gathered), local, replay)


class _Regather:
    __slots__ = ("local", "replay")

    def __init__(self, local, replay):
        self.local, self.replay = local, replay


def _pack(t: torch.Tensor):
    entry = _GATHERED.get(id(t))
    if entry is not None and entry[0]() is t:
        return _Regather(entry[1], entry[2])
    return t


def _unpack(obj):
    if isinstance(obj, _Regather):
        with torch.no_grad():
            return obj.replay(obj.local)
    return obj


@contextlib.contextmanager
def regather_saved_params():
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _GATHERED.clear()
