"""The search's worker threads: independent attempts run side by side, one thread's Python at a time.

Building a problem and improving a plan are Python (the GIL runs one thread at a time); the LP and
MIP solvers are C++ and release the GIL. Left to the GIL, threads interleave their Python in
small slices, so every problem is built slowly at once and the largest LP starts late. Here a
thread runs Python only while it holds the *turn* and gives the turn away while its solver runs:
the largest problem is built first without interruption, and the others are built while its LP
solves (the turn goes to the waiting task given first). Results never depend on the threads:
each task is deterministic, and the memos the tasks share hold pure values.
"""
from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["run_concurrently", "solver_running"]


class _Turn:
    """The right to run Python, given to the waiting thread of highest priority (the smallest
    tuple: a task's priority is its parent's followed by its index among its siblings, so the
    first task given, and the tasks it starts in turn, go first)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._held = False
        self._waiting: list[tuple] = []

    def acquire(self, priority: tuple) -> None:
        with self._cond:
            self._waiting.append(priority)
            while self._held or min(self._waiting) != priority:
                self._cond.wait()
            self._waiting.remove(priority)
            self._held = True

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()


_TURN = _Turn()
_HOLDS = threading.local()  # .priority: this thread's task priority; .turn: it holds the turn


@contextlib.contextmanager
def solver_running():
    """Around a call that releases the GIL (a solver): the turn goes to another worker meanwhile."""
    if not getattr(_HOLDS, "turn", False):
        yield
        return
    _HOLDS.turn = False
    _TURN.release()
    try:
        yield
    finally:
        _TURN.acquire(_HOLDS.priority)
        _HOLDS.turn = True


def _with_turn(f, priority: tuple):
    def run():
        _HOLDS.priority = priority
        _TURN.acquire(priority)
        _HOLDS.turn = True
        try:
            return f()
        finally:
            _HOLDS.turn = False
            _TURN.release()
    return run


def run_concurrently(tasks: dict, threads: int | None) -> dict:
    """Run the callables of ``tasks`` on up to ``threads`` worker threads (None: the
    environment's ``AUTOPAR_PLANNER_THREADS``, else one per CPU), started in the order given (put
    the longest first); their results by key. The first exception
    is re-raised after every task has ended. A task may itself call this (its turn is given
    away while it waits)."""
    if threads is None:
        threads = int(os.environ.get("AUTOPAR_PLANNER_THREADS") or os.cpu_count() or 1)
    workers = min(len(tasks), threads)
    if workers <= 1:
        return {k: f() for k, f in tasks.items()}
    with solver_running():  # waiting for the workers, as for a solver
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="autopar-plan") as pool:
            parent = getattr(_HOLDS, "priority", ())
            futures = {k: pool.submit(_with_turn(f, parent + (i,))) for i, (k, f) in enumerate(tasks.items())}
    return {k: fut.result() for k, fut in futures.items()}
