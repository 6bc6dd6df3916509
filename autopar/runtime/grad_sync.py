"""Bucketed, asynchronous gradient all-reduce for parameters the program left unsynchronised.

Hand-written because torch's bucketing reducer lives inside ``DistributedDataParallel`` and only
wraps whole modules; here the program decides per parameter which mesh axes to reduce over.
Buckets fill in the order gradients become ready (reverse of use); a full bucket is flattened and
all-reduced with ``async_op=True`` while backward continues; ``wait()`` finishes them all and
writes the reduced gradients back. Invariant: after ``wait()`` every registered parameter's
``.grad`` is the sum over its axes, exactly what an in-graph all-reduce would have produced.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["GradBucketer"]

BUCKET_BYTES = 4 * 2**20  # DDP uses 25 MiB; smaller buckets overlapped better on gloo here (benchmarks/README.md)
FIRST_BUCKET_BYTES = 2**20  # as DDP: a small first bucket starts communication early


class GradBucketer:
    def __init__(self, params: dict[torch.nn.Parameter, tuple], groups: tuple, bucket_bytes: int = BUCKET_BYTES):
        self.groups = groups
        self.bucket_bytes = bucket_bytes
        self.axes = {id(p): axes for p, axes in params.items()}
        self.params = list(params)
        self._pending: dict[tuple, list[torch.nn.Parameter]] = {}
        self._pending_bytes: dict[tuple, int] = {}
        self._inflight: list[tuple[list, list, torch.Tensor]] = []
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]
        self.enabled = True  # off while microbatches accumulate: reduce once, after the last
        self._buffers: dict[tuple, torch.Tensor] = {}  # bucket (param ids) -> flat buffer

    def _ready(self, p: torch.nn.Parameter) -> None:
        if not self.enabled:
            return
        axes = self.axes[id(p)]
        self._pending.setdefault(axes, []).append(p)
        self._pending_bytes[axes] = self._pending_bytes.get(axes, 0) + p.grad.numel() * p.grad.element_size()
        cap = FIRST_BUCKET_BYTES if not self._inflight else self.bucket_bytes
        if self._pending_bytes[axes] >= cap:
            self._flush(axes)

    def _flush(self, axes: tuple) -> None:
        bucket = self._pending.pop(axes, [])
        self._pending_bytes.pop(axes, None)
        if not bucket:
            return
        key = tuple(id(p) for p in bucket)
        grads = [p.grad.reshape(-1) for p in bucket]
        flat = self._buffers.get(key)
        if flat is None or flat.dtype != grads[0].dtype:
            flat = self._buffers[key] = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype,
                                                    device=grads[0].device)
        torch.cat(grads, out=flat)  # into a buffer kept across steps: no allocation per step
        works = [dist.all_reduce(flat, group=self.groups[a], async_op=True) for a in axes[:1]]
        self._inflight.append((bucket, list(axes[1:]), flat, works))

    def wait(self) -> None:
        for axes in list(self._pending):
            self._flush(axes)
        for bucket, rest, flat, works in self._inflight:
            for w in works:
                w.wait()
            for a in rest:  # further axes reduce after the first (rare: 2-D data parallel)
                dist.all_reduce(flat, group=self.groups[a])
            offset = 0
            for p in bucket:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        self._inflight.clear()
