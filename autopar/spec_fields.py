"""Field checks and JSON helpers for the cluster spec's frozen dataclasses (``autopar.cluster``).

Every check raises ``ClusterSpecError`` naming the owner and field and saying what a valid value
is; the JSON helpers turn a parsed spec back into constructor arguments and name the JSON path of
whatever is wrong. Pure functions; nothing here knows the spec's fields.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

from autopar.errors import ClusterSpecError

__all__ = ["check_float", "check_int", "is_fraction", "is_real", "check_rows", "check_name", "json_rows",
           "json_fields", "json_build"]


def check_float(owner: str, field: str, value: Any, hint: str) -> float:
    """Return ``value`` as a float if it is a finite number > 0, else raise naming the field."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ClusterSpecError(
            f"{owner}.{field} must be a positive finite number, got {value!r}; {hint}"
        )
    return float(value)


def check_int(owner: str, field: str, value: Any, hint: str) -> int:
    """Return ``value`` as an int if it is an integer >= 1, else raise naming the field."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ClusterSpecError(f"{owner}.{field} must be an integer >= 1, got {value!r}; {hint}")
    return int(value)


def is_fraction(value: Any) -> bool:
    """A real number in (0, 1] (not a bool, not NaN)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and 0.0 < float(value) <= 1.0


def is_real(value: Any, low: float = 0.0, high: float = math.inf, strict: bool = False) -> bool:
    """A finite real number (not a bool) in [low, high) -- in (low, high) where ``strict``."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        return False
    return (value > low if strict else value >= low) and value < high


def check_rows(owner: str, field: str, value: Any, row_ok, convert, expected: str, unique: bool = True) -> tuple:
    """``value`` (a sequence of rows) as a sorted tuple of ``convert(row)``: every row a list or
    tuple passing ``row_ok``, else an error saying ``expected``; with ``unique``, a first item
    (a name, a kind) listed twice is an error too."""
    rows = []
    for row in value if isinstance(value, (list, tuple)) else [value]:
        if not (isinstance(row, (list, tuple)) and row_ok(row)):
            raise ClusterSpecError(f"{owner}.{field} entries must be {expected}, got {row!r}")
        rows.append(convert(row))
    names = [r[0] for r in rows]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None) if unique else None
    if twice is not None:
        raise ClusterSpecError(f"{owner}.{field} lists {twice!r} twice: {names}")
    return tuple(sorted(rows))


def check_name(owner: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ClusterSpecError(f"{owner}.name must be a non-empty string, got {value!r}")


def json_rows(value: Any) -> Any:
    """JSON's lists as the spec's tuples, one level of rows deep (anything else unchanged: the
    field's own check says what is wrong with it)."""
    if not isinstance(value, list):
        return value
    return tuple(tuple(r) if isinstance(r, list) else r for r in value)


def json_fields(d: Any, prefix: str, names: list[str]) -> dict[str, Any]:
    """Check that JSON object ``d`` has exactly the keys ``names``; errors name the full path."""
    if not isinstance(d, dict):
        where = f"field '{prefix[:-1]}'" if prefix else "top level"
        raise ClusterSpecError(f"cluster JSON {where} must be an object, got {d!r}")
    missing = [k for k in names if k not in d]
    if missing:
        raise ClusterSpecError(f"cluster JSON is missing field '{prefix}{missing[0]}'")
    unknown = sorted(k for k in d if k not in names)
    if unknown:
        raise ClusterSpecError(
            f"cluster JSON has unknown field '{prefix}{unknown[0]}'; known: {sorted(names)}"
        )
    return dict(d)


def json_build(cls: type, kwargs: dict[str, Any], where: str) -> Any:
    """Construct ``cls(**kwargs)``, prefixing validation errors with the JSON location."""
    try:
        return cls(**kwargs)
    except ClusterSpecError as e:
        raise ClusterSpecError(f"cluster JSON {where}: {e}") from None
