"""The calibrated compute figures as the planner prices them: a matmul or linear by the measured
shape table, the optimizer's update and the gradient buffers per element (cold and warm), each
sharded with the state it touches."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.cluster import Cluster
from autopar.errors import ClusterSpecError


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))


def test_the_optimizer_update_is_priced_and_sharded_with_its_state():
    """The plan's step time includes the optimizer's update: Adam's costs more than SGD's, and
    sharding the optimizer state over 4 ranks (ZeRO-1) divides it."""
    x = torch.randn(64, 256)
    cluster = Cluster.local(4)

    def compute_s(optimizer, zero):
        c = autopar.Constraints(dp=4, tp=1, zero=zero)
        return autopar.plan(_mlp(), cluster, x, optimizer=optimizer, constraints=c).predicted.compute_s

    from autopar.planner.costing import CostContext, optimizer_update_time
    from autopar.cost_models.memory import optimizer_spec, precision_policy
    from autopar.strategies import Strategy
    from autopar.trace import TensorMeta

    meta = TensorMeta((1024, 256), torch.float32)
    ctx = {o: CostContext((4,), ("dp",), cluster, precision_policy("fp32"), optimizer_spec(o)) for o in ("sgd", "adam")}
    from torch.distributed.tensor.placement_types import Replicate

    replicated = Strategy(ins=(), outs=((Replicate(),),), grad_ins=())
    sharded = dataclasses.replace(replicated, zero_axes=(0,), zero_stage=1)
    sgd, adam = (optimizer_update_time(meta, replicated, ctx[o]) for o in ("sgd", "adam"))
    assert adam > 2 * sgd > 0
    assert optimizer_update_time(meta, sharded, ctx["adam"]) == pytest.approx(adam / 4, rel=1e-6)
    assert compute_s("adam", 0) > compute_s("sgd", 0)
    assert compute_s("adam", 1) < compute_s("adam", 0)


def test_a_gradient_buffer_is_zeroed_once_and_accumulated_each_microbatch():
    """``gradient_buffer_time``: per step, one pass zeroing the parameter's gradient and one adding
    each microbatch's gradient into it, over what the rank holds of it (a ZeRO-2 shard, a
    tensor-parallel slice), at the device's calibrated ``grad_buffer_element_s``; the plan
    prices it in the step's compute."""
    from torch.distributed.tensor.placement_types import Replicate, Shard

    from autopar.cost_models.memory import optimizer_spec, precision_policy
    from autopar.planner.costing import CostContext, gradient_buffer_time
    from autopar.strategies import Strategy
    from autopar.trace import TensorMeta

    base = Cluster.local(4, calibrated=False)
    zero, add = 1e-9, 2e-9

    def with_buffer(z, a):
        return dataclasses.replace(base, device=dataclasses.replace(base.device, grad_buffer_element_s=(z, a)))

    ctx = CostContext((4,), ("dp",), with_buffer(zero, add), precision_policy("fp32"), optimizer_spec("adam"))
    meta = TensorMeta((1024, 256), torch.float32)
    n = 1024 * 256
    replicated = Strategy(ins=(), outs=((Replicate(),),), grad_ins=())
    sliced = dataclasses.replace(replicated, outs=((Shard(0),),))
    zero1 = dataclasses.replace(replicated, zero_axes=(0,), zero_stage=1)
    zero2 = dataclasses.replace(replicated, zero_axes=(0,), zero_stage=2)
    for m in (1, 4):
        assert gradient_buffer_time(meta, replicated, ctx, m) == pytest.approx(n * (zero + m * add))
        assert gradient_buffer_time(meta, zero1, ctx, m) == pytest.approx(n * (zero + m * add))
        assert gradient_buffer_time(meta, sliced, ctx, m) == pytest.approx(n / 4 * (zero + m * add))
        assert gradient_buffer_time(meta, zero2, ctx, m) == pytest.approx(n / 4 * (zero + m * add))
    # uncalibrated: streamed at memory bandwidth, still growing with the microbatches
    plain = CostContext((4,), ("dp",), base, precision_policy("fp32"), optimizer_spec("adam"))
    assert 0 < gradient_buffer_time(meta, replicated, plain, 1) < gradient_buffer_time(meta, replicated, plain, 4)
    # in the plan: the same replicated model, its gradients' accumulation twice as slow, predicted
    # slower by one more add per parameter element
    x = torch.randn(64, 256)
    c = autopar.Constraints(dp=4, tp=1, zero=0)
    fast_s, slow_s = (autopar.plan(_mlp(), cl, x, constraints=c).predicted.compute_s
                      for cl in (with_buffer(zero, add), with_buffer(zero, 2 * add)))
    params = sum(p.numel() for p in _mlp().parameters())
    assert slow_s - fast_s == pytest.approx(add * params, rel=1e-6)


