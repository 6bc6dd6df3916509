"""Checkpoints and recovery (issue 11): sharded saves that reload into any plan, resume after a
crash, re-plan on another world size, and refuse damaged or foreign checkpoints.

The training runs are the example GPT (``parity.build_case("gpt")``) with AdamW, the batch of step
``s`` being ``batches[s % 8]``, so an interrupted run sees what an uninterrupted one does.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.errors import CheckpointError, WorkerFailedError
from autopar.runtime.checkpoint_files import MANIFEST, complete_steps

ROOT = Path(__file__).resolve().parents[1]


def _adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.05, momentum=0.9)


def _compile(constraints: dict, checkpoint=None, optimizer=_adamw, case: str = "gpt"):
    from autopar.testing.parity import build_case

    model, batches, loss_fn = build_case(case)
    x, t = batches[0]
    pm = autopar.compile(model, autopar.Cluster.local(int(os.environ.get("WORLD_SIZE", "1"))), (x,), example_target=t, loss_fn=loss_fn, optimizer=optimizer,
                         constraints=autopar.Constraints(**constraints), checkpoint=checkpoint)
    return pm, batches


def _train_to(pm, batches, steps: int, die_at: int | None = None) -> None:
    while pm.step < steps:
        if die_at is not None and pm.step == die_at and dist.get_rank() == 1:
            os._exit(13)
        x, t = batches[pm.step % len(batches)]
        pm.train_step(x, target=t)


def _state(pm) -> dict:
    return {"model": pm.full_state_dict(), "optim": pm.full_optimizer_state_dict(), "step": pm.step,
            "mesh": pm.plan.mesh, "stages": len(pm.plan.stages), "resumed": pm.resumed, "plan": pm.plan}


def train_worker(constraints, steps, root=None, every=None, die_at=None, save_at=None, optimizer=_adamw, asynchronous=True):
    """Train to ``steps`` (from the newest checkpoint under ``root`` if any); ``save_at``: also save
    there by hand and return the state at that step."""
    ckpt = autopar.Checkpointing(root, every=every, asynchronous=asynchronous) if root else None
    pm, batches = _compile(constraints, ckpt, optimizer)
    at_save = None
    if save_at is not None:
        _train_to(pm, batches, save_at)
        pm.save(os.path.join(root, "manual"))
        at_save = _state(pm)
    _train_to(pm, batches, steps, die_at)
    pm.wait_saved()
    out = _state(pm)
    out["at_save"] = at_save
    pm.close()
    return out


def load_worker(folder, configs, resave_root=None, resave=()):
    """Load ``folder`` under each constraint set in turn: each one's full state right after loading.
    ``resave``: indices of configs that also save under ``resave_root``; each of those checkpoints
    is then loaded under dp=4 (their states appended, in order)."""
    out, resaved = [], []
    for i, constraints in enumerate(configs):
        pm, _ = _compile(constraints)
        pm.load(folder)
        out.append(_state(pm))
        if i in resave:
            resaved.append(pm.save(os.path.join(resave_root, str(i))))
        pm.close()
    for path in resaved:
        pm, _ = _compile({"dp": 4})
        pm.load(path)
        out.append(_state(pm))
        pm.close()
    return out


def _assert_equal_states(got: dict, want: dict, exact: bool, label: str) -> None:
    for part in ("model", "optim"):
        assert set(got[part]) == set(want[part]), (label, part, set(got[part]) ^ set(want[part]))
        for k, w in want[part].items():
            g = got[part][k]
            if exact:
                assert torch.equal(g, w), f"{label}: {part} {k} differs by {float((g - w).abs().max())}"
            else:
                err = float((g.double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-3))
                assert err <= 1e-5, f"{label}: {part} {k} relative error {err:.2e}"


# ----------------------------------------------------------------------------- acceptance


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """4 ranks, dp=2 tp=2, 10 steps without a break; saved by hand at step 3 (the resharding source)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    return autopar.launch(train_worker, 4, {"dp": 2, "tp": 2}, 10, str(root), None, None, 3, timeout_s=600)[0], root


