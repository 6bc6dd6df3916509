"""Consecutive 2-process torchrun launches of a data-parallel training script, beside a process
that burns a CPU: every run must exit 0 (no "terminate called without an active exception" at
interpreter exit, the abort gloo gave when process groups outlived ``destroy_process_group``).

    python benchmarks/torchrun_exit.py [--runs 30] [--nproc 2] [--no-burner] [--close]

``--close``: the script closes its model before ``destroy_process_group`` (by default it does not,
as users' scripts do not; autopar closes open models at exit).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import textwrap
import time

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist, autopar
    from examples.mlp import MLP, example_batch, mlp_loss
    x, t = example_batch()
    pm = autopar.compile(MLP(), autopar.Cluster.local(), (x,), example_target=t, loss_fn=mlp_loss,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), constraints=autopar.Constraints(dp=2))
    losses = [float(pm.train_step(x, target=t)) for _ in range(3)]
    if dist.get_rank() == 0:
        print("LOSSES", losses)
    CLOSE
    dist.barrier()
    dist.destroy_process_group()
""")


def _burn() -> None:
    while True:
        pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--no-burner", action="store_true")
    ap.add_argument("--close", action="store_true")
    a = ap.parse_args()
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as f:
            f.write(SCRIPT.replace("CLOSE", "pm.close()" if a.close else "pass"))
        burner = None if a.no_burner else multiprocessing.Process(target=_burn, daemon=True)
        if burner is not None:
            burner.start()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        failures, t0 = [], time.perf_counter()
        try:
            for i in range(a.runs):
                done = subprocess.run([sys.executable, "-m", "autopar.cli", "run", script, "--nproc", str(a.nproc)],
                                      capture_output=True, text=True, timeout=300, env=env, cwd=root)
                aborted = "terminate called" in done.stderr
                status = "ok" if done.returncode == 0 else f"exit {done.returncode}" + (" (abort at exit)" if aborted else "")
                print(f"run {i + 1:>3}/{a.runs}: {status}", flush=True)
                if done.returncode != 0:
                    failures.append(i + 1)
                    print("\n".join(f"    | {line}" for line in done.stderr.splitlines()[-25:]), flush=True)
        finally:
            if burner is not None:
                burner.terminate()
    print(f"{a.runs - len(failures)}/{a.runs} runs exited 0 ({'with' if not a.no_burner else 'without'} a CPU burner, "
          f"model {'closed by the script' if a.close else 'left open'}; {time.perf_counter() - t0:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
