"""``autopar bench``: the table, the naive-DP memory pre-check, and every row on 2 gloo processes."""
from __future__ import annotations

import re

import pytest
import torch

import autopar
from autopar.bench import BenchSpec, Row, bench_worker, format_table, memory_limited_fraction, parse_constraints
from autopar.cli import main
from autopar.testing.baselines import fsdp2_units, hand_tp_plan, replicated_state_fit

MIB = 2**20


def tiny_mlp():
    """A bench factory (MODULE:FACTORY): the example MLP, small, with a global batch of 8."""
    from examples.mlp import MLP, example_batch, mlp_loss

    x, t = example_batch(32, 8)
    return MLP(32, 128, 2), (x,), mlp_loss, t


def test_table_has_every_row_speedups_and_footnotes():
    rows = [Row("naive", "naive data parallel", 0.300, 100 * MIB, 0.6, predicted_step_s=0.1,
                predicted_peak_bytes=90 * MIB, predicted_comm_share=0.5, notes=("timed",)),
            Row("ddp", "torch DDP", 0.150, 100 * MIB, 0.2, notes=("by difference",)),
            Row("fsdp2", "torch FSDP2 fully_shard", 0.200, 30 * MIB, None, notes=("not measured",)),
            Row("tp", "hand TP", not_run="n/a", notes=("no hand plan for X",)),
            Row("autopar", "autopar (free plan)", 0.100, 25 * MIB, 0.3, predicted_step_s=0.05,
                predicted_peak_bytes=24 * MIB, predicted_comm_share=0.2, notes=("timed",))]
    text = format_table(rows, title="T", footer=("plan: dp=4",))
    lines = text.splitlines()
    assert lines[0] == "T" and lines[2].startswith("| setup | step ms (median) | peak MiB / rank | comm % |")
    assert lines[4] == "| naive data parallel | 300.0 | 100.00 | 60.0% [1] | 1.00 | 100.0 | 3.00 | 90.00 | 50.0% |"
    assert lines[5] == "| torch DDP | 150.0 | 100.00 | 20.0% [2] | 2.00 | — | — | — | — |"
    assert lines[6] == "| torch FSDP2 fully_shard | 200.0 | 30.00 | n/a [3] | 1.50 | — | — | — | — |"
    assert lines[7] == "| hand TP | n/a [4] | — | — | — | — | — | — | — |"
    assert lines[8] == "| autopar (free plan) | 100.0 | 25.00 | 30.0% [1] | 3.00 | 50.0 | 2.00 | 24.00 | 20.0% |"
    assert "[1] timed" in text and "[4] no hand plan for X" in text and text.endswith("plan: dp=4")
    # a memory limit adds a column; a refused naive row leaves the speedups empty
    rows[0] = Row("naive", "naive data parallel", not_run="refused", notes=("needs 128 MiB, has 45 MiB",))
    limited = format_table(rows, limit_bytes=28 * MIB).splitlines()
    assert "within 28.0 MiB" in limited[0]
    assert limited[2] == "| naive data parallel | refused [1] | — | — | — | — | — | — | — | — |"
    assert limited[4].startswith("| torch FSDP2 fully_shard | 200.0 | 30.00 | **no** | n/a [3] | — |")
    assert limited[6].startswith("| autopar (free plan) | 100.0 | 25.00 | yes | 30.0% [5] | — | 50.0 |")


def test_naive_dp_pre_check_counts_params_grads_and_optimizer_state():
    model = torch.nn.Linear(1024, 1024)  # 1,049,600 parameters, 4 B each
    fit = replicated_state_fit(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), 8 * MIB)
    assert (fit.param_count, fit.optimizer_states) == (1_049_600, 2)
    assert fit.needed_bytes == 4 * 4 * 1_049_600 and not fit.fits
    text = fit.describe()
    assert "needs 16.0 MiB per device" in text and "the device has 8.0 MiB: does not fit: refused" in text
    sgd = replicated_state_fit(model, lambda ps: torch.optim.SGD(ps, lr=0.1), 8.1 * MIB)
    assert sgd.optimizer_states == 0 and sgd.needed_bytes == 2 * 4 * 1_049_600 and sgd.fits


