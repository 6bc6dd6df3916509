"""The runtime's gradient-sync and prefetch settings, which the planner's cost and memory models
price: one definition, below both (``runtime.grad_sync`` and ``runtime.prefetch`` run them,
``planner.costing`` and ``planner.memory_model`` predict them)."""
from __future__ import annotations

__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "ZERO2_MAX_INFLIGHT", "ZERO3_MAX_INFLIGHT", "WIRE_BUCKETS",
           "bucket_full"]

BUCKET_BYTES = 4 * 2**20  # DDP uses 25 MiB; smaller buckets overlapped better on gloo here (benchmarks/README.md)
FIRST_BUCKET_BYTES = 2**20  # as DDP: a small first bucket starts communication early
ZERO2_MAX_INFLIGHT = 2  # ZeRO-2 reduce-scatters pending at once (each holds one full gradient)
ZERO3_MAX_INFLIGHT = 1  # ZeRO-3 gradient reduce-scatters pending at once (each keeps a whole gradient alive)
WIRE_BUCKETS = 2  # buckets alive at once as copies in a narrower reduce dtype


def bucket_full(nbytes: int, buckets: int) -> bool:
    """Whether a bucket holding ``nbytes`` takes no more gradients, when ``buckets`` exist."""
    return nbytes >= (FIRST_BUCKET_BYTES if buckets <= 1 else BUCKET_BYTES)
