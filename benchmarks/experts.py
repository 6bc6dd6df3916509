"""Expert parallelism: measured step time beside the prediction, and planning time at scale.

Default: the static-capacity MoE GPT of ``examples/moe.py`` (8 experts of 256 -> 1024, top-2,
capacity factor 1.25; 2 layers, hidden 256, sequence 64, global batch 16) on ``--nproc`` gloo
processes, trained with AdamW under

* ``Constraints(dp=N, ep=N)``: experts split over the data-parallel devices, tokens moved to them
  by all-to-all (GShard);
* ``Constraints(dp=N, tp=1, zero=0)``: every expert replicated, gradients all-reduced (plain data
  parallelism);
* the free plan.

``--model moe_modules``: the same MoE GPT with each layer's experts written as an ``nn.ModuleList``
of MLPs called in a loop (``MoEConfig(expert_modules=True)``), which the trace merges over stacked
weights (``autopar.stack_experts``); same three plans.

``--model mixtral``: the tiny Hugging Face Mixtral of ``examples/real_models.py`` (dropless, 4
experts, grouped matmuls; expert parallel by all-to-alls of variable sizes), same three plans.

The plans run interleaved in the same processes (round-robin, ``--steps`` timed steps each after
two warm-up steps); the table gives the median step time, the plan's prediction and the ratios.

``--plan-speed``: ``autopar.plan`` wall time (trace + search, bf16-mixed, no constraints, in a
fresh subprocess each) for a Mixtral-8x7B shape (32 layers, hidden 4096, 8 experts of 14336,
top-2, sequence 4096, global batch 256) on 64 H100s (8 dgx-h100 nodes) and a DeepSeek-V3-like
shape (61 layers, hidden 7168, 256 experts of 2048, top-8, 128 heads, vocab 129280, sequence 4096,
global batch 4096) on 1024 H100s (128 nodes); goal 60 s each. These are our GPT with its MLPs
replaced by static-capacity MoE layers (full attention, LayerNorm, GELU experts), not the
published architectures (SwiGLU experts, GQA or MLA, shared experts): the expert and attention
shapes, which planning time depends on, are theirs.

    python benchmarks/experts.py [--nproc 4] [--steps 20] [--model moe|moe_modules|mixtral]
    python benchmarks/experts.py --plan-speed
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

BENCH = dict(n_embd=256, ff=1024, n_experts=8, top_k=2, capacity_factor=1.25, n_layer=2, n_head=4, block_size=64)
PLANS = {
    "expert parallel": {"ep": "world", "dp": "world"},
    "replicated experts": {"dp": "world", "tp": 1, "zero": 0},
    "free plan": {},
}


def _constraints(spec: dict, world: int):
    import autopar

    return autopar.Constraints(**{k: (world if v == "world" else v) for k, v in spec.items()})


def _model(which: str):
    """(fresh model, input, target, loss) of the benchmark's model."""
    if which == "mixtral":
        from examples.real_models import build_real

        model, batches, loss = build_real("mixtral")
        return model, batches[0][0], batches[0][1], loss
    from examples.moe import MoEConfig, MoEGPT, example_batch, moe_loss

    cfg = MoEConfig(**BENCH, expert_modules=which == "moe_modules")
    x, y = example_batch(cfg, 16)
    return MoEGPT(cfg), x, y, moe_loss


def _worker(steps: int, which: str) -> dict:
    import os

    import autopar

    world = int(os.environ["WORLD_SIZE"])
    models = {}
    for name, spec in PLANS.items():
        torch.manual_seed(0)
        model, x, y, loss = _model(which)
        pm = autopar.compile(model, autopar.Cluster.local(), x, example_target=y, loss_fn=loss,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), constraints=_constraints(spec, world))
        for _ in range(2):
            pm.train_step(x, target=y)
        models[name] = pm
    times = {name: [] for name in models}
    for _ in range(steps):
        for name, pm in models.items():
            t = time.perf_counter()
            pm.train_step(x, target=y)
            times[name].append(time.perf_counter() - t)
    out = {}
    for name, pm in models.items():
        plan = pm.plan
        expert = next(p for p in plan.params.values() if p.fqn.endswith(("moe.w_in", "experts.gate_up_proj", "experts.*.0.weight")))
        out[name] = {"measured_s": statistics.median(times[name]), "predicted_s": plan.predicted.step_time_s,
                     "mesh": dict(plan.mesh_axes), "experts": expert.layout,
                     "comm_bytes": dict(plan.predicted.comm_bytes)}
        pm.close()
    return out


