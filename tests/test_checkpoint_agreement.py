"""Checkpoints, folders and the exit path under rank-local trouble (issue 42): a late rename on rank
0, a damaged newest checkpoint, a full disk in the middle of a save, a folder that cannot be
written, an elastic resume that changes the global batch, a ``close()`` that raises.

The multi-process cases run in one 2-rank world (``agreement_worker``), each scenario's outcome
returned per rank; the tiny MLP (``parity.build_case("mlp")``, 16-row batches) under dp=2.
"""
from __future__ import annotations

import errno
import os
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.errors import AutoparError, CheckpointError
from autopar.runtime.checkpoint_files import complete_steps


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.05, momentum=0.9)


def _compile(checkpoint=None, monitor=None, rows: int = 16, batch: str = "global", constraints=None):
    from autopar.testing.parity import build_case

    model, batches, loss_fn = build_case("mlp")
    x, t = batches[0]
    x, t = x[:rows], t[:rows]
    pm = autopar.compile(model, autopar.Cluster.local(int(os.environ.get("WORLD_SIZE", "1"))), (x,), example_target=t,
                         loss_fn=loss_fn, optimizer=_sgd, constraints=constraints, checkpoint=checkpoint,
                         monitor=monitor, batch=batch, collective_timeout_s=60)
    return pm, batches


def _train_to(pm, batches, steps: int) -> list[float]:
    losses = []
    while pm.step < steps:
        x, t = batches[pm.step % len(batches)]
        losses.append(float(pm.train_step(x, target=t)))
    return losses


