"""``model.to(...)``, ``.half()``, ``.bfloat16()``, ``.float()``, ``.cuda()``, ``.cpu()``,
``.to_empty(...)`` on a compiled model (the user's module sharded in place, or its
``ParallelModel``): all of them go through ``nn.Module._apply``, which this replaces.

The model's parameters and buffers are the plan's shards, which the program was traced, planned
and priced for at their dtype on their device, and which the program reads from its own store
(the DTensors share its storage): converting them would hand the user DTensors the program never
reads (it kept running the old shards). So a conversion or move is refused with what to do
instead (``compile(precision=...)``, a ``Cluster`` of that ``device_type``, or
``autopar.export_module(model).to(...)`` for a one-device copy); one that changes nothing
(``model.to(the shards' device)``, ``model.float()`` of a float32 model: the common habit) is a
no-op, as on any module.

A submodule's move (``model.transformer.h[0].half()``) is guarded the same way
(``guard_children``): every submodule of the compiled model and of its ``ParallelModel`` holds a
``_MoveGuard`` as its own ``_apply`` (an instance attribute, so its class, ``type(m) is``
checks, ``repr`` and pickling stay the user's); ``export_module`` drops them from its copy
(``unguard``), and a deep copy or unpickled copy of a submodule converts freely (it is no part
of the program).

Invariants: the decision is made on a small probe tensor per distinct (dtype, ndim) on the
shards' device, never by converting a shard: refusing allocates nothing of the model's size and
changes nothing. A submodule's (dtype, ndim) set is recorded when it is guarded, before a
pipeline plan takes another stage's entries off this rank's tree: the same move is refused on
every rank, whichever stage holds the submodule. It is rank-local and gates no collective.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from autopar.errors import AutoparError

__all__ = ["apply_or_refuse", "guard_children", "unguard"]


def apply_or_refuse(module: torch.nn.Module, fn, device: torch.device, what: str,
                    had: frozenset = frozenset()) -> torch.nn.Module:
    """``module._apply(fn)`` for a compiled ``module`` whose shards live on ``device``: ``module``
    unchanged where ``fn`` leaves every parameter and buffer as it is (those it holds, and the
    (dtype, ndim) pairs in ``had``), else an ``AutoparError`` naming the change and the fix
    (``what``: how the user holds the model, for the message)."""
    keys = dict.fromkeys(sorted(had, key=str))  # (dtype, ndim) -> None, in a fixed order
    keys.update(dict.fromkeys((t.dtype, t.dim()) for t in itertools.chain(module.parameters(), module.buffers())))
    for dtype, ndim in keys:
        probe = torch.empty((2,) * ndim, dtype=dtype, device=device)
        try:
            with torch.no_grad():
                out = fn(probe)
        except Exception as exc:  # noqa: BLE001 - the move itself fails here (e.g. .cuda() without CUDA)
            raise AutoparError(f"{what}.to(...)/.cuda()/.half()... after autopar.compile: converting its {dtype} "
                               f"shards on {device} fails ({type(exc).__name__}: {exc}). " + _fix(device)) from exc
        if out is probe:
            continue
        change = [f"{dtype} to {out.dtype}"] if out.dtype != dtype else []
        if out.device != probe.device:
            change.append(f"{device} to {out.device}")
        if not change:
            change.append("their memory layout (a copy the program would not read)")
        raise AutoparError(
            f"{what}.to(...)/.cuda()/.half()... after autopar.compile would convert its parameters and buffers "
            f"from {' and from '.join(change)}: they are the plan's shards, which the program was planned for and "
            f"keeps reading as they are, so the program would not run on the converted ones. " + _fix(device))
    return module


@dataclass(frozen=True, eq=False)
class _MoveGuard:
    """A compiled model's submodule's ``_apply`` (see the module docstring): ``apply_or_refuse``
    over what it holds and what it had when guarded. A copy (``copy.deepcopy``, ``pickle``) of the
    submodule is no part of the program: its guard is not ``live`` and lets the move happen."""

    module: torch.nn.Module
    device: torch.device
    what: str
    had: frozenset
    live: bool = True

    def __call__(self, fn, recurse: bool = True) -> torch.nn.Module:
        if not self.live:
            return type(self.module)._apply(self.module, fn, recurse)
        return apply_or_refuse(self.module, fn, self.device, self.what, self.had)

    def __reduce__(self):
        return (_MoveGuard, (self.module, self.device, self.what, self.had, False))


def guard_children(root: torch.nn.Module, device: torch.device, what: str) -> None:
    """Give every submodule of ``root`` (not ``root`` itself: its class guards it) a ``_MoveGuard``
    over the (dtype, ndim) of the parameters and buffers under it now. ``what``: how the user
    holds ``root`` (``"model"``, ``"pm"``), for the message."""
    for path, mod in root.named_modules():
        if mod is not root:
            had = frozenset((t.dtype, t.dim()) for t in itertools.chain(mod.parameters(), mod.buffers()))
            mod.__dict__["_apply"] = _MoveGuard(mod, device, f"{what}.{path} (a {type(mod).__name__})", had)


def unguard(root: torch.nn.Module) -> None:
    """Drop ``guard_children``'s guards from ``root``'s tree (a plain one-device copy converts freely)."""
    for mod in root.modules():
        if isinstance(mod.__dict__.get("_apply"), _MoveGuard):
            del mod.__dict__["_apply"]


def _fix(device: torch.device) -> str:
    return ("Convert or move the model before autopar.compile; for mixed precision compile with "
            "precision='bf16-mixed' (fp32 master weights, bf16 compute); for another device compile with a Cluster of "
            f"that device_type (these shards live on {device.type}); for a plain one-device copy to convert, use "
            "autopar.export_module(model).to(...). A .to() that changes nothing (the same device and dtype) is fine.")
