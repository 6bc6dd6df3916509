"""autopar.resharding (steps between layouts) and planner.costing.reshard_time (their price).

Prices are checked against alpha-beta figures computed by hand from the preset link numbers
(dgx-a100: NVLink 300 GB/s, 3.4 us per hop; IB HDR 25 GB/s per GPU, 9.6 us per hop) and the
local loopback (2 GB/s, 50 us).
"""
import itertools
import math

import pytest
import torch

from autopar.cluster import Cluster
from autopar.cost_models import CommGroup, collective_time, precision_policy
from autopar.layouts import Partial, R, Shard
from autopar.planner.costing import CostContext, reshard_time
from autopar.resharding import ReshardStep, layout_after, reshard_steps
from autopar.trace import TensorMeta

P = Partial("sum")
NV_BW, NV_A = 300e9, 3.4e-6
IB_BW, IB_A = 25e9, 9.6e-6
LO_BW, LO_A = 2e9, 50e-6


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)


def kinds(steps):
    return [(s.kind, s.axis) for s in steps]


# --------------------------------------------------------------------------- steps, one axis
def test_partial_to_replicate_is_all_reduce():
    assert reshard_steps((P,), (R,)) == [ReshardStep("all_reduce", 0, op="sum")]
    assert reshard_steps((Partial("avg"),), (R,)) == [ReshardStep("all_reduce", 0, op="avg")]


def test_partial_to_shard_is_reduce_scatter():
    assert reshard_steps((P,), (Shard(1),)) == [ReshardStep("reduce_scatter", 0, dim=1, op="sum")]


def test_shard_to_replicate_is_all_gather():
    assert reshard_steps((Shard(2),), (R,)) == [ReshardStep("all_gather", 0, dim=2)]


def test_shard_to_other_shard_is_all_to_all():
    assert reshard_steps((Shard(0),), (Shard(1),)) == [ReshardStep("all_to_all", 0, dim=1, src_dim=0)]


def test_replicate_to_shard_is_local_slice():
    steps = reshard_steps((R,), (Shard(1),))
    assert steps == [ReshardStep("slice", 0, dim=1)]
    assert not steps[0].is_collective


def test_same_layout_needs_nothing():
    for lay in [(R, R), (Shard(0), P), (Shard(1), Shard(0))]:
        assert reshard_steps(lay, lay) == []


def test_replicate_to_partial_and_shard_to_partial():
    assert reshard_steps((R,), (P,)) == [ReshardStep("to_partial", 0, op="sum")]
    assert kinds(reshard_steps((Shard(0),), (P,))) == [("all_gather", 0), ("to_partial", 0)]
    assert reshard_steps((Partial("avg"),), (P,)) == [ReshardStep("scale", 0, op="avg_to_sum")]


def test_mesh_rank_mismatch_raises():
    with pytest.raises(ValueError, match="mesh rank"):
        reshard_steps((R,), (R, R))


# --------------------------------------------------------------------------- multi-axis order
def test_reductions_before_gathers():
    # the all-reduce shrinks nothing but must come before the gather (cheap steps first)
    steps = reshard_steps((Shard(0), P), (R, R))
    assert kinds(steps) == [("all_reduce", 1), ("all_gather", 0)]


def test_slices_first():
    steps = reshard_steps((R, Shard(0)), (Shard(1), R))
    assert kinds(steps) == [("slice", 0), ("all_gather", 1)]


def test_blocked_reduce_scatter_waits_for_the_gather():
    steps = reshard_steps((Shard(0), Shard(2), P), (R, Shard(1), Shard(0)))
    # axis 2 (reduce_scatter onto dim 0) must wait until axis 0 stops sharding dim 0
    assert kinds(steps) == [("all_to_all", 1), ("all_gather", 0), ("reduce_scatter", 2)]


def test_shard_moving_between_axes_waits_for_gather():
    # introducing S(0) on axis 1 while axis 0 still shards dim 0 would nest shards of one dim
    steps = reshard_steps((Shard(0), R), (R, Shard(0)))
    assert steps == [ReshardStep("all_gather", 0, dim=0), ReshardStep("slice", 1, dim=0)]


def test_swap_cycle_gathers_first():
    steps = reshard_steps((Shard(0), Shard(1)), (Shard(1), Shard(0)))
    assert steps == [
        ReshardStep("all_gather", 0, dim=0),
        ReshardStep("all_to_all", 1, dim=0, src_dim=1),
        ReshardStep("slice", 0, dim=1),
    ]


def _valid(layout):
    dims = [p.dim for p in layout if isinstance(p, Shard)]
    return len(dims) == len(set(dims))


@pytest.mark.parametrize("ndim", [2, 3])
def test_every_pair_reaches_destination_without_nested_shards(ndim):
    placements = [R, Shard(0), Shard(1), P, Partial("avg")]
    layouts = [lay for lay in itertools.product(placements, repeat=ndim) if _valid(lay)]
    for src, dst in itertools.product(layouts, layouts):
        cur = src
        steps = reshard_steps(src, dst)
        for st in steps:
            cur = layout_after(cur, st)
            assert _valid(cur), (src, dst, steps)
        assert cur == dst, (src, dst, steps)
        # at most one collective per axis unless a swap cycle forces a gather first
        collectives = [s for s in steps if s.is_collective]
        assert len(collectives) <= ndim + 1


