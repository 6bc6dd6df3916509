"""Per-rank memory measurement of a real training step: live tensor storages, by category.

``MemoryTracker`` is a ``TorchDispatchMode`` that sees every tensor an op creates (forward,
autograd backward, optimizer step, communication buffers), keys it by its *storage* (a view or a
transpose shares its base's storage, which is what autograd often saves: ``linear`` saves
``weight.t()``) and learns of each storage's release through a weak reference to it (torch keeps
a storage's Python object alive exactly as long as the storage). It works on any device, the
meta device included; on CUDA the caching allocator's own peak is reported beside it.

Categories: storages that exist before the step are registered with their role (``params`` for
parameters and buffers, ``grads``, ``optimizer_state``); storages created during the step are
named after the phase that created them (``activations`` in forward, ``backward`` and
``optimizer_step`` transients), except that the runtime may re-register a persistent one (e.g.
optimizer state created lazily on the first step). ``register_process()`` then counts every other
storage alive in the process (``process_storages``: the user's original model, a tensor the
loop keeps, the input batch) as ``unaccounted``: memory this rank holds that no category of the
plan's prediction covers, each such storage named by its owner in the report. For each category
the report gives its maximum over the step, and the composition at the moment of the overall peak.

Why hand-written: torch's ``torch.distributed._tools.mem_tracker`` does this for modules and
optimizers, but it is private, changes between releases, and knows nothing of autopar's phases.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch.utils import _pytree as pytree
from torch.distributed.tensor import DTensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.process_storages import StorageRecord, live_storages, owner_names

__all__ = ["MemoryTracker", "MemoryReport", "CATEGORIES", "UNACCOUNTED"]

CATEGORIES = ("params", "grads", "optimizer_state", "activations", "backward", "optimizer_step")  # the plan predicts these
UNACCOUNTED = "unaccounted"  # alive in the process, in no predicted category
_TRACKED = CATEGORIES + (UNACCOUNTED,)
_LARGEST = 20  # unaccounted storages a report lists by name
_PHASE_CATEGORY = {"forward": "activations", "backward": "backward", "optimizer": "optimizer_step"}


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per rank. ``category_peaks``: each category's maximum over the step; ``at_peak``: the
    composition when the total peaked. ``device_peak_bytes``: the CUDA caching allocator's peak
    (allocated bytes) when measured on CUDA, else None. ``unaccounted``: the storages counted as
    ``unaccounted`` (alive in the process, in no predicted category) still alive at the end,
    largest first (at most ``_LARGEST``); ``unaccounted_by_holder``: their bytes per module or
    optimizer holding them ("" for none); ``unaccounted_bytes``: the unaccounted bytes at the peak."""

    peak_bytes: int
    category_peaks: dict = field(default_factory=dict)
    at_peak: dict = field(default_factory=dict)
    peak_phase: str = ""
    device_peak_bytes: int | None = None
    unaccounted: tuple[StorageRecord, ...] = ()
    unaccounted_by_holder: dict = field(default_factory=dict)
    unaccounted_bytes: int = 0

    def table(self, predicted: dict | None = None, predicted_peak: float | None = None) -> str:
        """A text table, with the prediction beside each figure when given."""
        mib = 2.0**20
        rows = [f"{'category':<16} {'measured MiB':>13} {'at peak MiB':>12}" + (f" {'predicted MiB':>14} {'ratio':>6}" if predicted else "")]
        for c in _TRACKED:
            got = self.category_peaks.get(c, 0)
            line = f"{c:<16} {got / mib:>13.3f} {self.at_peak.get(c, 0) / mib:>12.3f}"
            if predicted:
                want = predicted.get(c, 0.0)
                line += f" {want / mib:>14.3f} {got / want if want else float('nan'):>6.2f}"
            rows.append(line)
        line = f"{'peak':<16} {self.peak_bytes / mib:>13.3f} {'(' + self.peak_phase + ')':>12}"
        if predicted_peak:
            line += f" {predicted_peak / mib:>14.3f} {self.peak_bytes / predicted_peak:>6.2f}"
        rows.append(line)
        if self.unaccounted_by_holder:
            held = ", ".join(f"{h or '(no module or optimizer)'} {b / mib:.3f}"
                             for h, b in sorted(self.unaccounted_by_holder.items(), key=lambda kv: -kv[1]))
            rows.append(f"unaccounted at the peak {self.unaccounted_bytes / mib:.3f} MiB; held by (MiB): {held}; largest:")
            rows += [f"  {r.describe()}" for r in self.unaccounted]
        return "\n".join(rows)


class _Entry:
    __slots__ = ("nbytes", "category", "ref")

    def __init__(self, nbytes: int, category: str, ref):
        self.nbytes, self.category, self.ref = nbytes, category, ref


