"""Per-step monitoring (runtime.monitor): what train_step records, the slow-step warning, the report."""
import json
import warnings

import pytest
import torch

import autopar
from autopar.cli import main as cli_main
from autopar.errors import AutoparError
from autopar.testing.parity import build_case


def _monitored_run(run_dir, steps):
    model, batches, loss = build_case("gpt")
    x, y = batches[0]
    pm = autopar.compile(model, autopar.Cluster.local(), x, loss_fn=loss, example_target=y,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                         monitor=autopar.Monitoring(run_dir, slow_factor=1e-9, slow_steps=2, memory_every=3))
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for xb, yb in batches[:steps]:
            losses.append(pm.train_step(xb, target=yb))
    slow = [str(w.message) for w in caught if issubclass(w.category, autopar.SlowStepWarning)]
    return {"losses": losses, "slow": slow, "fingerprint": pm.plan.fingerprint,
            "predicted": pm.plan.predicted.step_time_s, "tokens": int(x.numel())}


@pytest.mark.slow
def test_monitored_run_records_every_step_beside_the_prediction(tmp_path, capsys):
    results = autopar.launch(_monitored_run, 2, str(tmp_path), 3)
    lines = [json.loads(s) for s in (tmp_path / "steps.jsonl").read_text().splitlines()]
    r = results[0]
    assert [s["step"] for s in lines] == [1, 2, 3]  # rank 0 writes, once per step
    for s, loss in zip(lines, r["losses"]):
        assert s["wall_s"] > 0 and s["predicted_s"] == r["predicted"] and s["loss"] == loss
        assert s["ratio"] == pytest.approx(s["wall_s"] / s["predicted_s"])
        assert s["tokens_per_s"] == pytest.approx(r["tokens"] / s["wall_s"]) and 0 < s["mfu"] < 1
        # its collectives: bytes as the plan predicts them, time blocked within the step
        assert s["comm_bytes"] == {k: int(v) for k, v in s["predicted_comm_bytes"].items()} and s["comm_bytes"]
        assert 0 < s["comm_s"] < s["wall_s"] and s["compute_s"] == pytest.approx(s["wall_s"] - s["comm_s"])
        assert set(s["comm_s_by_kind"]) <= set(s["comm_bytes"])
    # off CUDA every memory_every-th step (here the 3rd) measures its peak under the storage tracker,
    # beside the plan's figure and by category (the other steps measure none)
    assert [s.get("memory_tracked", False) for s in lines] == [False, False, True]
    assert lines[0]["peak_bytes"] is None and lines[2]["peak_bytes"] > 0
    # the goal of memory fidelity (issue 7, benchmarks/README.md): the peak within 15% of the prediction
    assert abs(lines[2]["peak_bytes"] / lines[2]["predicted_peak_bytes"] - 1) <= 0.15, lines[2]
    assert lines[2]["memory_bytes"]["params"] == pytest.approx(lines[2]["predicted_memory_bytes"]["params"], rel=0.05)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["fingerprint"] == r["fingerprint"] and run["world_size"] == 2 and run["versions"]["torch"]
    assert autopar.Plan.from_json((tmp_path / "plan.json").read_text()).fingerprint == r["fingerprint"]
    # a streak of 2 slow steps warns once, on every rank, naming the steps
    assert all(len(res["slow"]) == 1 and "steps 1..2" in res["slow"][0] for res in results), results
    assert all("the largest excess: " in res["slow"][0] for res in results), results
    assert cli_main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "measured ms" in out and len([ln for ln in out.splitlines() if ln.strip()[:1].isdigit()]) == 3
    assert "largest excess over the prediction" in out and "collective" in out
    assert "peak memory per device" in out and "optimizer_state" in out
    for png in ("step_time.png", "comm_breakdown.png", "memory.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    # provenance: the run's record plans again to the same plan, byte for byte
    assert run["inputs_fingerprint"] and isinstance(run["seed"], int)
    assert cli_main(["replay", str(tmp_path), "examples.gpt:gpt_small"]) == 0
    assert "reproduced byte for byte" in capsys.readouterr().out


def test_monitoring_refuses_bad_settings(tmp_path):
    with pytest.raises(AutoparError, match="slow_factor"):
        autopar.Monitoring(tmp_path, slow_factor=0)
    with pytest.raises(AutoparError, match="slow_steps"):
        autopar.Monitoring(tmp_path, slow_steps=0)
    with pytest.raises(AutoparError, match="memory_every"):
        autopar.Monitoring(tmp_path, memory_every=-1)
    with pytest.raises(AutoparError, match="needs a folder"):
        autopar.Monitoring("")
    from autopar.runtime.monitor import read_steps

    with pytest.raises(AutoparError, match="monitor=autopar.Monitoring"):
        read_steps(tmp_path)


def test_compile_refuses_a_monitor_that_is_not_monitoring(tmp_path):
    model, batches, loss = build_case("gpt")
    with pytest.raises(AutoparError, match="monitor= takes autopar.Monitoring"):
        autopar.compile(model, autopar.Cluster.local(1), monitor=str(tmp_path))


def test_a_monitoring_write_failing_mid_run_warns_and_training_goes_on(tmp_path, world1):
    """Rank 0 alone writes the records: a full disk mid-run must not raise there (the other ranks
    would wait in the next step's collectives) but stop monitoring with a warning naming the path."""
    from autopar.runtime.monitor import MonitoringWriteWarning

    model, batches, loss = build_case("gpt")
    x, y = batches[0]
    run_dir = tmp_path / "run"
    pm = autopar.compile(model, world1, x, loss_fn=loss, example_target=y,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), monitor=autopar.Monitoring(run_dir))
    pm.train_step(*batches[0][:1], target=batches[0][1])
    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        if str(path).startswith(str(run_dir)) and "a" in mode:
            raise OSError(28, "No space left on device", str(path))
        return real_open(path, mode, *args, **kwargs)

    import builtins
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mp.setattr(builtins, "open", full_disk)
        losses = [pm.train_step(xb, target=yb) for xb, yb in batches[1:4]]
    failed = [str(w.message) for w in caught if issubclass(w.category, MonitoringWriteWarning)]
    assert len(failed) == 1 and "No space left on device" in failed[0] and str(run_dir) in failed[0]
    assert len(losses) == 3 and all(isinstance(float(v), float) for v in losses)
    assert len(autopar.runtime.monitor.read_steps(run_dir)) == 1  # the step recorded before the disk filled
