"""Sharding rules: for one op and ONE mesh axis, the ways its inputs and outputs may be laid out.

A rule is a function ``(OpView) -> list[AxisOption]``, registered by aten op name in ``RULES``: a
table, not a class hierarchy. The engine (``autopar.strategies``) takes the product of options over
the mesh axes, drops combinations that do not divide evenly, and adds the all-Replicate option.

Why hand-written: torch's DTensor has per-op strategy functions, but their registry, signatures
and single-dim variants are private and changed between 2.11 and 2.13 (``op_single_dim_strategy_
funcs`` is new in 2.13). The rules here are per op *family* (pointwise via ``torch.Tag.pointwise``,
einsum-style contractions, reductions, reshapes by shape arithmetic), so an op torch tags as
pointwise is covered without an entry. An op with no rule falls back to replicated.

Semantics every option must satisfy: running the op on the local shards (with shape arguments
localised) yields the local shard of the output in the stated placement.
"""
from __future__ import annotations

import operator
from typing import Callable, Sequence

import torch
import torch.fx as fx

from autopar.layouts import Partial, R, Shard
from autopar.node_view import OpView, op_name
from autopar.regions import REGION_EXPERTS_KEY
from autopar.strategies.conv_rules import batch_norm, convolution, pooling
from autopar.strategies.op_view import AxisOption
from autopar.strategies.reshape import reshape_dim_map
from autopar.trace import TensorMeta

# ``AxisOption``, ``OpView`` and ``op_name`` are re-exported: callers import the vocabulary with the rules
__all__ = ["AxisOption", "OpView", "RULES", "rule_for", "FACTORY_OPS"]

aten = torch.ops.aten


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


# --------------------------------------------------------------------------- pointwise
_LINEAR_UNARY = {"neg", "clone", "contiguous", "alias", "detach", "to", "_to_copy", "type_as", "positive"}
_LINEAR_SUM = {"add", "sub"}
_LINEAR_SCALE = {"mul", "div"}


def pointwise(op: OpView) -> list[AxisOption]:
    """Elementwise ops with broadcasting: any output dim may be sharded; inputs follow or stay R."""
    out = op.out
    if out is None:
        return []
    r = len(out.shape)
    options = []
    for d in range(r):
        if out.shape[d] == 1:
            continue
        ins = []
        for m in op.in_metas:
            if m is None:
                ins.append(None)
                continue
            k = d - (r - len(m.shape))
            ins.append(Shard(k) if k >= 0 and m.shape[k] == out.shape[d] else R)
        options.append(AxisOption(tuple(ins), (Shard(d),) * len(op.out_metas)))
    options += _partial_passthrough(op)
    return options


def _partial_passthrough(op: OpView) -> list[AxisOption]:
    """Linear elementwise ops keep a pending reduction pending (Partial in, Partial out)."""
    name = op_name(op.node)
    n = len(op.inputs)
    opts = []
    for kind in ("sum",):  # Partial(avg) only arises at the loss; it is not carried further
        P = Partial(kind)
        if name in _LINEAR_UNARY and n >= 1:
            opts.append(AxisOption((P,) + (None,) * (n - 1), (P,)))
        elif name in _LINEAR_SUM and n == 2 and _no_scalar_operand(op):
            opts.append(AxisOption((P, P), (P,)))
        elif name in _LINEAR_SCALE and n >= 1:
            if n == 1:
                opts.append(AxisOption((P,), (P,)))
            elif n == 2:
                opts.append(AxisOption((P, R), (P,)))
                if name == "mul":
                    opts.append(AxisOption((R, P), (P,)))
    return opts


def _no_scalar_operand(op: OpView) -> bool:
    return not any(isinstance(a, (int, float)) and not isinstance(a, bool) for a in op.node.args[:2])


def like_factory(op: OpView) -> list[AxisOption]:
    """``zeros_like`` & co: the output takes the input's layout (values do not depend on it)."""
    opts = pointwise(op)
    return [o for o in opts if not any(isinstance(p, Partial) for p in o.outs)]


