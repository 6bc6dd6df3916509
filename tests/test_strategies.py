"""Candidate strategies (autopar.strategies) on tiny traced graphs."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.layouts import Partial, R, Shard, divides_evenly
from autopar.strategies.rules import OpView
from autopar.strategies import UnknownOpWarning, enumerate_strategies
from autopar.strategies.reshape import reshape_dim_map, reshape_groups
from autopar.strategies.rules import rule_for
from autopar.trace import trace_model

P = Partial("sum")
TP = ((2,), ("tp",))


def ops(traced, name=None):
    found = [n for n in traced.graph.nodes if n.op == "call_function" and (name is None or n.name == name
                                                                            or str(n.target).startswith(f"aten.{name}."))]
    return found


def one_op(traced, name):
    found = ops(traced, name)
    assert len(found) == 1, [n.name for n in ops(traced)]
    return found[0]


def strategies_of(node, mesh=TP):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownOpWarning)
        return enumerate_strategies(node, *mesh)


def io(ns, mesh_axis=0):
    """{(input placements), (output placements)} on one mesh axis."""
    return {
        (tuple(i[mesh_axis] if i is not None else None for i in s.ins), tuple(o[mesh_axis] for o in s.outs if o is not None))
        for s in ns.strategies
    }


class Fn(nn.Module):
    def __init__(self, fn, **mods):
        super().__init__()
        self.fn = fn
        for k, m in mods.items():
            setattr(self, k, m)

    def forward(self, *xs):
        return self.fn(self, *xs)


# --------------------------------------------------------------------------- linear
def test_linear_column_and_row_parallel():
    m = Fn(lambda s, x: s.fc(x), fc=nn.Linear(8, 16))
    tg = trace_model(m, torch.randn(4, 6, 8))
    ns = strategies_of(one_op(tg, "linear"))
    opts = io(ns)
    # inputs are (x, weight, bias)
    column = ((R, Shard(0), Shard(0)), (Shard(2),))  # weight rows (out features) split: out S(last)
    row = ((Shard(2), Shard(1), P), (P,))  # contraction split: x S(last), weight S(1) -> partial sums
    batch = ((Shard(0), R, R), (Shard(0),))
    assert column in opts and row in opts and batch in opts
    assert ((R, R, R), (R,)) in opts
    # never shard the output on a dim the op cannot produce locally
    assert all(o[0] != Shard(2) or i[1] == Shard(0) for i, o in opts)
    # gradients: the replicated x of the column split gets a partial gradient back
    col = next(s for s in ns.strategies if s.outs[0] == (Shard(2),))
    assert col.grad_ins[0] == (P,) and col.grad_ins[1] == (Shard(0),)
    rows = [s for s in ns.strategies if s.ins[1] == (Shard(1),)]
    assert rows and all(s.grad_ins[0] == (Shard(2),) for s in rows)


def test_linear_two_axis_combinations():
    m = Fn(lambda s, x: s.fc(x), fc=nn.Linear(8, 16))
    tg = trace_model(m, torch.randn(4, 6, 8))
    ns = strategies_of(one_op(tg, "linear"), ((2, 2), ("dp", "tp")))
    lays = {(s.ins[0], s.ins[1], s.outs[0]) for s in ns.strategies}
    # data parallel on dp x Megatron column on tp
    assert ((Shard(0), R), (R, Shard(0)), (Shard(0), Shard(2))) in lays
    # every strategy is valid: no tensor dim sharded on both axes, all dims divide
    for s in ns.strategies:
        for lay in s.ins + s.outs:
            if lay is not None:
                dims = [p.dim for p in lay if isinstance(p, Shard)]
                assert len(dims) == len(set(dims))


# --------------------------------------------------------------------------- pointwise
def test_pointwise_broadcasting():
    m = Fn(lambda s, x, b: x * b)
    tg = trace_model(m, (torch.randn(4, 6, 8), torch.randn(8)))
    opts = io(strategies_of(one_op(tg, "mul")))
    assert ((Shard(0), R), (Shard(0),)) in opts  # b has no batch dim: stays whole
    assert ((Shard(1), R), (Shard(1),)) in opts
    assert ((Shard(2), Shard(0)), (Shard(2),)) in opts  # b's only dim lines up with the last
    # partial stays partial through a multiplication by a replicated factor
    assert ((P, R), (P,)) in opts and ((R, P), (P,)) in opts
    assert ((P, P), (P,)) not in opts  # (a1 + a2)(b1 + b2) != a1 b1 + a2 b2


def test_pointwise_size_one_broadcast_dim_is_not_sharded_on_the_small_input():
    m = Fn(lambda s, x, y: x + y)
    tg = trace_model(m, (torch.randn(4, 6), torch.randn(1, 6)))
    opts = io(strategies_of(one_op(tg, "add")))
    assert ((Shard(0), R), (Shard(0),)) in opts
    assert ((Shard(1), Shard(1)), (Shard(1),)) in opts
    assert ((P, P), (P,)) in opts  # a sum of partial sums


def test_add_of_a_scalar_keeps_no_partial():
    m = Fn(lambda s, x: x + 1.0)
    tg = trace_model(m, torch.randn(4, 6))
    opts = io(strategies_of(one_op(tg, "add")))
    assert not any(isinstance(o[0], Partial) for _, o in opts)  # (x1 + 1) + (x2 + 1) != x + 1
    assert ((Shard(1),), (Shard(1),)) in opts


# --------------------------------------------------------------------------- reshapes
def test_reshape_dim_map_pure():
    assert reshape_groups((2, 6, 16), (2, 6, 4, 4)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    assert reshape_dim_map((2, 6, 16), (2, 6, 4, 4)) == {0: 0, 1: 1, 2: 2}
    assert reshape_dim_map((2, 6, 16), (12, 16)) == {0: 0, 2: 1}
    assert reshape_dim_map((4, 1, 8), (4, 8)) == {0: 0, 2: 1}
    with pytest.raises(ValueError, match="numel"):
        reshape_groups((2, 3), (7,))


def test_split_heads_reshape_moves_the_channel_shard_to_heads():
    m = Fn(lambda s, x: x.view(2, 6, 4, 4))
    tg = trace_model(m, torch.randn(2, 6, 16))
    opts = io(strategies_of(one_op(tg, "view")))
    assert ((Shard(2),), (Shard(2),)) in opts  # C -> H
    assert ((Shard(0),), (Shard(0),)) in opts and ((Shard(1),), (Shard(1),)) in opts
    assert not any(o == (Shard(3),) for _, o in opts)  # D cannot carry a shard of C


def test_merge_reshape_keeps_only_the_leading_dim_shard():
    m = Fn(lambda s, x: x.reshape(12, 16))
    tg = trace_model(m, torch.randn(2, 6, 16))
    opts = io(strategies_of(one_op(tg, "reshape")))
    assert ((Shard(0),), (Shard(0),)) in opts  # B -> B*T (contiguous blocks of rows)
    assert ((Shard(2),), (Shard(1),)) in opts
    assert not any(i == (Shard(1),) for i, _ in opts)  # T is not leading in [B*T]


def test_merge_reshape_uneven_leading_dim_excluded():
    m = Fn(lambda s, x: x.reshape(12, 16))
    tg = trace_model(m, torch.randn(2, 6, 16))
    ns = strategies_of(one_op(tg, "reshape"), ((4,), ("tp",)))
    assert not any(s.ins[0] == (Shard(0),) for s in ns.strategies)  # B=2 over 4 ranks
    assert any("does not divide" in why and "dim 0 (size 2)" in why for _, why in ns.excluded)


# --------------------------------------------------------------------------- attention
def test_sdpa_shards_batch_or_heads_only():
    m = Fn(lambda s, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    x = torch.randn(4, 8, 6, 16)
    tg = trace_model(m, (x, x.clone(), x.clone()))
    ns = strategies_of(one_op(tg, "scaled_dot_product_attention"))
    outs = {s.outs[0] for s in ns.strategies}
    assert outs == {(Shard(0),), (Shard(1),), (R,)}
    for s in ns.strategies:
        assert s.ins[0] == s.ins[1] == s.ins[2] == s.outs[0]  # q, k, v follow the output


def test_sdpa_mask_follows_only_dims_it_has():
    m = Fn(lambda s, q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    x = torch.randn(4, 8, 6, 16)
    tg = trace_model(m, (x, x.clone(), x.clone(), torch.zeros(8, 6, 6)))
    ns = strategies_of(one_op(tg, "scaled_dot_product_attention"))
    by_out = {s.outs[0]: s.ins[3] for s in ns.strategies}
    assert by_out[(Shard(0),)] == (R,)  # the mask has no batch dim
    assert by_out[(Shard(1),)] == (Shard(0),)  # its leading dim is the heads dim


# --------------------------------------------------------------------------- exclusions, fallback
def test_uneven_dims_are_excluded_with_a_reason():
    m = Fn(lambda s, x: s.fc(x), fc=nn.Linear(6, 10))
    tg = trace_model(m, torch.randn(3, 6))
    ns = strategies_of(one_op(tg, "linear"), ((4,), ("tp",)))
    for s in ns.strategies:  # the invariant: every kept strategy divides evenly
        for lay, meta in zip(s.outs, one_op(tg, "linear").meta["autopar.outputs"]):
            assert divides_evenly(meta.shape, lay, (4,))
    assert not any(s.outs[0] in ((Shard(0),), (Shard(1),)) for s in ns.strategies)
    reasons = [why for _, why in ns.excluded]
    assert reasons and all("does not divide" in r for r in reasons)
    assert any("size 3" in r and "'tp'" in r and "size 4" in r for r in reasons)
    # the linear never takes its weight unevenly sharded ...
    for s in ns.strategies:
        assert all(lay is None or divides_evenly(m.shape, lay, (4,))
                   for lay, m in zip(s.ins, OpView(one_op(tg, "linear")).in_metas))
    # ... but the weight may be *stored* unevenly (ZeRO-3 / FSDP2-style, gathered before use)
    w = tg.node("p_fc_weight")
    wns = strategies_of(w, ((4,), ("tp",)))
    assert {s.outs[0] for s in wns.strategies} == {(R,), (Shard(0),), (Shard(1),)}
    assert not wns.excluded


@pytest.mark.parametrize("fn, opname, dims", [
    (lambda s, x: torch.topk(x, 2, dim=1)[0], "topk", {0, 2}),
    (lambda s, x: torch.sort(x, -1)[0], "sort", {0, 1}),
    (lambda s, x: F.one_hot(x.argmax(1), 6).float(), "one_hot", {0, 1}),
])
def test_routing_ops_split_every_dim_but_their_own(fn, opname, dims):
    """topk / sort keep the dim they select along whole; one_hot keeps its classes whole (an MoE
    router's ops: batch-split tokens route on their own devices)."""
    tg = trace_model(Fn(fn), torch.randn(4, 6, 8))
    ns = strategies_of(one_op(tg, opname), ((2,), ("tp",)))
    split = {s.outs[0][0].dim for s in ns.strategies if isinstance(s.outs[0][0], Shard)}
    assert split == dims


@pytest.mark.parametrize("fn, opname", [
    (lambda s, x: torch.cummax(x, 1)[0], "cummax"),
    (lambda s, x: torch.kthvalue(x, 2, -1)[0], "kthvalue"),
])
def test_op_without_rule_falls_back_to_replicated_with_warning(fn, opname):
    m = Fn(fn)
    tg = trace_model(m, torch.randn(4, 6))
    node = one_op(tg, opname)
    assert rule_for(node) is None
    with pytest.warns(UnknownOpWarning, match=rf"aten\.{opname}\.") as rec:
        ns = enumerate_strategies(node, (2, 2), ("dp", "tp"))
    assert node.name in str(rec[0].message)
    assert ns.fallback
    assert len(ns.strategies) == 1
    s = ns.strategies[0]
    assert all(lay == (R, R) for lay in s.ins + s.outs + s.grad_ins if lay is not None)


def test_known_ops_do_not_warn():
    m = Fn(lambda s, x: F.gelu(s.fc(x)).softmax(-1), fc=nn.Linear(8, 8))
    tg = trace_model(m, torch.randn(4, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in ops(tg):
            ns = enumerate_strategies(n, (2,), ("tp",))
            assert not ns.fallback
    sm = strategies_of(one_op(tg, "softmax"))
    assert {s.outs[0] for s in sm.strategies} == {(Shard(0),), (R,)}  # never across the softmax dim


def test_size_one_axis_carries_only_replicate():
    m = Fn(lambda s, x: s.fc(x), fc=nn.Linear(8, 16))
    tg = trace_model(m, torch.randn(4, 8))
    ns = strategies_of(one_op(tg, "linear"), ((2, 1), ("dp", "tp")))
    for s in ns.strategies:
        for lay in s.ins + s.outs:
            assert lay[1] == R


def test_placeholder_options():
    m = Fn(lambda s, x: s.fc(x), fc=nn.Linear(8, 16))
    tg = trace_model(m, torch.randn(4, 8))
    w = strategies_of(tg.node("p_fc_weight"))
    assert {(s.outs[0], s.zero_axes) for s in w.strategies} == {
        ((R,), ()), ((R,), (0,)), ((Shard(0),), ()), ((Shard(1),), ())}
    x = strategies_of(tg.node("input_0"))
    assert {s.outs[0] for s in x.strategies} == {(R,), (Shard(0),), (Shard(1),)}
    assert all(not s.zero_axes for s in x.strategies)  # only parameters are ZeRO-sharded


# --------------------------------------------------------------------------- what real models contain
def test_cat_onto_an_empty_cache_shards_the_other_operand():
    """Hugging Face KV caches: cat(tensor([]), k[B, H, T, D], dim=-2)."""
    m = Fn(lambda s, k: torch.cat([k.new_zeros(0), k], dim=-2) * 2)
    tg = trace_model(m, torch.randn(4, 2, 6, 8))
    got = io(strategies_of(one_op(tg, "cat")))
    assert ((R, Shard(0)), (Shard(0),)) in got and ((R, Shard(1)), (Shard(1),)) in got
    assert ((R, Shard(3)), (Shard(3),)) in got
    assert not any(o == (Shard(2),) for _, o in got)  # never the joined dim


def test_stack_skips_size_one_dims():
    m = Fn(lambda s, a, b: torch.stack([a, b], 1))
    tg = trace_model(m, (torch.randn(4, 1, 6), torch.randn(4, 1, 6)))
    got = io(strategies_of(one_op(tg, "stack")))
    assert ((Shard(0), Shard(0)), (Shard(0),)) in got and ((Shard(2), Shard(2)), (Shard(3),)) in got
    assert not any(i == (Shard(1), Shard(1)) for i, _ in got)


@pytest.mark.parametrize("groups, tp, channel_parallel", [(8, 2, True), (8, 4, True), (2, 4, False), (1, 2, False)])
def test_grouped_conv_is_channel_parallel_where_the_axis_divides_the_groups(groups, tp, channel_parallel):
    m = Fn(lambda s, x: s.conv(x), conv=nn.Conv2d(8, 16, 3, padding=1, groups=groups))
    tg = trace_model(m, torch.randn(4, 8, 6, 6))
    ns = strategies_of(one_op(tg, "conv2d"), ((tp,), ("tp",)))
    channel = ((Shard(1), Shard(0), Shard(0)), (Shard(1),))
    assert (channel in io(ns)) == channel_parallel
    if groups > 1:  # a grouped conv never splits its input channels into partial sums
        assert not any(o == (P,) for _, o in io(ns))
        if not channel_parallel:
            assert any("does not divide 2 groups" in why for _, why in ns.excluded)


def test_depthwise_conv_runs_with_local_groups():
    """The pass rewrites groups to the local count; the local conv equals the global one's shard."""
    from autopar.passes.localize_shapes import _conv_groups, _set_conv_groups

    m = Fn(lambda s, x: s.conv(x), conv=nn.Conv2d(8, 8, 3, padding=1, groups=8))
    tg = trace_model(m, torch.randn(2, 8, 5, 5))
    node = one_op(tg, "conv2d")
    assert _conv_groups(node) == 8
    _set_conv_groups(node, 4)
    assert _conv_groups(node) == 4
    x, conv = torch.randn(2, 8, 5, 5), m.conv
    local = F.conv2d(x[:, 4:], conv.weight[4:], conv.bias[4:], padding=1, groups=4)
    torch.testing.assert_close(local, conv(x)[:, 4:])


def test_batch_norm_splits_channels_or_the_batch_and_keeps_running_stats_whole_in_training():
    m = Fn(lambda s, x: s.bn(x), bn=nn.BatchNorm2d(8))
    tg = trace_model(m, torch.randn(4, 8, 6, 6))
    got = io(strategies_of(one_op(tg, "batch_norm")))
    assert ((Shard(1), Shard(0), Shard(0), R, R), (Shard(1),)) in got
    assert ((Shard(0), R, R, R, R), (Shard(0),)) in got and ((Shard(2), R, R, R, R), (Shard(2),)) in got
    assert not any(i[3] == Shard(0) for i, _ in got)  # running stats are updated in place: never a copy
    tg = trace_model(m.eval(), torch.randn(4, 8, 6, 6))
    assert ((Shard(1), Shard(0), Shard(0), Shard(0), Shard(0)), (Shard(1),)) in io(strategies_of(one_op(tg, "batch_norm")))


@pytest.mark.parametrize("fn, opname, free, fixed", [
    (lambda s, x: torch.cumsum(x, 1), "cumsum", {0, 2}, 1),
    (lambda s, x: torch.diff(x, dim=2), "diff", {0, 1}, 2),
    (lambda s, x: torch.gather(x, 1, (x > 0).long()), "gather", {0, 2}, 1),
])
def test_ops_along_a_dim_split_every_other_dim(fn, opname, free, fixed):
    tg = trace_model(Fn(fn), torch.randn(4, 6, 8))
    outs = {o[0] for _, o in io(strategies_of(one_op(tg, opname)))}
    assert {Shard(d) for d in free} <= outs and Shard(fixed) not in outs


def test_mask_ops_have_rules():
    def fn(s, x):
        mask = torch.logical_and(x > 0, x < 1)
        return torch.where(mask, F.hardswish(x), x[torch.arange(4), 0:1].sum())
    tg = trace_model(Fn(fn), torch.randn(4, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownOpWarning)
        for n in ops(tg):
            enumerate_strategies(n, (2,), ("tp",))


def test_advanced_index_keeps_untouched_dims_splittable():
    tg = trace_model(Fn(lambda s, x: x[:, torch.tensor([0, 2])]), torch.randn(4, 6, 8))
    got = io(strategies_of(one_op(tg, "index")))
    assert ((Shard(0), R), (Shard(0),)) in got and ((Shard(2), R), (Shard(2),)) in got
    assert not any(i[0] == Shard(1) for i, _ in got)
