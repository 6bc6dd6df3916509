"""Per-step monitoring: every ``train_step``'s measured time beside the plan's prediction.

``compile(..., monitor=autopar.Monitoring(run_dir))``: rank 0 writes ``run_dir/run.json`` (what
ran: plan fingerprint, mesh, cluster spec, world size, package versions, command line) and
``run_dir/plan.json`` once, then appends one JSON line per step to ``run_dir/steps.jsonl``:
the step, measured wall time and the predicted step time, their ratio, the loss, samples and
tokens per second, MFU (the plan's model FLOPs over wall time x devices x peak FLOP/s) and the
step's peak memory beside the predicted peak: on CUDA every step (the allocator's peak); elsewhere
every ``memory_every``-th step, run under the storage tracker (``memory_tracker``: live tensor
storages by category, as ``ParallelModel.measure_step``), which slows that step (its line says
``memory_tracked``; it does not count towards the slow-step warning). A step that ran
``slow_factor`` times its prediction ``slow_steps`` times in a row raises a ``SlowStepWarning``
(once per streak).

Each step also records its collectives: bytes and seconds blocked per kind (``CommStats``: time
inside a collective or its ``wait()``, the communication not overlapped), the rest of the step as
compute, beside the plan's predictions; the slow-step warning names the part furthest above its
prediction (``largest_contributor``).

``autopar report RUN_DIR`` (``report_run``) prints the steps and the collectives as tables and,
with matplotlib, draws ``step_time.png`` (measured vs predicted, blocked communication),
``comm_breakdown.png`` (per collective kind: bytes and time, measured vs predicted) and, where
the steps measured it, ``memory.png`` (peak vs predicted).
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

__all__ = ["Monitoring", "SlowStepWarning", "MonitoringWriteWarning", "StepMonitor", "read_steps", "report_run"]

STEPS_FILE = "steps.jsonl"


class MonitoringWriteWarning(UserWarning):
    """Rank 0 could not write a monitoring record mid-run: monitoring stops, training goes on."""


class SlowStepWarning(UserWarning):
    """Measured steps ran far slower than the plan predicted, several steps in a row."""


@dataclass(frozen=True)
class Monitoring:
    """Where and how ``train_step`` records its steps (module docstring)."""

    run_dir: str | os.PathLike
    slow_factor: float = 3.0
    slow_steps: int = 5
    memory_every: int = 10  # off CUDA: measure the peak memory of every n-th step (0: never)

    def __post_init__(self):
        if not str(self.run_dir):
            raise AutoparError("Monitoring(run_dir=...) needs a folder to write the run's steps into")
        if not (isinstance(self.slow_factor, (int, float)) and self.slow_factor > 0):
            raise AutoparError(f"Monitoring.slow_factor must be a positive number (measured / predicted step time), "
                               f"got {self.slow_factor!r}")
        if not (isinstance(self.slow_steps, int) and self.slow_steps >= 1):
            raise AutoparError(f"Monitoring.slow_steps must be a positive integer, got {self.slow_steps!r}")
        if not (isinstance(self.memory_every, int) and self.memory_every >= 0):
            raise AutoparError(f"Monitoring.memory_every must be an integer >= 0 (measure every n-th step's memory; "
                               f"0: never), got {self.memory_every!r}")


class StepMonitor:
    """Records steps for one compiled model; only rank 0 writes."""

    def __init__(self, cfg: Monitoring, rank: int):
        """At compile, on every rank: the run folder is checked writable first (rank 0 writes it;
        every rank refuses it alike, ``runtime.writable``)."""
        from autopar.runtime.writable import check_writable

        check_writable(cfg.run_dir, "monitoring folder", every_rank_writes=False)
        self.cfg = cfg
        self.rank = rank
        self.dir = Path(cfg.run_dir)
        self._plan = None
        self._slow = 0
        self._write_failure: str | None = None  # rank 0's first failed write: monitoring stops writing

    def _write(self, name: str, text: str, mode: str = "w") -> None:
        """Rank 0 writes ``text`` into ``run_dir/name``. A failure mid-run (a full disk, a folder
        removed) stops the monitor's writes with a ``MonitoringWriteWarning`` naming the path and
        the error, and training goes on: rank 0 alone writes, so raising here would leave the other
        ranks waiting in the next step's collectives (the folder was checked writable at compile)."""
        if self._write_failure is not None:
            return
        path = self.dir / name
        try:
            with open(path, mode) as f:
                f.write(text)
        except OSError as exc:
            self._write_failure = f"{path}: {exc.strerror or exc}"
            warnings.warn(f"autopar: monitoring stopped writing: {self._write_failure}; training goes on without "
                          f"monitoring records; free the space or fix the folder, and monitor the next run into a "
                          f"writable Monitoring(run_dir=...)", MonitoringWriteWarning, stacklevel=3)

    def _start(self, plan, world_size: int) -> None:
        from autopar.runtime.launch import software_versions

        self._plan = plan
        if self.rank != 0:
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # named by the write below
        self._write("plan.json", plan.to_json())
        # provenance: with plan.json (graph and inputs hash, constraints, decisions), what
        # ``autopar replay RUN_DIR MODULE:FACTORY`` plans again and compares byte for byte
        run = {"fingerprint": plan.fingerprint, "inputs_fingerprint": plan.inputs_fingerprint, "mesh": plan.mesh,
               "world_size": world_size, "cluster": json.loads(plan.cluster_json), "versions": software_versions(),
               "argv": list(sys.argv), "seed": torch.initial_seed()}
        self._write("run.json", json.dumps(run, indent=1, sort_keys=True, default=str))

    def tracks_memory(self, step: int) -> bool:
        """Whether step ``step`` (1-based) runs under the storage tracker (off CUDA). Not the first:
        optimizers create their state in it."""
        every = self.cfg.memory_every
        return bool(every) and step > 1 and step % every == 0

    def record(self, plan, world_size: int, step: int, wall_s: float, loss: float, inputs: tuple,
               peak_bytes: int | None, comm: tuple[dict, dict] | None = None, memory: dict | None = None,
               predicted_comm_bytes: dict | None = None) -> None:
        """``comm``: this step's (bytes, seconds blocked) per collective kind (``CommStats``);
        ``memory``: its peak bytes by category where the storage tracker measured it;
        ``predicted_comm_bytes``: this rank's predicted bytes (default: the plan's)."""
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
        if memory is not None:
            line.update({"memory_tracked": True, "memory_bytes": memory,
                         "predicted_memory_bytes": dict(plan.predicted.memory_bytes)})
        if comm is not None:
            nbytes, seconds = comm
            blocked = sum(seconds.values())
            line.update({
                # blocked in collectives (not overlapped) vs the rest of the step, beside the plan's
                "comm_s": blocked, "compute_s": max(wall_s - blocked, 0.0),
                "predicted_comm_s": plan.predicted.blocking_comm_s + plan.predicted.exposed_comm_s,
                "predicted_compute_s": plan.predicted.compute_s,
                "comm_bytes": nbytes, "predicted_comm_bytes": {k: v for k, v in (
                    predicted_comm_bytes.items() if predicted_comm_bytes is not None else plan.predicted.comm_bytes) if v},
                "comm_s_by_kind": seconds, "predicted_comm_s_by_kind": {k: v for k, v in plan.predicted.comm_s if v},
            })
        self._check_slow(step, ratio, line)
        if self.rank == 0:
            self._write(STEPS_FILE, json.dumps(line) + "\n", mode="a")

    def _check_slow(self, step: int, ratio: float | None, line: dict) -> None:
        if line.get("memory_tracked"):
            return  # the tracker's own time: neither slow nor a break in a streak
        self._slow = self._slow + 1 if ratio is not None and ratio > self.cfg.slow_factor else 0
        if self._slow == self.cfg.slow_steps:
            warnings.warn(
                f"autopar: steps {step - self._slow + 1}..{step} each ran more than {self.cfg.slow_factor:g}x the "
                f"predicted {self._plan.predicted.step_time_s * 1e3:.3f} ms (last {ratio:.1f}x){_contributor(line)}. "
                "The cost model is uncalibrated for this machine, or something outside the plan (data loading, other "
                "processes) takes the time; ParallelModel.measure_step splits a step by memory and collective bytes",
                SlowStepWarning, stacklevel=4)


