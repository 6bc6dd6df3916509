"""Where a data-parallel MoE ``train_step`` spends its time: cProfile of rank 0 over 8 steps (after 3
warm-up steps), 4 gloo processes, on a *tuning* configuration drawn by hand (in no scored set of
``benchmarks/calibration.py``), with the plan's prediction beside it.

    AUTOPAR_CALIBRATION_DIR=<spec dir> OMP_NUM_THREADS=1 python benchmarks/moe_dp_profile.py [--foreach]

A diagnostic, not a benchmark: nothing is fitted on it (see benchmarks/README.md, "MoE dp step").
"""
from __future__ import annotations

import copy
import cProfile
import functools
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.getcwd())

DIMS = dict(layers=2, width=160, experts=8, top_k=1, seq=32, batch=16, heads=4, vocab=256, ff=320)


def rank(foreach: bool) -> str:
    import torch
    import torch.distributed as dist

    import autopar
    from autopar.runtime.launch import init_distributed
    from autopar.testing.baselines import make_replicas_equal
    from benchmarks.scored_set import ScoredPlan

    world = int(os.environ["WORLD_SIZE"])
    init_distributed("gloo", world)
    sp = ScoredPlan("moe", tuple(sorted(DIMS.items())), "dp", world)
    torch.manual_seed(0)
    model, inputs, loss_fn, target = sp.build()
    make_replicas_equal(model)
    opt = functools.partial(torch.optim.AdamW, lr=1e-3, foreach=True if foreach else None)
    pm = autopar.compile(copy.deepcopy(model), autopar.Cluster.local(world), inputs, loss_fn=loss_fn,
                         example_target=target, optimizer=opt, constraints=autopar.Constraints(**sp.constraints))
    step = functools.partial(pm.train_step, *inputs, target=target)
    for _ in range(3):
        step()
    prof = cProfile.Profile()
    dist.barrier()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(8):
        step()
    prof.disable()
    wall = (time.perf_counter() - t0) / 8
    pred = pm.plan.predicted
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(45)
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    pm.close()
    head = (f"{sp.label}: {wall * 1e3:.1f} ms a step under cProfile; predicted {pred.step_time_s * 1e3:.1f} "
            f"(compute {pred.compute_s * 1e3:.1f}, comm {dict(pred.comm_s)})\n")
    return head + out.getvalue() if dist.get_rank() == 0 else ""


if __name__ == "__main__":
    from autopar.runtime.launch import launch

    print(launch(rank, 4, "--foreach" in sys.argv, timeout_s=300)[0])