class MemoryTracker(TorchDispatchMode):
    """Track live storages while active (``with tracker:``); read ``report()`` afterwards.

    ``phase(name)`` ("forward", "backward", "optimizer") names what new storages are;
    ``register(tensors, category)`` declares storages that exist already (or changes the
    category of one created during the step, e.g. lazily made optimizer state).
    """

    def __init__(self, count_unallocated: bool = True):
        """``count_unallocated=False`` (measuring a real run): fake and meta tensors are not
        memory (DTensor's sharding propagation creates them on a cache miss)."""
        super().__init__()
        self.count_unallocated = count_unallocated
        self._live: dict[int, _Entry] = {}
        self._unaccounted: dict[int, StorageRecord] = {}  # storage key -> what it is, while counted unaccounted
        self._current = dict.fromkeys(_TRACKED, 0)
        self._total = 0
        self._peak = 0
        self._peaks = dict.fromkeys(_TRACKED, 0)
        self._at_peak: dict[str, int] = {}
        self._phase = "forward"
        self._peak_phase = ""
        self._ids = itertools.count()

    # ------------------------------------------------------------------ bookkeeping
    def _add(self, t: torch.Tensor, category: str, *, retag: bool = False) -> None:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return
        local = getattr(t, "_local_tensor", None)  # a DTensor: what this rank holds is its local shard
        if isinstance(local, torch.Tensor):
            t = local
        if not self.count_unallocated and (t.device.type == "meta" or isinstance(t, FakeTensor)):
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            return
        key = st._cdata
        entry = self._live.get(key)
        if entry is not None:
            if retag and entry.category != category:
                if entry.category == UNACCOUNTED:
                    self._unaccounted.pop(key, None)
                self._current[entry.category] -= entry.nbytes
                entry.category = category
                self._current[category] += entry.nbytes
                self._peaks[category] = max(self._peaks[category], self._current[category])
            return
        nbytes = st.nbytes()
        ref = weakref.ref(st, self._freer(key))
        self._live[key] = _Entry(nbytes, category, ref)
        self._current[category] += nbytes
        self._total += nbytes
        if self._current[category] > self._peaks[category]:
            self._peaks[category] = self._current[category]
        if self._total > self._peak:
            self._peak = self._total
            self._at_peak = dict(self._current)
            self._peak_phase = self._phase

    def _freer(self, key: int):
        tracker = weakref.ref(self)

        def freed(_ref):
            me = tracker()
            if me is None:
                return
            entry = me._live.get(key)
            if entry is not None and entry.ref is _ref:
                del me._live[key]
                me._unaccounted.pop(key, None)
                me._current[entry.category] -= entry.nbytes
                me._total -= entry.nbytes

        return freed

    def register(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        assert category in CATEGORIES, category
        for t in tensors:
            self._add(t, category, retag=True)

    def register_process(self, device_type: str | None = None, named_roots: dict | None = None) -> int:
        """Count every storage alive in the process (on ``device_type`` when given) that is not
        counted yet as ``unaccounted``, each named by its owner (``process_storages.owner_names``;
        ``named_roots``: modules to name first, e.g. {"the user's model": model}). Call it after
        registering what the prediction covers, and again after the step for storages made
        outside the dispatch mode. Returns the bytes it added."""
        found = live_storages(device_type)
        fresh = {k: v for k, v in found.items() if k not in self._live}
        del found
        names = owner_names(named_roots) if fresh else {}
        before = self._current[UNACCOUNTED]
        for key, (st, t) in fresh.items():
            self._add(t, UNACCOUNTED)
            if key in self._live:
                holder, owner = names.get(key, ("", ""))
                self._unaccounted[key] = StorageRecord(st.nbytes(), tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                                       owner, holder)
        return self._current[UNACCOUNTED] - before

    @contextlib.contextmanager
    def phase(self, name: str):
        assert name in _PHASE_CATEGORY, name
        old, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = old

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # the mode sees a DTensor op before DTensor does, and the wrapper it returns has the
            # *global* size; deferring lets DTensor run its local ops (the shards, the
            # collectives' buffers), which come back here as plain tensors
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        category = _PHASE_CATEGORY[self._phase]
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t, category)
        return out

    # ------------------------------------------------------------------ results
    @property
    def current_bytes(self) -> int:
        return self._total

    def reset_peak(self) -> None:
        """Start measuring the peak afresh from the current live bytes."""
        self._peak = self._total
        self._peaks = dict(self._current)
        self._at_peak = dict(self._current)

    def report(self, device_peak_bytes: int | None = None) -> MemoryReport:
        """The step's figures; measured on CUDA (``device_peak_bytes``: the caching allocator's
        peak, every allocation of the process), that is the peak, the categories this tracker's."""
        largest = sorted(self._unaccounted.values(), key=lambda r: -r.nbytes)
        held: dict[str, int] = {}
        for r in largest:
            held[r.holder] = held.get(r.holder, 0) + r.nbytes
        return MemoryReport(
            peak_bytes=int(self._peak if device_peak_bytes is None else device_peak_bytes),
            category_peaks={c: int(v) for c, v in self._peaks.items()},
            at_peak={c: int(v) for c, v in self._at_peak.items()},
            peak_phase=self._peak_phase,
            device_peak_bytes=device_peak_bytes,
            unaccounted=tuple(largest[:_LARGEST]),
            unaccounted_by_holder=held,
            unaccounted_bytes=int(self._at_peak.get(UNACCOUNTED, 0)),
        )
