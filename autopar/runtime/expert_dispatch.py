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


def _routing(offs: torch.Tensor, axis: int, n: int) -> tuple:
    """(rows to each rank, rows from each rank, received rows regrouped by local expert as an
    index and its inverse, the local experts' cumulative row counts, rows routed) for ``offs``:
    one all-to-all of the per-expert counts."""
    comm = current_mesh()
    ep = comm.sizes[axis]
    ends = offs.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # rows per expert, this rank's tokens
    recv_counts = torch.empty_like(counts)
    comm.all_to_all_v(recv_counts, counts.contiguous(), axis, [n] * ep, [n] * ep)
    send = counts.view(ep, n).sum(dim=1).tolist()  # rows to each rank (its experts, contiguous)
    got = recv_counts.view(ep, n)  # [source rank, local expert]: rows received
    # received rows come by source, then expert; the local grouped matmul wants them by expert
    # (each expert's rows from every source, in source order): a stable sort of each row's
    # (expert, source) block key
    block = torch.repeat_interleave(torch.arange(ep * n, device=offs.device), got.reshape(-1))
    index = torch.argsort((block % n) * ep + block // n, stable=True)
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=index.device)
    return send, got.sum(dim=1).tolist(), index, inverse, torch.cumsum(got.sum(dim=0), 0), int(ends[-1])


def ep_grouped_mm(x: torch.Tensor, w_local: torch.Tensor, offs: torch.Tensor, axis: int,
                  routed: dict | None = None) -> torch.Tensor:
    """``grouped_mm(x, w, offs)`` where this rank holds experts ``[r * n, (r + 1) * n)`` of ``w``
    (``w_local``, n of them) on mesh ``axis`` of size ``ep`` (``offs``: cumulative rows per expert
    over all ``ep * n`` experts; rows sorted by expert). ``routed``: a memo of the routing per
    ``offs`` tensor, so the grouped matmuls of one layer exchange their counts once."""
    ep, n = current_mesh().sizes[axis], w_local.shape[0]
    if offs.shape[0] != ep * n:
        raise RuntimeError(f"expert parallelism: {offs.shape[0]} experts over {ep} ranks of {n} each do not add up")
    routed = {} if routed is None else routed
    key = (id(offs), axis)
    if key not in routed:
        routed[key] = (offs, _routing(offs, axis, n))  # keeps offs alive, so its id is not reused
    send, recv, index, inverse, local_offs, total = routed[key][1]
    rows = _AllToAllV.apply(x[:total], axis, recv, send)
    out_local = grouped_mm(rows.index_select(0, index), w_local, local_offs)
    back = _AllToAllV.apply(out_local.index_select(0, inverse), axis, send, recv)
    if back.shape[0] < x.shape[0]:  # rows past the last group are zero, as grouped_mm leaves them
        back = torch.cat([back, back.new_zeros((x.shape[0] - back.shape[0], back.shape[1]))])
    return back
