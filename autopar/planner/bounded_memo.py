"""``BoundedMemo``: the planner's process-wide memos, each with a bound.

Invariant: a memo's value is a pure function of its key (planning inputs, an op's signature), so
dropping an entry only costs computing it again; at most ``maxsize`` entries are held, the least
recently used dropped first. Thread-safe: the search's worker threads share the memos.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable

__all__ = ["BoundedMemo", "memo_of"]


class BoundedMemo:
    """A least-recently-used memo of at most ``maxsize`` entries, guarded by ``lock`` (re-entrant:
    a ``make`` may consult another memo under the same lock)."""

    def __init__(self, maxsize: int, lock: threading.RLock | None = None):
        if maxsize < 1:
            raise ValueError(f"BoundedMemo needs maxsize >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._lock = lock if lock is not None else threading.RLock()
        self._table: OrderedDict = OrderedDict()

    def get(self, key, default: Any = None) -> Any:
        with self._lock:
            if key not in self._table:
                return default
            self._table.move_to_end(key)
            return self._table[key]

    def put(self, key, value) -> Any:
        with self._lock:
            self._table[key] = value
            self._table.move_to_end(key)
            while len(self._table) > self.maxsize:
                self._table.popitem(last=False)
            return value

    def get_or_make(self, key, make: Callable[[], Any]) -> Any:
        """The value under ``key``, made (under the lock) and kept when absent."""
        with self._lock:
            if key in self._table:
                self._table.move_to_end(key)
                return self._table[key]
            return self.put(key, make())

    def clear(self) -> None:
        with self._lock:
            self._table.clear()

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, key) -> bool:
        return key in self._table


# per object (a traced graph, an fx graph): a dict of what the planner derives from it alone,
# held apart from the object (an fx module's ``meta`` is copied with it, ``runtime.compile``
# deep-copies the traced module); a dead or dropped object's entry only costs deriving again
_PER_OBJECT = BoundedMemo(16)


def memo_of(obj) -> dict:
    """The memo dict of ``obj`` (while ``obj`` lives; checked by a weak reference, so a new
    object at a dead one's address gets a fresh dict)."""
    import weakref

    with _PER_OBJECT._lock:
        hit = _PER_OBJECT.get(id(obj))
        if hit is not None and hit[0]() is obj:
            return hit[1]
        return _PER_OBJECT.put(id(obj), (weakref.ref(obj), {}))[1]
