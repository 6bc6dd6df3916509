"""What a user can count on from the runtime, on real gloo processes: replicas start equal however
each process seeded, one plan for all ranks made once, evaluation in eval mode, the user's state
dict keys, a process group the user made, and planning errors raised on every rank."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.testing.parity import relative_error
from autopar.testing.zoo import ManualAttentionGPT, SmallCNN, TinyLlama


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.05, momentum=0.9)


def _cnn_batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)


class _DropoutMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(12, 32), torch.nn.Linear(32, 4)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def seeds_and_plans_worker():
    """Every rank seeds differently (as users often do); only rank 0 may plan."""
    import os

    rank = int(os.environ["RANK"])
    if rank != 0:
        import autopar.planner.search as search

        def refuse(*a, **k):
            raise AssertionError("only rank 0 plans")
        search.search_plan = refuse
    torch.manual_seed(1000 + rank)
    model = SmallCNN()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    x, t = _cnn_batch()
    pm = autopar.compile(model, autopar.Cluster.local(), (x,), example_target=t,
                         loss_fn=torch.nn.functional.cross_entropy, optimizer=_sgd,
                         constraints=autopar.Constraints(dp=2, tp=1))
    start = pm.full_state_dict()
    losses = [pm.train_step(x, target=t) for _ in range(3)]
    # evaluation runs the model in eval mode (BatchNorm's running statistics) and leaves them alone
    before = pm.full_state_dict()
    evaluated = pm.eval_step(x, target=t)
    after = pm.full_state_dict()
    out = {"initial": initial, "start": start, "losses": losses, "eval": evaluated, "trained": before,
           "eval_changed": sorted(k for k in before if not torch.equal(before[k], after[k]))}
    pm.close()
    return out


def _reference(initial: dict, steps: int):
    model = SmallCNN()
    model.load_state_dict(initial)
    opt = _sgd(list(model.parameters()))
    x, t = _cnn_batch()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), t)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        evaluated = float(torch.nn.functional.cross_entropy(model(x), t))
    return model, losses, evaluated


@pytest.mark.slow
def test_replicas_start_from_rank0_weights_one_plan_and_eval_mode():
    results = autopar.launch(seeds_and_plans_worker, 2)
    r0, r1 = results
    # the ranks built different weights, but train from rank 0's
    assert not torch.equal(r0["initial"]["conv1.weight"], r1["initial"]["conv1.weight"])
    for k, v in r0["initial"].items():
        assert torch.equal(r0["start"][k], v) and torch.equal(r1["start"][k], v), k
    ref, losses, evaluated = _reference(r0["initial"], 3)
    for got, want in zip(r0["losses"], losses):
        assert abs(got - want) <= 1e-5 * abs(want)
    assert r0["losses"] == r1["losses"]
    for k, v in ref.state_dict().items():
        assert relative_error(r0["trained"][k], v) <= 1e-5, k  # running statistics included
    # eval_step: the eval-mode loss (running statistics, not the batch's), nothing updated
    assert abs(r0["eval"] - evaluated) <= 1e-5 * abs(evaluated) and r0["eval"] == r1["eval"]
    assert r0["eval_changed"] == []


def user_group_worker():
    """The user initialises the process group before compiling (without torchrun's variables in
    the cluster spec: Cluster.local(n) with the group's size)."""
    import os

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    model = ManualAttentionGPT()
    x = torch.randint(0, 128, (8, 16))
    pm = autopar.compile(model, autopar.Cluster.local(dist.get_world_size()), (x,), example_target=x,
                         loss_fn=lambda lg, t: torch.nn.functional.cross_entropy(lg.reshape(-1, 128), t.reshape(-1)),
                         optimizer=_sgd)
    pm.train_step(x, target=x)
    keys = list(pm.state_dict())
    full = list(pm.full_state_dict())
    pm.close()
    return keys, full, list(model.state_dict())


@pytest.mark.slow
def test_compile_accepts_a_group_the_user_initialised_and_keeps_state_dict_keys():
    for keys, full, model_keys in autopar.launch(user_group_worker, 2):
        # tied weights appear under both keys, in the model's order, exactly as model.state_dict()
        assert keys == model_keys and full == model_keys
        assert "lm_head.weight" in keys and "wte.weight" in keys


def planning_error_worker():
    model = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    try:
        autopar.compile(model, autopar.Cluster.local(), (x,), example_target=x, loss_fn=torch.nn.functional.mse_loss,
                        optimizer=_sgd, constraints=autopar.Constraints(dp=2, tp=2))
    except autopar.AutoparError as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.slow
def test_a_planning_error_on_rank0_is_raised_on_every_rank():
    results = autopar.launch(planning_error_worker, 2, timeout_s=120)
    assert all(r is not None and r[0] == "ConstraintError" and "dp=2 x tp=2 = 4" in r[1] for r in results), results


# ------------------------------------------------------------------ one process



def test_eval_step_turns_dropout_off(world1):
    torch.manual_seed(0)
    model = _DropoutMLP()
    ref = copy.deepcopy(model).eval()
    x, t = torch.randn(16, 12), torch.randn(16, 4)
    pm = autopar.compile(model, world1, (x,), example_target=t, loss_fn=torch.nn.functional.mse_loss,
                         optimizer=_sgd)
    got = [pm.eval_step(x, target=t) for _ in range(2)]
    with torch.no_grad():
        want = float(torch.nn.functional.mse_loss(ref(x), t))
    assert got[0] == got[1] and abs(got[0] - want) <= 1e-6 * abs(want)
    assert model.training  # the user's module is left in the mode it was in


def test_state_dict_leaves_out_non_persistent_buffers(world1):
    torch.manual_seed(0)
    model = TinyLlama()
    x = torch.randint(0, 128, (4, 16))
    pm = autopar.compile(model, world1, (x,), example_target=x,
                         loss_fn=lambda lg, t: torch.nn.functional.cross_entropy(lg.reshape(-1, 128), t.reshape(-1)),
                         optimizer=_sgd)
    assert list(pm.state_dict()) == list(model.state_dict()) == list(pm.full_state_dict())
    assert "cos" not in pm.state_dict()  # registered with persistent=False


def loss_rider_worker(constraints: dict):
    """GPT (cross-entropy over a count of valid targets) trained 3 steps under ``constraints``:
    per-step collective calls by kind, the losses, the plan's choice of riding."""
    from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss

    torch.manual_seed(0)
    cfg = GPTConfig()
    idx, tgt = example_batch(cfg, 8)
    # ignored targets in row 0 alone: the loss divides by a count that differs between ranks and
    # between microbatches (each microbatch's mean weighs by its share of the count)
    tgt[0, :5] = -100
    pm = autopar.compile(GPT(cfg), autopar.Cluster.local(), (idx,), example_target=tgt, loss_fn=gpt_loss,
                         optimizer=_sgd, constraints=autopar.Constraints(**constraints))
    pm.train_step(idx, target=tgt)
    pm.comm.stats.reset()
    losses = [pm.train_step(idx, target=tgt) for _ in range(3)]
    calls = {k: v / 3 for k, v in pm.comm.stats.calls.items()}
    buckets = len(pm._grad_sync.buckets)
    pm.close()
    return {"losses": losses, "calls": calls, "buckets": buckets}


@pytest.mark.slow
@pytest.mark.parametrize("constraints, rides", [(dict(dp=2, tp=1, zero=0), True), (dict(dp=2, tp=1, zero=0, microbatches=2), True),
                                                 (dict(dp=2, tp=1, zero=2), False)])
def test_the_loss_value_rides_the_last_gradient_bucket(constraints, rides):
    """A step's loss value is reduced once, in the all-reduce of the last gradient bucket where
    one syncs over the loss's axis (ZeRO-2 has none: one all-reduce of its own, whatever the
    microbatches); the loss is the one-device loss either way, and the plan priced the same."""
    from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss

    results = autopar.launch(loss_rider_worker, 2, constraints)
    torch.manual_seed(0)
    cfg = GPTConfig()
    idx, tgt = example_batch(cfg, 8)
    tgt[0, :5] = -100
    model = GPT(cfg)
    opt = _sgd(model.parameters())
    ref = []
    for _ in range(4):
        opt.zero_grad()
        loss = gpt_loss(model(idx), tgt)
        loss.backward()
        opt.step()
        ref.append(float(loss.detach()))
    for r in results:
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref[1:])) < 1e-5, (r["losses"], ref)
        # the early-started count of valid targets is the one all-gather or all-reduce outside the buckets
        own = r["calls"].get("all_reduce", 0) - (r["buckets"] if rides else 0)
        assert own == (0 if rides else 1) + (r["calls"].get("all_gather", 0) == 0), r
    plan = autopar.plan(GPT(cfg), autopar.Cluster.local(2), (idx,), loss_fn=gpt_loss, example_target=tgt,
                        constraints=autopar.Constraints(**constraints))
    assert plan.mesh_axes[0] == ("dp", 2)