def test_matmul_time_gives_back_the_measured_shapes_and_interpolates_between_them():
    """A table whose efficiency grows with the inner dimension k: each measured shape is priced as
    measured, a shape between two is priced between them, one beyond the grid's largest at its
    edge's efficiency, one below its smallest at the edge's time scaled by the elements moved,
    and bf16 at its own peak."""
    from autopar.cost_models.compute import matmul_time

    dims = (8, 64, 512)
    peak = 1e11
    eff = {8: 0.05, 64: 0.4, 512: 0.8}
    table = tuple((m, k, n, 2.0 * m * k * n / (peak * eff[k])) for m in dims for k in dims for n in dims)
    d = dataclasses.replace(Cluster.local(1, calibrated=False).device, matmul_table=table,
                            peak_flops=autopar.cluster.PeakFlops(fp32=peak, tf32=peak, bf16=2 * peak, fp16=2 * peak))
    for m, k, n, t in table:
        assert matmul_time(m, k, n, d, "fp32") == pytest.approx(t, rel=1e-9)
    between = matmul_time(64, 128, 64, d, "fp32")
    assert matmul_time(64, 512, 64, d, "fp32") > between / 2 and between > matmul_time(64, 64, 64, d, "fp32")
    assert 2.0 * 64 * 4096 * 64 / matmul_time(64, 4096, 64, d, "fp32") == pytest.approx(peak * 0.8, rel=1e-9)
    assert matmul_time(64, 64, 64, d, "bf16") == pytest.approx(matmul_time(64, 64, 64, d, "fp32") / 2, rel=1e-9)
    assert matmul_time(64, 64, 64, d, "fp32", batch=3) == pytest.approx(3 * matmul_time(64, 64, 64, d, "fp32"))
    # below the grid's smallest dim: the edge's time scaled by the elements moved, not by the
    # FLOPs (a weight gradient over a 4-row microbatch writes the whole [m, n] gradient)
    edge = matmul_time(512, 8, 512, d, "fp32")
    moved = (512 * 4 + 4 * 512 + 512 * 512) / (512 * 8 + 8 * 512 + 512 * 512)
    assert matmul_time(512, 4, 512, d, "fp32") == pytest.approx(edge * moved, rel=1e-9)
    assert matmul_time(512, 4, 512, d, "fp32") > 0.9 * edge


def test_a_calibrated_shape_table_prices_a_linear_by_its_local_shapes():
    """With a shape table, a linear's forward is priced by its local (rows, in, out) and its
    backward by the input gradient's and the weight gradient's shapes (the latter's inner dim is
    the rows): a small batch's weight gradient costs what the table says such a shape costs."""
    from autopar.cost_models.compute import matmul_time

    dims = (8, 64, 512)
    table = tuple((m, k, n, 2.0 * m * k * n / (1e11 * (0.05 if 8 in (m, k) else 0.8))) for m in dims for k in dims
                  for n in dims)
    base = Cluster.local(1, calibrated=False)
    one = dataclasses.replace(base, device=dataclasses.replace(
        base.device, matmul_table=table, op_overhead=0.0,
        peak_flops=autopar.cluster.PeakFlops(fp32=1e11, tf32=1e11, bf16=1e11, fp16=1e11)))
    model = torch.nn.Linear(512, 512, bias=False)
    plan = autopar.plan(model, one, torch.randn(8, 512), optimizer="sgd")
    node = next(n for n in plan.nodes.values() if "linear" in n.op)
    d = one.device
    expected = matmul_time(8, 512, 512, d, "fp32") + matmul_time(8, 512, 512, d, "fp32") + matmul_time(512, 8, 512, d, "fp32")
    assert node.compute_s == pytest.approx(expected, rel=1e-6)


