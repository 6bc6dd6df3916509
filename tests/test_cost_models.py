"""Cost models vs hand-computed alpha-beta, roofline and byte-count figures."""

import math

import pytest
import torch

from autopar.cluster import Cluster
from autopar.cost_models import (
    CommGroup,
    PrecisionPolicy,
    axis_group,
    collective_time,
    dtype_bytes,
    op_time,
    optimizer_state_bytes_per_param,
    precision_policy,
    training_state_bytes_per_param,
)
from autopar.cost_models import compute
from autopar.errors import AutoparError, ConstraintError

GiB = 2**30
A100 = Cluster.preset("dgx-a100")
H100x4 = Cluster.preset("dgx-h100", nodes=4)
NV3_A, NV4_A, IB_A = 3.4e-6, 3.4e-6, 9.6e-6  # preset latencies (alpha)


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)


# --- axis_group ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "mesh, axis, dpn, expected",
    [
        ((4, 8), 1, 8, CommGroup(8, 8)),  # a node
        ((4, 8), 0, 8, CommGroup(4, 1)),  # one rank on each of 4 nodes
        ((16, 2), 0, 8, CommGroup(16, 4)),  # 4 per node, 4 nodes
        ((16, 2), 1, 8, CommGroup(2, 2)),
        ((2, 2, 2), 0, 8, CommGroup(2, 2)),  # whole mesh inside one node
        ((2, 4, 8), 1, 8, CommGroup(4, 1)),
        ((2, 4, 8), -1, 8, CommGroup(8, 8)),
        ((32,), 0, 8, CommGroup(32, 8)),
        ((3, 4), 0, 8, CommGroup(3, 2)),  # uneven: ranks {0, 4} on node 0, {8} on node 1
    ],
)
def test_axis_group(mesh, axis, dpn, expected):
    assert axis_group(mesh, axis, dpn) == expected


def test_axis_group_nodes_and_errors():
    assert axis_group((16, 2), 0, 8).nodes == 4
    with pytest.raises(AutoparError, match="out of range"):
        axis_group((4, 8), 2, 8)
    with pytest.raises(AutoparError, match="mesh_shape"):
        axis_group((4, 0), 0, 8)


def test_comm_group_validation():
    with pytest.raises(AutoparError, match="exceeds the group size"):
        CommGroup(2, 4)
    with pytest.raises(AutoparError, match="CommGroup.size"):
        CommGroup(0, 1)


# --- collectives inside one node -------------------------------------------------------------

def test_all_reduce_one_a100_node():
    t = collective_time("all_reduce", GiB, CommGroup(8, 8), A100)
    assert close(t, 2 * 7 / 8 * GiB / 300e9 + 14 * NV3_A)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
def test_gather_scatter_alltoall_one_node(kind):
    t = collective_time(kind, GiB, CommGroup(8, 8), A100)
    assert close(t, 7 / 8 * GiB / 300e9 + 7 * NV3_A)


def test_broadcast_and_send_recv_one_node():
    assert close(collective_time("broadcast", GiB, CommGroup(4, 4), A100), GiB / 300e9 + 3 * NV3_A)
    assert close(collective_time("send_recv", GiB, CommGroup(2, 2), A100), GiB / 300e9 + NV3_A)


@pytest.mark.parametrize(
    "kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"]
)
def test_group_of_one_and_zero_bytes_cost_nothing(kind):
    assert collective_time(kind, GiB, CommGroup(1, 1), H100x4) == 0.0
    assert collective_time(kind, 0, CommGroup(8, 8), H100x4) == 0.0


# --- collectives across nodes (4 x dgx-h100) -------------------------------------------------

def test_all_reduce_flat_ring_over_nics():
    # Data-parallel axis of mesh (4, 8): one rank per node, each on its own NIC.
    t = collective_time("all_reduce", GiB, axis_group((4, 8), 0, 8), H100x4)
    assert close(t, 2 * 3 / 4 * GiB / 50e9 + 6 * IB_A)


