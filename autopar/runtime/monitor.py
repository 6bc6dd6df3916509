"""Per-step monitoring: every ``train_step``'s measured time beside the plan's prediction.

``compile(..., monitor=autopar.Monitoring(run_dir))``: rank 0 writes ``run_dir/run.json`` (what
ran: plan fingerprint, mesh, cluster spec, world size, package versions, command line) and
``run_dir/plan.json`` once, then appends one JSON line per step to ``run_dir/steps.jsonl``:
the step, measured wall time and the predicted step time, their ratio, the loss, samples and
tokens per second, MFU (the plan's model FLOPs over wall time x devices x peak FLOP/s) and, on
CUDA, the step's peak memory beside the predicted peak. A step that ran ``slow_factor`` times its
prediction ``slow_steps`` times in a row raises a ``SlowStepWarning`` (once per streak).

``autopar report RUN_DIR`` (``report_run``) prints the steps as a table and, with matplotlib,
draws measured vs predicted step time into ``RUN_DIR/step_time.png``.

Not measured here yet: the split of a step into compute and exposed communication, and CPU
memory per step (``ParallelModel.measure_step`` measures both categories and bytes on demand).
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from autopar.errors import AutoparError

__all__ = ["Monitoring", "SlowStepWarning", "StepMonitor", "read_steps", "report_run"]

STEPS_FILE = "steps.jsonl"


class SlowStepWarning(UserWarning):
    """Measured steps ran far slower than the plan predicted, several steps in a row."""


@dataclass(frozen=True)
class Monitoring:
    """Where and how ``train_step`` records its steps (module docstring)."""

    run_dir: str | os.PathLike
    slow_factor: float = 3.0
    slow_steps: int = 5

    def __post_init__(self):
        if not str(self.run_dir):
            raise AutoparError("Monitoring(run_dir=...) needs a folder to write the run's steps into")
        if not (isinstance(self.slow_factor, (int, float)) and self.slow_factor > 0):
            raise AutoparError(f"Monitoring.slow_factor must be a positive number (measured / predicted step time), "
                               f"got {self.slow_factor!r}")
        if not (isinstance(self.slow_steps, int) and self.slow_steps >= 1):
            raise AutoparError(f"Monitoring.slow_steps must be a positive integer, got {self.slow_steps!r}")


class StepMonitor:
    """Records steps for one compiled model; only rank 0 writes."""

    def __init__(self, cfg: Monitoring, rank: int):
        self.cfg = cfg
        self.rank = rank
        self.dir = Path(cfg.run_dir)
        self._plan = None
        self._slow = 0

    def _start(self, plan, world_size: int) -> None:
        from autopar.runtime.launch import software_versions

        self._plan = plan
        if self.rank != 0:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "plan.json").write_text(plan.to_json())
        run = {"fingerprint": plan.fingerprint, "mesh": plan.mesh, "world_size": world_size,
               "cluster": json.loads(plan.cluster_json), "versions": software_versions(), "argv": list(sys.argv)}
        (self.dir / "run.json").write_text(json.dumps(run, indent=1, sort_keys=True, default=str))

    def record(self, plan, world_size: int, step: int, wall_s: float, loss: float, inputs: tuple,
               peak_bytes: int | None) -> None:
        if self._plan is not plan:
            self._start(plan, world_size)
        predicted = plan.predicted.step_time_s
        ratio = wall_s / predicted if predicted > 0 else None
        first = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
        samples = int(first.shape[0]) if first is not None and first.dim() else None
        tokens = int(first.numel()) if first is not None and not first.is_floating_point() else None
        line = {
            "step": step, "wall_s": wall_s, "predicted_s": predicted, "ratio": ratio, "loss": loss,
            "samples_per_s": samples / wall_s if samples and wall_s > 0 else None,
            "tokens_per_s": tokens / wall_s if tokens and wall_s > 0 else None,
            # the plan's MFU is model FLOPs / (predicted step x devices x peak): scaled to the wall time
            "mfu": plan.predicted.mfu * predicted / wall_s if wall_s > 0 else None,
            "peak_bytes": peak_bytes, "predicted_peak_bytes": plan.predicted.peak_memory_bytes,
        }
        self._check_slow(step, ratio)
        if self.rank == 0:
            with open(self.dir / STEPS_FILE, "a") as f:
                f.write(json.dumps(line) + "\n")

    def _check_slow(self, step: int, ratio: float | None) -> None:
        self._slow = self._slow + 1 if ratio is not None and ratio > self.cfg.slow_factor else 0
        if self._slow == self.cfg.slow_steps:
            warnings.warn(
                f"autopar: steps {step - self._slow + 1}..{step} each ran more than {self.cfg.slow_factor:g}x the "
                f"predicted {self._plan.predicted.step_time_s * 1e3:.3f} ms (last {ratio:.1f}x). The cost model is "
                "uncalibrated for this machine, or something outside the plan (data loading, other processes) takes "
                "the time; ParallelModel.measure_step splits a step by memory and collective bytes",
                SlowStepWarning, stacklevel=4)


def read_steps(run_dir: str | os.PathLike) -> list[dict]:
    """The step records of a monitored run (``steps.jsonl``), in order."""
    path = Path(run_dir) / STEPS_FILE
    if not path.is_file():
        raise AutoparError(f"{run_dir} holds no {STEPS_FILE}: it is written by a run compiled with "
                           "monitor=autopar.Monitoring(run_dir)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _fmt(v, scale: float = 1.0, spec: str = ".3f") -> str:
    return "-" if v is None else format(v * scale, spec)


def report_run(run_dir: str | os.PathLike, png: bool = True) -> str:
    """The run's steps as a text table (and ``step_time.png`` beside them when ``png`` and
    matplotlib is installed); returns the text."""
    steps = read_steps(run_dir)
    rows = [f"{'step':>5} {'measured ms':>12} {'predicted ms':>13} {'ratio':>7} {'loss':>10} {'tokens/s':>10} {'MFU %':>7}"]
    for s in steps:
        rows.append(f"{s['step']:>5} {_fmt(s['wall_s'], 1e3):>12} {_fmt(s['predicted_s'], 1e3):>13} "
                    f"{_fmt(s['ratio'], 1, '.2f'):>7} {_fmt(s['loss'], 1, '.4f'):>10} "
                    f"{_fmt(s.get('tokens_per_s'), 1, ',.0f'):>10} {_fmt(s.get('mfu'), 100, '.2f'):>7}")
    if steps:
        ratios = sorted(s["ratio"] for s in steps if s["ratio"] is not None)
        if ratios:
            rows.append(f"median measured / predicted step time: {ratios[len(ratios) // 2]:.2f} over {len(ratios)} steps")
    if png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            rows.append("(no plot: matplotlib is not installed; pip install matplotlib)")
        else:
            fig, ax = plt.subplots(figsize=(7, 3.5))
            ax.plot([s["step"] for s in steps], [s["wall_s"] * 1e3 for s in steps], "o-", label="measured")
            ax.plot([s["step"] for s in steps], [s["predicted_s"] * 1e3 for s in steps], "--", label="predicted")
            ax.set_xlabel("step")
            ax.set_ylabel("step time (ms)")
            ax.legend()
            fig.tight_layout()
            out = Path(run_dir) / "step_time.png"
            fig.savefig(out, dpi=100)
            plt.close(fig)
            rows.append(f"wrote {out}")
    return "\n".join(rows)