@pytest.mark.slow
def test_torchrun_restart_resumes_bitwise(uninterrupted, tmp_path):
    """Rank 1 dies at step 6 of 10 under ``--max-restarts 1``: the restarted workers resume from the
    newest complete checkpoint and end bitwise equal to the uninterrupted run."""
    ref, _ = uninterrupted
    out = tmp_path / "final.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone", "--max-restarts", "1",
         str(ROOT / "examples" / "resumable.py"), "--root", str(tmp_path / "ckpt"), "--steps", "10", "--every", "2",
         "--die-at", "6", "--dp", "2", "--tp", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "starting at step 0" in done.stdout
    resumed_at = [int(line.split()[3]) for line in done.stdout.splitlines() if line.startswith("starting at step")]
    assert resumed_at[0] == 0 and resumed_at[1] in (4, 6), done.stdout  # 6 if its save completed before the crash
    got = torch.load(out, weights_only=True)
    assert got["step"] == 10
    _assert_equal_states(got, ref, exact=True, label="restarted")
    assert complete_steps(tmp_path / "ckpt")[-3:] == [6, 8, 10]  # keep=3


@pytest.mark.slow
def test_fewer_processes_replan_and_reshard(uninterrupted, tmp_path):
    """The same crash without restarts, then a launch on 2 processes: a new plan, the checkpoint
    loaded resharded, the final state within 1e-5 of the uninterrupted 4-process run."""
    ref, _ = uninterrupted
    root = str(tmp_path)
    with pytest.raises(WorkerFailedError, match="rank 1 died with exit code 13"):
        autopar.launch(train_worker, 4, {"dp": 2, "tp": 2}, 10, root, 2, 6, timeout_s=600)
    last = complete_steps(root)[-1]
    assert last in (4, 6)
    got = autopar.launch(train_worker, 2, {}, 10, root, 2, timeout_s=600)[0]
    assert got["resumed"].step == last and got["resumed"].saved_world_size == 4
    assert any("world size 4 -> 2" in c for c in got["resumed"].changes), got["resumed"].changes
    assert any(c.startswith("plan dp=2 tp=2 -> ") for c in got["resumed"].changes), got["resumed"].changes
    _assert_equal_states(got, ref, exact=False, label="2 processes")


@pytest.mark.slow
def test_reshard_matrix(uninterrupted):
    """Saved under dp=2 tp=2 on 4 ranks; loaded under dp=4, tp=4, ZeRO-3 dp=4, pp=2 x dp=2 and ZeRO-2
    dp=4 (the last two save again, each loaded under dp=4) and on one process: the full model and
    optimizer state equal what was saved, bit for bit."""
    ref, root = uninterrupted
    saved = ref["at_save"]
    folder = str(root / "manual" / "step-3")
    configs = [{"dp": 4}, {"tp": 4}, {"dp": 4, "zero": 3}, {"pp": 2, "dp": 2}, {"dp": 4, "zero": 2}]
    results = autopar.launch(load_worker, 4, folder, configs, str(root / "resaved"), (3, 4), timeout_s=600)[0]
    labels = [str(c) for c in configs] + ["saved under pp=2 x dp=2, loaded under dp=4",
                                          "saved under ZeRO-2 dp=4, loaded under dp=4"]
    assert len(results) == len(labels)
    for label, got in zip(labels, results):
        assert got["step"] == 3
        _assert_equal_states(got, saved, exact=True, label=label)
    assert results[3]["stages"] == 2
    assert all(p.zero_stage == 2 for p in results[4]["plan"].params.values() if p.zero_axes), "no ZeRO-2 parameter"
    assert any(p.zero_axes for p in results[4]["plan"].params.values())


