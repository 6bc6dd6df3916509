"""How well the calibrated cost model predicts step time: plans measured beside their prediction.

    python benchmarks/calibration.py [--calibrate] [--nproc 2 4] [--steps 16] [--seconds 3] [--shared] [--only PLAN ...] [--json OUT]

``--calibrate`` first runs ``autopar calibrate`` for each process count (its spec is what
``Cluster.local(n)`` then plans with). Each configuration below (the example GPT and the
parameter-heavy MLP of ``autopar bench``: the free plan and forced alternatives: data, tensor,
2-D, ZeRO and pipeline plans) is compiled in its own processes, warmed up, and timed for
``--steps`` steps back to back, as a training run has it. ``--shared``: one launch per process
count compiles every configuration and times them in interleaved rounds (``bench.time_interleaved``;
collective-heavy plans measured 20-30% faster there than alone). Printed: per plan, predicted and
measured step time (the slowest rank's median) and the relative error; then the median relative
error and Kendall's tau of predicted vs measured order, over all plans and within each (model,
process count) group. Issue 13's goals: median error at most 10%, tau at least 0.8.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# (model, constraints) per process count: the parity configurations and forced alternatives
CONFIGS = {
    2: [("gpt", {}), ("gpt", {"dp": 2}), ("gpt", {"tp": 2}), ("gpt", {"dp": 2, "zero": 3}), ("gpt", {"pp": 2}),
        ("mlp", {}), ("mlp", {"dp": 2}), ("mlp", {"tp": 2}), ("mlp", {"dp": 2, "zero": 2}), ("mlp", {"pp": 2})],
    4: [("gpt", {}), ("gpt", {"dp": 4}), ("gpt", {"tp": 4}), ("gpt", {"dp": 2, "tp": 2}), ("gpt", {"dp": 4, "zero": 3}),
        ("gpt", {"pp": 2, "dp": 2}),
        ("mlp", {}), ("mlp", {"dp": 4}), ("mlp", {"tp": 4}), ("mlp", {"dp": 2, "tp": 2}), ("mlp", {"dp": 4, "zero": 1}),
        ("mlp", {"dp": 4, "zero": 3}), ("mlp", {"pp": 2, "dp": 2})],
}


def _label(model: str, constraints: dict) -> str:
    return f"{model} " + (",".join(f"{k}={v}" for k, v in constraints.items()) or "free")


def _steps_for(step, steps: int, min_seconds: float) -> int:
    """How many steps to time: ``steps``, or as many as fill ``min_seconds`` at the speed of three
    trial steps (after a warm-up one), the most any rank asks for."""
    import math
    import time

    import torch
    import torch.distributed as dist

    step()
    t0 = time.perf_counter()
    for _ in range(3):
        step()
    want = torch.tensor([max(steps, math.ceil(min_seconds / ((time.perf_counter() - t0) / 3)))])
    dist.all_reduce(want, op=dist.ReduceOp.MAX)
    return int(want)


def worker(steps: int, configs: list | None = None, min_seconds: float = 0.0) -> list[dict]:
    """One rank: compile each of ``configs`` (default: every configuration for this world size),
    time them interleaved (one configuration: its steps back to back, as a training run, for at
    least ``steps`` steps and ``min_seconds``)."""
    import torch
    import torch.distributed as dist

    import autopar
    from autopar.bench import _adamw, load_bench_model, time_interleaved
    from autopar.runtime.baselines import make_replicas_equal
    from autopar.runtime.launch import init_distributed

    world = int(os.environ["WORLD_SIZE"])
    init_distributed("gloo", world)
    cluster = autopar.Cluster.local(world)
    made = {}
    models, timed = {}, {}
    for name, constraints in configs or CONFIGS[world]:
        if name not in made:
            torch.manual_seed(0)
            made[name] = load_bench_model(name)
            make_replicas_equal(made[name][0])
        model, inputs, loss_fn, target = made[name]
        label = _label(name, constraints)
        pm = autopar.compile(copy.deepcopy(model), cluster, inputs, loss_fn=loss_fn, example_target=target,
                             optimizer=functools.partial(_adamw, lr=1e-3),
                             constraints=autopar.Constraints(**constraints))
        models[label] = pm
        timed[label] = (functools.partial(pm.train_step, *inputs, target=target), None)
    if len(timed) == 1 and min_seconds > 0:  # alone: at least min_seconds of steps (every rank the same count)
        steps = _steps_for(next(iter(timed.values()))[0], steps, min_seconds)
    walls, _ = time_interleaved(timed, steps, rounds=3 if len(timed) > 1 else 1, warmup=3)
    mine = {k: statistics.median(v) for k, v in walls.items()}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    rows = []
    for label, pm in models.items():
        plan = pm.plan
        rows.append({"plan": label, "nproc": world, "model": label.split()[0],
                     "mesh": dict(plan.mesh), "summary": [ln for ln in plan.summary().splitlines()
                                                          if ln.startswith(("mesh ", "parameters:", "pipeline:"))],
                     "predicted_s": plan.predicted.step_time_s, "predicted_compute_s": plan.predicted.compute_s,
                     "predicted_comm_s": plan.predicted.blocking_comm_s + plan.predicted.exposed_comm_s,
                     "measured_s": max(g[label] for g in gathered)})
        pm.close()
    return rows


def summarise(rows: list[dict]) -> str:
    """The table and the scores (pure)."""
    from scipy.stats import kendalltau

    from autopar.calibration.fit import relative_errors

    lines = ["| plan | processes | predicted ms | measured ms | measured / predicted | error |",
             "|---|---:|---:|---:|---:|---:|"]
    errs = relative_errors([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    for r, e in zip(rows, errs):
        lines.append(f"| {r['plan']} | {r['nproc']} | {r['predicted_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | "
                     f"{r['measured_s'] / r['predicted_s']:.2f} | {e * 100:.1f}% |")
    tau_all = kendalltau([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]).statistic
    lines += ["", f"{len(rows)} plans: median error {statistics.median(errs) * 100:.1f}%, "
                  f"mean error {statistics.fmean(errs) * 100:.1f}%, Kendall tau (all plans) {tau_all:.2f}"]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["model"], r["nproc"]), []).append(r)
    for (model, n), rs in sorted(groups.items()):
        tau = kendalltau([r["predicted_s"] for r in rs], [r["measured_s"] for r in rs]).statistic
        e = relative_errors([r["predicted_s"] for r in rs], [r["measured_s"] for r in rs])
        lines.append(f"  {model} on {n} processes ({len(rs)} plans): median error {statistics.median(e) * 100:.1f}%, "
                     f"Kendall tau {tau:.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrate", action="store_true", help="run autopar calibrate for each process count first")
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=16, help="timed steps per plan, at least")
    ap.add_argument("--seconds", type=float, default=3.0,
                    help="time each plan for at least this long (alone; not --shared): this machine's speed "
                         "moves from second to second, and 16 steps of a 10 ms plan sample a tenth of one")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--only", nargs="+", default=None, metavar="PLAN",
                    help='time only these plans, as the table names them ("gpt dp=2,tp=2", "mlp free")')
    ap.add_argument("--shared", action="store_true",
                    help="compile every plan of a process count in the same processes and time them interleaved "
                         "(default: each plan in its own processes, as a training run has it)")
    args = ap.parse_args()
    from autopar.calibration import calibrate
    from autopar.runtime.launch import launch

    if args.only:
        known = {_label(*c) for n in args.nproc for c in CONFIGS[n]}
        unknown = sorted(set(args.only) - known)
        if unknown:
            ap.error(f"--only: no plan named {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}")
    rows = []
    for n in args.nproc:
        if args.calibrate:
            cluster, path = calibrate(n)
            print(f"calibrated {n} processes -> {path}", flush=True)
        configs = [c for c in CONFIGS[n] if not args.only or _label(*c) in args.only]
        if args.shared:
            rows += launch(worker, n, args.steps, configs, timeout_s=3600)[0]
        else:
            for config in configs:
                rows += launch(worker, n, args.steps, [config], args.seconds, timeout_s=900)[0]
        print(summarise(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
