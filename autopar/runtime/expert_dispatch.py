"""Expert parallelism for dropless experts: the grouped matmul over experts other ranks hold.

In a token-wise region (``autopar.regions``) whose expert weights the plan splits over a mesh
axis (``[experts, ...]``, dim 0, ``ep`` ranks holding ``experts / ep`` each), every rank sorts its
own tokens' rows by expert as the model's code does, and each ``grouped_mm(x, w, offs)`` of the
region runs ``ep_grouped_mm`` instead: the rows of each rank's experts (contiguous, being sorted)
go to that rank by an all-to-all with variable split sizes, which computes its experts on the
rows of every rank and sends the results back by the reverse all-to-all. Backward runs the same
exchanges for the gradients (each all-to-all's backward is the reverse one). The per-expert row
counts are exchanged first (an all-to-all of ``experts`` int64 per rank).
"""
from __future__ import annotations

import torch

from autopar.grouped_mm import grouped_mm
from autopar.runtime.collectives import current_mesh

__all__ = ["ep_grouped_mm"]


class _AllToAllV(torch.autograd.Function):
    """Rows to ranks by ``in_splits``, rows from ranks by ``out_splits``; backward the reverse."""

    @staticmethod
    def forward(ctx, x, axis, out_splits, in_splits):
        ctx.axis, ctx.out_splits, ctx.in_splits = axis, out_splits, in_splits
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        current_mesh().all_to_all_v(out, x.contiguous(), axis, out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        current_mesh().all_to_all_v(back, grad.contiguous(), ctx.axis, ctx.in_splits, ctx.out_splits)
        return back, None, None, None


def ep_grouped_mm(x: torch.Tensor, w_local: torch.Tensor, offs: torch.Tensor, axis: int) -> torch.Tensor:
    """``grouped_mm(x, w, offs)`` where this rank holds experts ``[r * n, (r + 1) * n)`` of ``w``
    (``w_local``, n of them) on mesh ``axis`` of size ``ep`` (``offs``: cumulative rows per expert
    over all ``ep * n`` experts; rows sorted by expert)."""
    comm = current_mesh()
    ep, n = comm.sizes[axis], w_local.shape[0]
    experts = offs.shape[0]
    if experts != ep * n:
        raise RuntimeError(f"expert parallelism: {experts} experts over {ep} ranks of {n} each do not add up")
    ends = offs.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # rows per expert, this rank's tokens
    recv_counts = torch.empty_like(counts)
    comm.all_to_all_v(recv_counts, counts.contiguous(), axis, [n] * ep, [n] * ep)
    send = counts.view(ep, n).sum(dim=1).tolist()  # rows to each rank (its experts, contiguous)
    got = recv_counts.view(ep, n)  # [source rank, local expert]: rows received
    recv = got.sum(dim=1).tolist()
    rows = _AllToAllV.apply(x[: int(ends[-1])], axis, recv, send)  # by source, then expert
    # regroup by local expert (its rows from every source, in source order), compute, restore
    flat = got.reshape(-1).tolist()
    starts, pos = [], 0
    for c in flat:
        starts.append(pos)
        pos += c
    order = [i for e in range(n) for s in range(ep)
             for i in range(starts[s * n + e], starts[s * n + e] + flat[s * n + e])]
    index = torch.tensor(order, dtype=torch.int64, device=x.device)
    local_offs = torch.cumsum(got.sum(dim=0), 0)
    out_local = grouped_mm(rows.index_select(0, index), w_local, local_offs)
    restored = torch.empty_like(out_local).index_copy(0, index, out_local) if len(order) else out_local
    back = _AllToAllV.apply(restored, axis, send, recv)
    if back.shape[0] < x.shape[0]:  # rows past the last group are zero, as grouped_mm leaves them
        back = torch.cat([back, back.new_zeros((x.shape[0] - back.shape[0], back.shape[1]))])
    return back
