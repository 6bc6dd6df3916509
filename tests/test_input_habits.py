"""Inputs as a new user passes them (issue 42): each habit trains as one device does or is refused
with an error naming the fix.

* ``batch="local"`` under a plan with a tensor axis: the ranks of one data shard must hold the
  same rows (fed per rank, their parameter copies silently diverged); compared on the checked steps
  like global batches are, and refused on every rank, naming ``DistributedSampler(num_replicas=
  pm.data_parallel_size, rank=pm.data_parallel_rank)``; fed that way it trains as one device;
* a local batch of the wrong size says how many rows each rank passes, and how;
* meta tensors to ``train_step``, the target passed positionally, ``eval_step`` without target;
* an empty batch, an fp64 batch into an fp32 model, an op whose output size depends on the values
  (``torch.unique``) outside a token-wise module: refused while tracing, naming module and op.
"""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import InputMismatchError, TraceError
from helpers import compiled_mlp, error_of, one_device_losses

TOL = 1e-5


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.1)


# ----------------------------------------------------------------------------- local batches, 4 processes


def local_batches_worker():
    from autopar.testing.parity import _sampled_shards, relative_error
    from examples.mlp import MLP, example_batch, mlp_loss

    rank = int(os.environ["RANK"])
    batches = [example_batch(64, 16, seed=s) for s in range(3)]
    x, t = batches[0]
    torch.manual_seed(0)
    model = MLP(64, 256, 2)
    ref = copy.deepcopy(model)
    pm = autopar.compile(model, autopar.Cluster.local(), (x,), example_target=t, loss_fn=mlp_loss, optimizer=_sgd,
                         constraints=autopar.Constraints(dp=2, tp=2), batch="local", collective_timeout_s=60)
    out = {"split": (pm.data_parallel_size, pm.data_parallel_rank)}
    # the habit of DDP: a sampler over the world, so the two ranks of one data shard read different rows
    own = _sampled_shards([example_batch(64, 32, seed=9)], 4, rank)  # 8 rows each, as planned
    out["per_rank_rows"] = error_of(lambda: pm.train_step(own[0][0], target=own[0][1]))
    mine = _sampled_shards(batches, pm.data_parallel_size, pm.data_parallel_rank)
    # one rank's batch short: its own error there, a pointer to it on every other rank (no hang)
    out["short_on_rank3"] = error_of(lambda: pm.train_step(mine[0][0][:4] if rank == 3 else mine[0][0],
                                                         target=mine[0][1][:4] if rank == 3 else mine[0][1]))
    out["global_batch_passed"] = error_of(lambda: pm.train_step(x, target=t))
    out["step_after_refusals"] = pm.step
    # fed as the error says: the global batch's training, as on one device
    losses = [pm.train_step(bx, target=bt) for bx, bt in mine]
    ref_losses = one_device_losses(ref, batches, mlp_loss, _sgd)
    out["loss_err"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    full = pm.full_state_dict()
    out["param_err"] = max(relative_error(full[k], v) for k, v in ref.state_dict().items())
    pm.close()
    return out


@pytest.mark.slow
def test_local_batches_must_match_within_each_data_shard():
    results = autopar.launch(local_batches_worker, 4, timeout_s=600)
    for rank, r in enumerate(results):
        assert r["split"] == (2, rank // 2), r["split"]  # dp=2 x tp=2: ranks 0, 1 read shard 0
        assert r["step_after_refusals"] == 0
        assert ("InputMismatchError: ranks 0 and 1 read the same data shard (0 of 2) but hold different batches at "
                "step 0 (they differ on input 0)") in r["per_rank_rows"], r["per_rank_rows"]
        assert ("Feed the same rows to every rank of a data shard: DistributedSampler(dataset, num_replicas="
                "pm.data_parallel_size, rank=pm.data_parallel_rank)") in r["per_rank_rows"], r["per_rank_rows"]
        if rank == 3:
            assert "train_step: input 0 has shape (4, 64)" in r["short_on_rank3"], r["short_on_rank3"]
        else:
            assert ("train_step at step 0: rank 3 got a batch that does not match the compiled example"
                    in r["short_on_rank3"]), r["short_on_rank3"]
        g = r["global_batch_passed"]
        assert "input 0 has shape (16, 64)" in g and "but the model was compiled for shape (8, 64)" in g, g
        assert ("Each rank's batch must have 16 / pm.data_parallel_size = 8 rows: e.g. DataLoader(dataset, "
                "batch_size=8, sampler=DistributedSampler(dataset, num_replicas=pm.data_parallel_size, "
                "rank=pm.data_parallel_rank), drop_last=True)") in g, g
        assert "compile again with an example of this shape" not in g, g
        assert r["loss_err"] <= TOL and r["param_err"] <= TOL, (r["loss_err"], r["param_err"])


# ----------------------------------------------------------------------------- steps, one process


def test_meta_tensors_and_a_positional_target_are_refused_naming_the_fix(world1):
    pm, x, t = compiled_mlp(world1)
    with pytest.raises(InputMismatchError, match=r"train_step: input 0 is a meta tensor \(a shape without values\).*"
                       r"pass real tensors"):
        pm.train_step(x.to("meta"), target=t)
    with pytest.raises(InputMismatchError, match=r"train_step: target is a meta tensor"):
        pm.train_step(x, target=t.to("meta"))
    with pytest.raises(InputMismatchError, match=r"train_step got 2 inputs and no target=: the model takes 1, and the "
                       r"loss_fn's target goes by keyword: pm\.train_step\(\*inputs, target=y\)"):
        pm.train_step(x, t)
    with pytest.raises(InputMismatchError, match=r"input 0 has shape \(16, 64\) and dtype torch\.float64, but the model "
                       r"was compiled for shape \(16, 64\) and dtype torch\.float32\..*: pass it as torch\.float32 "
                       r"\(x\.to\(torch\.float32\)"):
        pm.train_step(x.double(), target=t)
    assert pm.step == 0  # nothing ran
    pm.train_step(x, target=t)
    assert pm.step == 1
    pm.close()


def test_eval_step_without_target_names_the_keyword(world1):
    pm, x, t = compiled_mlp(world1)
    with pytest.raises(InputMismatchError, match=r"eval_step needs target= \(the loss_fn's second argument\), by "
                       r"keyword: pm\.eval_step\(\*inputs, target=y\)$"):
        pm.eval_step(x)
    with pytest.raises(InputMismatchError, match=r"eval_step needs target=.*it got 2 inputs where MLP\.forward takes 1: "
                       r"was the target passed positionally\?"):
        pm.eval_step(x, t)
    assert pm.eval_step(x, target=t) == pytest.approx(pm.eval_step(x, target=t))
    pm.close()


def test_a_positional_target_before_the_plan_exists_is_named(world1):
    from examples.mlp import MLP, example_batch, mlp_loss

    x, t = example_batch(64, 16)
    pm = autopar.compile(MLP(64, 256, 2), world1, loss_fn=mlp_loss, optimizer=_sgd)  # planned at the first call
    with pytest.raises(InputMismatchError, match=r"train_step needs target=.*was the target passed positionally\?"):
        pm.train_step(x, t)
    pm.close()


# ----------------------------------------------------------------------------- what the trace refuses


class _Unique(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) + torch.unique(x.round()).sum()


class _WithUnique(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Unique()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.block(x))


class _CastsItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(x.float())


def test_an_op_of_data_dependent_size_names_its_module_and_the_fix():
    with pytest.raises(TraceError, match=r"autopar cannot plan module 'block' \(_Unique\): it calls torch\.unique "
                       r"\(aten\._unique2\), whose output size depends on the tensor values.*one row per token.*"
                       r"torch\.bincount\(x, minlength=n\)"):
        autopar.plan(_WithUnique(), autopar.Cluster.local(2), torch.randn(16, 8))


def test_an_empty_batch_and_an_fp64_batch_into_an_fp32_model_are_refused(world1):
    from examples.mlp import MLP, example_batch, mlp_loss

    x, t = example_batch(64, 16)
    with pytest.raises(TraceError, match=r"example input 0 has 0 rows \(shape \(0, 64\)\): an empty batch has nothing "
                       r"to plan or train.*drop_last=True"):
        autopar.plan(MLP(64, 256, 2), autopar.Cluster.local(2), x[:0], loss_fn=mlp_loss, example_target=t[:0])
    fix = r"cast the batch to the model's dtype before passing it \(e\.g\. x\.to\(torch\.float32\)"
    with pytest.raises(TraceError, match=r"module 'layers\.0\.up' \(Linear\) calls linear on tensors of dtypes "
                       r"torch\.float64, torch\.float32, which torch refuses.*" + fix):
        autopar.plan(MLP(64, 256, 2), autopar.Cluster.local(2), x.double(), loss_fn=mlp_loss, example_target=t.double())
    with pytest.raises(TraceError, match=fix):  # compile plans through the same trace
        autopar.compile(MLP(64, 256, 2), world1, (x.double(),), example_target=t.double(), loss_fn=mlp_loss,
                        optimizer=_sgd)
    # what eager torch accepts still plans: a model casting its input, mixed precision (autocast casts)
    autopar.plan(_CastsItsInput(), autopar.Cluster.local(2), torch.randn(16, 8, dtype=torch.float64))
    autopar.plan(MLP(64, 256, 2), autopar.Cluster.local(2), x, loss_fn=mlp_loss, example_target=t,
                 precision="bf16-mixed")


def test_an_annotation_on_a_module_outside_the_model_is_not_ignored_silently():
    from examples.mlp import MLP

    stray = autopar.annotate(nn.Linear(64, 256), weight={"tp": "S(0)"})  # not the model's own layer
    with pytest.warns(UserWarning, match=r"annotate\(\) pinned weight of a Linear that is not part of the MLP being "
                      r"planned \(1 such module\): the plan ignores those pins\. Annotate the model's own layer"):
        autopar.plan(MLP(64, 256, 2), autopar.Cluster.local(2), torch.randn(16, 64))
    del stray
    model = MLP(64, 256, 2)
    autopar.annotate(model.layers[0]["up"], weight={"tp": "S(0)"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the model's own layer: no warning
        plan = autopar.plan(model, autopar.Cluster.local(2), torch.randn(16, 64), constraints=autopar.Constraints(tp=2))
    assert plan.params["layers.0.up.weight"].layout == "[R, S(0)]", plan.params["layers.0.up.weight"].layout  # dp x tp
