"""Step time of ``autopar.compile(..., compile=...)`` against the eager program (issue 47 item 5).

    python benchmarks/compiled_step.py [--nproc 4] [--steps 20] [--backends aot_eager,inductor]

On ``--nproc`` gloo processes, for the example GPT (``GPTConfig()``, batch 8) and the example MLP
(``MLP(64, 256, 2)`` at batch 64) under ``dp=2 x tp=2`` (``--mesh``), ``train_step`` with SGD:
the eager program and each compiled backend on the same processes, model and batch. Each mode
is compiled once, warmed up (the first steps compile), then the modes' steps run interleaved
(A, B, C, A, B, C, ...) to share the noise. Prints per model the median step time of each mode,
its ratio to eager (goal: <= 1.0), and the first step's time (compile time included).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import autopar


def _case(name: str):
    torch.manual_seed(0)
    if name == "mlp":
        from examples.mlp import MLP, example_batch, mlp_loss

        return MLP(64, 256, 2), example_batch(64, 64), mlp_loss
    from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss

    cfg = GPTConfig()
    return GPT(cfg), example_batch(cfg, 8), gpt_loss


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.01)


def worker(models, backends, mesh, steps, warmup):
    out = {}
    for name in models:
        modes = {}
        firsts = {}
        for backend in ["eager"] + backends:
            model, (x, t), loss_fn = _case(name)
            pm = autopar.compile(model, autopar.Cluster.local(), (x,), example_target=t, loss_fn=loss_fn, optimizer=_sgd,
                                 constraints=autopar.Constraints(**mesh), check_inputs="never",
                                 compile=False if backend == "eager" else backend)
            t0 = time.perf_counter()
            float(pm.train_step(x, target=t))
            firsts[backend] = time.perf_counter() - t0
            for _ in range(warmup):
                float(pm.train_step(x, target=t))
            modes[backend] = pm
        times = {b: [] for b in modes}
        for _ in range(steps):
            for b, pm in modes.items():
                torch.distributed.barrier()
                t0 = time.perf_counter()
                float(pm.train_step(x, target=t))
                times[b].append(time.perf_counter() - t0)
        for pm in modes.values():
            pm.close()
        out[name] = {b: (statistics.median(v), firsts[b]) for b, v in times.items()}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--models", default="gpt,mlp")
    ap.add_argument("--backends", default="aot_eager,inductor")
    ap.add_argument("--mesh", default="dp=2,tp=2")
    a = ap.parse_args()
    mesh = {k: int(v) for k, v in (p.split("=") for p in a.mesh.split(","))}
    res = autopar.launch(worker, a.nproc, a.models.split(","), a.backends.split(","), mesh, a.steps, a.warmup,
                         timeout_s=900)[0]
    print(f"{a.nproc} gloo processes, {a.mesh}, train_step (SGD), median of {a.steps} interleaved steps (rank 0)")
    print(f"{'model':6} {'mode':10} {'step ms':>9} {'x eager':>8} {'first step s':>13}")
    for name, modes in res.items():
        eager = modes["eager"][0]
        for b, (med, first) in modes.items():
            print(f"{name:6} {b:10} {med * 1e3:9.2f} {med / eager:8.2f} {first:13.1f}")


if __name__ == "__main__":
    main()