# --------------------------------------------------------------------------- contractions
def _einsum_options(
    specs: Sequence[str | None], out_spec: str, metas: Sequence[TensorMeta | None], out_meta: TensorMeta,
    additive: Sequence[bool] = (),
) -> list[AxisOption]:
    """Options for ``out[out_spec] = sum(prod(inputs[spec]))``.

    A free letter (in the output) is sharded on the inputs that carry it at full size; a contracted
    letter is sharded on every input that has it and leaves the output ``Partial``; additive
    operands (a bias) without the contracted letter must then be ``Partial`` too.
    """
    additive = list(additive) + [False] * (len(specs) - len(additive))
    letters = []
    for s in list(specs) + [out_spec]:
        for c in s or "":
            if c not in letters:
                letters.append(c)
    options = []
    for c in letters:
        if c in out_spec:
            d = out_spec.index(c)
            if out_meta.shape[d] == 1:
                continue
            ins = []
            for s, m in zip(specs, metas):
                if s is None or m is None:
                    ins.append(None)
                elif c in s and m.shape[s.index(c)] == out_meta.shape[d]:
                    ins.append(Shard(s.index(c)))
                else:
                    ins.append(R)
            options.append(AxisOption(tuple(ins), (Shard(d),)))
        else:
            ins = []
            for s, m, add in zip(specs, metas, additive):
                if s is None or m is None:
                    ins.append(None)
                elif c in s:
                    ins.append(Shard(s.index(c)))
                else:
                    ins.append(Partial("sum") if add else R)
            options.append(AxisOption(tuple(ins), (Partial("sum"),)))
    # linearity in each multiplicative operand: Partial operand times Replicate others
    for i, (s, add) in enumerate(zip(specs, additive)):
        if s is None or add:
            continue
        ins = []
        for j, (s2, add2) in enumerate(zip(specs, additive)):
            if s2 is None:
                ins.append(None)
            elif j == i or add2:
                ins.append(Partial("sum"))
            else:
                ins.append(R)
        options.append(AxisOption(tuple(ins), (Partial("sum"),)))
    return options


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _batch_letters(n: int) -> str:
    return "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:n]


def linear(op: OpView) -> list[AxisOption]:
    x, w = op.in_metas[0], op.in_metas[1]
    nb = len(x.shape) - 1
    b = _batch_letters(nb)
    specs = [b + "k", "nk" if len(w.shape) == 2 else "k"]
    out_spec = b + ("n" if len(w.shape) == 2 else "")
    additive = [False, False]
    if len(op.in_metas) > 2:
        bias = op.in_metas[2]
        specs.append(out_spec[len(out_spec) - len(bias.shape):] if bias.shape else "")
        additive.append(True)
    return _einsum_options(specs, out_spec, op.in_metas, op.out, additive)


def _matmul_specs(a: TensorMeta, b: TensorMeta, out: TensorMeta) -> tuple[str, str, str]:
    ra, rb = len(a.shape), len(b.shape)
    batch = _batch_letters(max(ra, rb) - 2) if min(ra, rb) >= 2 else _batch_letters(max(ra, rb) - 1)
    if ra == 1 and rb == 1:
        return "k", "k", ""
    if ra == 1:
        return "k", batch[len(batch) - (rb - 2):] + "kn", batch[len(batch) - (rb - 2):] + "n"
    if rb == 1:
        return batch[len(batch) - (ra - 2):] + "mk", "k", batch[len(batch) - (ra - 2):] + "m"
    sa = batch[len(batch) - (ra - 2):] + "mk"
    sb = batch[len(batch) - (rb - 2):] + "kn"
    return sa, sb, batch + "mn"


def matmul(op: OpView) -> list[AxisOption]:
    a, b = op.in_metas[0], op.in_metas[1]
    sa, sb, so = _matmul_specs(a, b, op.out)
    return _einsum_options([sa, sb], so, [a, b], op.out)


