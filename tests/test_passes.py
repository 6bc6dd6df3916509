"""Structure of the per-rank program: which collectives the passes insert, and local shapes."""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.passes import run_passes
from autopar.passes.analysis import count_collectives
from autopar.passes.context import PassContext
from autopar.passes.pipeline import PassError
from autopar.planner.search import search_plan
from autopar.trace import trace_model
from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss
from examples.mlp import MLP, example_batch as mlp_batch, mlp_loss

MEGATRON_MLP = {"layers.*.up.weight": {"tp": "S(0)"}, "layers.*.down.weight": {"tp": "S(1)"}}


def _program(model, inputs, target, loss_fn, constraints, nproc=2):
    traced = trace_model(model, inputs, loss_fn=loss_fn, example_target=target)
    plan = search_plan(traced, autopar.Cluster.local(nproc), constraints=constraints, _with_free=False, _with_baseline=False)
    return plan, run_passes(copy.deepcopy(traced.gm), PassContext.for_stage(plan))


def test_pure_tensor_parallel_mlp_collectives_by_kind():
    layers = 3
    x, t = mlp_batch()
    plan, gm = _program(MLP(64, 256, layers), (x,), t, mlp_loss, autopar.Constraints(tp=2, placements=MEGATRON_MLP))
    counts = count_collectives(gm)
    assert set(kind for _, kind in counts) <= {"all_reduce", "reduce_scatter", "all_gather"}, counts
    # Megatron: one reduction after each row-parallel layer in forward (an all-reduce; with the
    # residual stream sharded by rows, sequence parallelism, a reduce-scatter, and an all-gather
    # before each later column-parallel layer); in backward one reduction of the gradient entering
    # each column-parallel layer whose input needs a gradient (not layer 0), the gathers' mirror
    c = lambda phase, kind: counts.get((phase, kind), 0)  # noqa: E731
    assert c("forward", "all_reduce") + c("forward", "reduce_scatter") == layers, counts
    assert c("backward", "all_reduce") + c("backward", "reduce_scatter") == layers - 1, counts
    assert c("forward", "all_gather") == c("backward", "reduce_scatter"), counts
    assert c("backward", "all_gather") == c("forward", "reduce_scatter"), counts
    params = plan.params
    assert params["layers.0.up.weight"].layout == "[R, S(0)]"
    assert params["layers.0.down.weight"].layout == "[R, S(1)]"


def test_data_parallel_program_syncs_each_gradient_once():
    x, t = mlp_batch()
    plan, gm = _program(MLP(64, 256, 2), (x,), t, mlp_loss, autopar.Constraints(dp=2, tp=1, zero=0))
    counts = count_collectives(gm)
    n_params = len(plan.params)
    assert counts[("backward", "all_reduce")] == n_params  # one gradient all-reduce per parameter
    # ... taken out of the graph so the runtime buckets them and overlaps them with backward
    from autopar.passes.defer_gradient_sync import GRAD_SYNC_KEY

    assert gm.meta[GRAD_SYNC_KEY] == {n: (0,) for n in (p.node for p in plan.params.values())}
    assert counts[("forward", "all_gather")] == 0 and counts[("forward", "all_reduce")] == 0
    # the loss value is reduced by the runtime, off the critical path
    from autopar.passes.insert_collectives import LOSS_LAYOUT_KEY

    assert gm.meta[LOSS_LAYOUT_KEY] == "[P(avg), R]"


def test_zero3_gathers_parameters_and_reduce_scatters_gradients():
    x, t = mlp_batch()
    plan, gm = _program(MLP(64, 256, 2), (x,), t, mlp_loss, autopar.Constraints(dp=2, zero=3))
    counts = count_collectives(gm)
    n = len(plan.params)
    assert counts[("forward", "all_gather")] == n
    assert counts[("backward", "reduce_scatter")] == n