def _pieces(full: torch.Tensor, layout, mesh=(2, 2)) -> dict:
    """Each rank's local tensor of ``full`` laid out ``layout`` (Partial(sum): rank 0 of the axis
    holds the value, the others zeros; nested shards cut outer axis first, as DTensor does)."""
    from autopar.runtime.collectives import slice_dim

    out = {}
    for coords in itertools.product(*(range(n) for n in mesh)):
        t = full
        for a, (p, c) in enumerate(zip(layout, coords)):
            if isinstance(p, Shard):
                t = slice_dim(t, p.dim, mesh[a], c)
            elif isinstance(p, Partial) and c:
                t = torch.zeros_like(t)
        out[coords] = t
    return out


def _simulate(steps, pieces: dict, mesh=(2, 2)) -> dict:
    """Run reshard steps on every rank's piece, each collective over the ranks of its axis group."""
    from autopar.runtime.collectives import slice_dim

    for st in steps:
        new = {}
        for coords, x in pieces.items():
            peers = [pieces[coords[:st.axis] + (k,) + coords[st.axis + 1:]] for k in range(mesh[st.axis])]
            c, n = coords[st.axis], mesh[st.axis]
            new[coords] = {
                "slice": lambda: slice_dim(x, st.dim, n, c),
                "all_gather": lambda: torch.cat(peers, st.dim),
                "all_reduce": lambda: sum(peers),
                "reduce_scatter": lambda: slice_dim(sum(peers), st.dim, n, c),
                "all_to_all": lambda: slice_dim(torch.cat(peers, st.src_dim), st.dim, n, c),
                "to_partial": lambda: x if c == 0 else torch.zeros_like(x),
            }[st.kind]()
        pieces = new
    return pieces


def test_nested_shards_of_one_dim_form_outer_axis_first_and_hold_the_right_rows():
    """On data axes a dim may be sharded twice ([S(0), S(0)]: rank (i, j) holds rows block
    2i + j of 4). Every move between such layouts and the others ends with each rank holding
    exactly the piece DTensor's cut gives it (simulated collectives over the axis groups)."""
    full = torch.arange(64.0).reshape(8, 8)
    placements = [R, Shard(0), Shard(1), P]
    layouts = list(itertools.product(placements, repeat=2))
    nested = [(Shard(0), Shard(0)), (Shard(1), Shard(1))]
    assert all(lay in layouts for lay in nested)
    for src, dst in itertools.product(layouts, layouts):
        if not (src in nested or dst in nested) or isinstance(dst[0], Partial) or isinstance(dst[1], Partial):
            continue
        steps = reshard_steps(src, dst)
        got = _simulate(steps, _pieces(full, src))
        want = _pieces(full, dst)
        for coords in want:
            assert torch.equal(got[coords], want[coords]), (src, dst, steps, coords)
    assert kinds(reshard_steps((Shard(0), Shard(0)), (Shard(0), Shard(1)))) == [("all_to_all", 1)]  # the inner axis moves alone
    assert kinds(reshard_steps((Shard(0), Shard(0)), (Shard(0), R))) == [("all_gather", 1)]


# --------------------------------------------------------------------------- prices
def _ctx(mesh, cluster, precision="fp32"):
    names = ("dp", "tp")[-len(mesh):]
    return CostContext(tuple(mesh), names, cluster, precision_policy(precision), "adamw")


META = TensorMeta((8, 16), torch.float32)  # 512 bytes in fp32


def test_single_axis_prices_on_loopback():
    ctx = _ctx((2,), Cluster.local(2))
    # all_reduce of the whole 512-byte buffer over 2 ranks: 2(p-1)/p n/B + 2(p-1) a
    t = reshard_time(META, (P,), (R,), ctx)
    assert set(t) == {"all_reduce"} and close(t["all_reduce"], 2 * 1 / 2 * 512 / LO_BW + 2 * LO_A)
    # reduce_scatter of the full 512-byte input: (p-1)/p n/B + (p-1) a
    t = reshard_time(META, (P,), (Shard(0),), ctx)
    assert set(t) == {"reduce_scatter"} and close(t["reduce_scatter"], 0.5 * 512 / LO_BW + LO_A)
    # all_gather into the full 512-byte output (each rank holds 256)
    t = reshard_time(META, (Shard(0),), (R,), ctx)
    assert set(t) == {"all_gather"} and close(t["all_gather"], 0.5 * 512 / LO_BW + LO_A)
    # all_to_all of the 256 bytes a rank holds
    t = reshard_time(META, (Shard(0),), (Shard(1),), ctx)
    assert set(t) == {"all_to_all"} and close(t["all_to_all"], 0.5 * 256 / LO_BW + LO_A)
    # slicing and equal layouts are free
    assert reshard_time(META, (R,), (Shard(1),), ctx) == {}
    assert reshard_time(META, (Shard(0),), (Shard(0),), ctx) == {}