def addmm_like(op: OpView) -> list[AxisOption]:
    """addmm(bias, a, b) / baddbmm(bias, a, b): a contraction plus an additive operand."""
    bias, a, b = op.in_metas[0], op.in_metas[1], op.in_metas[2]
    sa, sb, so = _matmul_specs(a, b, op.out)
    sbias = so[len(so) - len(bias.shape):] if bias.shape else ""
    if op.arg("beta", 1) == 0:
        sbias = None
    return _einsum_options([sbias, sa, sb], so, [bias, a, b], op.out, additive=[True, False, False])


def einsum(op: OpView) -> list[AxisOption]:
    eq = op.arg("equation").replace(" ", "")
    if "..." in eq or "->" not in eq:
        return []
    lhs, out_spec = eq.split("->")
    specs = lhs.split(",")
    if len(specs) != len(op.in_metas):
        return []
    return _einsum_options(specs, out_spec, op.in_metas, op.out)


# --------------------------------------------------------------------------- reductions
def _keep_dims_options(op: OpView, x: TensorMeta, blocked: set[int], extra_in: int = 0) -> list[AxisOption]:
    """Shard any input dim not in ``blocked``; the output keeps the same dim index."""
    options = []
    for d in range(len(x.shape)):
        if d in blocked or x.shape[d] == 1:
            continue
        ins = (Shard(d),) + (R,) * extra_in
        options.append(AxisOption(ins[: len(op.inputs)], (Shard(d),) * len(op.out_metas)))
    return options


def _reduced_dims(op: OpView, nd: int) -> tuple[set[int], bool] | None:
    """(reduced dims, keepdim) of a reduction; all dims when ``dim`` is None or empty."""
    dims = op.arg("dim")
    if dims in (None, [], ()):
        return set(range(nd)), bool(op.arg("keepdim", False))
    dims = [dims] if isinstance(dims, int) else dims
    return {_norm_dim(d, nd) for d in dims}, bool(op.arg("keepdim", False))


def _reduction_options(op: OpView, partial_kind: str | None) -> list[AxisOption]:
    """Kept dims pass their shard through; a reduced dim may be sharded only when the reduction
    is linear (``partial_kind``: the output is then that Partial)."""
    x = op.in_metas[0]
    red, keepdim = _reduced_dims(op, len(x.shape))
    options = []
    for d in range(len(x.shape)):
        if x.shape[d] == 1:
            continue
        if d in red:
            if partial_kind is not None:
                options.append(AxisOption((Shard(d),), (Partial(partial_kind),)))
            continue
        od = d if keepdim else d - sum(1 for r in red if r < d)
        options.append(AxisOption((Shard(d),), (Shard(od),) * len(op.out_metas)))
    return options


def sum_mean(op: OpView) -> list[AxisOption]:
    kind = "avg" if op_name(op.node) == "mean" else "sum"
    options = _reduction_options(op, kind)
    options.append(AxisOption((Partial("sum"),), (Partial("sum"),)))  # mean of a sum of parts
    return options


def max_like(op: OpView) -> list[AxisOption]:
    """amax/amin/max.dim/argmax: reduced dims stay whole; kept dims may be sharded."""
    if op.arg("dim") in (None, [], ()):
        return []
    return _reduction_options(op, None)


def softmax(op: OpView) -> list[AxisOption]:
    x = op.in_metas[0]
    return _keep_dims_options(op, x, {_norm_dim(op.arg("dim"), len(x.shape))})


def norm(op: OpView) -> list[AxisOption]:
    """layer_norm / rms_norm: the normalised trailing dims stay whole; weight and bias replicated."""
    x = op.in_metas[0]
    k = len(op.arg("normalized_shape"))
    nd = len(x.shape)
    return _keep_dims_options(op, x, set(range(nd - k, nd)), extra_in=len(op.inputs) - 1)