def largest_contributor(line: dict) -> tuple[str, float, float] | None:
    """(what, measured s, predicted s) of the step part furthest above its prediction: the
    compute (the step less its blocked communication) or one collective kind; None when the
    step's communication was not recorded."""
    if "comm_s" not in line:
        return None
    parts = {"compute": (line["compute_s"], line["predicted_compute_s"])}
    measured, predicted = line["comm_s_by_kind"], line["predicted_comm_s_by_kind"]
    for kind in set(measured) | set(predicted):
        parts[kind] = (measured.get(kind, 0.0), predicted.get(kind, 0.0))
    what = max(parts, key=lambda k: parts[k][0] - parts[k][1])
    return (what,) + parts[what]


def _contributor(line: dict) -> str:
    found = largest_contributor(line)
    if found is None:
        return ""
    what, got, want = found
    part = "compute" if what == "compute" else f"blocked in {what}"
    return f"; the largest excess: {part}, {got * 1e3:.3f} ms measured vs {want * 1e3:.3f} ms predicted"


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
    rows = [f"{'step':>5} {'measured ms':>12} {'predicted ms':>13} {'ratio':>7} {'comm ms':>8} {'pred comm':>9} "
            f"{'loss':>10} {'tokens/s':>10} {'MFU %':>7}"]
    for s in steps:
        rows.append(f"{s['step']:>5} {_fmt(s['wall_s'], 1e3):>12} {_fmt(s['predicted_s'], 1e3):>13} "
                    f"{_fmt(s['ratio'], 1, '.2f'):>7} {_fmt(s.get('comm_s'), 1e3):>8} "
                    f"{_fmt(s.get('predicted_comm_s'), 1e3):>9} {_fmt(s['loss'], 1, '.4f'):>10} "
                    f"{_fmt(s.get('tokens_per_s'), 1, ',.0f'):>10} {_fmt(s.get('mfu'), 100, '.2f'):>7}")
    if steps:
        ratios = sorted(s["ratio"] for s in steps if s["ratio"] is not None)
        if ratios:
            rows.append(f"median measured / predicted step time: {ratios[len(ratios) // 2]:.2f} over {len(ratios)} steps")
        rows += _collective_rows(steps)
        rows += _memory_rows(steps)
    if png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            rows.append("(no plot: matplotlib is not installed; pip install matplotlib)")
        else:
            rows += [f"wrote {out}" for out in _plots(plt, steps, Path(run_dir))]
    return "\n".join(rows)