def test_hand_tensor_parallel_plans_and_fsdp_units():
    from examples.gpt import GPT, GPTConfig

    model = tiny_mlp()[0]
    plan, why = hand_tp_plan(model, 2)
    assert sorted(plan) == ["layers.0.down", "layers.0.up", "layers.1.down", "layers.1.up"] and not why
    assert hand_tp_plan(model, 3) == (None, "the hidden width 128 does not split over 3 ranks")
    plan, why = hand_tp_plan(GPT(GPTConfig()), 2)
    assert plan is None and "fused qkv" in why
    assert hand_tp_plan(torch.nn.Linear(2, 2), 2)[0] is None
    assert [type(m).__name__ for m in fsdp2_units(model)] == ["Linear"] * 4
    assert len(fsdp2_units(GPT(GPTConfig()))) == 2  # the blocks
    assert memory_limited_fraction(4) == pytest.approx(0.35) and memory_limited_fraction(2) == pytest.approx(0.7)


def test_forced_constraints_parse_and_refuse_what_they_cannot_mean():
    assert parse_constraints("dp=4, tp=1,zero=0") == {"dp": 4, "tp": 1, "zero": 0}
    with pytest.raises(autopar.ConstraintError, match="expected KEY=INT pairs .* got 'dp=x'"):
        parse_constraints("dp=x")
    with pytest.raises(autopar.ConstraintError, match="KEY one of dp, tp"):
        parse_constraints("foo=1")
    with pytest.raises(autopar.ConstraintError, match="ZeRO stage"):
        BenchSpec(also=("zero=7",))


def test_bench_command_refuses_bad_arguments(capsys):
    assert main(["bench", "--nproc", "0"]) == 2
    assert "--nproc must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--model is gpt, mlp or MODULE:FACTORY"):
        main(["bench", "--model", "resnet"])
    assert main(["bench", "--memory", "-1"]) == 2
    assert "--memory must be a positive number of MiB" in capsys.readouterr().err


def _both_benches(steps: int) -> tuple[dict, dict]:
    """The free bench and the memory-limited one in the same two processes (one start-up)."""
    free = bench_worker(BenchSpec(model="test_bench:tiny_mlp", steps=steps, rounds=2, warmup=1, also=("dp=2,tp=1,zero=0",)))
    limited = bench_worker(BenchSpec(model="test_bench:tiny_mlp", steps=steps, rounds=2, warmup=1,
                                     memory_limited=True))
    return free, limited


@pytest.mark.slow
def test_bench_measures_every_row_and_refuses_naive_dp_under_a_memory_limit():
    free, limited = autopar.launch(_both_benches, 2, 2, timeout_s=300)[0]
    rows = {r.key: r for r in free["rows"]}
    assert list(rows) == ["naive", "ddp", "fsdp2", "tp", "autopar", "autopar:dp=2,tp=1,zero=0"]
    assert rows["autopar:dp=2,tp=1,zero=0"].name == "autopar Constraints(dp=2, tp=1, zero=0)"
    for r in rows.values():  # every row ran and has its numbers
        assert not r.not_run and r.step_s > 0 and r.peak_bytes > 0, r
    for key in ("naive", "ddp", "autopar", "autopar:dp=2,tp=1,zero=0"):
        assert 0 <= rows[key].comm_share <= 1, rows[key]
    for key in ("fsdp2", "tp"):  # not measurable: said why
        assert rows[key].comm_share is None and "not measured" in rows[key].notes[0]
    assert rows["autopar"].predicted_step_s > 0 and rows["naive"].predicted_step_s > 0
    assert rows["fsdp2"].peak_bytes < rows["naive"].peak_bytes  # sharded state counted per rank, not globally
    table = format_table(free["rows"], title=free["title"], footer=free["footer"])
    assert table.count("\n| ") == 7  # the header and six rows
    spread = re.search(r"\(6 setups, relative spread ([0-9.e+-]+)\)", table)
    assert spread and float(spread.group(1)) < 1e-5, table  # every setup took the same first step
    # the memory-limited case: replicas refused by the pre-check, autopar under the limit
    rows = {r.key: r for r in limited["rows"]}
    limit = limited["limit_bytes"]
    for key in ("naive", "ddp"):
        assert rows[key].not_run == "refused" and rows[key].step_s is None
        assert "per device for parameters, gradients and optimizer state" in rows[key].notes[0]
        assert "does not fit: refused" in rows[key].notes[0]
    assert not rows["autopar"].not_run and rows["autopar"].step_s > 0
    assert rows["autopar"].peak_bytes <= limit, (rows["autopar"].peak_bytes, limit)
    assert "| autopar (free plan) |" in format_table(limited["rows"], limit_bytes=limit)
