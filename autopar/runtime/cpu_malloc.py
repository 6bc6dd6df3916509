"""glibc's malloc, set for training on CPU: large tensors reuse the heap instead of fresh pages.

On CPU, torch allocates every tensor with the C library's ``malloc``. glibc serves a block above
its mmap threshold (128 KiB at start) with a fresh ``mmap`` and unmaps it on free, so each step
of a training loop page-faults and zeroes its activations, gradients and collective buffers anew.
glibc raises that threshold by itself as blocks are freed (up to 32 MiB), which is why a CPU run
speeds up over its first tens of steps: the 8.4M-parameter MLP at dp=4 on 4 gloo processes ran
231 ms per step over its first 10 steps and 162-169 ms after 50; with the thresholds below, 143-161 ms
from the first step (``benchmarks/README.md``, "calibration.py").

``tune_cpu_malloc`` sets the mmap threshold to ``MMAP_THRESHOLD`` and the trim threshold to
``TRIM_THRESHOLD`` with ``mallopt`` (what PyTorch's CPU performance guides do with
``MALLOC_*`` variables or an ``LD_PRELOAD``-ed jemalloc / tcmalloc: no allocator is written here).
The process keeps up to ``TRIM_THRESHOLD`` of freed heap rather than returning it to the
system; tensors' own bytes, which the plan's memory figures count, do not change. Left alone
where the user chose: ``AUTOPAR_CPU_MALLOC=system``, any ``MALLOC_*_`` / ``GLIBC_TUNABLES``
malloc setting, an ``LD_PRELOAD``-ed allocator, or a C library other than glibc.
"""
from __future__ import annotations

import ctypes
import functools
import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune_cpu_malloc", "why_untuned"]

MMAP_THRESHOLD = 256 * 2**20  # blocks below this come from the heap (glibc's dynamic ceiling: 32 MiB)
TRIM_THRESHOLD = 2**30  # freed heap kept up to this before it is returned to the system
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_USER_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def why_untuned(environ=os.environ) -> str | None:
    """Why malloc is left as it is (a sentence), or None where autopar sets it (pure)."""
    if environ.get("AUTOPAR_CPU_MALLOC", "").lower() == "system":
        return "AUTOPAR_CPU_MALLOC=system"
    for name in _USER_ENV:
        if name in environ:
            return f"{name} is set"
    if "malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets malloc"
    preload = environ.get("LD_PRELOAD", "")
    for lib in _ALLOCATORS:
        if lib in preload:
            return f"{lib} is preloaded"
    return None


@functools.cache
def tune_cpu_malloc() -> bool:
    """Set glibc's mmap and trim thresholds in this process once (see the module doc); True where
    they are set, False where left alone (``why_untuned``, or not glibc)."""
    if why_untuned() is not None:
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: musl and macOS have their own allocators
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False
