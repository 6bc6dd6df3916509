"""The errors ``trace_model`` raises for a model it cannot capture: the user module that was running
and the innermost line of user code, whether the failure is data-dependent control flow (which no
capture can plan), and for a mixture-of-experts layer computing each expert on its routed tokens,
the forms autopar plans instead; and the description of a model output that is not a loss.

Invariant: every capture failure becomes one ``TraceError``, raised from the original exception,
that names the module and (where there is one) the user source line.
"""
from __future__ import annotations

import linecache
import traceback
from typing import TYPE_CHECKING

import torch

from autopar.errors import TraceError

if TYPE_CHECKING:
    from autopar.trace import _ModuleTracker


def _user_frame(exc: BaseException) -> tuple[str, int, str] | None:
    """Innermost traceback frame outside torch and autopar: (file, line, source)."""
    best = None
    for frame in traceback.extract_tb(exc.__traceback__):
        f = frame.filename.replace("\\", "/")
        if "/torch/" in f or "/autopar/" in f or "/site-packages/" in f or f.startswith("<"):
            continue
        best = (frame.filename, frame.lineno or 0, (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip())
    return best


_DATA_DEPENDENT_HINTS = (
    "data-dependent",
    "DataDependent",
    "Could not guard on data-dependent",
    "aten._local_scalar_dense",
    "item()",
    "Cannot call numpy",
    "nonzero",
)


def _is_data_dependent(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return any(h in text for h in _DATA_DEPENDENT_HINTS)


def _raise_trace_error(exc: BaseException, tracker: _ModuleTracker) -> None:
    path, cls = tracker.current()
    frame = _user_frame(exc)
    where = f" at {frame[0]}:{frame[1]}: `{frame[2]}`" if frame else ""
    text = f"{type(exc).__name__}: {exc}"
    module = f"module '{path}' ({cls})" if path else f"the model's top-level forward ({cls})"
    if any(h in text for h in _DATA_DEPENDENT_HINTS):
        msg = (
            f"autopar cannot trace {module}{where}: it branches on (or reads) tensor values, and a "
            "plan must hold for every input. Rewrite the branch with tensor ops (torch.where, "
            "masking, torch.cond) or move the data-dependent part out of the model."
        )
        if any(_looks_like_experts(tracker.modules[m]) for m in tracker.stack):
            msg += (" It looks like a mixture-of-experts layer computing each expert on the tokens routed to it "
                    "(sizes that depend on the routing), in a way autopar cannot follow: a Python loop or branch "
                    "over tensor values (such as the experts that were hit), or outside one module whose output is "
                    "per token. "
                    "autopar plans such loops inside a module that takes the tokens and returns one row per token "
                    "(run whole on each device's tokens), and the two forms that keep sizes known: grouped matmuls "
                    "over the tokens sorted by expert (torch.nn.functional.grouped_mm; Hugging Face models: "
                    "config._experts_implementation = 'grouped_mm'), or a fixed capacity per expert (einsums over "
                    "[experts, capacity, d]); see the README's 'Mixture of experts'.")
    else:
        msg = (
            f"autopar could not trace {module}{where}. The failure was: {text.splitlines()[0][:400]}. "
            "autopar needs a forward pass torch.fx can capture with fake tensors (no .item(), numpy "
            "or data-dependent shapes)."
        )
    raise TraceError(msg) from exc


def _looks_like_experts(module: torch.nn.Module) -> bool:
    """A weight stacked over experts (3 or more dims, its own), or a ModuleList of two or more
    modules of one class with equally shaped parameters."""
    if not isinstance(module, torch.nn.modules.conv._ConvNd) and any(p.dim() >= 3 for p in module.parameters(recurse=False)):
        return True
    for child in module.children():
        if isinstance(child, torch.nn.ModuleList) and len(child) >= 2:
            shapes = {(type(m), tuple(tuple(p.shape) for p in m.parameters())) for m in child}
            if len(shapes) == 1 and next(iter(shapes))[1]:
                return True
    return False


def _describe_output(out) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    if isinstance(out, dict):
        return f"{type(out).__name__} with {sorted(k for k, v in out.items() if v is not None)}"
    return type(out).__name__