def tied_pipeline_worker(root):
    """Gemma (input and output embeddings tied) trained 2 steps at pp=2, where both stages hold
    the tied weight, saved, then loaded under dp=2 and under zbv (one rank runs both of its
    stages, the other holds neither): its full model and optimizer states after each load; and the
    bytes this rank's all-reduces counted while training (the tied copies' gradient sums only)."""
    pm, batches = _compile({"pp": 2}, case="real:gemma")
    before = pm.comm.stats.totals()
    _train_to(pm, batches, 2)
    summed = pm.comm.stats.since(before)[0].get("all_reduce", 0)
    tied = [4 * math.prod(p.shape) for p in pm.plan.params.values()  # fp32, whole (pp only)
            if sum(any(q.fqn == p.fqn for q in s.params) for s in pm.plan.stages) > 1]
    saved = _state(pm)
    saved["tied"] = (summed, tied)
    saved["predicted_all_reduce"] = dict(pm.plan.stages[pm._pipeline.mine[0]].comm_bytes).get("all_reduce", 0)
    path = pm.save(os.path.join(root, "tied"))
    pm.close()
    loaded = []
    for constraints in ({"dp": 2}, {"pp": 2, "schedule": "zbv"}):
        pm, _ = _compile(constraints, case="real:gemma")
        pm.load(path)
        loaded.append(_state(pm))
        pm.close()
    return saved, loaded


@pytest.mark.slow
def test_tied_weights_across_pipeline_stages_save_and_reshard(tmp_path):
    saved, loaded = autopar.launch(tied_pipeline_worker, 2, str(tmp_path))[0]
    assert saved["stages"] == 2
    summed, tied = saved["tied"]
    assert len(tied) == 1 and summed == 2 * tied[0], "the tied gradient sums are counted once per step"
    assert summed == 2 * saved["predicted_all_reduce"], "the plan predicts this rank's tied sum (Stage.comm_bytes)"
    for state, label in zip(loaded, ("dp=2", "zbv")):
        _assert_equal_states(state, saved, True, f"saved at pp=2, loaded under {label}")


@pytest.mark.slow
def test_reshard_into_one_process(uninterrupted, world1):
    ref, root = uninterrupted
    pm, _ = _compile({})
    pm.load(str(root / "manual" / "step-3"))
    _assert_equal_states(_state(pm), ref["at_save"], exact=True, label="1 process")
    assert any("world size 4 -> 1" in c for c in pm.resumed.changes)
    pm.close()


def reshard_worker(constraints: dict, case: str, optimizer, folder_in, root_out):
    """Compile ``case`` under ``constraints``, load a checkpoint saved by 1 process, train one step,
    save its own: (state loaded, state after the step, the folder saved)."""
    pm, batches = _compile(constraints, case=case, optimizer=optimizer)
    pm.load(folder_in)
    loaded = _state(pm)
    _train_to(pm, batches, pm.step + 1)
    folder = pm.save(root_out)
    out = _state(pm)
    pm.close()
    return loaded, out, folder


@pytest.mark.slow
def test_uneven_shards_reshard_both_ways(tmp_path, world1):
    pm, batches = _compile({}, case="odd_mlp", optimizer=_sgd)
    _train_to(pm, batches, 2)
    folder = pm.save(str(tmp_path / "one"))
    saved = _state(pm)
    pm.close()
    # odd_mlp (21 features) under ZeRO-3 over 2 ranks: shards of 11 and 10 rows
    loaded, trained, folder2 = autopar.launch(reshard_worker, 2, {"dp": 2, "zero": 3}, "odd_mlp", _sgd, folder,
                                              str(tmp_path / "two"), timeout_s=300)[0]
    assert any("S(" in p.layout and p.shape[0] % 2 for p in loaded["plan"].params.values()), "no uneven shard"
    _assert_equal_states(loaded, saved, exact=True, label="1 -> zero-3 uneven")
    pm, _ = _compile({}, case="odd_mlp", optimizer=_sgd)
    pm.load(folder2)
    _assert_equal_states(_state(pm), trained, exact=True, label="zero-3 uneven -> 1")
    pm.close()


