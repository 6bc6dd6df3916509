"""Checks of a Plan's fields, at construction and when read back from JSON (``Plan.from_json``).

A plan JSON is a record people edit and other autopar versions write: every field autopar does
not know, and every value of the wrong kind, is a ``PlanFormatError`` naming the field and
saying what a valid value is, rather than a raw Python error later in the runtime. Pure
functions over a plan's values; nothing here plans.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import fields
from typing import Any

from autopar.errors import PlanFormatError

__all__ = ["check_known_fields", "check_plan_fields", "NOT_SERIALISED"]

NOT_SERIALISED = ("timings", "edited", "observed")  # Plan fields (and its parts') that to_json leaves out

_FIX = "re-plan with autopar.plan (or autopar plan -o) instead of editing the record"


def check_known_fields(obj: Any, cls: type, where: str) -> None:
    """``obj`` (a JSON object) holds no key that ``cls`` has no field for (a record of a newer
    schema, or a typo in an edited one)."""
    if not isinstance(obj, dict):
        raise PlanFormatError(f"plan JSON field '{where[:-1] or '<top level>'}' must be an object, got {obj!r}")
    known = {f.name for f in fields(cls)} - set(NOT_SERIALISED)
    unknown = sorted(k for k in obj if k not in known and not (k == "schema_version" and not where))
    if unknown:
        raise PlanFormatError(
            f"plan JSON has unknown field '{where}{unknown[0]}' (a record of a newer autopar, or a typo in an edited "
            f"one; the {cls.__name__} fields are {', '.join(sorted(known))}): upgrade autopar to read it, or {_FIX}")


def _positive_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def _bad(name: str, value: Any, expected: str) -> PlanFormatError:
    return PlanFormatError(f"plan field '{name}' must be {expected}, got {value!r}; {_FIX}")


def check_plan_fields(plan) -> None:
    """The decisions a runtime reads from a plan (mesh, microbatches, schedule, stages) have
    the right kinds; raises PlanFormatError naming the first field that does not."""
    from autopar.constraints import SCHEDULES

    if not _positive_int(plan.microbatches):
        raise _bad("microbatches", plan.microbatches, "an integer >= 1 (microbatches per training step)")
    if not _positive_int(plan.virtual_stages):
        raise _bad("virtual_stages", plan.virtual_stages, "an integer >= 1 (pipeline stages per rank)")
    if not isinstance(plan.recompute, bool):
        raise _bad("recompute", plan.recompute, "true or false")
    if plan.schedule is not None and plan.schedule not in SCHEDULES:
        raise _bad("schedule", plan.schedule, f"null or one of {', '.join(SCHEDULES)}")
    for name in ("model_class", "cluster_json", "precision", "optimizer", "constraints"):
        if not isinstance(getattr(plan, name), str):
            raise _bad(name, getattr(plan, name), "a string")
    axes = plan.mesh_axes
    if not (isinstance(axes, tuple) and axes and all(
            isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str) and _positive_int(a[1]) for a in axes)):
        raise _bad("mesh_axes", axes, "a non-empty list of [axis name, size >= 1] pairs")
    if not (isinstance(plan.stages, tuple) and plan.stages):
        raise _bad("stages", plan.stages, "a non-empty list of stages")
    if len(plan.stages) % plan.virtual_stages:
        raise _bad("virtual_stages", plan.virtual_stages, f"a divisor of the {len(plan.stages)} stages")
    for i, st in enumerate(plan.stages):
        if not (isinstance(st.first_rank, numbers.Integral) and not isinstance(st.first_rank, bool)
                and st.first_rank >= 0):
            raise _bad(f"stages[{i}].first_rank", st.first_rank, "an integer >= 0 (the stage's first rank)")
    free = plan.free_step_time_s
    if free is not None and not (isinstance(free, numbers.Real) and not isinstance(free, bool) and math.isfinite(free)
                                 and free >= 0):
        raise _bad("free_step_time_s", free, "null or seconds >= 0")
    bubble = plan.bubble_fraction
    if not (isinstance(bubble, numbers.Real) and not isinstance(bubble, bool) and 0.0 <= bubble <= 1.0):
        raise _bad("bubble_fraction", bubble, "a fraction in [0, 1]")
