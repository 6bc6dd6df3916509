"""Command line: ``autopar plan MODULE:FACTORY --cluster dgx-h100 --nodes 4``, ``autopar demo``,
``autopar run script.py --nproc N``, ``autopar bench [--model gpt|mlp|MODULE:FACTORY] [--nproc 4]``,
``autopar calibrate [--nproc 4] [--out PATH] [--backend gloo|nccl]``.

``FACTORY`` is a callable in ``MODULE`` returning ``(model, example_inputs)`` or
``(model, example_inputs, loss_fn, example_target)``; build the model on the meta device to plan
big shapes without allocating them.
"""
from __future__ import annotations

import argparse
import os
import sys

from autopar.factory import call_factory, load_factory

__all__ = ["main"]


def _cmd_plan(args) -> int:
    import autopar
    from autopar.errors import ClusterSpecError, ConstraintError

    # flags that would be ignored, and an output path that cannot be written, are refused before planning
    if args.cluster != "local" and args.nproc is not None:
        raise ClusterSpecError(f"--nproc applies to --cluster local; a {args.cluster} cluster is sized with --nodes N")
    if args.cluster == "local" and args.nodes != 1:
        raise ClusterSpecError("--nodes applies to preset clusters; size --cluster local with --nproc N")
    if args.output:
        folder = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ConstraintError(f"--output {args.output!r}: cannot write there (folder {folder!r} does not exist or is "
                                  "not writable); create it or choose another path")
    model, inputs, loss_fn, target = call_factory(args.factory)
    if args.cluster == "local":
        cluster = autopar.Cluster.local(4 if args.nproc is None else args.nproc)
    else:
        cluster = autopar.Cluster.preset(args.cluster, nodes=args.nodes)
    constraints = autopar.Constraints(dp=args.dp, tp=args.tp, zero=args.zero, pp=args.pp, schedule=args.schedule,
                                      microbatches=args.microbatches,
                                      recompute={None: None, "on": True, "off": False}[args.recompute])
    plan = autopar.plan(model, cluster, inputs, loss_fn=loss_fn, example_target=target, precision=args.precision,
                        optimizer=args.optimizer, constraints=constraints, verbose=args.verbose)
    print(plan.summary())
    if args.output:
        with open(args.output, "w") as f:
            f.write(plan.to_json())
        print(f"\nplan written to {args.output}")
    if args.draw:
        plan.draw(args.draw)
        print(f"\ntimeline written to {args.draw}")
    if args.explain is not None:
        try:
            text = plan.explain(args.explain)
        except KeyError as exc:  # the module path names nothing in the model
            raise ConstraintError(f"--explain {args.explain!r}: {exc.args[0] if exc.args else exc}") from None
        print()
        print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autopar", description="Automatic parallelization for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan a model on a cluster and print the summary")
    p.add_argument("factory", help="MODULE:FACTORY returning (model, example_inputs[, loss_fn, example_target])")
    p.add_argument("--cluster", default="dgx-h100", help="preset name (dgx-a100, dgx-h100, dgx-h200) or 'local'")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--nproc", type=int, default=None, help="processes for --cluster local")
    p.add_argument("--precision", default="bf16-mixed", choices=["fp32", "bf16-mixed"])
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--dp", type=int)
    p.add_argument("--tp", type=int)
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3])
    p.add_argument("--pp", type=int, help="pipeline stages (1: no pipeline; default: the planner weighs them on several nodes)")
    p.add_argument("--schedule", help="pipeline schedule: 1f1b, gpipe, interleaved-1f1b, zero-bubble, zbv, dualpipev")
    p.add_argument("--microbatches", type=int)
    p.add_argument("--draw", metavar="PNG", help="also write a pipeline plan's predicted timeline here")
    p.add_argument("--recompute", choices=["on", "off"])
    p.add_argument("--explain", metavar="MODULE_PATH", help="also explain the choices for this module")
    p.add_argument("--output", "-o", help="write the plan JSON here")
    p.add_argument("--verbose", "-v", action="store_true")
    p.set_defaults(func=_cmd_plan)
    d = sub.add_parser("demo", help="plan the example GPT for 4 local processes and print the plan")
    d.add_argument("--nproc", type=int, default=4)
    d.set_defaults(func=_cmd_demo)
    r = sub.add_parser("run", help="run a training script on N local processes (torchrun); "
                                   "arguments autopar does not know go to the script")
    r.add_argument("script")
    r.add_argument("--nproc", type=int, default=4)
    r.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                   help="restart every worker this many times after one fails (default %(default)s); a script compiled "
                        "with checkpoint=autopar.Checkpointing(root) resumes from its newest checkpoint")
    r.set_defaults(func=_cmd_run)
    rep = sub.add_parser("report", help="print a monitored run's steps (measured vs predicted) and plot them "
                                        "(a run compiled with monitor=autopar.Monitoring(RUN_DIR))")
    rep.add_argument("run_dir")
    rep.add_argument("--no-plot", action="store_true", help="the table only")
    rep.set_defaults(func=_cmd_report)
    rp = sub.add_parser("replay", help="plan again from a recorded plan (a plan JSON file or a monitored run's folder) "
                                       "and say whether the same plan comes out, byte for byte")
    rp.add_argument("record")
    rp.add_argument("factory", help="MODULE:FACTORY returning (model, example_inputs[, loss_fn, example_target])")
    rp.set_defaults(func=_cmd_replay)
    b = sub.add_parser("bench", help="time autopar's plan beside naive data parallelism, DDP, FSDP2 and hand tensor "
                                     "parallelism on N local processes, and print one table")
    b.add_argument("--model", default=None, help="gpt (the example GPT, default), mlp (parameter-heavy) or "
                                                 "MODULE:FACTORY returning (model, example_inputs, loss_fn, example_target)")
    b.add_argument("--nproc", type=int, default=4)
    b.add_argument("--steps", type=int, default=60, help="timed steps per setup (default %(default)s)")
    b.add_argument("--memory-limited", action="store_true",
                   help="give each device too little memory for a whole replica (default model: mlp): naive data "
                        "parallelism is refused, autopar plans under the limit")
    b.add_argument("--memory", type=float, metavar="MIB", help="the per-device memory limit in MiB (implies "
                   "--memory-limited; default: a fraction of what a whole replica's training state needs)")
    b.add_argument("--also", action="append", default=[], metavar="K=V,...",
                   help="also time autopar with its plan forced by these constraints (e.g. dp=4,tp=1,zero=0); repeatable")
    b.set_defaults(func=_cmd_bench)
    c = sub.add_parser("calibrate", help="measure this machine's compute and collectives on N local gloo processes (or "
                                         "N GPUs over NCCL) and write the cluster spec Cluster.local(N) uses from then on")
    c.add_argument("--nproc", type=int, default=4)
    c.add_argument("--out", default=None, help="where to write the spec JSON (default: the file Cluster.local(N) reads, "
                                              "$AUTOPAR_CALIBRATION_DIR/local-N.json or ~/.cache/autopar/calibration)")
    c.add_argument("--quick", action="store_true", help="the smallest grids (a few seconds; for tests)")
    c.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="gloo: N CPU processes; nccl: N GPUs, one per process, written to local-cuda-N.json for "
                        "Cluster.from_json (default: nccl where CUDA shows N GPUs, else gloo)")
    c.add_argument("--allow-noisy", action="store_true",
                   help="write the spec even where the machine's speed moved while it was measured (refused by "
                        "default after two tries: other work on its cores)")
    c.set_defaults(func=_cmd_calibrate)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "run":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.script_args = extra
    from autopar.errors import AutoparError

    try:
        return args.func(args)
    except AutoparError as exc:
        print(f"autopar: error: {exc}", file=sys.stderr)
        return 2


