"""What every step's batch is checked against (``ParallelModel``): the compiled example's shapes,
dtypes and constants; an exact, order-independent checksum the ranks compare in global-batch mode;
and, at compile time, inputs the plan would split unevenly.
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from autopar.errors import ConstraintError
from autopar.layouts import Shard, divides_evenly
from autopar.trace import TensorMeta

__all__ = ["CHECK_INPUTS_MODES", "FIRST_CHECKED_STEPS", "DEBUG_ENV", "Value", "Example", "check_inputs_mode",
           "example_spec", "mismatch", "checksum", "refuse_uneven_inputs"]

CHECK_INPUTS_MODES = ("first", "always", "never")
FIRST_CHECKED_STEPS = 2  # check_inputs="first": the ranks compare their batches on this many steps
DEBUG_ENV = "AUTOPAR_DEBUG"  # AUTOPAR_DEBUG=1: check_inputs="always"


@dataclass(frozen=True)
class Value:
    """A non-tensor input of the compiled example (a constant of the traced program)."""

    value: Any


@dataclass(frozen=True)
class Example:
    """The compiled example each step's batch must match: per input a ``TensorMeta`` (global
    shape and dtype), a ``Value``, or None (unknown: not checked); the same for the target."""

    inputs: tuple
    target: Any
    has_target: bool


def check_inputs_mode(mode: str | None) -> str:
    if mode is not None and mode not in CHECK_INPUTS_MODES:
        raise ConstraintError(f"check_inputs must be one of {', '.join(map(repr, CHECK_INPUTS_MODES))}, got {mode!r}")
    if os.environ.get(DEBUG_ENV, "").strip() not in ("", "0"):
        return "always"
    return mode or "first"


def example_spec(traced, microbatches: int, example: tuple | None) -> Example:
    """What the model was compiled with: from ``example`` (inputs, target) when given, else from the
    traced graph (traced at one microbatch's size: its batch dim times the microbatches)."""
    def spec(x):
        if isinstance(x, torch.Tensor):
            return TensorMeta(tuple(x.shape), x.dtype)
        return Value(x)

    has_target = traced.target_name is not None
    if example is not None:
        inputs, target = example
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        return Example(tuple(spec(x) for x in inputs), spec(target) if has_target else None, has_target)

    def from_graph(name):
        meta = (traced.node(name).meta.get("autopar.outputs") or (None,))[0]
        if meta is None:
            return None
        shape = tuple(meta.shape)
        if microbatches > 1 and shape:
            shape = (shape[0] * microbatches,) + shape[1:]
        return TensorMeta(shape, meta.dtype)

    return Example(tuple(from_graph(n) for n in traced.input_names),
                    from_graph(traced.target_name) if has_target else None, has_target)


def mismatch(x: Any, want: Any) -> str | None:
    """How ``x`` differs from the compiled ``want``, or None."""
    if want is None:
        return None
    if isinstance(want, TensorMeta):
        if not isinstance(x, torch.Tensor):
            return (f"is a {type(x).__name__}, but the model was compiled with a tensor of shape {want.shape} and "
                    f"dtype {want.dtype}")
        if tuple(x.shape) != tuple(want.shape) or x.dtype != want.dtype:
            return (f"has shape {tuple(x.shape)} and dtype {x.dtype}, but the model was compiled for shape "
                    f"{tuple(want.shape)} and dtype {want.dtype}")
        return None
    v = want.value
    try:
        same = type(x) is type(v) and bool(x == v)
    except Exception:  # noqa: BLE001 - a value that cannot be compared is not the compiled one
        same = False
    return None if same else f"is {x!r}, but the model was compiled with {v!r}"


_CHECKSUM_CHUNK = 1 << 22


def checksum(x: Any) -> list[int]:
    """[kind/shape/dtype code, sum, position-weighted sum] of a batch input, exact and independent
    of summation order: the tensor's bytes are summed as integers (int32 words), so equal batches
    give equal checksums on every rank whatever the thread count or device."""
    if not isinstance(x, torch.Tensor):
        return [zlib.crc32(repr(x).encode()), 0, 0]
    code = zlib.crc32(f"{tuple(x.shape)}|{x.dtype}".encode())
    if x.layout != torch.strided:
        return [code, 0, 0]
    raw = x.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    s1 = s2 = 0
    for start in range(0, words.numel(), _CHECKSUM_CHUNK):
        w = words[start: start + _CHECKSUM_CHUNK].to(torch.int64)
        # weights up to 251: |w * pos| < 2**39, a chunk's sum < 2**61 (no int64 overflow)
        pos = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device) % 251 + 1
        s1 += int(w.sum())
        s2 += int((w * pos).sum())
    wrap = lambda v: (v + 2**63) % 2**64 - 2**63  # noqa: E731 - into int64
    return [code, wrap(s1), wrap(s2)]


def refuse_uneven_inputs(plan, prog) -> None:
    """Every input the plan shards must divide evenly over its shards at the size the program
    runs (one microbatch; ``prog``: the ``parallel_model.RankProgram`` that runs it): an uneven share would be weighted as an even one in the loss and the
    gradients, training wrong without a word. Raised alike on every rank (it reads the plan)."""
    names = [a for a, _ in plan.mesh_axes]
    sizes = [n for _, n in plan.mesh_axes]
    traced = prog.traced
    for ph, layout in prog.input_layouts.items():
        meta = (traced.node(ph).meta.get("autopar.outputs") or (None,))[0]
        if meta is None or divides_evenly(meta.shape, layout, sizes):
            continue
        shape = tuple(meta.shape)
        counts: dict[int, int] = {}
        axes: dict[int, list[str]] = {}
        for p, n, a in zip(layout, sizes, names):
            if isinstance(p, Shard):
                counts[p.dim] = counts.get(p.dim, 1) * n
                axes.setdefault(p.dim, []).append(a)
        d = next(d for d in sorted(counts) if d >= len(shape) or shape[d] % counts[d])
        label = "the target" if ph == traced.target_name else f"input {traced.input_names.index(ph)}"
        over = f"mesh axis{'es' if len(axes[d]) > 1 else ''} {', '.join(map(repr, axes[d]))} ({counts[d]} shards)"
        m = plan.microbatches
        if m > 1 and d == 0:
            raise ConstraintError(
                f"the plan splits {label} (batch {shape[0] * m} on dim 0) into {m} microbatches of {shape[0]}, and "
                f"{over} split each microbatch: {shape[0]} does not divide by {counts[d]}, so the ranks' shares would "
                f"be uneven and weighted wrongly in the loss and gradients. Use a batch divisible by microbatches x "
                f"shards ({m * counts[d]}), or Constraints(microbatches=...) with {shape[0] * m} / microbatches "
                f"divisible by {counts[d]}")
        raise ConstraintError(
            f"the plan shards dim {d} of {label} (shape {shape}) over {over}, but {shape[d] if d < len(shape) else '-'} "
            f"does not divide by {counts[d]}: the ranks' shares would be uneven and weighted wrongly. Use a batch "
            f"divisible by {counts[d]} (pad or drop the last batch), or re-plan")
