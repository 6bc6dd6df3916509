"""The runtime's gradient-sync and prefetch settings, which the planner's cost and memory models
price: one definition, below both (``runtime.grad_sync`` and ``runtime.prefetch`` run them,
``planner.costing`` and ``planner.memory_model`` predict them)."""
from __future__ import annotations

import math

__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "ZERO2_MAX_INFLIGHT", "ZERO3_MAX_INFLIGHT", "WIRE_BUCKETS",
           "bucket_full", "bucket_count"]

BUCKET_BYTES = 25 * 2**20  # as DDP: 4 MiB buckets were 0.95-1.08x slower on gloo (benchmarks/README.md,
#                             runtime_overhead.py), the waits after backward outnumbering the overlap
FIRST_BUCKET_BYTES = 2**20  # as DDP: a small first bucket starts communication early
ZERO2_MAX_INFLIGHT = 2  # ZeRO-2 reduce-scatters pending at once (each holds one full gradient)
ZERO3_MAX_INFLIGHT = 1  # ZeRO-3 gradient reduce-scatters pending at once (each keeps a whole gradient alive)
WIRE_BUCKETS = 2  # buckets alive at once as copies in a narrower reduce dtype


def bucket_full(nbytes: int, buckets: int) -> bool:
    """Whether a bucket holding ``nbytes`` takes no more gradients, when ``buckets`` exist."""
    return nbytes >= (FIRST_BUCKET_BYTES if buckets <= 1 else BUCKET_BYTES)


def bucket_count(nbytes: float) -> int:
    """The buckets ``bucket_full`` cuts from one run of ``nbytes`` of gradients in fine pieces
    (each bucket closes once it holds its cap): the first at ``FIRST_BUCKET_BYTES``, the rest at
    ``BUCKET_BYTES``. Parameters larger than a cap make fewer, larger buckets."""
    if not math.isfinite(nbytes):
        return 1 << 62
    if nbytes <= FIRST_BUCKET_BYTES:
        return 1
    return 1 + math.ceil((nbytes - FIRST_BUCKET_BYTES) / BUCKET_BYTES)
