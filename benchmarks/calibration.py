"""How well the calibrated cost model predicts step time: plans measured beside their prediction.

    python benchmarks/calibration.py [--calibrate] [--nproc 2 4] [--seed S [--scored N]] [--steps 16] [--seconds 3]
                                     [--shared] [--only PLAN ...] [--json OUT]

``--calibrate`` first runs ``autopar calibrate`` for each process count (its spec is what
``Cluster.local(n)`` then plans with). Two sets of plans, reported apart:

* the **fit set** (``CONFIGS``: the example GPT and the parameter-heavy MLP of ``autopar bench``:
  the free plan and forced alternatives: data, tensor, 2-D, ZeRO and pipeline plans). The
  calibration probes and the cost model's terms were developed against these plans, change after
  change: their error is a fit, not a prediction;
* with ``--seed S``, the **scored set**: ``--scored N`` configurations (default 20) per process
  count drawn from the seed by ``benchmarks/scored_set.py`` (GPT, Llama with grouped-query
  attention, wide MLP, CNN and MoE models of drawn sizes under drawn plan constraints). Nothing is
  fitted on it: ``autopar calibrate`` fits on its own probes only (``autopar.calibration`` reads
  neither this file nor ``scored_set.py``), and no constant may be tuned on its results.

Each configuration is compiled in its own processes, warmed up, and timed for ``--steps`` steps
back to back, as a training run has it. ``--shared``: one launch per process count and set
compiles every configuration and times them in interleaved rounds (``bench.time_interleaved``;
collective-heavy plans measured 20-30% faster there than alone). Printed, per set: per plan,
predicted and measured step time (the slowest rank's median) and the signed error
(predicted / measured - 1: negative is under-predicted); the median |error| and Kendall's tau of
predicted vs measured order; and the mean signed error per plan kind (free, dp, tp, dpxtp, zero,
pp), per model family and per (kind, family), so that systematic under- or over-prediction shows.
A scored configuration that fails to compile or run is listed as failed, never dropped silently.
Issue 13's goals (fit set): median error at most 10%, tau at least 0.8; issue 44's (scored set):
median error at most 10%, tau at least 0.85, no plan family off by more than 15% on average.
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


def _kind(constraints: dict) -> str:
    """The plan kind a fit-set configuration's constraints force (``scored_set``'s kinds, ZeRO
    stages as ``zeroK``; ``pp`` for pipelines)."""
    if constraints.get("pp", 1) > 1:
        return "pp"
    if constraints.get("zero"):
        return f"zero{constraints['zero']}"
    dp, tp = constraints.get("dp", 1), constraints.get("tp", 1)
    return "dpxtp" if dp > 1 and tp > 1 else "tp" if tp > 1 else "dp" if dp > 1 else "free"


def _config(config):
    """(label, set, family, kind, constraints, maker) of a fit-set ``(model, constraints)`` pair or
    a ``ScoredPlan``; ``maker()`` gives (model, example_inputs, loss_fn, target)."""
    if isinstance(config, tuple):
        from autopar.bench import load_bench_model

        name, constraints = config
        return (_label(name, constraints), "fit", name, _kind(constraints), constraints,
                functools.partial(load_bench_model, name))
    return config.label, "scored", config.family, config.kind, config.constraints, config.build


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
    """One rank: compile each of ``configs`` (fit-set pairs or ``ScoredPlan``s; default: the fit
    set for this world size), time them interleaved (one configuration: its steps back to back, as
    a training run, for at least ``steps`` steps and ``min_seconds``)."""
    import torch
    import torch.distributed as dist

    import autopar
    from autopar.bench import _adamw, time_interleaved
    from autopar.testing.baselines import make_replicas_equal
    from autopar.runtime.launch import init_distributed

    world = int(os.environ["WORLD_SIZE"])
    init_distributed("gloo", world)
    cluster = autopar.Cluster.local(world)
    made = {}
    models, timed, about = {}, {}, {}
    for config in configs or CONFIGS[world]:
        label, which, family, kind, constraints, maker = _config(config)
        key = (which, family) if which == "fit" else label
        if key not in made:
            torch.manual_seed(0)
            made[key] = maker()
            make_replicas_equal(made[key][0])
        model, inputs, loss_fn, target = made[key]
        pm = autopar.compile(copy.deepcopy(model), cluster, inputs, loss_fn=loss_fn, example_target=target,
                             optimizer=functools.partial(_adamw, lr=1e-3),
                             constraints=autopar.Constraints(**constraints))
        models[label] = pm
        about[label] = {"set": which, "model": family, "kind": kind}
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
        rows.append({"plan": label, "nproc": world, **about[label],
                     "mesh": dict(plan.mesh), "summary": [ln for ln in plan.summary().splitlines()
                                                          if ln.startswith(("mesh ", "parameters:", "pipeline:"))],
                     "predicted_s": plan.predicted.step_time_s, "predicted_compute_s": plan.predicted.compute_s,
                     "predicted_comm_s": plan.predicted.blocking_comm_s + plan.predicted.exposed_comm_s,
                     "measured_s": max(g[label] for g in gathered)})
        pm.close()
    return rows


def _coarse(kind: str) -> str:
    """zero1/zero2/zero3 -> zero: the plan families the signed errors are grouped by."""
    return "zero" if kind.startswith("zero") else kind


def _scores(rows: list[dict]) -> str:
    """median |error|, mean |error| and Kendall's tau of ``rows`` (at least one)."""
    from scipy.stats import kendalltau

    from autopar.calibration.fit import relative_errors

    p, m = [r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]
    errs = relative_errors(p, m)
    tau = kendalltau(p, m).statistic if len(rows) > 1 else float("nan")
    return (f"median error {statistics.median(errs) * 100:.1f}%, mean error {statistics.fmean(errs) * 100:.1f}%, "
            f"Kendall tau {tau:.2f}")