def _kinds(steps: list[dict]) -> list[str]:
    return sorted({k for s in steps for key in ("comm_bytes", "predicted_comm_bytes") for k in s.get(key, {})})


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _collective_rows(steps: list[dict]) -> list[str]:
    """Per collective kind, over the recorded steps: bytes and seconds blocked beside the plan's."""
    steps = [s for s in steps if "comm_bytes" in s]
    if not steps:
        return []
    rows = [f"{'collective':<16} {'bytes/step':>14} {'predicted':>14} {'blocked ms':>11} {'predicted ms':>13}"]
    for k in _kinds(steps):
        rows.append(f"{k:<16} {_mean([s['comm_bytes'].get(k, 0) for s in steps]):>14,.0f} "
                    f"{_mean([s['predicted_comm_bytes'].get(k, 0) for s in steps]):>14,.0f} "
                    f"{_mean([s['comm_s_by_kind'].get(k, 0.0) for s in steps]) * 1e3:>11.3f} "
                    f"{_mean([s['predicted_comm_s_by_kind'].get(k, 0.0) for s in steps]) * 1e3:>13.3f}")
    last = steps[-1]
    what, got, want = largest_contributor(last)
    rows.append(f"largest excess over the prediction (last step): {what}, {got * 1e3:.3f} ms vs {want * 1e3:.3f} ms "
                "(collectives: time blocked, i.e. not overlapped; predicted: their whole time)")
    return rows