def loss_with_target(op: OpView) -> list[AxisOption]:
    """cross_entropy / nll: shard the sample dims (dim 0 and trailing spatial dims), never classes.

    reduction "mean" leaves ``Partial(avg)`` (exact with even shards and no ignored targets), "sum"
    leaves ``Partial(sum)``, "none" keeps the sample dim sharded.
    """
    x = op.in_metas[0]
    if len(x.shape) < 2:
        return []
    reduction = op.arg("reduction", 1)
    options = []
    sample_dims = [0] + list(range(2, len(x.shape)))
    for d in sample_dims:
        if x.shape[d] == 1:
            continue
        td = 0 if d == 0 else d - 1
        ins = [Shard(d), Shard(td)] + [R] * (len(op.inputs) - 2)
        if reduction == 0:
            out = Shard(td)
        else:
            out = Partial("avg" if reduction == 1 else "sum")
        options.append(AxisOption(tuple(ins), (out,)))
    return options


def elementwise_loss(op: OpView) -> list[AxisOption]:
    """mse/l1/bce-with-logits: elementwise, then reduced by ``reduction``."""
    x = op.in_metas[0]
    reduction = op.arg("reduction", 1)
    options = []
    for d in range(len(x.shape)):
        if x.shape[d] == 1:
            continue
        ins = tuple(Shard(d) if m is not None and m.shape == x.shape else R for m in op.in_metas)
        out = Shard(d) if reduction == 0 else Partial("avg" if reduction == 1 else "sum")
        options.append(AxisOption(ins, (out,)))
    return options


# --------------------------------------------------------------------------- data movement
def reshape(op: OpView) -> list[AxisOption]:
    x = op.in_metas[0]
    dmap = reshape_dim_map(x.shape, op.out.shape)
    options = [AxisOption((Shard(i),) + (None,) * (len(op.inputs) - 1), (Shard(o),)) for i, o in dmap.items()]
    options.append(AxisOption((Partial("sum"),) + (None,) * (len(op.inputs) - 1), (Partial("sum"),)))
    return options


def permute_like(op: OpView) -> list[AxisOption]:
    name = op_name(op.node)
    x = op.in_metas[0]
    nd = len(x.shape)
    if name == "t":
        perm = [1, 0] if nd == 2 else list(range(nd))
    elif name in ("transpose", "swapaxes"):
        d0 = _norm_dim(op.arg("dim0", op.arg("axis0")), nd)
        d1 = _norm_dim(op.arg("dim1", op.arg("axis1")), nd)
        perm = list(range(nd))
        perm[d0], perm[d1] = perm[d1], perm[d0]
    else:
        perm = [_norm_dim(d, nd) for d in op.arg("dims")]
    options = [AxisOption((Shard(perm[j]),), (Shard(j),)) for j in range(nd) if x.shape[perm[j]] != 1]
    options.append(AxisOption((Partial("sum"),), (Partial("sum"),)))
    return options


def expand(op: OpView) -> list[AxisOption]:
    x, out = op.in_metas[0], op.out
    lead = len(out.shape) - len(x.shape)
    options = []
    for d in range(len(out.shape)):
        if out.shape[d] == 1:
            continue
        k = d - lead
        if k >= 0 and x.shape[k] == out.shape[d]:
            options.append(AxisOption((Shard(k),), (Shard(d),)))
        else:
            options.append(AxisOption((R,), (Shard(d),)))  # expanding straight into local size
    return options


def _slicing_dim_rule(op: OpView, dim: int, removes_dim: bool) -> list[AxisOption]:
    x = op.in_metas[0]
    nd = len(x.shape)
    dim = _norm_dim(dim, nd)
    options = []
    for d in range(nd):
        if d == dim or x.shape[d] == 1:
            continue
        od = d - 1 if removes_dim and d > dim else d
        options.append(AxisOption((Shard(d),) + (R,) * (len(op.inputs) - 1), (Shard(od),) * len(op.out_metas)))
    return options


def slice_like(op: OpView) -> list[AxisOption]:
    name = op_name(op.node)
    dim = op.arg("dim", 0)
    return _slicing_dim_rule(op, dim, removes_dim=name in ("select", "unbind"))


def _is_legacy_empty(m: TensorMeta | None) -> bool:
    """A 1-D tensor of size 0: ``cat`` skips it whatever the other operands' rank (Hugging Face
    KV caches start as ``torch.tensor([])`` and are concatenated onto)."""
    return m is not None and m.shape == (0,)