@pytest.mark.slow
def test_stacked_experts_reshard_between_ep_and_one_process(tmp_path, world1):
    """Experts written as modules: saved by one process (every expert whole), loaded with the
    experts split over 2 ranks, trained, saved, loaded by one process again; the full state (per
    expert, under the model's own keys, model and AdamW state) equal at each hand-over."""
    pm, batches = _compile({}, case="moe_modules")
    _train_to(pm, batches, 2)
    folder = pm.save(str(tmp_path / "one"))
    saved = _state(pm)
    pm.close()
    assert "blocks.0.moe.experts.3.2.weight" in saved["model"] and "blocks.0.moe.experts.3.2.weight/exp_avg" in saved["optim"]
    # the experts split over the 2 ranks (ep=2)
    loaded, trained, folder2 = autopar.launch(reshard_worker, 2, {"dp": 2, "ep": 2}, "moe_modules", _adamw, folder,
                                              str(tmp_path / "two"), timeout_s=300)[0]
    assert loaded["plan"].params["blocks.0.moe.experts.*.0.weight"].layout.startswith("[S(0)"), "experts not split"
    _assert_equal_states(loaded, saved, exact=True, label="1 -> ep=2")
    pm, _ = _compile({}, case="moe_modules")
    pm.load(folder2)
    _assert_equal_states(_state(pm), trained, exact=True, label="ep=2 -> 1")
    pm.close()


def crash_in_save_worker(root):
    """Save every 2 steps; rank 1 dies while writing step 4's shards."""
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data

    def dying(self, plan, planner):
        if dist.get_rank() == 1 and "step-4" in str(self.path):
            os._exit(14)
        return original(self, plan, planner)

    FileSystemWriter.write_data = dying
    pm, batches = _compile({"dp": 2}, autopar.Checkpointing(root, every=2))
    _train_to(pm, batches, 6)
    pm.wait_saved()


@pytest.mark.slow
def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, world1):
    root = tmp_path
    with pytest.raises(WorkerFailedError, match="exit code 14"):
        autopar.launch(crash_in_save_worker, 2, str(root), timeout_s=300)
    assert complete_steps(root) == [2]
    assert (root / "step-4.partial").is_dir() and not (root / "step-4.partial" / MANIFEST).exists()
    # resumed (here on one process): from step 2, the intact one
    pm, batches = _compile({}, autopar.Checkpointing(str(root), every=2))
    assert pm.step == 2 and pm.resumed.step == 2
    _train_to(pm, batches, 4)
    pm.wait_saved()
    assert complete_steps(root) == [2, 4] and not (root / "step-4.partial").exists()
    pm.close()


# ----------------------------------------------------------------------------- one process


def _saved_once(root, world1_, steps=2, optimizer=_adamw):
    pm, batches = _compile({}, autopar.Checkpointing(str(root), every=steps, asynchronous=False), optimizer)
    _train_to(pm, batches, steps)
    return pm, batches


def test_truncated_or_altered_shard_is_named(tmp_path, world1):
    pm, _ = _saved_once(tmp_path, world1)
    folder = tmp_path / "step-2"
    shard = next(folder.glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name} does not match its sha256"):
        pm.load(str(folder))
    shard.write_bytes(bytes(data[:-100]))
    with pytest.raises(CheckpointError, match=rf"{shard.name} has {len(data) - 100} bytes, the manifest says {len(data)}"):
        pm.load(str(folder))
    pm.close()


def test_another_models_checkpoint_is_refused(tmp_path, world1):
    pm, _ = _saved_once(tmp_path, world1)
    pm.close()
    other, _ = _compile({}, case="mlp")
    with pytest.raises(CheckpointError, match=r"is of another model \(saved from a GPT, this is a MLP\)"):
        other.load(str(tmp_path / "step-2"))
    other.close()