def _failure(fn) -> str | None:
    """``fn()``'s CheckpointError/AutoparError text (None: it did not raise one)."""
    try:
        fn()
    except AutoparError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def agreement_worker(tmp: str) -> dict:
    import autopar.runtime.checkpoint as ckpt_mod
    from torch.distributed.checkpoint import FileSystemWriter

    rank = int(os.environ["RANK"])  # the process group starts at the first compile
    tmp = Path(tmp)
    out: dict = {}
    dp2 = autopar.Constraints(dp=2)

    # 1. rank 0's rename of a complete save lands 1 s late (a slow network filesystem): the save,
    # saving the same step again, the next step and the next save complete on every rank
    root = tmp / "late"
    real_replace = os.replace

    def late_replace(src, dst, *a, **k):
        if rank == 0 and Path(dst).name.startswith("step-"):
            time.sleep(1.0)
        return real_replace(src, dst, *a, **k)

    os.replace = late_replace
    try:
        pm, batches = _compile(autopar.Checkpointing(str(root), every=2), constraints=dp2)
        _train_to(pm, batches, 2)  # train_step saves step 2 in the background
        pm.save()  # the same step again: rank 0 waits for its late rename, rank 1 does not
        at2 = pm.full_state_dict()
        out["late_losses"] = _train_to(pm, batches, 3)
        pm.save(asynchronous=False)
        pm.wait_saved()
        out["late_steps"] = complete_steps(root)
    finally:
        os.replace = real_replace

    # 2. the newest checkpoint is damaged (a shard truncated): load_latest falls back to step 2 on
    # every rank, warning (rank 0) with the folder and why; a resume at compile does the same
    if rank == 0:
        shard = max((root / "step-3").glob("__*.distcp"), key=lambda p: p.stat().st_size)
        shard.write_bytes(shard.read_bytes()[:-7])
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["fallback_step"] = pm.load_latest()
    out["fallback_warnings"] = [str(w.message) for w in caught if type(w.message).__name__ == "DamagedCheckpointWarning"]
    got = pm.full_state_dict()
    out["fallback_equal"] = all(torch.equal(got[k], at2[k]) for k in at2)
    # rank 1's view of the folder lags (its manifest not visible yet): rank 0 reads it for all
    real_read = ckpt_mod.read_manifest

    def lagging(folder):
        if rank == 1:
            raise CheckpointError(f"{folder} has no manifest.json here yet")
        return real_read(folder)

    ckpt_mod.read_manifest = lagging
    try:
        out["lagging_load"] = _failure(lambda: pm.load(str(root / "step-2")))
    finally:
        ckpt_mod.read_manifest = real_read
    pm.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm, batches = _compile(autopar.Checkpointing(str(root), every=2), constraints=dp2)
    out["resumed_step"] = pm.step
    got = pm.full_state_dict()
    out["resumed_equal"] = all(torch.equal(got[k], at2[k]) for k in at2)

    # 3. a full disk: rank 1's shard write (DCP) in a background save, then rank 0's manifest in a
    # synchronous one: raised on every rank naming the path; the next step and save work
    root = tmp / "full"
    real_write_data, real_manifest = FileSystemWriter.write_data, ckpt_mod.write_manifest

    def full_write_data(self, plan, planner):
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(self.path) / "__1_0.distcp"))
        return real_write_data(self, plan, planner)

    def full_manifest(folder, manifest):
        raise OSError(errno.ENOSPC, "No space left on device")  # no file name, as a flush's failure has

    FileSystemWriter.write_data = full_write_data
    try:
        pm.save(str(root), asynchronous=True)
        out["full_shard"] = _failure(pm.wait_saved)
    finally:
        FileSystemWriter.write_data = real_write_data
    if rank == 0:
        ckpt_mod.write_manifest = full_manifest
    try:
        out["full_manifest"] = _failure(lambda: pm.save(str(tmp / "full2")))
    finally:
        ckpt_mod.write_manifest = real_manifest
    _train_to(pm, batches, pm.step + 1)
    pm.save(str(root))
    out["full_then_steps"] = complete_steps(root)
    pm.close()

    # 4. folders checked writable at compile, before any work: rank 1's checkpoint root is under a
    # file (rank 0's is fine); rank 0's monitoring folder is under a file (it alone writes there)
    blocker = tmp / "a-file"
    if rank == 0:
        blocker.write_text("x")
    dist.barrier()
    bad_root = str(blocker / "ckpt") if rank == 1 else str(tmp / "fine")
    out["root_refused"] = _failure(lambda: _compile(autopar.Checkpointing(bad_root, every=1), constraints=dp2))
    bad_run = str(blocker / "run") if rank == 0 else str(tmp / "run")
    out["monitor_refused"] = _failure(lambda: _compile(monitor=autopar.Monitoring(bad_run), constraints=dp2))

    # 5. a checkpoint of local batches (16 global rows, 8 per rank) for the elastic resume below
    pm, batches = _compile(autopar.Checkpointing(str(tmp / "local"), every=1, asynchronous=False), batch="local",
                           constraints=dp2)
    x, t = batches[0]
    pm.train_step(x[rank * 8:(rank + 1) * 8], target=t[rank * 8:(rank + 1) * 8])
    pm.close()

    # 6. pm.load_state_dict of plain full tensors (one device's state dict) under a tensor and a
    # ZeRO-3 plan: each rank takes its shard; one step then matches one device loaded alike; and
    # a state dict of DTensors (pm.state_dict()) loads into another model of the same plan
    from autopar.testing.parity import build_case

    for name, constraints in (("tp", autopar.Constraints(tp=2)), ("zero3", autopar.Constraints(dp=2, zero=3))):
        pm, batches = _compile(constraints=constraints)
        g = torch.Generator().manual_seed(5)
        full = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in pm.full_state_dict().items()}
        pm.load_state_dict(full)
        got = pm.full_state_dict()
        out[f"{name}_loaded_equal"] = all(torch.equal(got[k], full[k]) for k in full)
        ref, _, loss_fn = build_case("mlp")
        ref.load_state_dict(full)
        opt = _sgd(ref.parameters())
        x, t = batches[0]
        ref_loss = loss_fn(ref(x), t)
        ref_loss.backward()
        want_loss = float(ref_loss.detach())
        opt.step()
        loss = float(pm.train_step(x, target=t))
        after, want = pm.full_state_dict(), ref.state_dict()
        out[f"{name}_loss_err"] = abs(loss - want_loss) / abs(want_loss)
        out[f"{name}_param_err"] = max(float((after[k] - want[k]).norm() / want[k].norm().clamp_min(1e-12)) for k in want)
        other, _ = _compile(constraints=constraints)
        other.load_state_dict(pm.state_dict())
        got = other.full_state_dict()
        out[f"{name}_dtensor_equal"] = all(torch.equal(got[k], after[k]) for k in after)
        other.close()
        pm.close()
    return out