def test_all_reduce_hierarchical():
    # Intra reduce-scatter over 8 GPUs, inter all-reduce of GiB/8 on 8 parallel rails of 4
    # nodes, intra all-gather.
    t = collective_time("all_reduce", GiB, CommGroup(32, 8), H100x4)
    intra = 7 / 8 * GiB / 450e9 + 7 * NV4_A
    inter = 2 * 3 / 4 * (GiB / 8) / 50e9 + 6 * IB_A
    assert close(t, intra + inter + intra)
    flat = 2 * 31 / 32 * GiB / 50e9 + 62 * IB_A
    assert t < flat / 4  # the rails make the hierarchy far cheaper than a flat ring on one NIC


def test_all_gather_and_reduce_scatter_hierarchical():
    g = CommGroup(16, 4)  # mesh (16, 2) axis 0
    inter = 3 / 4 * (GiB / 4) / 50e9 + 3 * IB_A
    intra = 3 / 4 * GiB / 450e9 + 3 * NV4_A
    for kind in ("all_gather", "reduce_scatter"):
        assert close(collective_time(kind, GiB, g, H100x4), inter + intra)


def test_link_efficiency_scales_only_the_bandwidth_term():
    import dataclasses

    slow = dataclasses.replace(H100x4, inter_node=dataclasses.replace(H100x4.inter_node, efficiency=0.5))
    g = CommGroup(16, 4)
    inter = 3 / 4 * (GiB / 4) / (0.5 * 50e9) + 3 * IB_A  # latency unchanged
    intra = 3 / 4 * GiB / 450e9 + 3 * NV4_A  # NVLink keeps its own (unset) efficiency
    assert close(collective_time("all_gather", GiB, g, slow), inter + intra)


def test_all_to_all_hierarchical():
    t = collective_time("all_to_all", GiB, CommGroup(32, 8), H100x4)
    t_intra = 7 / 32 * GiB / 450e9 + 7 * NV4_A
    t_inter = 24 / 32 * GiB / 50e9 + 24 * IB_A
    assert close(t, max(t_intra, t_inter)) and close(t, t_inter)


def test_broadcast_and_send_recv_across_nodes():
    g = CommGroup(32, 8)
    assert close(collective_time("broadcast", GiB, g, H100x4), GiB / 50e9 + 3 * IB_A + 28 * NV4_A)
    t = collective_time("send_recv", GiB, CommGroup(2, 1), H100x4)
    assert close(t, GiB / 50e9 + IB_A)


def test_collective_errors():
    with pytest.raises(ValueError, match="unknown collective kind 'allreduce'.*all_reduce"):
        collective_time("allreduce", GiB, CommGroup(8, 8), A100)
    with pytest.raises(AutoparError, match="nbytes"):
        collective_time("all_reduce", -1, CommGroup(8, 8), A100)
    with pytest.raises(AutoparError, match="does not fit"):
        collective_time("all_reduce", GiB, CommGroup(16, 8), A100)  # 2 nodes on a 1-node cluster


def test_monotone_in_bytes_and_group_size():
    ts = [collective_time("all_reduce", n, CommGroup(8, 8), A100) for n in (1e3, 1e6, 1e9)]
    assert ts == sorted(ts)
    assert collective_time("all_gather", GiB, CommGroup(2, 2), A100) < collective_time(
        "all_gather", GiB, CommGroup(8, 8), A100
    )


# --- roofline --------------------------------------------------------------------------------

def test_matmul_compute_bound():
    n = 8192
    flops, nbytes = 2 * n**3, 3 * 2 * n**2  # bf16 A, B, C
    dev = A100.device
    t = op_time(flops, nbytes, dev, "bf16", "matmul")
    assert close(t, flops / (312e12 * compute.MATMUL_EFFICIENCY))
    assert t > nbytes / (2.039e12 * compute.MEMORY_EFFICIENCY)
    assert close(op_time(flops, nbytes, dev, torch.bfloat16, efficiency=0.5), flops / 156e12)
    assert close(op_time(flops, nbytes, dev, "tf32"), flops / (156e12 * compute.MATMUL_EFFICIENCY))
    assert close(
        op_time(flops, nbytes, dev, "bf16", "attention"),
        flops / (312e12 * compute.ATTENTION_EFFICIENCY),
    )