def _memory_rows(steps: list[dict]) -> list[str]:
    """The measured peaks (and categories, where the storage tracker measured them) beside the plan's."""
    measured = [s for s in steps if s.get("peak_bytes")]
    if not measured:
        return []
    last = measured[-1]
    rows = [f"peak memory per device: {last['peak_bytes'] / 2**20:.2f} MiB measured (step {last['step']}) vs "
            f"{last['predicted_peak_bytes'] / 2**20:.2f} MiB predicted ({last['peak_bytes'] / last['predicted_peak_bytes']:.2f}x)"]
    if "memory_bytes" in last:
        want = last.get("predicted_memory_bytes", {})
        rows.append(f"{'category':<16} {'measured MiB':>13} {'predicted MiB':>14}")
        for k, v in last["memory_bytes"].items():
            rows.append(f"{k:<16} {v / 2**20:>13.2f} {want.get(k, 0.0) / 2**20:>14.2f}")
    return rows


def _plots(plt, steps: list[dict], run_dir: Path) -> list[Path]:
    """step_time.png (measured vs predicted, with the blocked communication), and where the steps
    recorded them comm_breakdown.png (per collective kind, measured vs predicted) and memory.png
    (peak per step vs predicted)."""
    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        written.append(run_dir / name)
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)

    def per_step(series: list[tuple[list, str, str]], ylabel: str, name: str) -> None:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for ys, style, label in series:
            ax.plot(x, ys, style, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.legend()
        save(fig, name)

    x = [s["step"] for s in steps]
    lines = [([s["wall_s"] * 1e3 for s in steps], "o-", "measured"),
             ([s["predicted_s"] * 1e3 for s in steps], "--", "predicted")]
    if all("comm_s" in s for s in steps):
        lines.append(([s["comm_s"] * 1e3 for s in steps], "s:", "measured: blocked in collectives"))
    per_step(lines, "step time (ms)", "step_time.png")
    comm = [s for s in steps if "comm_bytes" in s]
    kinds = _kinds(comm)
    if kinds:
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
        pos = range(len(kinds))
        for ax, key, unit, scale in ((left, "bytes", "MiB / step", 2.0**-20), (right, "s_by_kind", "ms / step", 1e3)):
            got = [_mean([s["comm_" + key].get(k, 0) for s in comm]) * scale for k in kinds]
            want = [_mean([s["predicted_comm_" + key].get(k, 0) for s in comm]) * scale for k in kinds]
            ax.bar([p - 0.2 for p in pos], got, 0.4, label="measured" + (" (blocked)" if key != "bytes" else ""))
            ax.bar([p + 0.2 for p in pos], want, 0.4, label="predicted")
            ax.set_xticks(list(pos), kinds, rotation=20)
            ax.set_ylabel(unit)
            ax.legend()
        save(fig, "comm_breakdown.png")
    measured = [s for s in steps if s.get("peak_bytes")]
    if measured:  # every step on CUDA; every memory_every-th elsewhere
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot([s["step"] for s in measured], [s["peak_bytes"] / 2**20 for s in measured], "o-", label="measured peak")
        ax.plot(x, [s["predicted_peak_bytes"] / 2**20 for s in steps], "--", label="predicted peak")
        ax.set_xlabel("step")
        ax.set_ylabel("MiB per device")
        ax.legend()
        save(fig, "memory.png")
    return written