def cat_like(op: OpView) -> list[AxisOption]:
    """cat / stack: shard any dim other than the joined one on every operand; legacy empty
    operands (see ``_is_legacy_empty``) stay replicated (they hold nothing)."""
    metas = op.in_metas
    name = op_name(op.node)
    full = [m for m in metas if m is not None and not (name != "stack" and _is_legacy_empty(m))]
    if not full:
        return []
    nd = len(full[0].shape)
    if any(len(m.shape) != nd for m in full):
        return []
    dim = op.arg("dim", 0)
    options = []
    if name == "stack":
        dim = _norm_dim(dim, nd + 1)
        for d in range(nd):
            if full[0].shape[d] == 1:
                continue
            od = d if d < dim else d + 1
            options.append(AxisOption((Shard(d),) * len(metas), (Shard(od),)))
    else:
        dim = _norm_dim(dim, nd)
        for d in range(nd):
            if d == dim or full[0].shape[d] == 1:
                continue
            ins = tuple(R if _is_legacy_empty(m) else Shard(d) for m in metas)
            options.append(AxisOption(ins, (Shard(d),)))
        options.append(AxisOption(tuple(R if _is_legacy_empty(m) else Partial("sum") for m in metas),
                                  (Partial("sum"),)))
    return options


def repeat_interleave(op: OpView) -> list[AxisOption]:
    """repeat_interleave(x, int repeats, dim): every dim passes its shard through; on ``dim`` each
    rank's block of inputs becomes its block of outputs (repeats are consecutive)."""
    x = op.in_metas[0]
    if not isinstance(op.arg("repeats"), int) or op.arg("output_size") is not None or op.arg("dim") is None:
        return []  # dim=None flattens first: leave it replicated
    options = [AxisOption((Shard(d),), (Shard(d),)) for d in range(len(x.shape)) if x.shape[d] != 1]
    return options


def embedding(op: OpView) -> list[AxisOption]:
    """embedding(weight[V, C], idx[...]): shard the index dims, or the weight's embedding dim."""
    idx = op.in_metas[1]
    options = [
        AxisOption((R, Shard(d)), (Shard(d),)) for d in range(len(idx.shape)) if idx.shape[d] != 1
    ]
    options.append(AxisOption((Shard(1), R), (Shard(len(op.out.shape) - 1),)))
    return options


def sdpa(op: OpView) -> list[AxisOption]:
    """Attention over [B, H, T, D]: shard batch or heads (q, k, v and the mask follow)."""
    q = op.in_metas[0]
    options = []
    for d in (0, 1):
        if len(q.shape) < 4 or q.shape[d] == 1:
            continue
        ins = []
        for i, m in enumerate(op.in_metas):
            if m is None:
                ins.append(None)
            elif i < 3:
                ins.append(Shard(d))
            else:  # attention mask, broadcast against [B, H, Tq, Tk]
                k = d - (4 - len(m.shape))
                ins.append(Shard(k) if k >= 0 and m.shape[k] == q.shape[d] else R)
        options.append(AxisOption(tuple(ins), (Shard(d),) * len(op.out_metas)))
    options += _context_sdpa(op)
    return options


def _context_sdpa(op: OpView) -> list[AxisOption]:
    """Context parallelism (on a context axis only): the queries' rows split along the sequence
    (dim -2), keys and values whole on the axis (all-gathered there; their gradients come back
    partial and are reduce-scattered), a mask split on its query rows. Exact without a causal
    mask as it stands; with ``is_causal`` the passes run ``ir.context_sdpa``, which masks by this
    rank's global rows (``passes.context_attention``)."""
    q = op.in_metas[0]
    nd = len(q.shape)
    if nd < 2 or q.shape[-2] <= 1 or op.arg("is_causal", False) and q.shape[-2] != op.in_metas[1].shape[-2]:
        return []  # (a causal mask over keys of another length: not split)
    ins = []
    for i, m in enumerate(op.in_metas):
        if m is None:
            ins.append(None)
        elif i == 0:
            ins.append(Shard(nd - 2))
        elif i < 3:
            ins.append(R)
        else:  # attention mask, broadcast against [..., Tq, Tk]: split on its query rows where it has them
            k = len(m.shape) - 2
            ins.append(Shard(k) if k >= 0 and m.shape[k] == q.shape[-2] else R)
    return [AxisOption(tuple(ins), (Shard(nd - 2),) * len(op.out_metas), context=True)]


