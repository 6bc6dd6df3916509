"""The command line: ``autopar plan`` in-process, ``autopar run`` through torchrun."""
from __future__ import annotations

import os
from pathlib import Path
import subprocess
import sys
import textwrap

import pytest

from autopar.cli import main


def test_plan_prints_the_summary(capsys):
    assert main(["plan", "examples.gpt:gpt_small", "--cluster", "local", "--nproc", "2", "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "predicted step time" in out and "mesh dp=" in out and "naive data parallel" in out


def test_plan_explains_and_writes_json(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", "examples.gpt:gpt_small", "--cluster", "local", "--nproc", "2", "--tp", "2",
                 "--explain", "blocks.0.mlp", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    assert "why the plan lays out 'blocks.0.mlp'" in out
    import autopar

    assert autopar.Plan.from_json(path.read_text()).mesh == {"dp": 1, "tp": 2}


def test_replay_reproduces_a_recorded_plan_byte_for_byte(tmp_path, capsys):
    """autopar replay plans again from the record (cluster, constraints, precision, optimizer) and
    compares the JSON; a record edited by hand is reported as edited, exit 1."""
    import json

    path = tmp_path / "plan.json"
    assert main(["plan", "examples.gpt:gpt_small", "--cluster", "local", "--nproc", "2", "--tp", "2", "-o", str(path)]) == 0
    capsys.readouterr()
    assert main(["replay", str(path), "examples.gpt:gpt_small"]) == 0
    assert "reproduced byte for byte" in capsys.readouterr().out
    edited = json.loads(path.read_text())
    edited["precision"] = "fp32"  # planned as bf16-mixed
    path.write_text(json.dumps(edited))
    assert main(["replay", str(path), "examples.gpt:gpt_small"]) == 1
    out = capsys.readouterr().out
    assert "not reproduced" in out and "the record was edited after autopar wrote it" in out, out
    assert "not deterministic" not in out  # an edit is not blamed on the planner
    assert main(["replay", str(tmp_path / "missing"), "examples.gpt:gpt_small"]) == 2
    assert "no plan record there" in capsys.readouterr().err


def test_plan_pipelines_and_draws(tmp_path, capsys):
    png = tmp_path / "timeline.png"
    assert main(["plan", "examples.gpt:gpt_small", "--cluster", "local", "--nproc", "4", "--pp", "2",
                 "--schedule", "gpipe", "--microbatches", "4", "--precision", "fp32", "--draw", str(png)]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 2 stages x 2 device(s) | schedule gpipe | 4 microbatches" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plan_reports_bad_constraints_as_an_error(capsys):
    assert main(["plan", "examples.gpt:gpt_small", "--cluster", "local", "--nproc", "4", "--tp", "3"]) == 2
    assert "tp=3 does not divide the 4 devices" in capsys.readouterr().err


def test_plan_refuses_zero_processes(capsys):
    assert main(["plan", "examples.gpt:gpt_small", "--cluster", "local", "--nproc", "0"]) == 2
    err = capsys.readouterr().err
    assert "Cluster.local" in err and "0" in err, err


def test_plan_rejects_a_bad_factory():
    with pytest.raises(SystemExit, match="MODULE:FACTORY"):
        main(["plan", "examples.gpt"])


_TRAIN_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist, autopar
    from examples.mlp import MLP, example_batch, mlp_loss
    x, t = example_batch()
    pm = autopar.compile(MLP(), autopar.Cluster.local(), (x,), example_target=t, loss_fn=mlp_loss,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    losses = [float(pm.train_step(x, target=t)) for _ in range(3)]
    if dist.get_rank() == 0:
        print("LOSSES", losses, "WORLD", dist.get_world_size(), "MESH", pm.plan.mesh)
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every ``autopar run`` of this file, started side by side when a test first asks (each
    torchrun --standalone rendezvous on its own free port): most of a run is process start-up and
    torchrun's waits, which overlap. name -> CompletedProcess; "<case>_starts": the ranks' start
    log ("rank attempt") of the restart cases."""
    tmp = tmp_path_factory.mktemp("runs")
    (tmp / "train.py").write_text(_TRAIN_SCRIPT)
    (tmp / "restart.py").write_text(_RESTART_SCRIPT)
    root = Path(__file__).resolve().parents[1]
    commands = {"train": [str(tmp / "train.py"), "--nproc", "2"],
                # examples/train_hf.py: a HF causal LM from a local config in the torch-native loop
                "hf": [str(root / "examples" / "train_hf.py"), "--nproc", "2", "--steps", "3"],
                "constraint": [str(tmp / "restart.py"), "--nproc", "2", "--max-restarts", "3", "constraint"],
                "crash": [str(tmp / "restart.py"), "--nproc", "2", "--max-restarts", "3", "crash"]}
    procs = {}
    for name, args in commands.items():
        env = dict(os.environ, OMP_NUM_THREADS="1", RUN_LOG=str(tmp / f"{name}.log"))
        procs[name] = subprocess.Popen([sys.executable, "-m", "autopar.cli", "run", *args], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=env, cwd=root)
    out = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            out[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    for case in ("constraint", "crash"):
        out[case + "_starts"] = sorted((tmp / f"{case}.log").read_text().split("\n")[:-1])
    return out


@pytest.mark.slow
def test_run_launches_a_training_script_with_torchrun(runs):
    done = runs["train"]
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(l for l in done.stdout.splitlines() if l.startswith("LOSSES"))
    assert "WORLD 2" in line
    losses = eval(line.split("LOSSES", 1)[1].split("WORLD")[0])
    assert losses[2] < losses[0]  # SGD on a fixed batch makes progress


@pytest.mark.slow
def test_the_hugging_face_example_trains_under_autopar_run(runs):
    """examples/train_hf.py: a HF causal LM from a local config in the torch-native loop, each rank
    reading its shard through a DistributedSampler (the README's example of local batches)."""
    done = runs["hf"]
    assert done.returncode == 0, done.stderr[-2000:]
    steps = [l for l in done.stdout.splitlines() if l.startswith("step ")]
    assert len(steps) == 3, done.stdout[-2000:]
    assert "trained 3 steps; full state dict: 21 tensors, keys as model.state_dict()" in done.stdout


@pytest.mark.slow
def test_run_restarts_failed_workers_by_default(tmp_path, monkeypatch):
    """``autopar run`` hands torchrun --max-restarts (3 unless told): with Checkpointing a killed
    worker costs the steps since the last save, not the run."""

    from autopar.runtime import run_errors

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    calls = []
    monkeypatch.setattr(run_errors.TorchrunWatch, "run", lambda self: calls.append(self.cmd) or 0)
    assert main(["run", str(script), "--nproc", "2"]) == 0
    assert main(["run", str(script), "--nproc", "2", "--max-restarts", "0", "--steps", "5"]) == 0
    first, second = calls
    assert first[first.index("--max-restarts") + 1] == "3"
    assert second[second.index("--max-restarts") + 1] == "0" and second[-2:] == ["--steps", "5"]
    assert main(["run", str(script), "--max-restarts", "-1"]) == 2


_RESTART_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch, autopar
    from examples.mlp import MLP, example_batch, mlp_loss
    rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    with open(os.environ["RUN_LOG"], "a") as f:
        f.write(f"{rank} {attempt}\\n")
    if sys.argv[1] == "crash" and rank == "1" and attempt == "0":
        os.kill(os.getpid(), signal.SIGKILL)  # a process failure: restarted
    x, t = example_batch()
    tp = 3 if sys.argv[1] == "constraint" else 1  # tp=3 on 2 processes: a deterministic ConstraintError
    pm = autopar.compile(MLP(), autopar.Cluster.local(), (x,), example_target=t, loss_fn=mlp_loss,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), constraints=autopar.Constraints(tp=tp))
    pm.train_step(x, target=t)
    torch.distributed.barrier()  # no rank tears gloo down while another still talks to it
    torch.distributed.destroy_process_group()
""")


@pytest.mark.slow
def test_run_restarts_killed_ranks_but_not_deterministic_errors(runs):
    """A ConstraintError every rank raises at compile is deterministic: ``autopar run`` stops torchrun
    before it restarts anyone (despite --max-restarts 3), prints one traceback naming the ranks and
    exits 2. A rank killed by a signal is a process failure: restarted, and the run completes."""
    out = runs
    bad = out["constraint"]
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert out["constraint_starts"] == ["0 0", "1 0"]  # each rank started once: no restart
    assert bad.stderr.count("Traceback (most recent call last)") == 1, bad.stderr
    assert "ConstraintError: tp=3 does not divide the 2 devices" in bad.stderr
    assert "rank 0 raised this error (ranks 1 the same)" in bad.stderr and "no worker was restarted" in bad.stderr
    assert len(bad.stderr.splitlines()) < 40, bad.stderr
    crash = out["crash"]
    assert crash.returncode == 0, crash.stderr[-3000:]
    # rank 1 killed on attempt 0 (rank 0 may be stopped before it logs), both restarted once
    assert "1 0" in out["crash_starts"] and [s for s in out["crash_starts"] if not s.endswith(" 0")] == ["0 1", "1 1"]