# ``autopar run`` restarts failed workers (torchrun's --max-restarts): with Checkpointing a run
# resumes by itself; a script that keeps failing stops after this many tries
DEFAULT_MAX_RESTARTS = 3


def _cmd_replay(args) -> int:
    from autopar.replay import read_record, replay

    record = read_record(args.record)
    model, inputs, loss_fn, target = call_factory(args.factory)
    result = replay(record, model, inputs, loss_fn=loss_fn, example_target=target)
    print(result)
    return 0 if result.identical else 1


def _cmd_report(args) -> int:
    from autopar.runtime.monitor import report_run

    print(report_run(args.run_dir, png=not args.no_plot))
    return 0


def _check_nproc(nproc: int) -> None:
    from autopar.errors import ClusterSpecError

    if nproc < 1:
        raise ClusterSpecError(f"--nproc must be at least 1 (the number of local processes to launch), got {nproc}")


def _cmd_demo(args) -> int:
    """Plan and train the example GPT on ``--nproc`` local CPU processes under torchrun/gloo."""
    from autopar.runtime.launch import run_script

    _check_nproc(args.nproc)
    print(f"autopar demo: torchrun --nproc-per-node {args.nproc} -m examples.demo", flush=True)
    return run_script("examples.demo", args.nproc, [], module=True)


def _cmd_bench(args) -> int:
    """Run ``autopar.bench`` on ``--nproc`` local gloo processes and print its table."""
    from autopar.bench import BenchSpec, run_bench

    _check_nproc(args.nproc)
    limited = args.memory_limited or args.memory is not None
    model = args.model or ("mlp" if limited else "gpt")
    if ":" in model:
        load_factory(model)  # a bad MODULE:FACTORY is said here, not in every worker
    elif model not in ("gpt", "mlp"):
        raise SystemExit(f"autopar: --model is gpt, mlp or MODULE:FACTORY, got {model!r}")
    spec = BenchSpec(model=model, steps=args.steps, memory_limited=limited, also=tuple(args.also),
                     memory_bytes=int(args.memory * 2**20) if args.memory is not None else None)
    print(f"autopar bench: {args.nproc} gloo processes, model {model}{', memory-limited' if limited else ''} ...",
          flush=True)
    table, _ = run_bench(spec, args.nproc)
    print(table)
    return 0


def _cmd_calibrate(args) -> int:
    """Run ``autopar.calibration.calibrate`` and print what it fitted."""
    import time

    from autopar.calibration import calibrate, calibration_backend

    _check_nproc(args.nproc)
    backend = calibration_backend(args.nproc, args.backend)
    what = "gloo processes" if backend == "gloo" else "GPUs over NCCL, one per process"
    print(f"autopar calibrate: measuring {args.nproc} {what} ...", flush=True)
    t0 = time.perf_counter()
    cluster, path = calibrate(args.nproc, out=args.out, quick=args.quick, backend=backend,
                              allow_noisy=args.allow_noisy)
    print("\n".join(cluster.sources))
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s", flush=True)
    if cluster.device_type != "cpu":
        print(f"plan with it: autopar.Cluster.from_json(open({str(path)!r}).read())", flush=True)
    return 0


def _cmd_run(args) -> int:
    from autopar.errors import AutoparError
    from autopar.runtime.launch import run_script

    _check_nproc(args.nproc)
    if not os.path.isfile(args.script):
        raise AutoparError(f"no training script {args.script!r} (looked in {os.getcwd()!r}); pass the path of a Python file")
    if args.max_restarts < 0:
        raise AutoparError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    return run_script(args.script, args.nproc, args.script_args, max_restarts=args.max_restarts)


if __name__ == "__main__":
    sys.exit(main())
