"""Train the example GPT with checkpoints, so that a killed run resumes where it stopped.

    autopar run examples/resumable.py --nproc 4 --root /tmp/ckpt --steps 10 --every 2
    # or: torchrun --nproc-per-node 4 --max-restarts 1 examples/resumable.py --root /tmp/ckpt ...

A restarted run (torchrun restarts every worker when one dies) finds the newest complete checkpoint
under ``--root`` and continues from its step; launched on another number of processes it re-plans
and loads the checkpoint resharded. The batch of step ``s`` depends on ``s`` only, so a resumed run
sees the batches an uninterrupted one would.

``--die-at S``: rank 1 exits abruptly before step S on the first attempt (torchrun's
``TORCHELASTIC_RESTART_COUNT`` is 0), to show recovery. ``--out PATH``: rank 0 writes the final
parameters and optimizer state there (``torch.save``).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import autopar
from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="checkpoint folder, shared by every rank")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--every", type=int, default=2, help="save every this many steps")
    ap.add_argument("--die-at", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dp", type=int, default=None, help="fix the data-parallel degree (default: the planner's)")
    ap.add_argument("--tp", type=int, default=None, help="fix the tensor-parallel degree")
    ap.add_argument("--sync", action="store_true", help="save in the foreground instead of the background")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    batches = [example_batch(cfg, 8, seed=s) for s in range(8)]
    x, t = batches[0]
    pm = autopar.compile(model, autopar.Cluster.local(), (x,), example_target=t, loss_fn=gpt_loss,
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
                         constraints=autopar.Constraints(dp=args.dp, tp=args.tp),
                         checkpoint=autopar.Checkpointing(args.root, every=args.every, asynchronous=not args.sync))
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    rank = dist.get_rank()
    if rank == 0:
        print(f"starting at step {pm.step} on {dist.get_world_size()} ranks, {pm.plan.mesh}", flush=True)
    while pm.step < args.steps:
        if args.die_at is not None and pm.step == args.die_at and first and rank == 1:
            os._exit(13)  # a crash: no cleanup, no exception
        x, t = batches[pm.step % len(batches)]
        loss = pm.train_step(x, target=t)
        if rank == 0:
            print(f"step {pm.step} loss {loss:.6f}", flush=True)
    pm.wait_saved()
    state = {"model": pm.full_state_dict(), "optim": pm.full_optimizer_state_dict(), "step": pm.step,
             "resumed": pm.resumed.describe() if pm.resumed else None}
    if rank == 0 and args.out:
        torch.save(state, args.out)
    pm.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