def along_dim(op: OpView) -> list[AxisOption]:
    """cumsum / cumprod / diff / flip / sort-like ops along ``dim``: any other dim may be split
    (every tensor operand split alike: ``diff``'s prepend/append have the input's other dims)."""
    x = op.in_metas[0]
    dim = op.arg("dim", op.arg("dims", -1))
    dims = {_norm_dim(d, len(x.shape)) for d in (dim if isinstance(dim, (list, tuple)) else [dim])}
    options = []
    for d in range(len(x.shape)):
        if d in dims or x.shape[d] == 1:
            continue
        ins = tuple(Shard(d) if m is not None and len(m.shape) == len(x.shape) and m.shape[d] == x.shape[d] else R
                    for m in op.in_metas)
        if any(p == R for p in ins):
            continue
        options.append(AxisOption(ins, (Shard(d),) * len(op.out_metas)))
    return options


def gather(op: OpView) -> list[AxisOption]:
    """gather(x, dim, index): any dim but ``dim`` where index and x have the same size."""
    x, idx = op.in_metas[0], op.in_metas[1]
    dim = _norm_dim(op.arg("dim"), len(x.shape))
    return [AxisOption((Shard(d), Shard(d)), (Shard(d),)) for d in range(len(x.shape))
            if d != dim and x.shape[d] > 1 and idx.shape[d] == x.shape[d]]


def index(op: OpView) -> list[AxisOption]:
    """x[..., idx, ...] (``aten.index.Tensor``, adjacent index tensors): a dim that no index
    touches may be split (the index tensors stay whole); it keeps its place before the indexed
    dims or moves by the broadcast index rank after them."""
    x = op.in_metas[0]
    indices = op.arg("indices")
    if x is None or not isinstance(indices, (list, tuple)):
        return []
    used = [i for i, t in enumerate(indices) if t is not None]
    if not used or used != list(range(used[0], used[-1] + 1)):
        return []
    out_rank, lead, n_used = len(op.out.shape), used[0], len(used)
    idx_rank = out_rank - (len(x.shape) - n_used)
    options = []
    for d in range(len(x.shape)):
        if lead <= d <= used[-1] or x.shape[d] == 1:
            continue
        od = d if d < lead else d - n_used + idx_rank
        options.append(AxisOption((Shard(d),) + (R,) * (len(op.inputs) - 1), (Shard(od),)))
    return options


def one_hot(op: OpView) -> list[AxisOption]:
    """one_hot(x, num_classes): any dim of ``x`` may be split, the classes (a new last dim) stay
    whole; ``num_classes=-1`` (the classes read from the data) runs replicated."""
    x = op.in_metas[0]
    if op.arg("num_classes", -1) in (-1, None):
        return []
    return [AxisOption((Shard(d),), (Shard(d),)) for d in range(len(x.shape)) if x.shape[d] > 1]


def token_region(op: OpView) -> list[AxisOption]:
    """A token-wise region (``autopar.regions``): the tokens (dim 0 of every activation input and of
    the output) split alike, the module's weights whole."""
    ins = tuple(R if n.meta.get("autopar.kind") in ("param", "buffer") else Shard(0) for n in op.inputs)
    options = [AxisOption(ins, (Shard(0),))]
    experts = set(op.node.meta.get(REGION_EXPERTS_KEY, ()))
    if experts:  # expert parallel: each rank its share of the experts, rows exchanged with the rest
        options.append(AxisOption(tuple(Shard(0) if n.name in experts else p for n, p in zip(op.inputs, ins)),
                                  (Shard(0),)))
    return options


def replicated_only(op: OpView) -> list[AxisOption]:
    return []