def test_a_linear_forward_and_a_transposed_right_operand_are_priced_by_the_linear_table():
    """nn.Linear's forward (``x @ W.T``) and a matmul whose right operand is a transposed view are
    priced from ``DeviceSpec.linear_table``; their backward GEMMs and a plain ``a @ b`` from
    ``matmul_table``; a bias adds two passes over the output forward and one backward."""
    from autopar.cost_models.compute import matmul_time, op_time

    dims = (8, 64, 512)
    table = tuple((m, k, n, 2.0 * m * k * n / 4e10) for m in dims for k in dims for n in dims)
    slow = tuple((m, k, n, 3 * t) for m, k, n, t in table)
    base = Cluster.local(1, calibrated=False)
    one = dataclasses.replace(base, device=dataclasses.replace(
        base.device, matmul_table=table, linear_table=slow, op_overhead=0.0,
        peak_flops=autopar.cluster.PeakFlops(fp32=1e11, tf32=1e11, bf16=1e11, fp16=1e11)))
    d = one.device
    backward = matmul_time(8, 64, 512, d, "fp32") + matmul_time(512, 8, 64, d, "fp32")
    assert matmul_time(8, 512, 64, d, "fp32", linear=True) == pytest.approx(3 * matmul_time(8, 512, 64, d, "fp32"))

    def priced(model):
        plan = autopar.plan(model, one, torch.randn(8, 512), optimizer="sgd")
        return [n.compute_s for n in plan.nodes.values() if n.op in ("aten.linear.default", "aten.matmul.default")]

    forward = matmul_time(8, 512, 64, d, "fp32", linear=True)
    assert priced(torch.nn.Linear(512, 64, bias=False)) == [pytest.approx(forward + backward, rel=1e-6)]
    out_pass = op_time(0.0, 8 * 64 * 4, d, "fp32", "pointwise")
    assert priced(torch.nn.Linear(512, 64)) == [pytest.approx(forward + backward + 3 * out_pass, rel=1e-6)]

    class Product(torch.nn.Module):
        def __init__(self, transposed):
            super().__init__()
            self.transposed = transposed
            self.w = torch.nn.Parameter(torch.randn(64, 512) if transposed else torch.randn(512, 64))

        def forward(self, x):
            return x @ (self.w.transpose(-2, -1) if self.transposed else self.w)

    assert priced(Product(True)) == [pytest.approx(forward + backward, rel=1e-6)]
    assert priced(Product(False)) == [pytest.approx(matmul_time(8, 512, 64, d, "fp32") + backward, rel=1e-6)]


