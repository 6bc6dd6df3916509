"""Whether a folder the run writes into (checkpoints, monitoring, calibration output) can be written.

A folder found read-only or full only at its first write fails on the rank that writes it, in the
middle of a step or after minutes of measurements, while the other ranks wait in a collective it
never enters. So each such folder is checked at start, before any work: created if missing, a
probe file written, fsynced and removed, on every rank that will write into it, the verdict agreed
across ranks (``runtime.agreement``); a failure names the path, the reason (ENOSPC included) and
the fix. ``describe_write_failure`` words an ``OSError`` met later (a save running out of space)
the same way.
"""
from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from types import MappingProxyType
from typing import Callable

from autopar.errors import AutoparError
from autopar.runtime.agreement import decided_by_rank0, gathered

__all__ = ["write_problem", "describe_write_failure", "check_writable"]

_FIXES = MappingProxyType({
    errno.ENOSPC: "free space on that filesystem",
    errno.EDQUOT: "free space within your quota there",
    errno.EROFS: "the filesystem is mounted read-only: choose a folder on a writable one",
    errno.EACCES: "make the folder writable for this user (chmod/chown) or choose another",
    errno.EPERM: "make the folder writable for this user (chmod/chown) or choose another",
    errno.ENOTDIR: "a part of the path is a file, not a folder: choose another path",
    errno.EEXIST: "a file of that name is in the way: remove it or choose another path",
})


def describe_write_failure(where: str | os.PathLike, exc: OSError) -> str:
    """``exc`` met writing into ``where``, as one sentence naming the path, the reason and the fix."""
    path = exc.filename if getattr(exc, "filename", None) else where
    code = errno.errorcode.get(exc.errno, "") if exc.errno is not None else ""
    reason = exc.strerror or str(exc) or type(exc).__name__
    fix = _FIXES.get(exc.errno, "make it writable or choose another folder")
    return f"cannot write {path}: {reason}" + (f" ({code})" if code else "") + f"; {fix}"


def write_problem(folder: str | os.PathLike, probe: str = ".autopar-write-check") -> str | None:
    """Why ``folder`` cannot be written (see the module docstring), or None when it can."""
    folder = Path(folder)
    path = folder / probe
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return describe_write_failure(folder, exc)
    finally:
        try:
            path.unlink()
        except OSError:
            pass
    return None


def check_writable(folder: str | os.PathLike, what: str, *, every_rank_writes: bool,
                   error: Callable[[str], Exception] = AutoparError) -> None:
    """Raise ``error`` on every rank if ``folder`` (the ``what``: "checkpoint root", ...) cannot be
    written by a rank that will write into it (every rank, or rank 0 alone)."""
    if every_rank_writes:
        # a probe of each process's own (ranks may share the folder, and hosts a network filesystem)
        found = gathered(write_problem(folder, f".autopar-write-check-{socket.gethostname()}-{os.getpid()}"))
        problems = [f"rank {r}: {p}" for r, p in enumerate(found) if p]
    else:
        found = decided_by_rank0(lambda: write_problem(folder))
        problems = [found] if found else []
    if problems:
        raise error(f"the {what} {folder} cannot be written (checked before any work): " + "; ".join(problems))