@pytest.mark.slow
def test_checkpoint_decisions_agreed_across_ranks(tmp_path, world1):
    """Rows of issue 42, in one 2-rank world (see ``agreement_worker``), then the elastic resume
    of its local-batch checkpoint on one process."""
    results = autopar.launch(agreement_worker, 2, str(tmp_path), timeout_s=600)
    for rank, r in enumerate(results):
        # 1. a late rename
        assert r["late_steps"] == [2, 3], (rank, r["late_steps"])
        assert r["late_losses"] == results[0]["late_losses"]
        # 2. a damaged newest checkpoint
        assert r["fallback_step"] == 2 and r["fallback_equal"], (rank, r)
        assert r["resumed_step"] == 2 and r["resumed_equal"], (rank, r)
        assert r["lagging_load"] is None, (rank, r["lagging_load"])  # 3. the manifest read on rank 0 alone
        # 3. a full disk during a save
        assert r["full_shard"] is not None and "CheckpointError" in r["full_shard"], (rank, r["full_shard"])
        assert "rank 1: cannot write" in r["full_shard"] and "__1_0.distcp: No space left on device (ENOSPC)" in r["full_shard"]
        assert r["full_manifest"] is not None and "failed on rank 0: cannot write" in r["full_manifest"], r["full_manifest"]
        assert f"{tmp_path / 'full2' / 'step-2.partial'}: No space left on device (ENOSPC)" in r["full_manifest"]
        assert r["full_then_steps"] == [3], r["full_then_steps"]
        # 4. folders that cannot be written, refused at compile on every rank
        assert r["root_refused"] is not None and r["root_refused"].startswith("CheckpointError: the checkpoint root"), r
        assert f"rank 1: cannot write {tmp_path / 'a-file' / 'ckpt'}: Not a directory (ENOTDIR)" in r["root_refused"]
        assert r["monitor_refused"] is not None and "the monitoring folder" in r["monitor_refused"], r
        assert f"cannot write {tmp_path / 'a-file' / 'run'}: Not a directory (ENOTDIR)" in r["monitor_refused"]
        # 6. full tensors (and DTensors) into pm.load_state_dict
        for name in ("tp", "zero3"):
            assert r[f"{name}_loaded_equal"] and r[f"{name}_dtensor_equal"], (rank, name, r)
            assert r[f"{name}_loss_err"] <= 1e-5 and r[f"{name}_param_err"] <= 1e-5, (rank, name, r)
    warned = results[0]["fallback_warnings"]
    assert len(warned) == 1 and f"checkpoint {tmp_path / 'late' / 'step-3'} is damaged" in warned[0], warned
    assert "truncated" in warned[0] and "skipping it for the previous complete checkpoint" in warned[0]
    assert results[1]["fallback_warnings"] == []

    # 5. elastic resume on one process: the global batch changes from 16 rows to 8, or stays 16
    pm, _ = _compile(autopar.Checkpointing(str(tmp_path / "local"), every=1), rows=8, batch="local")
    changes = "; ".join(pm.resumed.changes)
    assert "world size 2 -> 1" in changes and "the global batch changed from 16 to 8 rows" in changes, changes
    assert "scale the learning rate (linearly: by 8/16)" in changes and "kept" not in changes
    pm.close()
    pm, _ = _compile(autopar.Checkpointing(str(tmp_path / "local"), every=1), rows=16, batch="local")
    changes = "; ".join(pm.resumed.changes)
    assert "the global batch kept at 16 rows" in changes and "changed" not in changes, changes
    pm.close()


# ----------------------------------------------------------------------------- one process


def test_calibration_output_folder_is_checked_before_measuring(tmp_path, monkeypatch):
    from autopar.calibration import calibrate

    def measured(*a, **k):
        raise AssertionError("calibrate measured before checking where its spec goes")

    monkeypatch.setattr("autopar.runtime.launch.launch", measured)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(AutoparError, match=rf"the calibration output folder {tmp_path / 'a-file' / 'specs'} cannot be "
                                           rf"written .*Not a directory \(ENOTDIR\); a part of the path is a file"):
        calibrate(1, out=tmp_path / "a-file" / "specs" / "local-1.json", backend="gloo")


def test_exit_closes_every_model_then_raises_the_first_failure(world1):
    """One model's close() raising does not leave the others open (at exit or in close())."""
    from autopar.runtime import parallel_model

    first, _ = _compile()
    second, _ = _compile()

    def broken():
        raise RuntimeError("the background save failed")

    first._checkpointer.close = broken
    with pytest.raises(RuntimeError, match="the background save failed"):
        parallel_model._close_all()
    assert first not in parallel_model._LIVE and second not in parallel_model._LIVE, "a model left open"
    assert not first._grad_sync._handles and not second._grad_sync._handles  # the rest of close() ran on both