def test_pointwise_memory_bound():
    elems = 2**28
    flops, nbytes = elems, 3 * 4 * elems  # fp32 c = a + b
    dev = Cluster.preset("dgx-h100").device
    t = op_time(flops, nbytes, dev, "fp32", "pointwise")
    assert close(t, nbytes / (3.35e12 * compute.MEMORY_EFFICIENCY))
    assert t > flops / (67e12 * compute.POINTWISE_EFFICIENCY)
    assert close(op_time(flops, nbytes, dev, "fp32", "pointwise", memory_efficiency=1.0),
                 nbytes / 3.35e12)


def test_pointwise_counts_flops_at_vector_rate():
    dev = A100.device  # no bytes: pure compute, bf16 pointwise still at the fp32 vector rate
    t = op_time(1e12, 0, dev, "bf16", "pointwise")
    assert close(t, 1e12 / (19.5e12 * compute.POINTWISE_EFFICIENCY))
    assert close(op_time(1e12, 0, dev, torch.int64, "other"),
                 1e12 / (19.5e12 * compute.OTHER_EFFICIENCY))


def test_op_time_errors():
    dev = A100.device
    with pytest.raises(AutoparError, match="unknown op kind 'conv'"):
        op_time(1, 1, dev, "bf16", "conv")
    with pytest.raises(AutoparError, match="flops"):
        op_time(-1, 1, dev, "bf16")
    with pytest.raises(AutoparError, match="efficiency"):
        op_time(1, 1, dev, "bf16", efficiency=1.5)
    with pytest.raises(ValueError, match="int8"):
        op_time(1, 1, dev, "int8", "matmul")  # no tensor-core integer peak in the spec


def test_dtype_bytes():
    assert dtype_bytes(torch.float32) == dtype_bytes("float32") == dtype_bytes("fp32") == 4
    assert dtype_bytes(torch.bfloat16) == dtype_bytes("bf16") == dtype_bytes("torch.bfloat16") == 2
    assert dtype_bytes("float16") == dtype_bytes(torch.half) == 2
    assert dtype_bytes(torch.int64) == 8 and dtype_bytes(torch.bool) == 1
    with pytest.raises(AutoparError, match="unknown dtype 'fp12'"):
        dtype_bytes("fp12")


# --- memory ----------------------------------------------------------------------------------

def test_training_state_bytes():
    fp32, mixed = precision_policy("fp32"), precision_policy("bf16-mixed")
    d = training_state_bytes_per_param("adam", fp32)
    assert d == {"param": 4, "grad": 4, "optimizer": 8} and sum(d.values()) == 16
    # bf16-mixed keeps fp32 parameters (they are the master copy) and fp32 gradients; the bf16
    # working copy autocast makes is activation memory, not state
    assert training_state_bytes_per_param("adamw", mixed) == d
    assert sum(training_state_bytes_per_param("sgd", fp32).values()) == 8
    assert optimizer_state_bytes_per_param("sgd", mixed) == 0
    assert optimizer_state_bytes_per_param("sgd-momentum", mixed) == 4
    assert optimizer_state_bytes_per_param("Adam", fp32) == 8


def test_precision_policies():
    mixed = precision_policy("bf16-mixed")
    assert (mixed.compute_dtype, mixed.param_dtype, mixed.reduce_dtype, mixed.mixed) == ("bf16", "fp32", "fp32", True)
    assert precision_policy("bf16-mixed-reduce-bf16").torch_reduce_dtype == torch.bfloat16
    assert not precision_policy("fp32").mixed
    custom = PrecisionPolicy("x", "bfloat16", torch.float32, "float32", "fp32")
    assert custom == PrecisionPolicy("x", "bf16", "fp32", "fp32", "fp32")


def test_precision_and_optimizer_errors():
    with pytest.raises(ConstraintError, match="'fp8'.*fp32, bf16-mixed"):
        precision_policy("fp8")
    with pytest.raises(ConstraintError, match="'lion'.*sgd, sgd-momentum, adam, adamw"):
        optimizer_state_bytes_per_param("lion", precision_policy("fp32"))
    with pytest.raises(ConstraintError, match="loss scaling"):
        PrecisionPolicy("x", "fp16", "fp32")
    with pytest.raises(ConstraintError, match="reduce_dtype"):
        PrecisionPolicy("x", "fp32", "fp32", "int8")