def summarise_set(rows: list[dict], name: str) -> str:
    """One set's table and scores (pure): per plan the signed error (predicted / measured - 1),
    the set's median |error| and tau over all plans and per process count, and the mean signed
    error per plan kind, per model family and per (kind, family)."""
    done = [r for r in rows if r.get("measured_s") is not None]
    failed = [r for r in rows if r.get("measured_s") is None]
    lines = [f"### {name} set", "",
             "| plan | family | kind | processes | predicted ms | measured ms | measured / predicted | signed error |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in done:
        lines.append(f"| {r['plan']} | {r['model']} | {r['kind']} | {r['nproc']} | {r['predicted_s'] * 1e3:.1f} | "
                     f"{r['measured_s'] * 1e3:.1f} | {r['measured_s'] / r['predicted_s']:.2f} | "
                     f"{(r['predicted_s'] / r['measured_s'] - 1) * 100:+.1f}% |")
    for r in failed:
        lines.append(f"| {r['plan']} | {r['model']} | {r['kind']} | {r['nproc']} | failed | failed | | "
                     f"{r.get('error', '')[:120]} |")
    lines.append("")
    if not done:
        return "\n".join(lines + [f"{name} set: no plan measured ({len(failed)} failed)"])
    lines.append(f"{name} set, {len(done)} plans" + (f" ({len(failed)} failed)" if failed else "") + f": {_scores(done)}")
    for n in sorted({r["nproc"] for r in done}):
        rs = [r for r in done if r["nproc"] == n]
        lines.append(f"  on {n} processes ({len(rs)} plans): {_scores(rs)}")
    if name == "fit":
        for model in sorted({r["model"] for r in done}):
            for n in sorted({r["nproc"] for r in done}):
                rs = [r for r in done if r["model"] == model and r["nproc"] == n]
                if rs:
                    lines.append(f"  {model} on {n} processes ({len(rs)} plans): {_scores(rs)}")
    signed = lambda rs: statistics.fmean(r["predicted_s"] / r["measured_s"] - 1 for r in rs) * 100  # noqa: E731
    for title, key in (("plan kind", lambda r: _coarse(r["kind"])), ("model family", lambda r: r["model"]),
                       ("kind x family", lambda r: f"{_coarse(r['kind'])} x {r['model']}")):
        groups: dict = {}
        for r in done:
            groups.setdefault(key(r), []).append(r)
        lines.append(f"  mean signed error per {title}: "
                     + ", ".join(f"{k} {signed(rs):+.0f}% ({len(rs)})" for k, rs in sorted(groups.items())))
    return "\n".join(lines)


def summarise(rows: list[dict]) -> str:
    """The fit set's and the scored set's tables and scores, apart (pure)."""
    sets = [name for name in ("fit", "scored") if any(r.get("set", "fit") == name for r in rows)]
    return "\n\n".join(summarise_set([r for r in rows if r.get("set", "fit") == name], name) for name in sets)


def _run(launch, n: int, configs: list, args) -> list[dict]:
    """Time ``configs`` on ``n`` processes (each alone, or together with ``--shared``); a scored
    configuration that fails is a row with ``measured_s`` None and the error."""
    if args.shared:
        return launch(worker, n, args.steps, configs, timeout_s=3600)[0] if configs else []
    rows = []
    for config in configs:
        try:
            rows += launch(worker, n, args.steps, [config], args.seconds, timeout_s=900)[0]
        except RuntimeError as e:
            label, which, family, kind, _, _ = _config(config)
            if which == "fit":
                raise
            print(f"scored plan {label!r} failed: {e}", flush=True)
            rows.append({"plan": label, "nproc": n, "set": which, "model": family, "kind": kind,
                         "measured_s": None, "error": str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrate", action="store_true", help="run autopar calibrate for each process count first")
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seed", type=int, default=None,
                    help="also time the scored set drawn from this seed (benchmarks/scored_set.py)")
    ap.add_argument("--scored", type=int, default=20, help="scored configurations per process count (with --seed)")
    ap.add_argument("--no-fit", action="store_true", help="time the scored set only")
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
    if args.no_fit and args.seed is None:
        ap.error("--no-fit leaves nothing to time without --seed")
    if args.scored < 1:
        ap.error(f"--scored must be at least 1, got {args.scored}")
    from autopar.calibration import calibrate
    from autopar.runtime.launch import launch
    from benchmarks.scored_set import scored_set

    sets = {n: ([] if args.no_fit else CONFIGS.get(n, []))
            + (list(scored_set(args.seed, args.scored, n)) if args.seed is not None else []) for n in args.nproc}
    if args.only:
        known = {_config(c)[0] for cs in sets.values() for c in cs}
        unknown = sorted(set(args.only) - known)
        if unknown:
            ap.error(f"--only: no plan named {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}")
    if args.seed is not None:
        print(f"scored set: seed {args.seed}, {args.scored} configurations per process count "
              "(benchmarks/scored_set.py; nothing is fitted on it)", flush=True)
    rows = []
    for n in args.nproc:
        if args.calibrate:
            cluster, path = calibrate(n)
            print(f"calibrated {n} processes -> {path}\n  " + "\n  ".join(cluster.sources), flush=True)
        configs = [c for c in sets[n] if not args.only or _config(c)[0] in args.only]
        rows += _run(launch, n, [c for c in configs if isinstance(c, tuple)], args)
        rows += _run(launch, n, [c for c in configs if not isinstance(c, tuple)], args)
        print(summarise(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seed": args.seed, "scored": args.scored if args.seed is not None else 0, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