def test_a_rank_updating_few_elements_pays_the_warm_per_element_costs():
    """``DeviceSpec.warm_elements``: at or below its count the warm figures, at or above the cold
    count the calibrated ``update_element_s`` / ``grad_buffer_element_s``, log-linearly between;
    the planner prices a rank by the largest of its parameter, gradient and optimizer elements (the
    MLP's 8.4M parameters over tp=2: 4.2M a rank), and again when the plan holds another count
    than the mesh suggested. Refused when malformed; kept by the JSON."""
    from autopar.bench import load_bench_model
    from autopar.planner.costing import element_costs

    base = Cluster.local(2, calibrated=False)
    dev = dataclasses.replace(base.device, update_element_s=(1e-9, 4e-9), grad_buffer_element_s=(1e-9, 2e-9),
                              warm_elements=(2.0**20, 2.0**23, 0.5e-9, 1e-9, 0.25e-9, 0.5e-9))
    assert element_costs(dev, 2.0**18) == ((0.5e-9, 1e-9), (0.25e-9, 0.5e-9))
    assert element_costs(dev, 2.0**24) == ((1e-9, 4e-9), (1e-9, 2e-9))
    mid = element_costs(dev, 2.0**21)  # a third of the way in log
    assert mid[0] == pytest.approx((0.5e-9 + 0.5e-9 / 3, 1e-9 + 3e-9 / 3))
    assert mid[1] == pytest.approx((0.25e-9 + 0.75e-9 / 3, 0.5e-9 + 1.5e-9 / 3))
    assert element_costs(base.device, 1.0) == (base.device.update_element_s, base.device.grad_buffer_element_s)
    with pytest.raises(ClusterSpecError, match="warm_elements"):
        dataclasses.replace(dev, warm_elements=(2.0**23, 2.0**20, 0, 0, 0, 0))
    cluster = dataclasses.replace(base, device=dev)
    assert Cluster.from_json(cluster.to_json()) == cluster
    model, inputs, loss, target = load_bench_model("mlp")
    cold = dataclasses.replace(cluster, device=dataclasses.replace(dev, warm_elements=None))
    plans = {c: autopar.plan(model, c, inputs, loss_fn=loss, example_target=target, optimizer="adamw",
                             constraints=autopar.Constraints(tp=2)) for c in (cluster, cold)}
    numel = sum(p.numel() for p in model.parameters()) / 2
    (per, per_state), (zero, add) = element_costs(dev, numel)
    (cper, cper_state), (czero, cadd) = element_costs(cold.device, numel)
    saved = numel * ((cper - per) + 2 * (cper_state - per_state) + (czero - zero) + (cadd - add))
    assert plans[cluster].predicted.compute_s == pytest.approx(plans[cold].predicted.compute_s - saved, rel=1e-3)
    # data parallel: priced first as if every rank held all 8.4M elements (the cold figures);
    # ZeRO-3 leaves each rank half of its parameters, gradients and states: priced again at that
    # count. ZeRO-2 keeps the parameters whole: the cold figures
    plans = {(c, z): autopar.plan(model, c, inputs, loss_fn=loss, example_target=target, optimizer="adamw",
                                  constraints=autopar.Constraints(dp=2, zero=z)) for c in (cluster, cold) for z in (2, 3)}
    assert sum(p.numel() for p in model.parameters()) >= 2**23
    assert plans[cluster, 3].predicted.compute_s < plans[cold, 3].predicted.compute_s * 0.97
    assert plans[cluster, 2].predicted.compute_s == pytest.approx(plans[cold, 2].predicted.compute_s)


def test_the_cache_a_node_s_ranks_share_says_where_between_warm_and_cold_a_rank_is_priced():
    """``DeviceSpec.shared_cache_bytes``: what the node's ranks stream (parameter, gradient and
    the optimizer's states, fp32, per element, times the ranks) filling at most half the cache is
    priced warm, all of it or more cold, linearly between, whatever the counts the two figures
    were measured at. The planner counts the cluster's ranks per node and the optimizer's states:
    the MLP's 8.4M parameters over tp=2 under AdamW (4.2M elements a rank, 134 MB on the 2-rank
    node) are warm in a 300 MiB cache, and its 4-rank data parallelism (8.4M a rank) cold."""
    from autopar.bench import load_bench_model
    from autopar.calibration.cpu_cache import last_level_cache_bytes
    from autopar.planner.costing import element_costs

    warm_fig, cold_fig = ((0.5e-9, 1e-9), (0.25e-9, 0.5e-9)), ((1e-9, 4e-9), (1e-9, 2e-9))
    base = Cluster.local(2, calibrated=False)
    dev = dataclasses.replace(base.device, update_element_s=cold_fig[0], grad_buffer_element_s=cold_fig[1],
                              warm_elements=(2.0**20, 2.0**23, *warm_fig[0], *warm_fig[1]), shared_cache_bytes=16e6)
    # AdamW streams 16 bytes per element (parameter, gradient, two states) of a 16 MB cache
    assert element_costs(dev, 0.5e6 / 2, ranks_per_node=2) == warm_fig  # 8 MB: half the cache
    assert element_costs(dev, 1e6 / 2, ranks_per_node=2) == cold_fig  # 16 MB: all of it
    mid = element_costs(dev, 0.75e6, states=2)  # 12 MB: halfway between
    assert mid[0] == pytest.approx((0.75e-9, 2.5e-9)) and mid[1] == pytest.approx((0.625e-9, 1.25e-9))
    assert element_costs(dev, 0.75e6, states=0) == warm_fig  # SGD streams half as much per element
    assert element_costs(dev, 4e6) == cold_fig  # 64 MB, four times the cache: cold, not beyond
    with pytest.raises(ClusterSpecError, match="shared_cache_bytes"):
        dataclasses.replace(dev, shared_cache_bytes=0)
    cluster = dataclasses.replace(base, device=dataclasses.replace(dev, shared_cache_bytes=300 * 2.0**20))
    assert Cluster.from_json(cluster.to_json()) == cluster
    model, inputs, loss, target = load_bench_model("mlp")
    plan = autopar.plan(model, cluster, inputs, loss_fn=loss, example_target=target, optimizer="adamw",
                        constraints=autopar.Constraints(tp=2))
    rows = max(nd.compute_s for nd in plan.nodes.values() if nd.op == "param")  # the largest weight's update
    numel = 2048 * 512 / 2
    assert rows == pytest.approx(numel * (warm_fig[0][0] + 2 * warm_fig[0][1] + sum(warm_fig[1])), rel=0.02)
    four = dataclasses.replace(Cluster.local(4, calibrated=False), device=cluster.device)
    plan = autopar.plan(model, four, inputs, loss_fn=loss, example_target=target, optimizer="adamw",
                        constraints=autopar.Constraints(dp=4))
    rows = max(nd.compute_s for nd in plan.nodes.values() if nd.op == "param")
    updated = rows / (cold_fig[0][0] + 2 * cold_fig[0][1] + sum(cold_fig[1]))  # at the cold figures: its elements
    assert any(updated == pytest.approx(2 * numel / k, rel=0.02) for k in (1, 4))  # whole, or its optimizer sharded
    assert last_level_cache_bytes() is None or last_level_cache_bytes() > 0