def test_prices_agree_with_collective_time_and_precision():
    cluster = Cluster.preset("dgx-a100")
    ctx = _ctx((8,), cluster, "bf16-mixed")  # traced under autocast: a bf16 value, 2 bytes per element
    meta = TensorMeta((64, 1024), torch.bfloat16)
    n = 64 * 1024 * 2
    t = reshard_time(meta, (P,), (R,), ctx)["all_reduce"]
    assert close(t, collective_time("all_reduce", n, CommGroup(8, 8), cluster))
    assert close(t, 2 * 7 / 8 * n / NV_BW + 14 * NV_A)
    # an explicit bytes-per-element (parameters in their own dtype) overrides the activation size
    t4 = reshard_time(meta, (Shard(0),), (R,), ctx, 4.0)["all_gather"]
    assert close(t4, 7 / 8 * (64 * 1024 * 4) / NV_BW + 7 * NV_A)


def test_two_axis_mesh_across_nodes():
    # mesh (2, 8) on two DGX A100 nodes: axis 1 is one node (NVLink), axis 0 one rank per node (IB)
    cluster = Cluster.preset("dgx-a100", nodes=2)
    ctx = _ctx((2, 8), cluster)
    meta = TensorMeta((32, 64), torch.float32)  # 8192 bytes
    # (S(0), P) -> (R, R): all-reduce over tp of the local (16, 64) = 4096 bytes, then an
    # all-gather over dp of the local (16, 64) into 8192 bytes
    t = reshard_time(meta, (Shard(0), P), (R, R), ctx)
    assert set(t) == {"all_reduce", "all_gather"}
    assert close(t["all_reduce"], 2 * 7 / 8 * 4096 / NV_BW + 14 * NV_A)
    assert close(t["all_gather"], 1 / 2 * 8192 / IB_BW + IB_A)
    # (P, S(1)) -> (S(0), S(1)): reduce-scatter over dp of the local (32, 8) = 1024 bytes
    t = reshard_time(meta, (P, Shard(1)), (Shard(0), Shard(1)), ctx)
    assert set(t) == {"reduce_scatter"} and close(t["reduce_scatter"], 1 / 2 * 1024 / IB_BW + IB_A)


def test_swap_cycle_price_sums_its_steps():
    cluster = Cluster.preset("dgx-a100")
    ctx = _ctx((2, 4), cluster)
    meta = TensorMeta((16, 32), torch.float32)  # 2048 bytes
    t = reshard_time(meta, (Shard(0), Shard(1)), (Shard(1), Shard(0)), ctx)
    # all_gather on axis 0 (group of 2, both on node 0) of local (8, 8) -> 512 bytes gathered
    # to (16, 8); then all_to_all on axis 1 (group of 4) of the 512 bytes a rank holds
    g0 = CommGroup(2, 2)
    g1 = CommGroup(4, 4)
    assert close(t["all_gather"], collective_time("all_gather", 512, g0, cluster))
    assert close(t["all_gather"], 1 / 2 * 512 / NV_BW + NV_A)
    assert close(t["all_to_all"], collective_time("all_to_all", 512, g1, cluster))
    assert close(t["all_to_all"], 3 / 4 * 512 / NV_BW + 3 * NV_A)
    assert set(t) == {"all_gather", "all_to_all"}


def test_uneven_shard_moves_by_gather_then_slice_never_all_to_all():
    # a parameter stored unevenly (ZeRO-3 of an odd dim) on axis 0: no all-to-all of uneven chunks
    steps = reshard_steps((Shard(0),), (Shard(1),), frozenset({(0, 0)}))
    assert kinds(steps) == [("all_gather", 0), ("slice", 0)]
    grad = reshard_steps((Shard(1),), (Shard(0),), frozenset({(0, 0)}))
    assert kinds(grad) == [("all_gather", 0), ("slice", 0)]
    # even dims keep the all-to-all
    assert kinds(reshard_steps((Shard(0),), (Shard(1),))) == [("all_to_all", 0)]


def test_uneven_dims_and_chunk_ranges_follow_torch_chunk():
    from autopar.layouts import chunk_range, local_shape, uneven_dims

    assert uneven_dims((21, 8), [(Shard(0), Shard(1)), None], (4, 2)) == {(0, 0)}
    assert uneven_dims((20, 8), [(Shard(0), Shard(1))], (4, 2)) == frozenset()
    for size, n in [(21, 4), (3, 4), (8, 4), (7, 3), (1, 5)]:
        pieces = torch.arange(size).chunk(n)
        for coord in range(n):
            start, length = chunk_range(size, n, coord)
            want = pieces[coord].tolist() if coord < len(pieces) else []
            assert list(range(start, start + length)) == want
    assert local_shape((21, 8), (Shard(0), Shard(1)), (4, 2)) == (6, 4)  # the largest (padded) shard
