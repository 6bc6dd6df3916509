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

Invariant: the decision is made on a small probe tensor per distinct (dtype, ndim) on the
shards' device, never by converting a shard: refusing allocates nothing of the model's size and
changes nothing. It is rank-local and gates no collective.
"""
from __future__ import annotations

import itertools

import torch

from autopar.errors import AutoparError

__all__ = ["apply_or_refuse"]


def apply_or_refuse(module: torch.nn.Module, fn, device: torch.device, what: str) -> torch.nn.Module:
    """``module._apply(fn)`` for a compiled ``module`` whose shards live on ``device``: ``module``
    unchanged where ``fn`` leaves every parameter and buffer as it is, else an ``AutoparError``
    naming the change and the fix (``what``: how the user holds the model, for the message)."""
    seen = set()
    for t in itertools.chain(module.parameters(), module.buffers()):
        key = (t.dtype, t.dim())
        if key in seen:
            continue
        seen.add(key)
        probe = torch.empty((2,) * t.dim(), dtype=t.dtype, device=device)
        try:
            with torch.no_grad():
                out = fn(probe)
        except Exception as exc:  # noqa: BLE001 - the move itself fails here (e.g. .cuda() without CUDA)
            raise AutoparError(f"{what}.to(...)/.cuda()/.half()... after autopar.compile: converting its {t.dtype} "
                               f"shards on {device} fails ({type(exc).__name__}: {exc}). " + _fix(device)) from exc
        if out is probe:
            continue
        change = [f"{t.dtype} to {out.dtype}"] if out.dtype != t.dtype else []
        if out.device != probe.device:
            change.append(f"{device} to {out.device}")
        if not change:
            change.append("their memory layout (a copy the program would not read)")
        raise AutoparError(
            f"{what}.to(...)/.cuda()/.half()... after autopar.compile would convert its parameters and buffers "
            f"from {' and from '.join(change)}: they are the plan's shards, which the program was planned for and "
            f"keeps reading as they are, so the program would not run on the converted ones. " + _fix(device))
    return module


def _fix(device: torch.device) -> str:
    return ("Convert or move the model before autopar.compile; for mixed precision compile with "
            "precision='bf16-mixed' (fp32 master weights, bf16 compute); for another device compile with a Cluster of "
            f"that device_type (these shards live on {device.type}); for a plain one-device copy to convert, use "
            "autopar.export_module(model).to(...). A .to() that changes nothing (the same device and dtype) is fine.")