def test_the_last_level_cache_is_read_from_sysfs(tmp_path):
    """``calibration.cpu_cache``: the highest level of a data or unified cache, its size parsed
    ("307200K" is 300 MiB); an instruction cache is not it; no sysfs: None."""
    import os

    from autopar.calibration.cpu_cache import last_level_cache_bytes

    cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    for index, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"),
                                                 (3, "Unified", "307200K"), (4, "Instruction", "1G")]):
        d = tmp_path / f"cpu{cpu}" / "cache" / f"index{index}"
        d.mkdir(parents=True)
        for name, text in (("level", f"{level}\n"), ("type", f"{kind}\n"), ("size", f"{size}\n")):
            (d / name).write_text(text)
    assert last_level_cache_bytes(tmp_path) == 300 * 2**20
    assert last_level_cache_bytes(tmp_path / "none") is None


def test_fit_attention_tells_the_per_pair_cost_from_the_per_flop_cost():
    """Attention's forward and backward, each ``fixed + pairs * per_pair + flops * per_flop``,
    timed with 2% noise at the calibration's shapes: the per-pair and per-FLOP costs come back
    within 10%, the fixed part (``op_overhead``'s) is not kept."""
    import numpy as np

    from autopar.calibration.fit import fit_attention
    from autopar.calibration.microbench import _ATTENTION_SHAPES

    truth = (1.5e-6, 2e-11, 3e-6, 5e-11)
    rng = np.random.default_rng(0)
    rows = []
    for b, h, s, d in _ATTENTION_SHAPES:
        pairs, flops = b * h, 2.0 * b * h * s * s * d
        fwd = 4e-6 + pairs * truth[0] + flops * truth[1]
        bwd = 15e-6 + pairs * truth[2] + flops * truth[3]
        rows.append((pairs, flops, fwd * rng.uniform(0.98, 1.02), (fwd + bwd) * rng.uniform(0.98, 1.02)))
    assert fit_attention(rows) == pytest.approx(truth, rel=0.1)
    with pytest.raises(autopar.AutoparError, match="three measured shapes"):
        fit_attention(rows[:2])


