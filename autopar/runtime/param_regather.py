"""Free gathered parameters after forward use and gather them again for backward (ZeRO-3/FSDP).

An op that consumes an all-gathered parameter saves it for backward (a linear saves the
transposed view ``weight.t()``); kept alive, every layer's full weights would sit in memory until
backward and ZeRO-3 would save nothing. ``regather_saved_params`` installs
``saved_tensors_hooks``: when autograd saves any tensor whose *storage* is that of a gathered
parameter (the tensor itself, a view, a transpose), only the local shard and the view's geometry
are kept, and backward gathers again and re-applies the geometry. This is FSDP's
``reshard_after_forward``; the planner prices the second gather. When backward unpacks one, the
gather of the one packed before it (the next backward needs) is started asynchronously, as FSDP's
backward prefetch does, where its gather can run asynchronously (``runtime.prefetch``).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref

import torch

__all__ = ["regather_saved_params", "remember_gathered_param"]


class _Recording:
    """One forward recorded under ``regather_saved_params``: ``gathered`` maps the storage id of
    a gathered parameter to (a weak reference to that storage, the local shard, the replay
    function); ``seq`` is the forward's ``_Sequence`` (kept alive by the saved tensors that point
    to it, until backward frees them)."""

    __slots__ = ("gathered", "seq")

    def __init__(self):
        self.gathered: dict[int, tuple] = {}
        self.seq = _Sequence()


# The forward being recorded in this thread (per-thread "active" state; the forward and the
# gathers it remembers run in one thread): set by the outermost ``regather_saved_params`` for its
# block, None outside it, where nothing is remembered.
_RECORDING: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar("autopar_regather", default=None)


def remember_gathered_param(gathered: torch.Tensor, local: torch.Tensor, replay) -> None:
    """Called by ``reshard`` for parameter gathers: how to rebuild ``gathered`` from ``local``.
    Outside ``regather_saved_params`` (e.g. a checkpointed block recomputed in backward) nothing
    is remembered: nothing would ever forget it."""
    rec = _RECORDING.get()
    if rec is None:
        return
    st = gathered.untyped_storage()
    rec.gathered[st._cdata] = (weakref.ref(st), local, replay)


class _Sequence:
    """Weak references to one forward's _Regather objects, in the order it saved them (no cycle
    keeps a prefetched buffer alive), and the one whose gather was started ahead (at most one)."""

    __slots__ = ("items", "ahead")

    def __init__(self):
        self.items: list = []
        self.ahead = None


class _Regather:
    __slots__ = ("local", "replay", "size", "stride", "offset", "seq", "index", "pending", "done", "__weakref__")

    def __init__(self, local, replay, t: torch.Tensor, seq: _Sequence):
        self.local, self.replay = local, replay
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.seq, self.index, self.pending, self.done = seq, len(seq.items), None, False


def _pack(rec: _Recording, t: torch.Tensor):
    if rec.gathered and t.layout == torch.strided:
        st = t.untyped_storage()
        entry = rec.gathered.get(st._cdata)
        if entry is not None and entry[0]() is st:
            seq = rec.seq
            obj = _Regather(entry[1], entry[2], t, seq)
            seq.items.append(weakref.ref(obj))
            return obj
    # not the tensor itself: an op saving its own output (softmax, exp) would then hold its node
    # through the output's grad_fn, a cycle that outlives the graph until Python's collector runs
    # (a graph dropped without backward, or kept by a split backward's ``retain_graph``)
    return t.detach() if t.grad_fn is not None else t


def _unpack(obj):
    if not isinstance(obj, _Regather):
        return obj
    with torch.no_grad():
        got = obj.pending if obj.pending is not None else obj.replay(obj.local)
        full = got.wait() if hasattr(got, "wait") else got
        obj.pending, obj.done = None, True
        seq = obj.seq
        if seq.ahead is not None and (seq.ahead() is None or seq.ahead() is obj or seq.ahead().done):
            seq.ahead = None
        j = obj.index - 1  # the one backward will need next: start its gather now (one at a time)
        while seq.ahead is None and j >= 0:
            nxt = seq.items[j]()
            if nxt is not None and not nxt.done and nxt.pending is None:
                nxt.pending = nxt.replay(nxt.local, async_op=True)
                seq.ahead = weakref.ref(nxt)
            j -= 1
    return full.as_strided(obj.size, obj.stride, obj.offset)


@contextlib.contextmanager
def regather_saved_params():
    """Inside: tensors autograd saves that are (views of) a gathered parameter keep only the
    local shard and are gathered again in backward. Nested blocks share the outermost's
    recording; leaving the outermost forgets every gathered parameter."""
    rec = _RECORDING.get()
    token = None
    if rec is None:
        rec = _Recording()
        token = _RECORDING.set(rec)
    try:
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(_pack, rec), _unpack):
            yield
    finally:
        if token is not None:
            rec.gathered.clear()
            _RECORDING.reset(token)