def test_incomplete_folder_is_not_a_checkpoint(tmp_path, world1):
    pm, _ = _saved_once(tmp_path, world1)
    (tmp_path / "step-2" / MANIFEST).unlink()
    assert pm.load_latest(str(tmp_path)) is None
    with pytest.raises(CheckpointError, match="has no manifest.json"):
        pm.load(str(tmp_path / "step-2"))
    pm.close()


def test_loading_runs_no_pickled_code(tmp_path, world1):
    """A crafted DCP ``.metadata`` (torch reads it with plain pickle) is refused before it runs."""
    pm, _ = _saved_once(tmp_path, world1)
    folder = tmp_path / "step-2"
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (folder / ".metadata").write_bytes(pickle.dumps(Evil()))
    manifest = json.loads((folder / MANIFEST).read_text())  # an attacker rewrites the manifest too
    from autopar.runtime.checkpoint_files import sha256_of

    manifest["files"][".metadata"] = {"bytes": (folder / ".metadata").stat().st_size, "sha256": sha256_of(folder / ".metadata")}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"names posix\.system|names os\.system"):
        pm.load(str(folder))
    # a dotted name that find_class would follow through an allowed module's namespace to os.system
    dotted = (b"\x80\x04" + pickle.dumps("torch.distributed.checkpoint.metadata", protocol=4)[2:-1]
              + pickle.dumps("os.system", protocol=4)[2:-1] + b"\x93" + pickle.dumps((f"touch {marker}",), protocol=4)[2:-1]
              + b"R.")
    (folder / ".metadata").write_bytes(dotted)
    manifest["files"][".metadata"] = {"bytes": len(dotted), "sha256": sha256_of(folder / ".metadata")}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"names torch\.distributed\.checkpoint\.metadata\.os\.system"):
        pm.load(str(folder))
    assert not marker.exists()
    pm.close()


