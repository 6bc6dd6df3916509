"""User constraints and per-module annotations for the planner.

``Constraints`` fixes parallel degrees and policies; what is left ``None`` the planner chooses.
``annotate(module, weight={"tp": "S(0)"})`` pins placements of a module's parameters (by
parameter name) or of its output (``output=``), by mesh axis name. ``Constraints.placements`` does
the same by glob over ``state_dict`` names: ``{"blocks.*.mlp.fc.weight": {"tp": "S(0)"}}``.
"""
from __future__ import annotations

import difflib
import functools
import gc
import json
import warnings
import weakref
from dataclasses import dataclass, field, fields
from typing import Mapping

import torch

from autopar.errors import ConstraintError
from autopar.layouts import Partial, Placement, Shard, format_placement, parse_placement

__all__ = ["Constraints", "annotate", "collect_annotations", "with_annotations", "SCHEDULES", "MESH_AXES"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
# The mesh axes a placement can name (the planner's ``constraint_filter.AXES``; a test keeps them
# equal). Checked here, where a pin is written, so a bad axis is refused at ``annotate`` /
# ``Constraints(...)`` rather than deep inside the solver.
# 'ep': only on a ('dp', 'ep') mesh, 'dp_shard': only on an HSDP mesh (planner.meshes; checked when planning)
MESH_AXES = ("dp", "tp", "ep", "dp_shard", "cp")
_ANNOTATION_ATTR = "_autopar_annotations"
_PLACEMENT_FORMS = "'R' (replicated), 'S(<dim>)' (sharded on tensor dim <dim>, e.g. 'S(0)'), 'P(sum)' or 'P(avg)' (partial, outputs only)"
_AXIS_HINTS = {
    "pp": "pipeline stages are not a placement: they are set with Constraints(pp=...)",
}


def _check_degree(name: str, value) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConstraintError(f"Constraints.{name} must be a positive integer or None, got {value!r}")


def _axis_error(where: str, axis) -> ConstraintError:
    known = ", ".join(repr(a) for a in MESH_AXES[:-1]) + f" and {MESH_AXES[-1]!r}"
    hint = _AXIS_HINTS.get(axis, f"pin on one of {known}")
    return ConstraintError(f"{where} names mesh axis {axis!r}, which does not exist: the mesh axes are {known}; {hint}")


def _placement_hint(text: str) -> str:
    """A suggestion for a placement written in torch's spelling ("Shard(0)", "Replicate()")."""
    body = text.strip()
    low = body.lower().replace(" ", "")
    for prefix in ("shard(", "s("):
        if low.startswith(prefix) and low.endswith(")"):
            inner = low[len(prefix):-1].removeprefix("dim=")
            return f" (did you mean 'S({inner})'?)" if inner.lstrip("-").isdigit() else ""
    if low in ("replicate()", "replicate", "r()", "replicated"):
        return " (did you mean 'R'?)"
    if low.startswith("partial"):
        return " (did you mean 'P(sum)'?)"
    return ""


def _parse_pin(where: str, text, *, param: bool) -> Placement:
    """One placement of a pin, from its text ("R", "S(0)", "P(sum)") or a torch placement object."""
    if isinstance(text, str):
        try:
            p = parse_placement(text)
        except ValueError:
            raise ConstraintError(
                f"{where}: bad placement {text!r}{_placement_hint(text)}. The accepted forms are {_PLACEMENT_FORMS}; "
                "torch.distributed.tensor placement objects (Shard(0), Replicate()) are accepted too"
            ) from None
    elif isinstance(text, Placement):
        p = text
    else:
        raise ConstraintError(
            f"{where}: a placement must be a string such as 'S(0)' or 'R' (or a torch.distributed.tensor "
            f"placement), got {type(text).__name__} {text!r}. The accepted forms are {_PLACEMENT_FORMS}"
        )
    try:
        format_placement(p)
    except TypeError:
        raise ConstraintError(f"{where}: unsupported placement {p!r}; the accepted forms are {_PLACEMENT_FORMS}") from None
    if isinstance(p, Shard) and p.dim < 0:
        raise ConstraintError(
            f"{where}: placement {format_placement(p)!r} counts dims from the end; write the dim counted from 0 "
            f"(for a 2-d weight, S({2 + p.dim}) instead of S({p.dim}))"
        )
    if param and isinstance(p, Partial):
        raise ConstraintError(
            f"{where}: a parameter cannot be {format_placement(p)!r} (partial sums exist only for computed values); "
            "pin a parameter 'R' (whole) or 'S(<dim>)' (sharded)"
        )
    return p


def _freeze_pins(pins: Mapping[str, Mapping[str, str]] | None, *, param: bool = True, what: str = "placement pin",
                 where: str | None = None) -> tuple:
    """Validated ``((pattern, ((axis, "S(0)"), ...)), ...)``; errors say ``where`` (default: the pin)."""
    if not pins:
        return ()
    if not isinstance(pins, Mapping):
        raise ConstraintError(
            f"{what}s must be a dict from names to {{mesh axis: placement}}, e.g. {{'fc.weight': {{'tp': 'S(0)'}}}}; "
            f"got {type(pins).__name__}"
        )
    out = []
    for pattern, axes in sorted(pins.items(), key=lambda kv: str(kv[0])):
        if not isinstance(pattern, str):
            raise ConstraintError(f"{what} keys must be name strings (globs allowed, e.g. 'blocks.*.fc.weight'), got {pattern!r}")
        if not isinstance(axes, Mapping) or not axes:
            raise ConstraintError(
                f"{where or f'{what} for {pattern!r}'} must map mesh axis names to placements, "
                f"e.g. {{'tp': 'S(0)'}}; got {axes!r}"
            )
        frozen = []
        for axis, text in sorted(axes.items(), key=lambda kv: str(kv[0])):
            at = where or f"{what} {pattern!r}"
            if axis not in MESH_AXES:
                raise _axis_error(at, axis)
            p = _parse_pin(f"{at} on axis {axis!r}", text, param=param)
            frozen.append((axis, format_placement(p)))
        out.append((pattern, tuple(frozen)))
    return tuple(out)


def _freeze_zero_params(value) -> tuple:
    """``Constraints.zero_params`` as ((glob, stage), ...) sorted, checked."""
    if isinstance(value, tuple):
        try:
            value = dict(value)
        except (TypeError, ValueError):
            raise ConstraintError(f"Constraints.zero_params must be a dict such as {{'blocks.0.*': 3}}, got {value!r}") from None
    if not isinstance(value, Mapping):
        raise ConstraintError(f"Constraints.zero_params must be a dict from parameter names (globs allowed) to a ZeRO "
                              f"stage 0-3, such as {{'blocks.0.*': 3}}; got {type(value).__name__}")
    for g, z in value.items():
        if not isinstance(g, str):
            raise ConstraintError(f"Constraints.zero_params keys must be parameter name strings (globs allowed), got {g!r}")
        if z not in (0, 1, 2, 3) or isinstance(z, bool):
            raise ConstraintError(f"Constraints.zero_params[{g!r}] must be a ZeRO stage 0, 1, 2 or 3, got {z!r}")
    return tuple(sorted(value.items()))


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
    virtual_stages: int | None = None  # pipeline stages per rank (interleaved and zero-bubble schedules)
    # ZeRO stage per parameter glob, beating ``zero`` where one matches ({'blocks.0.*': 3}); a
    # pipeline plan sets it for the stages of the ranks that need it (ZeRO per stage)
    zero_params: tuple = field(default=())  # ((glob, stage), ...)
    # HSDP: ZeRO-3 within groups of ``hsdp`` neighbouring data-parallel ranks (a node), replicated
    # across the groups (the ('dp', 'dp_shard') mesh, ``planner.meshes``)
    hsdp: int | None = None
    # context parallelism: attention split along the sequence over ``cp`` ranks (the ('dp', 'cp',
    # 'tp') mesh, ``planner.meshes.context_mesh``); dp x cp x tp = the world size
    cp: int | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "ep", "microbatches", "virtual_stages", "hsdp", "cp"):
            _check_degree(name, getattr(self, name))
        if self.hsdp is not None:
            self._check_hsdp()
        if self.zero is not None and (isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3)):
            raise ConstraintError(f"Constraints.zero must be 0, 1, 2 or 3 (ZeRO stage), got {self.zero!r}"
                                  + ("; True is not a stage: write zero=3 to shard parameters, gradients and optimizer "
                                     "state (zero=1 or 2 for state, or state and gradients)"
                                     if isinstance(self.zero, bool) else ""))
        object.__setattr__(self, "zero_params", _freeze_zero_params(self.zero_params))
        if self.recompute is not None and not isinstance(self.recompute, bool):
            raise ConstraintError(f"Constraints.recompute must be True, False or None, got {self.recompute!r}")
        if (self.virtual_stages or 1) > 1 and (self.pp or 1) == 1:
            raise ConstraintError(
                f"Constraints.virtual_stages={self.virtual_stages} sets pipeline stages per rank, but pp is "
                f"{self.pp!r}: there is no pipeline to interleave; set pp=N (e.g. Constraints(pp=2, virtual_stages="
                f"{self.virtual_stages}, schedule='interleaved-1f1b')) or drop virtual_stages")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ConstraintError(f"unknown schedule {self.schedule!r}; known schedules: {', '.join(SCHEDULES)}")
        for name, param in (("placements", True), ("outputs", False)):
            value = getattr(self, name)
            what = "placement pin" if param else "output pin"
            if isinstance(value, tuple):  # the frozen form ((glob, ((axis, placement), ...)), ...): check it too
                try:
                    value = {g: dict(axes) for g, axes in value}
                except (TypeError, ValueError):
                    raise ConstraintError(
                        f"Constraints.{name} must be a dict such as {{'fc.weight': {{'tp': 'S(0)'}}}}, got {value!r}"
                    ) from None
            if not isinstance(value, Mapping) and value:
                raise ConstraintError(
                    f"Constraints.{name} must be a dict such as {{'fc.weight': {{'tp': 'S(0)'}}}}, got {type(value).__name__}"
                )
            object.__setattr__(self, name, _freeze_pins(value, param=param, what=what))

    def _check_hsdp(self) -> None:
        if self.hsdp == 1:
            raise ConstraintError("Constraints.hsdp=1 shards over groups of one rank, which is plain data parallelism: "
                                  "leave hsdp unset (zero=0 for replicas, zero=3 to shard over every data rank)")
        if self.zero not in (None, 3) or any(z != 3 for _, z in self.zero_params):
            raise ConstraintError(f"Constraints.hsdp={self.hsdp} shards parameters, gradients and optimizer state in its "
                                  f"groups (ZeRO-3 there), but zero={self.zero!r}"
                                  f"{' and zero_params=' + str(dict(self.zero_params)) if self.zero_params else ''} asks "
                                  "otherwise; leave zero unset (or zero=3) with hsdp, or drop hsdp")
        for name in ("ep", "pp"):
            if (getattr(self, name) or 1) > 1:
                raise ConstraintError(f"Constraints.hsdp={self.hsdp} with {name}={getattr(self, name)} is not supported: "
                                      f"HSDP runs on a single-stage mesh without an expert axis; drop hsdp or {name}")
        if self.dp is not None and (self.dp % self.hsdp or self.dp == self.hsdp):
            raise ConstraintError(f"Constraints.hsdp={self.hsdp} must divide dp={self.dp} and be smaller (groups of "
                                  f"{self.hsdp} ranks, replicated across dp / hsdp >= 2 groups); for ZeRO-3 over all "
                                  "dp ranks write zero=3 without hsdp")

    def is_free(self) -> bool:
        return self == Constraints()

    def to_dict(self) -> dict:
        return {
            "dp": self.dp, "tp": self.tp, "pp": self.pp, "ep": self.ep,
            "microbatches": self.microbatches, "zero": self.zero, "recompute": self.recompute,
            "schedule": self.schedule, "virtual_stages": self.virtual_stages,
            "placements": [[g, [list(a) for a in axes]] for g, axes in self.placements],
            "outputs": [[g, [list(a) for a in axes]] for g, axes in self.outputs],
            "zero_params": [[g, z] for g, z in self.zero_params],
            **({"hsdp": self.hsdp} if self.hsdp is not None else {}),  # absent when unset: older JSON unchanged
            **({"cp": self.cp} if self.cp is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Constraints":
        d = dict(d)
        d["placements"] = {g: dict(map(tuple, axes)) for g, axes in d.get("placements", [])}
        d["outputs"] = {g: dict(map(tuple, axes)) for g, axes in d.get("outputs", [])}
        d["zero_params"] = {g: z for g, z in d.get("zero_params", [])}
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
            tuple(sorted(merged.items())), tuple(sorted(outs.items())), self.virtual_stages, self.zero_params,
            hsdp=self.hsdp, cp=self.cp,
        )

    def __str__(self) -> str:
        items = [f"{k}={v}" for k, v in self.to_dict().items() if v not in (None, [])]
        return "Constraints(" + ", ".join(items) + ")"


_FIELDS = tuple(f.name for f in fields(Constraints))
_dataclass_init = Constraints.__init__


@functools.wraps(_dataclass_init)
def _constraints_init(self, *args, **kwargs):
    """The dataclass ``__init__``, but an unknown keyword is a ConstraintError naming the known ones."""
    unknown = [k for k in kwargs if k not in _FIELDS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], _FIELDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConstraintError(
            f"Constraints got an unknown setting {unknown[0]!r}; {hint}the settings are {', '.join(_FIELDS)}"
        )
    if len(args) > len(_FIELDS):
        raise ConstraintError(f"Constraints takes at most {len(_FIELDS)} settings ({', '.join(_FIELDS)}); pass them by name")
    _dataclass_init(self, *args, **kwargs)


Constraints.__init__ = _constraints_init


def annotate(module: torch.nn.Module, *, output: Mapping[str, str] | None = None, **params: Mapping[str, str]) -> torch.nn.Module:
    """Pin placements for ``module``: its parameters by name, or its ``output``, per mesh axis.

    >>> import torch
    >>> fc = annotate(torch.nn.Linear(4, 8), weight={"tp": "S(0)"})
    >>> fc._autopar_annotations["weight"]
    (('tp', 'S(0)'),)
    """
    if not isinstance(module, torch.nn.Module):
        raise ConstraintError(f"annotate needs a torch.nn.Module (the layer whose parameters or output to pin), got {type(module).__name__}")
    own = dict(module.named_parameters(recurse=False))
    notes = dict(getattr(module, _ANNOTATION_ATTR, {}))
    for name, axes in params.items():
        if name not in own:
            raise ConstraintError(
                f"annotate: {type(module).__name__} has no parameter {name!r}; its parameters are {sorted(own)}"
            )
        notes[name] = _freeze_pins({name: axes}, where=f"annotate: the pin of {type(module).__name__}.{name}")[0][1]
    if output is not None:
        notes["__output__"] = _freeze_pins({"output": output}, param=False,
                                              where=f"annotate: the output pin of {type(module).__name__}")[0][1]
    setattr(module, _ANNOTATION_ATTR, notes)
    _ANNOTATED.add(module)
    return module


# every module ``annotate`` pinned, while it lives: a pin on a module outside the model planned is
# named (``_warn_foreign_annotations``) instead of being ignored without a word
_ANNOTATED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _warn_foreign_annotations(model: torch.nn.Module) -> None:
    """Warn of pins made with ``annotate`` on live modules that are not in ``model`` (an instance
    other than the model's own layer): a warning, not an error, since another model of this
    process may own them."""
    mine = {id(m) for m in model.modules()}

    def foreign() -> list:
        return [m for m in list(_ANNOTATED) if id(m) not in mine and getattr(m, _ANNOTATION_ATTR, None)]

    if foreign():
        gc.collect()  # a module only a reference cycle holds is not the user's: not warned of
    stray = foreign()
    if stray:
        m = stray[0]
        pins = ", ".join(sorted("its output" if k == "__output__" else k for k in getattr(m, _ANNOTATION_ATTR)))
        warnings.warn(
            f"annotate() pinned {pins} of a {type(m).__name__} that is not part of the {type(model).__name__} being "
            f"planned ({len(stray)} such module{'s' if len(stray) > 1 else ''}): the plan ignores those pins. "
            f"Annotate the model's own layer (e.g. annotate(model.<path to the layer>, ...) on the instance passed to "
            f"plan/compile), or pin by name: Constraints(placements={{'<layer path>.weight': {{'tp': 'S(0)'}}}})",
            UserWarning, stacklevel=4)


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
    """``constraints`` plus the pins made with ``annotate`` anywhere in ``model`` (pins on modules
    outside it are warned of)."""
    _warn_foreign_annotations(model)
    pins, outs = collect_annotations(model)
    return constraints.merged_with(pins, outs) if pins or outs else constraints


def constraints_json(c: Constraints) -> str:
    return json.dumps(c.to_dict(), sort_keys=True)