@pytest.mark.parametrize("factory, states, total, cur, prev", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3), 2, 0.0, 2.0, 1.0),  # per-parameter loop (CPU default)
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True), 2, 1.0, 0.0, 0.0),  # whole-list temporaries
    (lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9), 1, 0.0, 0.0, 0.0),
    (lambda ps: torch.optim.SGD(ps, lr=1e-3), 0, 0.0, 0.0, 0.0),
])
def test_describe_optimizer_measures_state_and_temporaries(factory, states, total, cur, prev):
    from autopar.cost_models.memory import describe_optimizer

    spec = describe_optimizer(factory)
    assert (spec.states, spec.temp_total, spec.temp_cur, spec.temp_prev) == (states, total, cur, prev)
    # the model it fits reproduces a measured step on parameters of unequal sizes
    from autopar.runtime.memory import MemoryTracker

    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (5000, 30000, 12000)]
    opt = factory(ps)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    with MemoryTracker() as tracker:
        tracker.register([t for p in ps for t in [p, p.grad, *opt.state[p].values()]], "params")
        before = tracker.current_bytes
        with tracker.phase("optimizer"):
            opt.step()
    measured = tracker.report().peak_bytes - before
    assert measured == pytest.approx(spec.step_temporary_bytes([4.0 * p.numel() for p in ps]), rel=0.05, abs=64)


def test_describe_optimizer_rejects_an_instance():
    from autopar.cost_models.memory import describe_optimizer

    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ConstraintError, match=r"got a SGD instance.*optimizer=lambda ps: torch.optim.SGD\(ps"):
        describe_optimizer(torch.optim.SGD([p], lr=0.1))




def test_rails_limit_the_inter_node_phase_of_groups_with_several_ranks_per_node():
    """``LinkSpec.rails`` = k: a node's r ranks push their inter-node phase through k NICs, so
    that phase takes r/k times as long; a group with one rank per node, and k >= r, are as
    without it."""
    import dataclasses
    one_nic = dataclasses.replace(H100x4, inter_node=dataclasses.replace(H100x4.inter_node, rails=1))
    g = CommGroup(16, 4)
    intra = 3 / 4 * GiB / 450e9 + 3 * NV4_A
    for rails, cluster in ((4, H100x4), (1, one_nic)):
        inter = 3 / 4 * (GiB / rails) / 50e9 + 3 * IB_A
        assert close(collective_time("all_gather", GiB, g, cluster), inter + intra)
        assert close(collective_time("reduce_scatter", GiB, g, cluster), inter + intra)
    ar = collective_time("all_reduce", GiB, g, one_nic)
    assert close(ar, 2 * intra + 2 * 3 / 4 * GiB / 50e9 + 6 * IB_A)
    flat = axis_group((4, 8), 0, 8)  # one rank per node: each on its own NIC either way
    assert collective_time("all_reduce", GiB, flat, one_nic) == collective_time("all_reduce", GiB, flat, H100x4)
    many = dataclasses.replace(H100x4, inter_node=dataclasses.replace(H100x4.inter_node, rails=16))
    assert collective_time("all_gather", GiB, g, many) == collective_time("all_gather", GiB, g, H100x4)
    a2a = collective_time("all_to_all", GiB, g, one_nic)
    assert close(a2a, max(3 / 16 * GiB / 450e9 + 3 * NV4_A, 12 / 16 * GiB * 4 / 50e9 + 12 * IB_A))


def test_memory_tracker_counts_a_dtensor_by_its_local_shard():
    """A sharded DTensor holds its shard on this rank, not the global tensor: registered and
    computed on (the wrapper DTensor returns has the global size; its local ops are what run),
    and DTensor's sharding propagation (fake and meta tensors) allocates nothing."""
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.runtime.memory import MemoryTracker

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        full = torch.randn(1024, 256)
        d = distribute_tensor(full, DeviceMesh("cpu", list(range(4))), [Shard(0)])
        shard = full.nbytes // 4
        with MemoryTracker(count_unallocated=False) as tracker:
            tracker.register([d], "params")
            doubled = d * 2
            assert doubled.to_local().nbytes == shard
        report = tracker.report()
        assert report.category_peaks["params"] == shard
        assert report.category_peaks["activations"] == shard
    finally:
        dist.destroy_process_group()