def _bucket_worker(constraints):
    import functools

    from autopar.bench import _adamw
    from autopar.runtime.launch import init_distributed
    from examples.mlp import MLP, example_batch, mlp_loss

    init_distributed("gloo", 2)
    torch.manual_seed(0)
    x, t = example_batch()
    pm = autopar.compile(MLP(64, 256, 3), autopar.Cluster.local(2), (x,), loss_fn=mlp_loss, example_target=t,
                         optimizer=functools.partial(_adamw, lr=1e-3), constraints=autopar.Constraints(**constraints))
    pm.train_step(x, target=t)
    before = dict(pm.comm.stats.calls)
    pm.train_step(x, target=t)
    calls = {k: v - before.get(k, 0) for k, v in pm.comm.stats.calls.items()}
    buckets = [sorted(pm.store.slots[m].fqn for m in b.members) for b in pm._grad_sync.buckets]
    pm.close()
    return calls, buckets


@pytest.mark.slow
def test_a_zero2_weight_between_biases_cuts_no_gradient_bucket():
    """The biases' gradients (summed in buckets) lie in the flat buffer next to each other; the
    ZeRO-2 weights between them keep theirs in the shard buffer: one bucket, one all-reduce a step
    (the planner prices their shares of one bucket), beside a reduce-scatter per weight."""
    calls, buckets = autopar.launch(_bucket_worker, 2, {"dp": 2, "zero": 0, "zero_params": {"layers.*.weight": 2}})[0]
    assert buckets == [[f"layers.{i}.{m}.bias" for i in range(3) for m in ("down", "up")]], buckets
    assert calls["all_reduce"] == 1 and calls["reduce_scatter"] == 6, calls


