"""The runtime in this process (world size 1): API contract, state dicts, meta models, errors."""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.testing.parity import relative_error
from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss
from examples.mlp import MLP, example_batch as mlp_batch, mlp_loss



def _opt(ps):
    return torch.optim.AdamW(ps, lr=1e-3)


def test_single_process_training_matches_eager(world1):
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    x, t = example_batch(cfg, 8)
    pm = autopar.compile(model, world1, (x,), example_target=t, loss_fn=gpt_loss, optimizer=_opt)
    opt = _opt(list(ref.parameters()))
    for step in range(3):
        got = pm.train_step(x, target=t)
        opt.zero_grad()
        want = gpt_loss(ref(x), t)
        want.backward()
        opt.step()
        assert abs(got - want.item()) <= 1e-5 * abs(want.item())
    assert pm.step == 3
    assert pm.eval_step(x, target=t) == pytest.approx(gpt_loss(ref(x), t).item(), rel=1e-5)
    full = pm.full_state_dict()
    assert list(full) == list(ref.state_dict())
    assert max(relative_error(full[k], v) for k, v in ref.state_dict().items()) <= 1e-5
    sharded = pm.state_dict()
    from torch.distributed.tensor import DTensor

    assert set(sharded) == {k for k, _ in model.named_parameters()} | {k for k, _ in model.named_buffers()}
    assert all(isinstance(v, DTensor) for v in sharded.values())
    assert "def forward" in pm.program.code


def test_tied_weights_keep_both_state_dict_keys(world1):
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    model.lm_head.weight = model.wte.weight  # weight tying, as GPT-2 does
    x, t = example_batch(cfg, 8)
    pm = autopar.compile(model, world1, (x,), example_target=t, loss_fn=gpt_loss, optimizer=_opt)
    pm.train_step(x, target=t)
    full = pm.full_state_dict()
    assert "lm_head.weight" in full and "wte.weight" in full
    assert torch.equal(full["lm_head.weight"], full["wte.weight"])


def test_meta_model_materialises_its_parameters(world1):
    with torch.device("meta"):
        model = MLP(64, 256, 2)
    x, t = mlp_batch()
    pm = autopar.compile(model, world1, (x,), example_target=t, loss_fn=mlp_loss, optimizer=_opt)
    first = pm.train_step(x, target=t)
    assert torch.isfinite(torch.as_tensor(first))
    full = pm.full_state_dict()
    assert not any(v.is_meta for v in full.values())
    assert full["layers.0.up.weight"].shape == (256, 64) and full["layers.0.up.weight"].abs().sum() > 0


@pytest.mark.slow
def test_compile_errors_are_clear(world1):
    x, t = mlp_batch()
    with pytest.raises(autopar.AutoparError, match="example_target"):
        autopar.compile(MLP(), world1, (x,), loss_fn=mlp_loss, optimizer=_opt)
    with pytest.raises(autopar.AutoparError, match="single process: launch with `torchrun --nproc-per-node 4"):
        autopar.compile(MLP(), autopar.Cluster.local(4), (x,), example_target=t, loss_fn=mlp_loss, optimizer=_opt)
    plan4 = autopar.plan(MLP(), autopar.Cluster.local(4), (x,), loss_fn=mlp_loss, example_target=t)
    with pytest.raises(autopar.ConstraintError, match="plan is for 4 devices but the cluster has 1"):
        autopar.compile(MLP(), world1, (x,), example_target=t, loss_fn=mlp_loss, optimizer=_opt, plan=plan4)
    pm = autopar.compile(MLP(), world1, (x,), example_target=t, loss_fn=mlp_loss, optimizer=_opt)
    with pytest.raises(autopar.AutoparError, match="needs target="):
        pm.train_step(x)


def test_zero3_saved_tensors_hooks_keep_no_reference_cycle():
    """Under ZeRO-3's saved-tensor hooks (``runtime.param_regather``) an op that saves its own
    output (log_softmax) must not hold its node through that output: a graph that backward
    leaves alive (a split backward's ``retain_graph``) or that is dropped without backward is
    freed by reference counting, not by Python's cycle collector."""
    import gc
    import weakref

    from autopar.runtime.param_regather import regather_saved_params

    x = torch.randn(64, 32, requires_grad=True)
    freed = []
    gc.disable()
    try:
        with regather_saved_params():
            y = x.log_softmax(-1)
        ref = weakref.ref(y.untyped_storage(), lambda _: freed.append(True))
        loss = (y * 2).sum()
        del y
        torch.autograd.grad(loss, x, retain_graph=True)
        del loss
        assert freed == [True], "the saved output outlived its graph"
    finally:
        gc.enable()
    assert ref() is None


def test_a_dtensor_shard_inside_a_larger_storage_deep_copies(world1):
    """A ZeRO-1/2 shard is a view into the whole parameter: its DTensor wrapper inherits the view's
    storage offset and torch's deepcopy then fails ("invalid python storage") on every rank whose
    shard does not start at 0. ``copyable`` (what pm.state_dict() hands out) deep-copies."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from autopar.runtime.copyable_state import copyable

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{autopar.runtime.launch.free_port()}", rank=0,
                            world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    whole = torch.arange(12.0).reshape(6, 2)
    shard = DTensor.from_local(whole[3:], mesh, [Shard(0)], run_check=False, shape=torch.Size([3, 2]), stride=(2, 1))
    with pytest.raises(RuntimeError, match="invalid python storage"):
        copy.deepcopy(shard)  # torch's behaviour this works around: if it is fixed, copyable can go
    value = copyable(shard)
    copied = copy.deepcopy(value)
    assert torch.equal(copied.to_local(), whole[3:]) and copied.to_local().data_ptr() != whole[3:].data_ptr()
    assert value.to_local().data_ptr() == whole[3:].data_ptr()  # the state dict's value shares the shard's memory
