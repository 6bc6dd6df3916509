"""The planner's ZeRO stages (autopar.plan with ``zero=`` and ``zero_params=``): which parameters
and states each stage shards on the data axis, and how a sharded weight's gathers are priced."""
import pytest
import torch

import autopar
from autopar import Cluster, ConstraintError, Constraints

from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss

CFG = GPTConfig()  # vocab 256, seq 32, 2 layers, 4 heads, 64 dims


def plan_gpt(cluster: Cluster, constraints: Constraints):
    torch.manual_seed(0)
    idx, tgt = example_batch(CFG, 8)
    return autopar.plan(GPT(CFG), cluster, idx, loss_fn=gpt_loss, example_target=tgt, constraints=constraints)


@pytest.mark.slow
def test_zero3_shards_every_parameter_on_dp():
    p = plan_gpt(cluster=Cluster.local(4), constraints=Constraints(dp=4, tp=1, zero=3))
    assert p.mesh == {"dp": 4, "tp": 1}
    assert len(p.params) == sum(1 for _ in GPT(CFG).parameters())
    for fqn, pp in p.params.items():
        assert pp.layout.startswith("[S("), (fqn, pp.layout)
    assert p.override_cost_s is not None and p.override_cost_s >= -1e-12


def test_zero3_with_tp_keeps_a_weight_whose_only_long_dim_is_on_tp():
    # weight (1, 6): dim 1 is sharded on 'tp' and dim 0 has one row: nothing is left to shard on
    # 'dp' (neither the weight nor, as a DTensor Shard, its optimizer state): it stays replicated
    # there, and the plan is still made
    m = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.GELU(), torch.nn.Linear(6, 1))
    p = autopar.plan(m, Cluster.local(8), torch.randn(8, 6), loss_fn=torch.nn.functional.mse_loss,
                     example_target=torch.randn(8, 1), constraints=Constraints(dp=4, tp=2, zero=3))
    w = p.params["2.weight"]
    assert w.layout == "[R, S(1)]" and w.zero_axes == ()
    assert p.params["0.weight"].layout.startswith("[S(")



@pytest.mark.parametrize("zero", [1, 2])
def test_zero1_and_zero2_keep_every_parameter_whole_on_dp(zero):
    # ZeRO-1/2 shard optimizer state (and gradients) on 'dp', never a parameter: a 1-D parameter
    # (a bias, a norm weight) once slipped through as sharded on 'dp', gathered ZeRO-3 style,
    # because "has it a whole dim left to shard" was asked of its already sharded layout
    p = plan_gpt(cluster=Cluster.local(4), constraints=Constraints(dp=4, tp=1, zero=zero))
    for fqn, pp in p.params.items():
        assert pp.layout.startswith("[R"), (fqn, pp.layout)
        assert pp.zero_axes == ("dp",) and pp.zero_stage == zero, (fqn, pp.zero_axes, pp.zero_stage)

@pytest.mark.slow
def test_zero0_shards_nothing_on_dp():
    p = plan_gpt(cluster=Cluster.local(4), constraints=Constraints(dp=4, tp=1, zero=0))
    for fqn, pp in p.params.items():
        assert pp.layout.startswith("[R"), (fqn, pp.layout)
        assert "dp" not in pp.zero_axes
    # the data parallel input is batch-sharded on dp
    assert p.nodes["input_0"].outs[0].startswith("[S(0)")


def test_zero_params_sets_zero_per_parameter():
    """``Constraints(zero_params=)``: a ZeRO stage per parameter glob, beating ``zero``; checked,
    and kept through ``to_dict``; a pipeline plan uses it for ZeRO per stage."""
    from examples.mlp import MLP, example_batch, mlp_loss

    x, t = example_batch()
    c = Constraints(dp=2, zero=0, zero_params={"layers.0.*": 3, "layers.2.*": 1})
    plan = autopar.plan(MLP(64, 256, 3), autopar.Cluster.local(2), (x,), loss_fn=mlp_loss, example_target=t, constraints=c)
    for fqn, p in plan.params.items():
        if fqn.startswith("layers.0."):
            assert p.layout == "[S(0), R]", (fqn, p)  # ZeRO-3: sharded on 'dp'
        elif fqn.startswith("layers.2."):
            assert p.layout == "[R, R]" and p.zero_stage == 1 and p.zero_axes == ("dp",), (fqn, p)
        else:
            assert p.layout == "[R, R]" and not p.zero_axes, (fqn, p)  # zero=0 elsewhere
    assert Constraints.from_dict(c.to_dict()) == c
    with pytest.raises(ConstraintError, match=r"zero_params\['a'\] must be a ZeRO stage"):
        Constraints(zero_params={"a": 4})
    with pytest.raises(ConstraintError, match="zero_params must be a dict"):
        Constraints(zero_params=["a", 3])