def _zero1_gather_worker():
    import functools

    from autopar.bench import _adamw
    from autopar.runtime import param_store
    from autopar.runtime.launch import init_distributed

    init_distributed("gloo", 2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 7))  # 7 rows: uneven
    x, t = torch.randn(8, 16), torch.randn(8, 7)
    buffered = []
    real_gather = param_store.gather_dim

    def counting(x, dim, comm, axis, size=None):
        buffered.append(tuple(x.shape))
        return real_gather(x, dim, comm, axis, size)

    param_store.gather_dim = counting
    finals = []
    for in_place in (True, False):
        if not in_place:  # the same steps, every parameter through a buffer
            param_store.zero_gather_in_place = lambda *a: False
        pm = autopar.compile(copy.deepcopy(model), autopar.Cluster.local(2), (x,), loss_fn=torch.nn.functional.mse_loss,
                             example_target=t, optimizer=functools.partial(_adamw, lr=1e-2),
                             constraints=autopar.Constraints(dp=2, tp=1, zero=1))
        buffered.clear()
        for _ in range(3):
            pm.train_step(x, target=t)
        finals.append(({s.fqn: s.local.detach().clone() for s in pm.store.slots.values()}, list(buffered)))
        pm.close()
    return finals


@pytest.mark.slow
def test_a_zero1_weight_cut_evenly_along_dim_0_is_gathered_in_place():
    """ZeRO-1: a weight whose shards are blocks of dim 0 (32 rows over 2 ranks) is all-gathered
    straight into itself, its own block being what the optimizer updated; the 7-row weight, cut
    unevenly, and the biases of odd length go through a buffer. Both ways train the same parameters,
    and the ranks hold the same ones."""
    finals = autopar.launch(_zero1_gather_worker, 2)
    for (in_place, buffered_calls), (through_buffer, all_calls) in finals:
        assert (32, 16) not in buffered_calls and (16, 16) not in buffered_calls, buffered_calls
        assert len(buffered_calls) == 3 * 2, buffered_calls  # each step: the 7-row weight and its 7-long bias
        assert len(all_calls) == 3 * 4  # every parameter through a buffer
        for fqn, p in in_place.items():
            assert torch.equal(p, through_buffer[fqn]), fqn
    assert all(torch.equal(finals[0][0][0][k], finals[1][0][0][k]) for k in finals[0][0][0])