FACTORY_OPS = {
    "arange", "zeros", "ones", "full", "empty", "scalar_tensor", "rand", "randn", "randint",
    "eye", "tensor", "lift_fresh_copy", "linspace", "empty_strided", "new_zeros", "new_ones",
    "new_full", "new_empty", "triu", "tril",
}


RULES: dict[str, Callable[[OpView], list[AxisOption]]] = {
    "linear": linear,
    "mm": matmul, "bmm": matmul, "matmul": matmul,
    "addmm": addmm_like, "baddbmm": addmm_like,
    "einsum": einsum,
    "sum": sum_mean, "mean": sum_mean,
    "amax": max_like, "amin": max_like, "argmax": max_like, "argmin": max_like,
    "softmax": softmax, "log_softmax": softmax, "_softmax": softmax, "_log_softmax": softmax,
    "layer_norm": norm, "rms_norm": norm,
    "cross_entropy_loss": loss_with_target, "nll_loss_nd": loss_with_target, "nll_loss": loss_with_target,
    "mse_loss": elementwise_loss, "l1_loss": elementwise_loss, "smooth_l1_loss": elementwise_loss,
    "binary_cross_entropy_with_logits": elementwise_loss, "huber_loss": elementwise_loss,
    "view": reshape, "reshape": reshape, "_unsafe_view": reshape, "flatten": reshape,
    "unflatten": reshape, "squeeze": reshape, "unsqueeze": reshape, "view_as": reshape,
    "_reshape_alias": reshape,
    "t": permute_like, "transpose": permute_like, "permute": permute_like, "swapaxes": permute_like,
    "expand": expand,
    "slice": slice_like, "select": slice_like, "narrow": slice_like, "split": slice_like,
    "split_with_sizes": slice_like, "chunk": slice_like, "unbind": slice_like,
    "cat": cat_like, "concat": cat_like, "stack": cat_like,
    "embedding": embedding,
    "batch_norm": batch_norm,
    "cumsum": along_dim, "cumprod": along_dim, "diff": along_dim, "flip": along_dim, "logcumsumexp": along_dim,
    "gather": gather, "index": index,
    "topk": along_dim, "sort": along_dim, "argsort": along_dim, "one_hot": one_hot, "token_region": token_region,
    # elementwise ops torch does not tag pointwise on every overload (the tagged ones need no entry)
    "where": pointwise, "masked_fill": pointwise, "hardswish": pointwise, "hardsigmoid": pointwise,
    "hardtanh": pointwise, "bitwise_and": pointwise, "bitwise_or": pointwise,
    "eq": pointwise, "ne": pointwise, "lt": pointwise, "le": pointwise, "gt": pointwise, "ge": pointwise,
    "repeat_interleave": repeat_interleave,
    "conv1d": convolution, "conv2d": convolution, "conv3d": convolution,
    "max_pool1d": pooling, "max_pool2d": pooling, "max_pool3d": pooling, "max_pool2d_with_indices": pooling,
    "avg_pool1d": pooling, "avg_pool2d": pooling, "avg_pool3d": pooling,
    "adaptive_avg_pool1d": pooling, "adaptive_avg_pool2d": pooling, "adaptive_avg_pool3d": pooling,
    "adaptive_max_pool2d": pooling,
    "scaled_dot_product_attention": sdpa,
    "broadcast_tensors": pointwise,
    "dropout": pointwise, "native_dropout": pointwise, "contiguous": pointwise, "to": pointwise,
    "_to_copy": pointwise, "type_as": pointwise, "alias": pointwise, "detach": pointwise,
    "zeros_like": like_factory, "ones_like": like_factory, "empty_like": like_factory,
    "full_like": like_factory, "rand_like": like_factory, "randn_like": like_factory,
}


def rule_for(node: fx.Node) -> Callable[[OpView], list[AxisOption]] | None:
    """The rule for ``node`` (None: no rule, the op runs replicated)."""
    if node.target is operator.getitem:
        return None
    name = op_name(node)
    if name in FACTORY_OPS:
        return replicated_only
    if name in RULES:
        return RULES[name]
    tags = getattr(node.target, "tags", ())
    if torch.Tag.pointwise in tags:
        return pointwise
    return None