def run(nproc: int, steps: int, which: str) -> None:
    import autopar

    res = autopar.launch(_worker, nproc, steps, which)[0]
    base = res["replicated experts"]["measured_s"]
    base_pred = res["replicated experts"]["predicted_s"]
    what = {"moe": f"MoE GPT {BENCH}, global batch 16",
            "moe_modules": f"MoE GPT {BENCH}, experts as an nn.ModuleList, global batch 16"}.get(
        which, "Hugging Face Mixtral (examples/real_models.py)")
    print(f"{nproc} gloo processes, {what}, AdamW; median of {steps} steps")
    print(f"{'plan':<20} {'mesh':<14} {'experts':<10} {'measured ms':>12} {'predicted ms':>13} {'meas/pred':>10} "
          f"{'speedup (meas)':>15} {'speedup (pred)':>15}  all-to-all bytes")
    for name, r in res.items():
        mesh = "x".join(f"{k}{v}" for k, v in r["mesh"].items())
        print(f"{name:<20} {mesh:<14} {r['experts']:<10} {r['measured_s'] * 1e3:>12.1f} {r['predicted_s'] * 1e3:>13.1f} "
              f"{r['measured_s'] / r['predicted_s']:>10.2f} {base / r['measured_s']:>15.2f} "
              f"{base_pred / r['predicted_s']:>15.2f}  {int(r['comm_bytes'].get('all_to_all', 0)):,}")


SHAPES = {
    "mixtral-8x7b@64xH100": (dict(vocab_size=32000, n_experts=8, top_k=2, n_embd=4096, ff=14336, n_layer=32, n_head=32,
                                  block_size=4096, capacity_factor=1.25), 8, 256),
    "deepseek-v3-like@1024xH100": (dict(vocab_size=129280, n_experts=256, top_k=8, n_embd=7168, ff=2048, n_layer=61,
                                        n_head=128, block_size=4096, capacity_factor=1.25), 128, 4096),
}


def _plan_one(name: str) -> dict:
    import autopar
    from examples.moe import MoEConfig, MoEGPT, example_batch, moe_loss

    shape, nodes, batch = SHAPES[name]
    cfg = MoEConfig(**shape)
    with torch.device("meta"):
        model = MoEGPT(cfg)
    x, y = example_batch(cfg, batch)
    t = time.perf_counter()
    plan = autopar.plan(model, autopar.Cluster.preset("dgx-h100").with_nodes(nodes), x, loss_fn=moe_loss,
                        example_target=y, precision="bf16-mixed")
    return {"plan_s": time.perf_counter() - t, "mesh": dict(plan.mesh_axes), "microbatches": plan.microbatches,
            "recompute": plan.recompute, "experts": plan.params["blocks.0.moe.w_in"].layout,
            "attention": plan.params["blocks.0.attn.qkv.weight"].layout, "step_s": plan.predicted.step_time_s,
            "peak_gib": plan.predicted.peak_memory_bytes / 2**30,
            "all_to_all_gib": dict(plan.predicted.comm_bytes).get("all_to_all", 0.0) / 2**30}


def plan_speed() -> None:
    print(f"{'shape':<28} {'plan s':>7} {'goal':>5}  {'mesh':<14} {'experts':<10} {'attention':<10} {'mb':>3} {'rc':>3} "
          f"{'step s':>7} {'GiB':>6} {'a2a GiB':>8}")
    for name in SHAPES:
        out = subprocess.run([sys.executable, __file__, "--plan-one", name], capture_output=True, text=True)
        if out.returncode:
            print(f"{name:<28} failed: {out.stderr.strip().splitlines()[-1]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        mesh = "x".join(f"{k}{v}" for k, v in r["mesh"].items())
        print(f"{name:<28} {r['plan_s']:>7.1f} {60:>5}  {mesh:<14} {r['experts']:<10} {r['attention']:<10} "
              f"{r['microbatches']:>3} {'y' if r['recompute'] else 'n':>3} {r['step_s']:>7.2f} {r['peak_gib']:>6.1f} "
              f"{r['all_to_all_gib']:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", choices=("moe", "moe_modules", "mixtral"), default="moe",
                    help="moe: examples/moe.py (static capacity); moe_modules: the same, experts as an nn.ModuleList "
                         "called in a loop; mixtral: Hugging Face's dropless Mixtral, tiny")
    ap.add_argument("--plan-speed", action="store_true")
    ap.add_argument("--plan-one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plan_one:
        print(json.dumps(_plan_one(args.plan_one)))
    elif args.plan_speed:
        plan_speed()
    else:
        run(args.nproc, args.steps, args.model)


if __name__ == "__main__":
    main()
