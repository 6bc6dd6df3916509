"""User constraints and per-module annotations for the planner.

``Constraints`` fixes parallel degrees and policies; what is left ``None`` the planner chooses.
``annotate(module, weight={"tp": "S(0)"})`` pins placements of a module's parameters (by
parameter name) or of its output (``output=``), by mesh axis name. ``Constraints.placements`` does
the same by glob over ``state_dict`` names: ``{"blocks.*.mlp.fc.weight": {"tp": "S(0)"}}``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping

import torch

from autopar.errors import ConstraintError
from autopar.layouts import format_placement, parse_placement

__all__ = ["Constraints", "annotate", "collect_annotations", "with_annotations", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
_ANNOTATION_ATTR = "_autopar_annotations"


def _check_degree(name: str, value) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConstraintError(f"Constraints.{name} must be a positive integer or None, got {value!r}")


def _freeze_pins(pins: Mapping[str, Mapping[str, str]] | None) -> tuple:
    if not pins:
        return ()
    out = []
    for pattern, axes in sorted(pins.items()):
        if not isinstance(axes, Mapping) or not axes:
            raise ConstraintError(
                f"placement pin for {pattern!r} must map mesh axis names to placements, "
                f"e.g. {{'tp': 'S(0)'}}; got {axes!r}"
            )
        frozen = []
        for axis, text in sorted(axes.items()):
            try:
                p = parse_placement(text) if isinstance(text, str) else text
            except ValueError as exc:
                raise ConstraintError(f"placement pin for {pattern!r} on axis {axis!r}: {exc}") from None
            frozen.append((axis, format_placement(p)))
        out.append((pattern, tuple(frozen)))
    return tuple(out)


@dataclass(frozen=True)
class Constraints:
    """Fixed decisions. Degrees multiply to the world size (``ep`` borrows dp x tp devices).

    >>> Constraints(tp=2, zero=3).tp
    2
    """

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    microbatches: int | None = None
    zero: int | None = None
    recompute: bool | None = None
    schedule: str | None = None
    placements: tuple = field(default=())  # ((glob, ((axis, placement), ...)), ...)
    outputs: tuple = field(default=())  # ((module glob, ((axis, placement), ...)), ...)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "ep", "microbatches"):
            _check_degree(name, getattr(self, name))
        if self.zero is not None and self.zero not in (0, 1, 2, 3):
            raise ConstraintError(f"Constraints.zero must be 0, 1, 2 or 3 (ZeRO stage), got {self.zero!r}")
        if self.recompute is not None and not isinstance(self.recompute, bool):
            raise ConstraintError(f"Constraints.recompute must be True, False or None, got {self.recompute!r}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ConstraintError(f"unknown schedule {self.schedule!r}; known schedules: {', '.join(SCHEDULES)}")
        if isinstance(self.placements, Mapping):
            object.__setattr__(self, "placements", _freeze_pins(self.placements))
        if isinstance(self.outputs, Mapping):
            object.__setattr__(self, "outputs", _freeze_pins(self.outputs))

    def is_free(self) -> bool:
        return self == Constraints()

    def to_dict(self) -> dict:
        return {
            "dp": self.dp, "tp": self.tp, "pp": self.pp, "ep": self.ep,
            "microbatches": self.microbatches, "zero": self.zero, "recompute": self.recompute,
            "schedule": self.schedule,
            "placements": [[g, [list(a) for a in axes]] for g, axes in self.placements],
            "outputs": [[g, [list(a) for a in axes]] for g, axes in self.outputs],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Constraints":
        d = dict(d)
        d["placements"] = {g: dict(map(tuple, axes)) for g, axes in d.get("placements", [])}
        d["outputs"] = {g: dict(map(tuple, axes)) for g, axes in d.get("outputs", [])}
        return cls(**d)

    def merged_with(self, placements: tuple, outputs: tuple) -> "Constraints":
        """These constraints plus annotation pins (a pin given twice must agree)."""
        merged = dict(self.placements)
        for g, axes in placements:
            if g in merged and merged[g] != axes:
                raise ConstraintError(
                    f"contradictory placements for {g!r}: {dict(merged[g])} (Constraints) vs "
                    f"{dict(axes)} (annotate); remove one of them"
                )
            merged[g] = axes
        outs = dict(self.outputs)
        for g, axes in outputs:
            if g in outs and outs[g] != axes:
                raise ConstraintError(f"contradictory output placements for module {g!r}: {dict(outs[g])} vs {dict(axes)}")
            outs[g] = axes
        return Constraints(
            self.dp, self.tp, self.pp, self.ep, self.microbatches, self.zero, self.recompute, self.schedule,
            tuple(sorted(merged.items())), tuple(sorted(outs.items())),
        )

    def __str__(self) -> str:
        items = [f"{k}={v}" for k, v in self.to_dict().items() if v not in (None, [])]
        return "Constraints(" + ", ".join(items) + ")"


def annotate(module: torch.nn.Module, *, output: Mapping[str, str] | None = None, **params: Mapping[str, str]) -> torch.nn.Module:
    """Pin placements for ``module``: its parameters by name, or its ``output``, per mesh axis.

    >>> import torch
    >>> fc = annotate(torch.nn.Linear(4, 8), weight={"tp": "S(0)"})
    >>> fc._autopar_annotations["weight"]
    (('tp', 'S(0)'),)
    """
    own = dict(module.named_parameters(recurse=False))
    notes = dict(getattr(module, _ANNOTATION_ATTR, {}))
    for name, axes in params.items():
        if name not in own:
            raise ConstraintError(
                f"annotate: {type(module).__name__} has no parameter {name!r}; its parameters are {sorted(own)}"
            )
        notes[name] = _freeze_pins({name: axes})[0][1]
    if output is not None:
        notes["__output__"] = _freeze_pins({"output": output})[0][1]
    setattr(module, _ANNOTATION_ATTR, notes)
    return module


def collect_annotations(model: torch.nn.Module) -> tuple[tuple, tuple]:
    """(parameter pins, output pins) from ``annotate`` calls anywhere in ``model``."""
    params, outputs = [], []
    for path, mod in model.named_modules():
        notes = getattr(mod, _ANNOTATION_ATTR, None)
        if not notes:
            continue
        for name, axes in notes.items():
            if name == "__output__":
                outputs.append((path, axes))
            else:
                params.append((f"{path}.{name}" if path else name, axes))
    return tuple(sorted(params)), tuple(sorted(outputs))


def with_annotations(constraints: Constraints, model: torch.nn.Module) -> Constraints:
    """``constraints`` plus the pins made with ``annotate`` anywhere in ``model``."""
    pins, outs = collect_annotations(model)
    return constraints.merged_with(pins, outs) if pins or outs else constraints


def constraints_json(c: Constraints) -> str:
    return json.dumps(c.to_dict(), sort_keys=True)