def test_a_zero3_weight_is_gathered_again_only_where_its_consumer_saves_it():
    """Under ZeRO-3 a gathered weight is freed after forward and gathered again for the backward
    of an op that saves it. The first layer of a stack saves no weight (its input needs no
    gradient) while the layers after it do: the edge that stands for all of them prices one
    forward gather each and a backward one for each consumer that saves it."""
    from torch.distributed.tensor.placement_types import Replicate, Shard as DShard

    from autopar.cost_models.memory import optimizer_spec, precision_policy
    from autopar.planner.blocks import find_repeated_blocks
    from autopar.planner.costing import reshard_time
    from autopar.planner.problem import build_problem
    from autopar.planner.contexts import cost_context
    from autopar.trace import trace_model
    from examples.mlp import MLP, example_batch as mlp_batch, mlp_loss

    layers = 4
    x, t = mlp_batch()
    traced = trace_model(MLP(64, 256, layers), (x,), loss_fn=mlp_loss, example_target=t)
    ctx = cost_context((2,), Cluster.local(2), precision_policy("fp32"), optimizer_spec("adam"))
    problem = build_problem(traced, find_repeated_blocks(traced.graph), ctx, recompute=False, microbatches=1)
    edge = next(e for e in problem.edges if e.u.endswith("up_weight"))
    assert edge.count == layers
    U = problem.nodes[edge.u]
    s = next(i for i, st in enumerate(U.strategies) if st.outs[0] == (DShard(0),) and not st.zero_axes)
    kv = next(kv for kv in range(edge.blocking.shape[1]) if edge.overlap[edge.u_key[s], kv] > 0)
    meta = U.node.meta["autopar.outputs"][0]
    gather = reshard_time(meta, (DShard(0),), (Replicate(),), ctx, blocking=False)["all_gather"]
    assert edge.overlap[edge.u_key[s], kv] == pytest.approx(layers * gather)
    assert edge.kinds[edge.u_key[s]][kv]["all_gather"] == pytest.approx((2 * layers - 1) * gather)


def test_a_zero1_gather_that_cannot_run_in_place_prices_the_host_copies():
    """ZeRO-1/2's post-step all-gather of a weight cut evenly along dim 0 writes straight into the
    weight (the runtime's ``ParamStore.gather_zero_params``): the collective alone. One cut
    unevenly (7 rows on 2 ranks) goes through a buffer copied back: its bytes at the host's
    copy rate besides."""
    import dataclasses

    from torch.distributed.tensor.placement_types import Replicate

    from autopar.cost_models.communication import blocking_collective_time
    from autopar.cost_models.memory import optimizer_spec, precision_policy
    from autopar.planner.costing import CostContext
    from autopar.planner.sync_pricing import post_step_gather_time
    from autopar.strategies import Strategy
    from autopar.trace import TensorMeta

    base = Cluster.local(2, calibrated=False)
    cluster = dataclasses.replace(base, device=dataclasses.replace(base.device, collective_host_byte_s=1e-9))
    ctx = CostContext((2,), ("dp",), cluster, precision_policy("fp32"), optimizer_spec("adam"))
    zero1 = Strategy(ins=(), outs=((Replicate(),),), grad_ins=(), zero_axes=(0,), zero_stage=1)
    for rows, copied in ((32, False), (7, True)):
        meta = TensorMeta((rows, 64), torch.float32)
        gather = blocking_collective_time("all_gather", rows * 64 * 4.0, ctx.groups[0], cluster)
        want = gather + (1e-9 * rows * 64 * 4 if copied else 0.0)
        assert post_step_gather_time(meta, zero1, ctx) == pytest.approx(want, rel=1e-9), rows


def test_zero2_reduce_scatters_pending_together_share_their_waiting_on_gloo_only():
    """ZeRO-2's reduce-scatters, up to ``ZERO2_MAX_INFLIGHT`` pending (``runtime.grad_sync``), run
    on gloo's worker threads side by side: each is priced its bytes and its waiting over
    ``concurrent_waits`` (2 on gloo, 1 on NCCL, whose stream runs them one after another)."""
    import dataclasses

    from torch.distributed.tensor.placement_types import Replicate

    from autopar.cost_models.communication import collective_latency, collective_time
    from autopar.cost_models.memory import optimizer_spec, precision_policy
    from autopar.planner.costing import CostContext
    from autopar.planner.sync_pricing import concurrent_waits, zero2_reduce_latency, zero2_reduce_time
    from autopar.trace import TensorMeta

    gloo = Cluster.local(4, calibrated=False)
    nccl = dataclasses.replace(Cluster.preset("dgx-a100"), nodes=1, devices_per_node=4)
    meta = TensorMeta((256, 64), torch.float32)
    for cluster, waits in ((gloo, 2), (nccl, 1)):
        assert concurrent_waits(cluster) == waits
        ctx = CostContext((4,), ("dp",), cluster, precision_policy("fp32"), optimizer_spec("adam"))
        full = collective_time("reduce_scatter", 256 * 64 * 4.0, ctx.groups[0], cluster)
        lat = collective_latency("reduce_scatter", ctx.groups[0], cluster)
        assert 0 < lat < full
        got = zero2_reduce_time(meta, (Replicate(),), (0,), (0,), ctx)
        assert got == {"reduce_scatter": pytest.approx(full - (1 - 1 / waits) * lat, rel=1e-9)}
        assert zero2_reduce_latency((0,), (0,), ctx) == pytest.approx(lat / waits, rel=1e-9)
