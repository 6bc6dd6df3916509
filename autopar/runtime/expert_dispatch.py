"""Expert parallelism for dropless experts: the grouped matmul over experts other ranks hold.

In a token-wise region (``autopar.regions``) whose expert weights the plan splits over a mesh
axis (``[experts, ...]``, dim 0, ``ep`` ranks holding ``experts / ep`` each), every rank sorts its
own tokens' rows by expert as the model's code does, and each ``grouped_mm(x, w, offs)`` of the
region runs ``ExpertRows.grouped_mm`` instead: the rows of each rank's experts (contiguous, being sorted)
go to that rank by an all-to-all with variable split sizes, which computes its experts on the
rows of every rank and sends the results back by the reverse all-to-all. Backward runs the same
exchanges for the gradients (each all-to-all's backward is the reverse one). The per-expert row
counts are exchanged first (an all-to-all of ``experts`` int64 per rank).

Between grouped matmuls over one routing the rows stay where the experts are (``ExpertRows``):
a grouped matmul's result is held as the experts' rows, ops that act on each row alone
(``regions.ROW_LOCAL_OPS``, every tensor operand such rows of one routing) run on them there,
and the next grouped matmul takes them as they are; anything else (or the region's end) brings
the value it takes back first. A Mixtral expert layer (gate-up, activation, down) so exchanges
rows twice, not four times. ``regions.grouped_exchanges`` prices the same rules.
"""
from __future__ import annotations

from types import MappingProxyType

import torch
import torch.utils._pytree as pytree

from autopar.grouped_mm import grouped_mm
from autopar.regions import ROW_LOCAL_OPS
from autopar.runtime.collectives import current_mesh

__all__ = ["ExpertRows", "row_local_name", "expert_group_axes"]


