"""Pipeline schedules, measured beside their prediction: step time and bubble fraction.

One invocation runs, on this machine's gloo processes:

* the baseline: the whole model in one process (``Constraints(microbatches=m)``, no pipeline),
  the same microbatches one after the other: ``T1``;
* every schedule autopar runs (GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble, ZBV,
  DualPipeV) with
  ``pp`` stages on ``pp`` processes, for each microbatch count: ``Tpp``.

Printed per row: the measured step (median of the timed steps), the plan's predicted step and
their ratio; the speed-up over the one-process baseline; the bubble fraction the plan predicts
and the one measured, ``1 - (T1 / pp) / Tpp`` (the share of the pipelined step not explained by
an even split of the one-process work: idle time in the schedule, plus the sends between
stages and the schedule's own overhead, which the prediction prices apart).

The CPU cost model is uncalibrated (``Cluster.local``), so the absolute ratio measured/predicted
says how far the preset is from this machine; the bubble columns and the ordering of the
schedules are what the schedule models claim. With 2 CPU cores keep ``--pp 2``: more processes
than cores time-share and every stage waits for a core, not for its neighbour.

Usage::

    python benchmarks/pipeline_schedules.py                 # pp=2, microbatches 4 and 8
    python benchmarks/pipeline_schedules.py --steps 8 --microbatches 4,8,16
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")


def _model_and_batch(layers: int, width: int, seq: int, batch: int):
    import torch

    from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=layers, n_embd=width, n_head=4, block_size=seq, vocab_size=512)
    return GPT(cfg), example_batch(cfg, batch, seed=0), gpt_loss


def worker(configs: list[dict], shape: dict, steps: int, warmup: int) -> list[dict]:
    """Compile and time each configuration in this process group (every rank runs the same list)."""
    import torch
    import torch.distributed as dist

    import autopar

    torch.set_num_threads(1)
    out = []
    for kw in configs:
        model, (x, y), loss = _model_and_batch(**shape)
        pm = autopar.compile(model, autopar.Cluster.local(), x, loss_fn=loss, example_target=y,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3), constraints=autopar.Constraints(**kw))
        times = []
        for i in range(warmup + steps):
            if dist.is_initialized():
                dist.barrier()
            t = time.perf_counter()
            pm.train_step(x, target=y)
            if i >= warmup:
                times.append(time.perf_counter() - t)
        out.append(dict(constraints=kw, measured_s=statistics.median(times), predicted_s=pm.plan.predicted.step_time_s,
                        bubble=pm.plan.bubble_fraction, stages=len(pm.plan.stages)))
        pm.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", default="4,8")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import autopar

    shape = dict(layers=args.layers, width=args.width, seq=args.seq, batch=args.batch)
    micro = [int(m) for m in args.microbatches.split(",")]
    t0 = time.perf_counter()
    base = autopar.launch(worker, 1, [dict(microbatches=m) for m in micro], shape, args.steps, args.warmup)[0]
    runs = [dict(pp=args.pp, microbatches=m, schedule=s) for m in micro for s in SCHEDULES]
    piped = autopar.launch(worker, args.pp, runs, shape, args.steps, args.warmup)[0]
    print(f"pipeline schedules: GPT {args.layers} layers x {args.width}, seq {args.seq}, batch {args.batch}, "
          f"pp={args.pp} on {args.pp} gloo processes, {os.cpu_count()} CPUs; median of {args.steps} steps "
          f"after {args.warmup}; {time.perf_counter() - t0:.0f} s in all\n")
    hdr = (f"{'schedule':<18} {'m':>3} {'stages':>6} {'measured ms':>12} {'predicted ms':>13} {'meas/pred':>9} "
           f"{'speed-up vs 1 proc':>18} {'bubble pred':>11} {'bubble meas':>11}")
    print(hdr)
    print("-" * len(hdr))
    one = {r["constraints"]["microbatches"]: r for r in base}
    for m in micro:
        b = one[m]
        print(f"{'1 process':<18} {m:>3} {1:>6} {b['measured_s'] * 1e3:>12.1f} {b['predicted_s'] * 1e3:>13.1f} "
              f"{b['measured_s'] / b['predicted_s']:>9.2f} {1.0:>18.2f} {'-':>11} {'-':>11}")
        for r in piped:
            if r["constraints"]["microbatches"] != m:
                continue
            meas_bubble = 1 - (b["measured_s"] / args.pp) / r["measured_s"]
            print(f"{r['constraints']['schedule']:<18} {m:>3} {r['stages']:>6} {r['measured_s'] * 1e3:>12.1f} "
                  f"{r['predicted_s'] * 1e3:>13.1f} {r['measured_s'] / r['predicted_s']:>9.2f} "
                  f"{b['measured_s'] / r['measured_s']:>18.2f} {r['bubble'] * 100:>10.1f}% {meas_bubble * 100:>10.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