@pytest.mark.parametrize("nproc", [2, 4])
def test_zero3_shards_odd_parameters_unevenly_and_passes_their_shape(nproc):
    from autopar.testing.zoo import OddMLP

    plan, gm = _program(OddMLP(), (torch.randn(16, 21),), torch.randn(16, 3), torch.nn.functional.mse_loss,
                        autopar.Constraints(dp=nproc, zero=3), nproc=nproc)
    n = len(plan.params)
    assert all(p.layout.startswith("[S(") for p in plan.params.values())  # no dim divides; all sharded
    counts = count_collectives(gm, (nproc, 1))
    assert counts[("forward", "all_gather")] == n
    assert counts[("backward", "reduce_scatter")] == n
    # each parameter is gathered ahead of its use, padded to the gathered length it passes on
    from autopar.ir import gather_param_finish, gather_param_start

    starts = [g for g in gm.graph.nodes if g.target is gather_param_start]
    assert len(starts) == n and all(g.args[0].op == "placeholder" for g in starts)
    assert all(g.args[3] == g.args[0].meta["autopar.outputs"][0].shape[g.args[2]] for g in starts)
    order = list(gm.graph.nodes)
    for a, b in zip(starts[1:], [u for g in starts[:-1] for u in g.users if u.target is gather_param_finish]):
        assert order.index(a) == order.index(b) + 1  # the next gather starts as the previous one is used
    # explain says so, with the padded size
    padded = -(-77 // nproc) * nproc
    assert f"dim 0 (77) over 'dp' ({nproc}), padded to {padded}" in plan.explain("up") or \
        f"dim 1 (21) over 'dp' ({nproc})" in plan.explain("up")


def test_shapes_are_localised_and_code_shows_collectives():
    cfg = GPTConfig()
    idx, tgt = example_batch(cfg, 8)
    plan, gm = _program(GPT(cfg), (idx,), tgt, gpt_loss, autopar.Constraints(dp=1, tp=2))
    code = gm.code
    assert "reshard(" in code and "'[R, S(" in code
    # attention views are local: batch 8 or the 4 heads are split over tp=2
    assert ("[8, 32, 2, 16]" in code or "[4, 32, 4, 16]" in code) and "[8, 32, 4, 16]" not in code
    for n in gm.graph.nodes:
        if n.meta.get("autopar.kind") == "reshard":
            assert n.meta["autopar.serves"] in {m.name for m in gm.graph.nodes}


def test_pass_runner_names_the_failing_pass():
    x, t = mlp_batch()
    traced = trace_model(MLP(64, 256, 1), (x,), loss_fn=mlp_loss, example_target=t)
    plan = search_plan(traced, autopar.Cluster.local(2), constraints=autopar.Constraints(), _with_free=False, _with_baseline=False)

    def break_graph_pass(gm, ctx):
        raise RuntimeError("boom")

    with pytest.raises(PassError, match="break_graph_pass failed: RuntimeError: boom"):
        run_passes(copy.deepcopy(traced.gm), PassContext.for_stage(plan), [break_graph_pass])


@pytest.mark.parametrize("zero", [0, 3])
def test_position_embedding_gradient_is_summed_with_its_parameter(zero):
    """The position embedding reads only a parameter (and arange): under data parallelism it runs
    replicated and its output gradient is a partial sum. It is handed back to ``wpe`` partial and
    summed with the parameters' gradients (GradSync's buckets; ZeRO-3's reduce-scatter), not
    all-reduced inside backward (``passes.sink_gradient_sums``); the planner prices it so."""
    from autopar.ir import GRAD_SYNC_KEY, gather_param_start, reshard

    cfg = GPTConfig()
    idx, tgt = example_batch(cfg, 8)
    plan, gm = _program(GPT(cfg), (idx,), tgt, gpt_loss, autopar.Constraints(dp=2, tp=1, zero=zero))
    (pos,) = [n for n in gm.graph.nodes if n.meta.get("autopar.module") == "wpe" and n.meta.get("autopar.kind") == "op"]
    assert not any(u.target is reshard for u in pos.users)  # its output gradient moves as it is
    (wpe,) = [n for n in gm.graph.nodes if n.name == plan.params["wpe.weight"].node]
    counts = count_collectives(gm)
    assert ("backward", "all_reduce") not in counts or zero == 0
    if zero == 0:
        assert gm.meta[GRAD_SYNC_KEY][wpe.name] == (0,)  # bucketed with every other gradient
        assert counts[("backward", "all_reduce")] == len(plan.params)
    else:  # gathered ahead; its partial gradient reduce-scattered back to the shard
        (start,) = [u for u in wpe.users if u.target is gather_param_start]
        assert start.kwargs["grad"] and counts[("backward", "reduce_scatter")] == len(plan.params)
    assert plan.placement(pos.name).outs == ("[R, R]",)  # replicated: the case this pass is for


def _index(gm, pred) -> int:
    return next(i for i, n in enumerate(gm.graph.nodes) if pred(n))


def test_a_loss_count_of_valid_targets_is_gathered_as_soon_as_the_batch_arrives():
    """GPT's cross-entropy divides by the count of targets != ignore_index over the whole batch:
    under data parallelism that count moves between ranks; its collective starts before the
    first forward op and is waited for only at the loss, and it is priced so."""
    from autopar.ir import reshard, reshard_finish, reshard_start

    cfg = GPTConfig()
    idx, tgt = example_batch(cfg, 8)
    plan, gm = _program(GPT(cfg), (idx,), tgt, gpt_loss, autopar.Constraints(dp=2, tp=1, zero=0))
    starts = [n for n in gm.graph.nodes if n.target is reshard_start]
    assert len(starts) == 1 and not any(n.target is reshard for n in gm.graph.nodes)
    start, = starts
    finish, = start.users
    assert finish.target is reshard_finish
    first_embedding = _index(gm, lambda n: n.op == "call_function" and "embedding" in str(n.target))
    assert _index(gm, lambda n: n is start) < first_embedding < _index(gm, lambda n: n is finish)
    # the moved chain reads the target only; counted like the reshard it replaced
    assert {a.op for a in start.args[0].all_input_nodes} <= {"placeholder", "call_function"}
    assert count_collectives(gm)[("forward", "all_gather")] + count_collectives(gm)[("forward", "all_reduce")] == 1

    # the planner priced it in the forward window, hidden by the ops before the loss
    from autopar.planner.blocks import find_repeated_blocks
    from autopar.planner.edge_tables import early_leads

    traced = trace_model(GPT(cfg), (idx,), loss_fn=gpt_loss, example_target=tgt)
    leads = early_leads(traced, find_repeated_blocks(traced.graph), recompute=False)
    # (producer, consumer) -> the share of the forward before the consumer: the loss ends it
    assert leads[(start.args[0].name, finish.users.__iter__().__next__().name)] > 0.99


def test_batch_only_values_leave_out_random_and_gradient_taking_ops():
    from autopar.ir import batch_only_values

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    def loss_fn(out, t):
        valid = t.ne(0)  # batch-only
        noisy = torch.nn.functional.dropout(t, 0.5)  # random: moving it would change the random stream
        return ((out - noisy) ** 2 * valid).sum() / valid.sum()

    x, t = torch.randn(8, 4), torch.randn(8, 4)
    traced = trace_model(Net(), (x,), loss_fn=loss_fn, example_target=t)
    early = batch_only_values(traced.graph)
    ops = {n.name: str(n.target).split(".")[1] for n in traced.graph.nodes if n.op == "call_function"}
    assert sorted(ops[n] for n in early) == ["ne", "sum"]  # valid and its count; not dropout, nor what needs a gradient
