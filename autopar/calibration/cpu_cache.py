"""The last-level cache a CPU node's ranks share (``DeviceSpec.shared_cache_bytes``), as Linux
describes it under ``/sys/devices/system/cpu/cpu*/cache``: what ``autopar calibrate`` records on
CPU processes, so that the cost model can tell an optimizer step whose state stays in cache from
one that streams it from memory (``planner.costing.element_costs``).
"""
from __future__ import annotations

import os
import pathlib

__all__ = ["last_level_cache_bytes", "parse_cache_size"]

_SYSFS = pathlib.Path("/sys/devices/system/cpu")


def parse_cache_size(text: str) -> int | None:
    """Bytes of a sysfs cache ``size`` ("307200K", "32M", "512"), None if unreadable (pure).

    >>> parse_cache_size("307200K"), parse_cache_size("32M"), parse_cache_size("512"), parse_cache_size("x")
    (314572800, 33554432, 512, None)
    """
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in "KMG" else text
    return int(digits) * scale if digits.isdigit() else None


def last_level_cache_bytes(root: pathlib.Path = _SYSFS) -> int | None:
    """Bytes of the highest-level data or unified cache of a core this process may run on; None
    where the system does not say (not Linux, no sysfs)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = [0]
    best: tuple[int, int] | None = None  # (level, bytes)
    for index in sorted((root / f"cpu{cpus[0] if cpus else 0}" / "cache").glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = parse_cache_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and size and (best is None or level > best[0]):
            best = (level, size)
    return best[1] if best else None