class _OneRankOfN:
    """A one-axis ``MeshComm`` stand-in for rank ``coord`` of ``n`` whose all-gather fills each
    rank's block from ``full``, cut as ``torch.chunk`` cuts ``dim`` and padded as ranks pad."""

    def __init__(self, full: torch.Tensor, dim: int, n: int, coord: int = 0):
        self.full, self.dim, self.sizes, self.coords = full, dim, (n,), (coord,)

    def all_gather(self, out, inp, axis, *, async_op=False):
        from autopar.layouts import chunk_range

        n, rows = self.sizes[0], inp.shape[self.dim]
        for k, block in enumerate(out.view((n,) + tuple(inp.shape)).unbind(0)):
            start, length = chunk_range(self.full.shape[self.dim], n, k)
            block.zero_()
            block.narrow(self.dim, 0, min(length, rows)).copy_(self.full.narrow(self.dim, start, length))


@pytest.mark.parametrize("dim, length, n", [(0, 8, 2), (1, 8, 2), (2, 12, 4), (1, 7, 4), (2, 5, 4), (0, 7, 4)])
def test_a_gather_along_any_dim_returns_the_whole_tensor_contiguous(dim, length, n):
    """``gather_dim`` gives back the tensor its shards were cut from, contiguous, along every dim
    and where the dim does not divide evenly: consumers then read it as the cost model priced
    them (a strided view of the receive buffer had a ``log_softmax`` over gathered logits take
    3x its contiguous time). Its priced layout copy is the gathered bytes where ``dim`` is not 0."""
    from autopar.layouts import chunk_range, parse_layout
    from autopar.planner.costing import reshard_copy_bytes, reshard_staging_bytes
    from autopar.runtime.collectives import gather_dim

    shape = [3, 5, 6]
    shape[dim] = length
    full = torch.randn(shape)
    coord = n - 1  # the last rank: the shortest (or empty) shard where uneven
    start, size = chunk_range(length, n, coord)
    local = full.narrow(dim, start, size).contiguous()
    out = gather_dim(local, dim, _OneRankOfN(full, dim, n, coord), 0, length if length % n else None)
    assert out.is_contiguous() and torch.equal(out, full)
    src, dst = parse_layout(f"[S({dim})]"), parse_layout("[R]")
    nbytes = full.numel() * 4.0 if length % n == 0 else None
    if nbytes is not None:
        assert reshard_copy_bytes(tuple(shape), 4.0, src, dst, (n,)) == [nbytes if dim else 0.0]
        assert reshard_staging_bytes(tuple(shape), 4.0, src, dst, (n,)) == (nbytes if dim else 0.0)
