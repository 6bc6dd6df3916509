"""User model factories named ``MODULE:FACTORY`` (``autopar plan``, ``replay``, ``bench``): a callable
returning ``(model, example_inputs)`` or ``(model, example_inputs, loss_fn, example_target)``; a bad
name or result exits with a message saying what to pass."""
from __future__ import annotations

import importlib
import sys

__all__ = ["load_factory", "call_factory"]


def load_factory(spec: str):
    """The callable ``MODULE:FACTORY`` names (MODULE imported with the working directory on the path)."""
    if ":" not in spec:
        raise SystemExit(f"autopar: expected MODULE:FACTORY (e.g. examples.gpt:gpt_small), got {spec!r}")
    mod_name, fn_name = spec.split(":", 1)
    sys.path.insert(0, ".")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise SystemExit(f"autopar: cannot import module {mod_name!r}: {exc}") from None
    fn = getattr(mod, fn_name, None)
    if fn is None or not callable(fn):
        raise SystemExit(f"autopar: module {mod_name!r} has no callable {fn_name!r}")
    return fn


def call_factory(factory: str):
    """(model, example_inputs, loss_fn, example_target) from a MODULE:FACTORY."""
    made = load_factory(factory)()
    if not isinstance(made, tuple) or len(made) not in (2, 4):
        raise SystemExit("autopar: the factory must return (model, example_inputs) or (model, example_inputs, loss_fn, example_target)")
    return (made[0], made[1]) + ((made[2], made[3]) if len(made) == 4 else (None, None))