def test_attention_is_priced_per_head_pair_and_flop_where_measured():
    """With ``DeviceSpec.attention_costs`` a GPT's attention node costs ``op_overhead`` plus its
    (batch, head) pairs and FLOPs at the measured rates, forward and backward, over the device's
    share: sharding the heads on 2 ranks halves both terms. A spec without them keeps the roofline."""
    from torch.distributed.tensor.placement_types import Replicate, Shard as DShard

    from autopar.cost_models.memory import optimizer_spec, precision_policy
    from autopar.planner.costing import CostContext, node_compute_time, node_flops
    from autopar.strategies import Strategy
    from autopar.trace import trace_model
    from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss

    cfg = GPTConfig()
    idx, tgt = example_batch(cfg, 4)
    traced = trace_model(GPT(cfg), (idx,), loss_fn=gpt_loss, example_target=tgt)
    node = next(n for n in traced.graph.nodes if "scaled_dot_product_attention" in str(n.target))
    q = node.meta["autopar.outputs"][0]
    pairs, (flops, kind) = q.shape[0] * q.shape[1], node_flops(node)
    assert kind == "attention" and pairs == 4 * cfg.n_head

    base = Cluster.local(2, calibrated=False)
    costs = (2e-6, 3e-11, 4e-6, 7e-11)
    device = dataclasses.replace(base.device, op_overhead=10e-6, attention_costs=costs)
    cluster = dataclasses.replace(base, device=device)
    ctx = CostContext((2,), ("tp",), cluster, precision_policy("fp32"), optimizer_spec("adam"))
    whole = Strategy(ins=(), outs=((Replicate(),),), grad_ins=())
    heads = Strategy(ins=(), outs=((DShard(1),),), grad_ins=())
    for strategy, split in ((whole, 1), (heads, 2)):
        fwd, bwd = node_compute_time(node, strategy, ctx)
        assert fwd == pytest.approx(10e-6 + (costs[0] * pairs + costs[1] * flops) / split)
        assert bwd == pytest.approx(10e-6 + (costs[2] * pairs + costs[3] * flops) / split)
    roofline = dataclasses.replace(cluster, device=dataclasses.replace(device, attention_costs=None))
    ctx = CostContext((2,), ("tp",), roofline, precision_policy("fp32"), optimizer_spec("adam"))
    fwd, bwd = node_compute_time(node, whole, ctx)
    assert bwd - 10e-6 == pytest.approx(2.5 * (fwd - 10e-6))  # the roofline's backward: 2.5x the FLOPs


def test_attention_costs_are_validated_and_round_trip():
    base = Cluster.local(2, calibrated=False)
    device = dataclasses.replace(base.device, attention_costs=(1e-6, 2e-11, 3e-6, 4e-11))
    spec = dataclasses.replace(base, device=device)
    assert Cluster.from_json(spec.to_json()) == spec
    for bad in ((1e-6, 2e-11, 3e-6), (1e-6, -1.0, 3e-6, 4e-11), (1e-6, 0.0, 3e-6, 0.0)):
        with pytest.raises(ClusterSpecError, match="attention_costs"):
            dataclasses.replace(base.device, attention_costs=bad)


def test_a_gpu_op_costs_the_longer_of_its_launch_and_its_kernel_a_cpu_op_both():
    """A GPU's host queues kernels ahead of the device: an op costs max(op_overhead, its work).
    A CPU process runs the dispatch and the work one after the other: their sum."""
    from autopar.planner.costing import BWD_OPS

    x = torch.randn(64, 256)
    overhead = 1e-3  # far above any of the small MLP's kernels on an H100
    gpu = Cluster.preset("dgx-h100")
    gpu = dataclasses.replace(gpu, devices_per_node=1, device=dataclasses.replace(gpu.device, op_overhead=overhead))
    cpu = Cluster.local(1, calibrated=False)
    cpu = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, op_overhead=overhead))
    per_op = {}
    for name, cluster in (("gpu", gpu), ("cpu", cpu)):
        plan = autopar.plan(_mlp(), cluster, x, optimizer="sgd")
        per_op[name] = {n.name: n.compute_s for n in plan.nodes.values() if n.op == "aten.linear.default"}
    assert len(per_op["gpu"]) == len(per_op["cpu"]) == 2
    # forward: the launch; backward: BWD_OPS launches (both GEMMs' kernels shorter than them)
    assert all(t == pytest.approx(overhead * (1 + BWD_OPS["matmul"]), rel=1e-9) for t in per_op["gpu"].values())
    assert all(t > overhead * (1 + BWD_OPS["matmul"]) * 1.001 for t in per_op["cpu"].values())