class _Counter:
    """A tracked object (as a data loader's position would be)."""

    def __init__(self):
        self.seen = 0

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def _sched(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _run_counting(pm, batches, counter, steps):
    while pm.step < steps:
        counter.seen += 1  # drawn before the step, as a loader's batch is
        x, t = batches[pm.step % 8]
        pm.train_step(x, target=t)


def test_sgd_scheduler_rng_and_tracked_state_resume(tmp_path, world1):
    """SGD's momentum, the LR scheduler train_step steps, the step, the RNG and a tracked object come
    back: training on from the checkpoint matches training on without a break, exactly."""
    from autopar.testing.parity import build_case

    def compile_(ckpt):
        model, batches, loss_fn = build_case("gpt")
        x, t = batches[0]
        return autopar.compile(model, autopar.Cluster.local(int(os.environ.get("WORLD_SIZE", "1"))), (x,), example_target=t, loss_fn=loss_fn, optimizer=_sgd,
                               lr_scheduler=_sched, checkpoint=ckpt), batches

    ref, batches = compile_(None)
    counter = _Counter()
    _run_counting(ref, batches, counter, 4)
    want, want_seen = _state(ref), counter.seen
    ref.close()

    pm, batches = compile_(autopar.Checkpointing(str(tmp_path / "ck"), every=2, asynchronous=False))
    counter = pm.track("data", _Counter())
    _run_counting(pm, batches, counter, 2)
    rng_at_save = torch.get_rng_state()
    pm.close()
    torch.manual_seed(1234)  # a restarted process: other RNG state
    pm, batches = compile_(autopar.Checkpointing(str(tmp_path / "ck"), every=2, asynchronous=False))
    assert pm.step == 2 and torch.equal(torch.get_rng_state(), rng_at_save)
    assert pm.lr_scheduler.get_last_lr() == [0.05 * 0.5 ** 2]
    counter = pm.track("data", _Counter())
    assert counter.seen == 2
    _run_counting(pm, batches, counter, 4)
    _assert_equal_states(_state(pm), want, exact=True, label="sgd resumed")
    assert counter.seen == want_seen
    pm.close()


def test_native_loop_optimizer_resumes(tmp_path, world1):
    """The torch-native loop: the user's AdamW over pm.parameters() (DTensors), tracked, saved with
    an explicit step, and restored into a new model whose optimizer is tracked after the load."""
    from autopar.testing.parity import build_case

    def native(steps_from, steps_to, opt, pm, batches, loss_fn):
        for s in range(steps_from, steps_to):
            x, t = batches[s % 8]
            opt.zero_grad()
            loss_fn(pm(x), t).backward()
            opt.step()

    def fresh(ckpt):
        model, batches, loss_fn = build_case("gpt")
        pm = autopar.compile(model, autopar.Cluster.local(1), batches[0][0], checkpoint=ckpt)
        return pm, torch.optim.AdamW(pm.parameters(), lr=1e-3), batches, loss_fn

    pm, opt, batches, loss_fn = fresh(None)
    native(0, 4, opt, pm, batches, loss_fn)
    want = pm.full_state_dict()
    pm.close()

    pm, opt, batches, loss_fn = fresh(autopar.Checkpointing(str(tmp_path)))
    pm.track("opt", opt)
    native(0, 2, opt, pm, batches, loss_fn)
    pm.save(step=2)
    pm.close()
    pm, opt, batches, loss_fn = fresh(autopar.Checkpointing(str(tmp_path)))
    assert pm.step == 2
    pm.track("opt", opt)  # the state is loaded here, after the parameters
    assert opt.state and all(int(st["step"]) == 2 for st in opt.state.values())
    native(2, 4, opt, pm, batches, loss_fn)
    got = pm.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    pm.close()


def test_resume_before_the_plan_exists_restores_data_order(tmp_path, world1):
    """compile without example inputs plans at the first call; the step, the RNG (which draws the
    batches here) and a tracked object's position are restored at compile, before any batch is
    drawn, so the resumed run sees the batches and ends with the state of an uninterrupted one."""
    from autopar.testing.parity import build_case

    def run(ckpt, steps, counter=None):
        model, batches, loss_fn = build_case("gpt")
        torch.manual_seed(0 if ckpt is None or not any(Path(ckpt.root).glob("step-*")) else 999)
        pm = autopar.compile(model, autopar.Cluster.local(1), loss_fn=loss_fn, optimizer=_adamw, checkpoint=ckpt)
        counter = pm.track("data", _Counter()) if ckpt is not None else _Counter()
        drawn = []
        while pm.step < steps:
            i = int(torch.randint(0, 8, (1,)))  # the batch drawn before the step, from the RNG
            counter.seen += 1
            drawn.append(i)
            x, t = batches[i]
            pm.train_step(x, target=t)
        return pm, drawn, counter

    ref, ref_drawn, _ = run(None, 4)
    want = _state(ref)
    ref.close()
    ckpt = autopar.Checkpointing(str(tmp_path), every=2, asynchronous=False)
    pm, first, _ = run(ckpt, 2)
    pm.close()
    pm, rest, counter = run(ckpt, 4)
    assert first + rest == ref_drawn and counter.seen == 4
    _assert_equal_states(_state(pm), want, exact=True, label="resumed before planning")
    pm.close()


def test_keep_and_fresh_root(tmp_path, world1):
    pm, batches = _compile({}, autopar.Checkpointing(str(tmp_path), every=1, keep=2))
    _train_to(pm, batches, 4)
    pm.wait_saved()
    assert complete_steps(tmp_path) == [3, 4]
    pm.close()
    with pytest.raises(autopar.AutoparError, match="already holds checkpoints of a run"):
        _compile({}, autopar.Checkpointing(str(tmp_path), resume=False))


@pytest.mark.parametrize("kwargs, match", [
    (dict(root=""), "must be a folder path"),
    (dict(root="x", every=0), "every=0"),
    (dict(root="x", keep=0), "keep=0"),
])
def test_checkpointing_arguments_are_checked(kwargs, match):
    with pytest.raises(autopar.AutoparError, match=match):
        autopar.Checkpointing(**kwargs)
