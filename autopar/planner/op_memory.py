"""What one op does to memory, measured by running it on fake tensors: what autograd saves for
its backward, which outputs alias an input, and the temporaries of its forward and backward.

Why measured rather than tabled: what an op saves depends on the op, its arguments and autocast
(``linear`` saves ``weight.t()``, or under autocast a bf16 *copy* of the weight and of its input;
``scaled_dot_product_attention`` saves its output and a log-sum-exp; ``gelu`` its input); a table
drifts from torch, a run on fake tensors cannot. Each distinct op signature (target, input
shapes, dtypes, gradient flags, non-tensor arguments, autocast dtype) runs once, forward and
backward, at the traced global shapes under ``memory_tracker.MemoryTracker``; repeated layers
share signatures, so a 96-layer model profiles one layer's ops.

Saved entries: ``("in", i)`` input i itself (or a view of it), ``("cast", i, itemsize)`` a copy
of input i in another dtype (autocast), ``("out", j)`` output j, ``("new", nbytes)`` anything
else (a log-sum-exp, a mask). Byte figures are global; the planner scales them to a rank's shard.
"""
from __future__ import annotations

import contextlib
import operator
import threading
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.planner.bounded_memo import BoundedMemo

__all__ = ["OpMemory", "op_memory", "clear_cache"]


@dataclass(frozen=True)
class OpMemory:
    saved: tuple[tuple, ...]
    aliases: tuple[int | None, ...]  # per output: the input index whose storage it shares
    fwd_temp: float  # bytes above inputs + what outlives the forward, at the forward's peak
    bwd_temp: float  # bytes above the input gradients, at the backward's peak
    measured: bool = True


# op signature (target, argument shapes and dtypes, autocast dtype) -> its OpMemory, measured once
# per process. Bounded: an entry depends on its signature only, so a dropped one is measured again;
# 8192 signatures hold every distinct op of the largest benchmark models several times over.
_CACHE = BoundedMemo(8192)


def clear_cache() -> None:
    _CACHE.clear()


def _fallback(node: fx.Node, n_in: int, n_out: int) -> OpMemory:
    """Conservative guess for an op that cannot run on fake tensors: it saves every input."""
    return OpMemory(tuple(("in", i) for i in range(n_in)), (None,) * n_out, 0.0, 0.0, measured=False)


def _signature(node: fx.Node, autocast_dtype) -> tuple:
    def key(a):
        if isinstance(a, fx.Node):
            m = (a.meta.get("autopar.outputs") or (None,))[0]
            return ("T", tuple(m.shape), str(m.dtype), bool(a.meta.get("autopar.needs_grad"))) if m is not None else ("N", a.name)
        return a
    args = pytree.tree_map(key, (node.args, node.kwargs))
    return (str(node.target), repr(args), str(autocast_dtype))


_WARNINGS_LOCK = threading.RLock()


@contextlib.contextmanager
def warnings_silenced():
    """``warnings.catch_warnings()`` ignoring everything, one thread at a time: it swaps
    process-global state, and two planner threads (``search.run_concurrently``) interleaving
    their enter and exit could leave warnings switched off for good."""
    with _WARNINGS_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def op_memory(node: fx.Node, autocast_dtype: torch.dtype | None = None, device_type: str = "cpu") -> OpMemory:
    """The memory profile of ``node`` (a call_function op of a traced graph)."""
    from autopar.trace import tensor_inputs

    inputs = tensor_inputs(node)
    outs = node.meta.get("autopar.outputs") or ()
    if node.op != "call_function" or node.target is operator.getitem:
        return OpMemory((), (0,) * len(outs), 0.0, 0.0)
    sig = _signature(node, autocast_dtype)
    hit = _CACHE.get(sig)
    if hit is None:
        try:
            with warnings_silenced():
                hit = _measure(node, inputs, autocast_dtype, device_type)
        except Exception:  # noqa: BLE001 - any op torch cannot fake gets the conservative guess
            hit = _fallback(node, len(inputs), len(outs))
        _CACHE.put(sig, hit)
    return hit


def _measure(node: fx.Node, inputs: list[fx.Node], autocast_dtype, device_type: str) -> OpMemory:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopar.memory_tracker import MemoryTracker

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fakes: dict[fx.Node, torch.Tensor] = {}
    with mode:
        for a in inputs:
            if a in fakes:
                continue
            m = a.meta["autopar.outputs"][0]
            t = torch.empty(m.shape, dtype=m.dtype, device=device_type)
            if a.meta.get("autopar.needs_grad") and m.is_floating:
                t.requires_grad_(True)
            fakes[a] = t
    in_list = [fakes[a] for a in inputs]
    args, kwargs = pytree.tree_map(lambda x: fakes[x] if isinstance(x, fx.Node) else x, (node.args, node.kwargs))
    saved: list[torch.Tensor] = []
    in_sids = [t.untyped_storage()._cdata for t in in_list]
    with mode, MemoryTracker() as tracker:
        tracker.register(in_list, "params")
        cast = torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
        with cast, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = node.target(*args, **kwargs)
        out_list = [o for o in (out if isinstance(out, (tuple, list)) else (out,))]
        out_t = [o for o in out_list if isinstance(o, torch.Tensor)]
        after_fwd = tracker.current_bytes
        fwd_temp = max(tracker.report().peak_bytes - after_fwd, 0)
        out_sids = [o.untyped_storage()._cdata if isinstance(o, torch.Tensor) else None for o in out_list]
        aliases = tuple(in_sids.index(s) if s in in_sids else None for s in out_sids)
        entries, seen = [], set()
        for t in saved:
            if not isinstance(t, torch.Tensor):
                continue
            sid = t.untyped_storage()._cdata
            if sid in seen:
                continue
            seen.add(sid)
            if sid in in_sids:
                entries.append(("in", in_sids.index(sid)))
            elif sid in out_sids:
                entries.append(("out", out_sids.index(sid)))
            else:
                src = next((i for i, x in enumerate(in_list) if x.numel() == t.numel() and x.dtype != t.dtype), None)
                if src is not None:
                    entries.append(("cast", src, t.dtype.itemsize))
                else:
                    entries.append(("new", float(t.untyped_storage().nbytes())))
        bwd_temp = 0.0
        want = [x for x in in_list if x.requires_grad]
        diff_outs = [o for o in out_t if o.requires_grad and o.is_floating_point()]
        if want and diff_outs:
            grads = [torch.empty_like(o) for o in diff_outs]
            tracker.register(grads, "params")
            before = tracker.current_bytes
            tracker.reset_peak()  # measure the backward's own peak
            with tracker.phase("backward"):
                got = torch.autograd.grad(diff_outs, want, grads, allow_unused=True)
            grad_bytes = sum(g.untyped_storage().nbytes() for g in got if g is not None)
            bwd_temp = max(tracker.report().peak_bytes - before - grad_bytes, 0)
    return OpMemory(tuple(entries), aliases, float(fwd_temp), float(bwd_temp))