class _AllToAllV(torch.autograd.Function):
    """Rows to ranks by ``in_splits``, rows from ranks by ``out_splits``; backward the reverse,
    over the mesh the forward used (backward may run outside any step: the native loop's)."""

    @staticmethod
    def forward(ctx, x, axis, out_splits, in_splits):
        ctx.axis, ctx.out_splits, ctx.in_splits = axis, out_splits, in_splits
        ctx.comm = current_mesh()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        ctx.comm.all_to_all_v(out, x.contiguous(), axis, out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        ctx.comm.all_to_all_v(back, grad.contiguous(), ctx.axis, ctx.in_splits, ctx.out_splits)
        return back, None, None, None


def _routing(offs: torch.Tensor, axis: int, n: int) -> tuple:
    """(rows to each rank, rows from each rank, received rows regrouped by local expert as an
    index and its inverse, the local experts' cumulative row counts, rows routed) for ``offs``:
    one all-to-all of the per-expert counts, then one host read of the split sizes (the only one
    per routing: dropless experts' step syncs once per expert layer, dense models' never)."""
    comm = current_mesh()
    ep = comm.size_of(axis)
    ends = offs.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # rows per expert, this rank's tokens
    recv_counts = torch.empty_like(counts)
    comm.all_to_all_v(recv_counts, counts.contiguous(), axis, [n] * ep, [n] * ep)
    got = recv_counts.view(ep, n)  # [source rank, local expert]: rows received
    # the one host read of a routing (the all-to-alls' split sizes are host integers): rows to each
    # rank (its experts, contiguous), rows from each rank, rows routed
    sizes = torch.cat([counts.view(ep, n).sum(dim=1), got.sum(dim=1), ends[-1:]]).tolist()
    send, recv, routed = sizes[:ep], sizes[ep:2 * ep], sizes[-1]
    # received rows come by source, then expert; the local grouped matmul wants them by expert
    # (each expert's rows from every source, in source order): a stable sort of each row's
    # (expert, source) block key
    block = torch.repeat_interleave(torch.arange(ep * n, device=offs.device), got.reshape(-1), output_size=sum(recv))
    index = torch.argsort((block % n) * ep + block // n, stable=True)
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=index.device)
    return send, recv, index, inverse, torch.cumsum(got.sum(dim=0), 0), routed


_METADATA = frozenset({"dtype", "device", "data_ptr", "requires_grad", "is_floating_point", "element_size",
                       "is_cuda", "layout", "is_contiguous"})
_REFLECTED = MappingProxyType({"rmul": "mul", "radd": "add", "rsub": "sub", "truediv": "div", "rtruediv": "div"})


def row_local_name(func) -> str:
    """``func``'s name as ``regions.ROW_LOCAL_OPS`` lists it (``Tensor.__mul__`` -> "mul", a
    property getter -> the property's name); "" for tensor indexing (it may pick rows)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    if name == "__getitem__":
        return ""
    name = name.strip("_")
    return _REFLECTED.get(name, name)


NOT_ROW_LOCAL = object()


def expert_group_axes(plan) -> tuple[tuple[int, ...], ...]:
    """The tuples of mesh axes (each of size > 1) whose ranks exchange expert rows as one group: the
    axes a parameter's dim 0 is split over, nested, where there are several (only expert weights
    nest; ``ir.region_expert_axis``). The same on every rank: read from the plan."""
    from autopar.layouts import Shard, parse_layout

    sizes = [n for _, n in plan.mesh_axes]
    out = set()
    for p in plan.params.values():
        axes = tuple(a for a, q in enumerate(parse_layout(p.layout)) if isinstance(q, Shard) and q.dim == 0 and sizes[a] > 1)
        if len(axes) > 1:
            out.add(axes)
    return tuple(sorted(out))


class ExpertRows:
    """One region call's grouped matmuls over mesh ``axis`` (see the module docstring; a tuple of
    axes: their flattened group, ``MeshComm.flat``, whose rank k holds the k-th block of experts as
    the nested ``Shard(0)`` cuts them, outer axis first): the routing per ``offs`` tensor, and the
    values held as experts' rows (by id, with their routing and the token rows they came from)."""

    def __init__(self, axis):
        self.axis = axis
        self.routed: dict = {}
        self.held: dict = {}  # id -> (tensor, routing key, token rows)
        self.returned: dict = {}  # id of a held value -> its token rows, once brought back

    def grouped_mm(self, x: torch.Tensor, w_local: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """The rows of this rank's experts times ``w_local``, held as experts' rows."""
        ep, n = current_mesh().size_of(self.axis), w_local.shape[0]
        if offs.shape[0] != ep * n:
            raise RuntimeError(f"expert parallelism: {offs.shape[0]} experts over {ep} ranks of {n} each do not add up")
        key = (id(offs), self.axis)
        if key not in self.routed:
            self.routed[key] = (offs, _routing(offs, self.axis, n))  # keeps offs alive, so its id is not reused
        send, recv, index, _inverse, local_offs, total = self.routed[key][1]
        held = self.held.get(id(x))
        if held is not None and held[1] == key:
            rows, tokens = x, held[2]
        else:
            x = self.bring_back(x) if held is not None else x
            rows, tokens = _AllToAllV.apply(x[:total], self.axis, recv, send).index_select(0, index), x.shape[0]
        out = grouped_mm(rows, w_local, local_offs)
        self.held[id(out)] = (out, key, tokens)
        return out

    def row_local(self, func, args: tuple, kwargs: dict):
        """``func`` run on held rows where it acts on each row alone (its result held too), or on
        metadata; ``NOT_ROW_LOCAL`` otherwise (and where it touches no held value)."""
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        keys = {self.held[id(t)][1] if id(t) in self.held else None for t in tensors}
        if not tensors or keys == {None}:
            return NOT_ROW_LOCAL
        name = row_local_name(func)
        if name in _METADATA:
            return func(*args, **kwargs)
        if name not in ROW_LOCAL_OPS or len(keys) != 1 or None in keys:
            return NOT_ROW_LOCAL
        if name in ("chunk", "split"):
            dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
            if dim % args[0].dim() != args[0].dim() - 1:
                return NOT_ROW_LOCAL
        key, tokens = keys.pop(), self.held[id(tensors[0])][2]
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.held[id(t)] = (t, key, tokens)
        return out

    def bring_back(self, t):
        """``t`` as token rows: a held value's rows sent back to the ranks whose tokens they are
        (once per value), anything else as it is."""
        if not isinstance(t, torch.Tensor) or id(t) not in self.held:
            return t
        if id(t) not in self.returned:
            _, key, tokens = self.held[id(t)]
            send, recv, _index, inverse, _local_offs, _total = self.routed[key][1]
            back = _AllToAllV.apply(t.index_select(0, inverse), self.axis, send, recv)
            if back.shape[0] < tokens:  # rows past the last group are zero, as grouped_mm leaves them
                back = torch.cat([back, back.new_zeros((tokens - back.shape[0],) + tuple(back.shape[1:]))])
            self.returned[id(t)] = back
        return self.returned[id(t)]

    def bring_back_all(self, tree):
        return pytree.tree_map(self.bring_back, tree)
