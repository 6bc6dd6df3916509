"""Every tensor storage alive in this process, and who owns it.

A measurement that counts only the tensors it was told about cannot see a forgotten reference (the
user's original module, a cached copy, a tensor the training loop keeps in a list).
``live_storages`` walks every object the cyclic garbage collector tracks (``gc.get_objects()``;
every Python tensor object is one) and keeps each distinct storage once: views, transposes and the
``.grad`` of a parameter count by the storage they share, a ``DTensor`` by its local shard on this
rank (the storage it really holds). ``owner_names`` names storages after the module parameter or
buffer, or the optimizer state, that holds them.

Limits (stated so a reader knows what "whole process" means off CUDA): storages reachable only from
C++ (a retained autograd graph's saved tensors, a C++ extension's cache) have no Python object and
are not seen; on CUDA the caching allocator's counters see them (``measure_step`` uses those).
Fake and meta tensors hold no memory and are skipped.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["StorageRecord", "live_storages", "storage_of", "owner_names"]


@dataclass(frozen=True)
class StorageRecord:
    """One storage alive in the process: its bytes, the shape and dtype of a tensor over it, who
    owns it (``owner``: the parameter, buffer or optimizer state's full name) and the module or
    optimizer that holds it (``holder``); both "" where none does."""

    nbytes: int
    shape: tuple
    dtype: str
    owner: str = ""
    holder: str = ""

    def describe(self) -> str:
        shape = "x".join(str(s) for s in self.shape) or "scalar"
        return f"{self.nbytes / 2**20:.2f} MiB {self.dtype} [{shape}] {self.owner or '(no module or optimizer holds it)'}"


def storage_of(t, device_type: str | None = None):
    """(key, untyped storage, tensor) of the memory ``t`` really holds on this rank, or None (not a
    dense tensor, fake or meta, on another device type, or a subclass without a storage). The key
    identifies the storage itself: views of one storage share it."""
    if not isinstance(t, torch.Tensor):
        return None
    local = getattr(t, "_local_tensor", None)  # a DTensor holds its local shard
    if isinstance(local, torch.Tensor):
        t = local
    try:
        if t.layout != torch.strided or t.device.type == "meta" or isinstance(t, FakeTensor):
            return None
        if device_type is not None and t.device.type != device_type:
            return None
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without a storage
        return None
    return st._cdata, st, t


def _tensors_in_process():
    """Every Python tensor object the garbage collector tracks, and the ``.grad`` of the leaves
    among them (a gradient may have no Python object of its own)."""
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(), not isinstance: no object's __class__ is read
            continue
        yield obj
        try:
            grad = obj.grad if obj.is_leaf and obj.requires_grad else None
        except (RuntimeError, NotImplementedError, AttributeError):
            grad = None
        if grad is not None:
            yield grad


def live_storages(device_type: str | None = None) -> dict[int, tuple]:
    """Every distinct storage alive in the process (on ``device_type`` when given): key ->
    (untyped storage, a tensor over it)."""
    found: dict[int, tuple] = {}
    for t in _tensors_in_process():
        s = storage_of(t, device_type)
        if s is not None and s[0] not in found:
            found[s[0]] = (s[1], s[2])
    return found


def owner_names(named_roots: dict[str, torch.nn.Module] | None = None) -> dict[int, tuple[str, str]]:
    """Storage key -> (holder, owner): "<root>.<parameter or buffer name>" for every module in the
    process (the roots given by name first, then every module no other module contains, called by
    its class), and "<Optimizer> state '<key>' of <parameter>" for every optimizer's state; the
    holder is the root's label or the optimizer's class."""
    names: dict[int, tuple[str, str]] = {}

    def claim(t, holder: str, name: str) -> None:
        s = storage_of(t)
        if s is not None and s[0] not in names:
            names[s[0]] = (holder, name)

    modules, optimizers = [], []
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.nn.Module):
            modules.append(obj)
        elif issubclass(type(obj), torch.optim.Optimizer):
            optimizers.append(obj)
    contained = {id(c) for m in modules for c in m._modules.values() if c is not None}
    roots = [(label, m) for label, m in (named_roots or {}).items()]
    roots += [(type(m).__name__, m) for m in modules if id(m) not in contained]
    for label, root in roots:
        try:
            for name, p in root.named_parameters(remove_duplicate=False):
                claim(p, label, f"{label}.{name}")
                if p.grad is not None:
                    claim(p.grad, label, f"{label}.{name}.grad")
            for name, b in root.named_buffers(remove_duplicate=False):
                claim(b, label, f"{label}.{name}")
        except Exception:  # noqa: BLE001 - a module in a broken state names nothing
            continue
    for opt in optimizers:
        label = type(opt).__name__
        for p, state in opt.state.items():
            s = storage_of(p)
            whose = names[s[0]][1] if s and s[0] in names else "a parameter of shape " + "x".join(map(str, p.shape))
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    claim(v, label, f"{label} state {k!r} of {whose}")
    return names