def _conv_device(eff, peak=1e11):
    """A device whose convolution table runs each implicit GEMM shape at ``eff(m, k, n)`` of
    ``peak`` forward and 3x that time backward; matmuls at the peak, no per-op overhead."""
    ms, ks, ns = (256, 1024, 4096), (36, 144, 576), (4, 16, 64)
    table = tuple((m, k, n, 2.0 * m * k * n / (peak * eff(m, k, n)), 6.0 * m * k * n / (peak * eff(m, k, n)))
                  for m in ms for k in ks for n in ns)
    base = Cluster.local(4, calibrated=False)
    flops = autopar.cluster.PeakFlops(fp32=peak, tf32=peak, bf16=peak, fp16=peak)
    return dataclasses.replace(base, device=dataclasses.replace(base.device, conv_table=table, op_overhead=0.0,
                                                                peak_flops=flops, matmul_efficiency=1.0))


def test_conv_time_gives_back_the_measured_convolutions_and_interpolates_between_them():
    """Each measured shape is priced as measured, forward and backward; a shape between two
    measured ones between them; few output channels at a small share of the rate."""
    from autopar.cost_models.compute import conv_time

    cluster = _conv_device(lambda m, k, n: 0.02 if n == 4 else 0.5)
    d = cluster.device
    for m, k, n, f, b in d.conv_table:
        assert conv_time(m, k, n, d, "fp32") == pytest.approx(f, rel=1e-9)
        assert conv_time(m, k, n, d, "fp32", backward=True) == pytest.approx(b, rel=1e-9)
    between = conv_time(1024, 144, 8, d, "fp32")
    assert conv_time(1024, 144, 4, d, "fp32") * 2 > between > conv_time(1024, 144, 16, d, "fp32") / 2
    assert 2.0 * 1024 * 144 * 4 / conv_time(1024, 144, 4, d, "fp32") == pytest.approx(0.02 * 1e11, rel=1e-9)


def test_a_convolution_is_priced_by_the_convolution_table_at_its_local_shape():
    """A calibrated convolution table prices a conv2d node by its local implicit GEMM (batch x
    pixels, input channels x kernel, output channels), not by its FLOPs at the matmul rate: the
    data-parallel plan's node by a quarter of the batch, the tensor-parallel one's by a quarter
    of the channels it splits (the output's, or the input's with a partial sum out), each forward +
    backward as the table says."""
    from autopar.cost_models.compute import conv_time

    cluster = _conv_device(lambda m, k, n: 0.05 * (n / 4) ** 0.5)  # 0.05 at 4 channels, 0.2 at 64
    d = cluster.device
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 64, 3, padding=1, bias=False), torch.nn.Flatten(),
                                torch.nn.Linear(64 * 16 * 16, 10))
    x = torch.randn(16, 16, 16, 16)
    for constraints in (autopar.Constraints(dp=4), autopar.Constraints(tp=4, dp=1)):
        plan = autopar.plan(model, cluster, x, optimizer="sgd", constraints=constraints)
        node = next(n for n in plan.nodes.values() if "conv2d" in n.op)
        if constraints.dp == 4:
            m, k, n = 4 * 256, 144, 64
        else:
            assert node.outs[0] in ("[R, S(1)]", "[R, P(sum)]"), node.outs
            m, k, n = (16 * 256, 144, 16) if "S(1)" in node.outs[0] else (16 * 256, 36, 64)
        # the input is the model's: no gradient for it, but the weight's (one backward op, priced as measured)
        expected = conv_time(m, k, n, d, "fp32") + conv_time(m, k, n, d, "fp32", backward=True)
        assert node.compute_s == pytest.approx(expected, rel=1e-6)
        assert node.compute_s > 3 * 4 * 2.0 * m * k * n / 1e11  # over 3x what its FLOPs cost at the matmul rate
