"""``measure_step`` counts the whole process: every tensor storage alive, not only the tensors
autopar registered, and names what no predicted category covers (one process, no launch)."""
from __future__ import annotations

import pytest
import torch

import autopar

MIB = 2**20


def _compiled_mlp():
    from autopar.testing.fidelity import fidelity_model

    model, inputs, target, loss_fn = fidelity_model("mlp")
    pm = autopar.compile(model, autopar.Cluster.local(1), inputs, example_target=target, loss_fn=loss_fn,
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    pm.train_step(*inputs, target=target)  # AdamW makes its state in the first step
    return model, pm, inputs, target


@pytest.mark.slow
def test_a_tensor_the_user_keeps_across_the_step_is_measured_and_named():
    """A 4 MiB tensor kept in a list across the step is in the measured peak (exactly its bytes
    more than the same step without it) and in the unaccounted storages, with its shape and dtype;
    the module given to ``compile`` is named by its parameters."""
    import torch.distributed as dist

    mine = not dist.is_initialized()  # compile on one process makes a group of one: leave none behind
    model, pm, inputs, target = _compiled_mlp()
    without = pm.measure_step(*inputs, target=target).memory
    kept = [torch.ones(MIB)]  # 4 MiB of float32 that nothing of autopar's refers to
    with_extra = pm.measure_step(*inputs, target=target).memory
    assert with_extra.peak_bytes - without.peak_bytes == 4 * MIB, (with_extra.table(), without.table())
    assert with_extra.unaccounted_bytes - without.unaccounted_bytes == 4 * MIB
    assert with_extra.at_peak["unaccounted"] >= 4 * MIB
    extra = [r for r in with_extra.unaccounted if r.shape == (MIB,)]
    assert [(r.nbytes, r.dtype, r.holder) for r in extra] == [(4 * MIB, "float32", "")], with_extra.table()
    assert "4.00 MiB float32 [1048576]" in with_extra.table()
    assert not [r for r in without.unaccounted if r.shape == (MIB,)]
    # whatever the user's module still holds is named by its own parameter names
    user = [r for r in with_extra.unaccounted if r.holder.startswith("the user's model (ResidualMLP)")]
    held = {r.owner.split(").", 1)[1] for r in user}
    assert held <= {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}, held
    assert with_extra.unaccounted_by_holder.get("the step's batch") == sum(
        t.nbytes for t in (*inputs, target))
    del kept
    pm.close()
    if mine:
        dist.destroy_process_group()


def test_a_storage_counts_once_whatever_views_dtensors_and_grads_refer_to_it():
    """Views, a transpose and a parameter's ``.grad`` count by the storage they share, a DTensor by
    its local shard; a tensor another module holds is named after that module's parameter."""
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.runtime.memory import MemoryTracker

    lin = torch.nn.Linear(1024, 2048, bias=False)  # 8 MiB weight
    lin.weight.grad = torch.zeros(2048, 1024)  # 8 MiB
    base = torch.zeros(2048, 1535)  # 12 MiB less 8 KiB: a size nothing else here has
    views = [base.t(), base[3:], base.view(-1)]
    mine = not dist.is_initialized()  # an in-process compile of another test may have made a group of one
    if mine:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        # this rank's quarter of a [4096, 1023] tensor sharded by rows over 4 ranks
        mesh = DeviceMesh("cpu", [dist.get_rank()])
        sharded = DTensor.from_local(torch.randn(1024, 1023), mesh, [Shard(0)], run_check=False,
                                     shape=torch.Size([4096, 1023]), stride=(1023, 1))
        with MemoryTracker(count_unallocated=False) as tracker:
            tracker.register([lin.weight], "params")
            tracker.register_process("cpu", {"probe": lin})
        r = tracker.report()
    finally:
        if mine:
            dist.destroy_process_group()
    assert sharded.shape == (4096, 1023)
    assert [rec.shape for rec in r.unaccounted if rec.nbytes == 1024 * 1023 * 4] == [(1024, 1023)], r.table()
    grads = [rec for rec in r.unaccounted if rec.owner == "probe.weight.grad"]
    assert [(g.nbytes, g.shape, g.holder) for g in grads] == [(8 * MIB, (2048, 1024), "probe")], r.table()
    assert not [rec for rec in r.unaccounted if rec.owner == "probe.weight"]  # registered as params
    assert len([rec for rec in r.unaccounted if rec.nbytes == base.nbytes]) == 1, r.table()
    assert r.category_peaks["params"] == 8 * MIB
    del views
