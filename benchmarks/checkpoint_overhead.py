"""What checkpoints cost: training with a save every N steps vs without, resume time, and re-planning
after losing half the processes.

    python benchmarks/checkpoint_overhead.py [--nproc 4] [--every 10] [--rounds 3] [--layers 4] [--embd 256]
                                             [--batch 16] [--seq 64] [--saves 3]

One launch of ``--nproc`` processes trains the example GPT (AdamW, the free plan) in alternating
phases of ``--saves`` x ``--every`` steps: without saving, with an asynchronous save every ``--every``
steps (as ``Checkpointing(every=N)`` does: each save waits for the previous one; the phase's
last save is waited for inside the phase), and with blocking saves; ``--rounds`` times. It prints
the median step time of each kind and the overhead as a share of step time (goal: <= 5% at a
save every 10 steps, asynchronous). Then a fresh launch on the same processes
resumes from the last checkpoint (compile + load), and one on half the processes re-plans and
loads it resharded; their times are printed next to a compile without a checkpoint.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def _setup(layers: int, embd: int, root: str | None, batch: int = 16, seq: int = 64):
    import autopar
    from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=layers, n_embd=embd, n_head=max(4, embd // 64), block_size=seq)
    batches = [example_batch(cfg, batch, seed=s) for s in range(4)]
    x, t = batches[0]
    t0 = time.perf_counter()
    pm = autopar.compile(GPT(cfg), autopar.Cluster.local(), (x,), example_target=t, loss_fn=gpt_loss,
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                         checkpoint=autopar.Checkpointing(root, keep=2) if root else None)
    return pm, batches, time.perf_counter() - t0


def _phase(pm, batches, steps: int, every: int, save: str | None, root: str) -> float:
    """Seconds per step over ``steps`` steps, saving after every ``every``-th (``save``: None,
    "async" or "blocking"), as ``Checkpointing(every=...)`` does: an asynchronous save waits for the
    previous one; the phase ends when its last save is complete (counted in the phase)."""
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        x, t = batches[pm.step % len(batches)]
        pm.train_step(x, target=t)
        if save and i % every == 0:
            pm.save(root, asynchronous=save == "async")
    pm.wait_saved()
    dist.barrier()
    return (time.perf_counter() - t0) / steps


def train_worker(root: str, layers: int, embd: int, every: int, rounds: int, batch: int, seq: int, saves: int) -> dict:
    pm, batches, _ = _setup(layers, embd, None, batch, seq)
    _phase(pm, batches, 3, every, None, root)  # warm-up
    out = {"plain": [], "async": [], "blocking": []}
    for _ in range(rounds):  # the kinds interleaved, to share the machine's noise
        for kind in out:
            out[kind].append(_phase(pm, batches, saves * every, every, None if kind == "plain" else kind, root))
    out.update(mesh=pm.plan.mesh, step=pm.step)
    pm.close()
    return out


def resume_worker(root: str, layers: int, embd: int, batch: int, seq: int) -> dict:
    t0 = time.perf_counter()
    pm, _, _ = _setup(layers, embd, root, batch, seq)
    total = time.perf_counter() - t0
    out = {"compile_and_load_s": total, "step": pm.step, "mesh": pm.plan.mesh,
           "changes": pm.resumed.changes if pm.resumed else ()}
    pm.close()
    return out


def plain_compile_worker(layers: int, embd: int, batch: int, seq: int) -> float:
    pm, _, compile_s = _setup(layers, embd, None, batch, seq)
    pm.close()
    return compile_s


def main() -> None:
    import autopar

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--saves", type=int, default=3, help="saves per measured phase (phases of saves x every steps)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="autopar-ckpt-bench-")
    try:
        r = autopar.launch(train_worker, args.nproc, root, args.layers, args.embd, args.every, args.rounds, args.batch,
                           args.seq, args.saves, timeout_s=3600)[0]
        plain, asy, blk = (statistics.median(r[k]) for k in ("plain", "async", "blocking"))
        from autopar.runtime.checkpoint_files import complete_steps, step_dir

        newest = step_dir(root, complete_steps(root)[-1])
        size = sum(f.stat().st_size for f in newest.iterdir())
        print(f"GPT {args.layers} layers x {args.embd}, {args.batch} x {args.seq} tokens per step, {args.nproc} processes, "
              f"plan {r['mesh']}; one checkpoint ~{size / 2**20:.1f} MiB; phases of {args.saves * args.every} steps, "
              f"{args.rounds} rounds (medians)")
        print(f"  step without saving          {plain * 1e3:8.1f} ms")
        print(f"  save every {args.every}, asynchronous  {asy * 1e3:8.1f} ms  overhead {100 * (asy / plain - 1):+.1f}% "
              f"of step time (goal <= 5%)")
        print(f"  save every {args.every}, blocking      {blk * 1e3:8.1f} ms  overhead {100 * (blk / plain - 1):+.1f}%")
        shape = (args.layers, args.embd, args.batch, args.seq)
        base = autopar.launch(plain_compile_worker, args.nproc, *shape, timeout_s=900)[0]
        same = autopar.launch(resume_worker, args.nproc, root, *shape, timeout_s=900)[0]
        half = autopar.launch(resume_worker, max(1, args.nproc // 2), root, *shape, timeout_s=900)[0]
        print(f"  compile without a checkpoint {base:8.2f} s")
        print(f"  resume on {args.nproc} processes      {same['compile_and_load_s']:8.2f} s  (compile + load of step "
              f"{same['step']}, plan {same['mesh']})")
        print(f"  resume on {max(1, args.nproc // 2)} processes      {half['compile_and_load_s']:8.2f} s  (re-plan + "
              f"resharded load: {'; '.join(half['changes'])})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
