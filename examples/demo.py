"""The README demo: plan the example GPT, train it on N local processes, compare with one device.

Run under torchrun (``autopar demo`` does it): every rank compiles the same plan and trains 20
steps; rank 0 also trains the single-device reference and prints both losses side by side, then
measured vs predicted step time.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist

import autopar
from autopar.cluster import calibration_path
from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss


def main(steps: int = 20) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
    model = GPT(cfg)
    reference = copy.deepcopy(model)
    batches = [example_batch(cfg, 16, seed=s) for s in range(steps)]
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=3e-3)  # noqa: E731
    cluster = autopar.Cluster.local()
    idx, tgt = batches[0]
    pm = autopar.compile(model, cluster, (idx,), example_target=tgt, loss_fn=gpt_loss, optimizer=make_opt)
    rank = dist.get_rank()
    if rank == 0:
        print(pm.plan.summary())
        print()
    losses, times = [], []
    for x, t in batches:
        t0 = time.perf_counter()
        losses.append(pm.train_step(x, target=t))
        times.append(time.perf_counter() - t0)
    if rank == 0:
        opt = make_opt(list(reference.parameters()))
        print(f"{'step':>4}  {'autopar loss':>13}  {'single-device loss':>18}  {'rel diff':>9}")
        for i, (x, t) in enumerate(batches):
            opt.zero_grad()
            ref = gpt_loss(reference(x), t)
            ref.backward()
            opt.step()
            r = float(ref.detach())
            print(f"{i:>4}  {losses[i]:>13.6f}  {r:>18.6f}  {abs(losses[i] - r) / abs(r):>9.1e}")
        measured = statistics.median(times[3:])
        predicted = pm.plan.predicted.step_time_s
        spec = calibration_path(cluster.world_size)
        where = (f"Cluster.local() read the spec `autopar calibrate` wrote, {spec}" if spec.is_file() else
                 f"Cluster.local() uses rough CPU numbers; `autopar calibrate --nproc {cluster.world_size}` will "
                 "measure them")
        print(f"\nmeasured step time {measured * 1e3:.2f} ms (median of steps 3-{steps - 1}) vs predicted "
              f"{predicted * 1e3:.2f} ms: ratio {measured / predicted:.2f} ({where})")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
