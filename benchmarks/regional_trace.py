"""Regional tracing (``autopar.stamp``) against the full trace: the same graph, and how much faster.

    python benchmarks/regional_trace.py [--plans] [--only NAME,...]

For each model: the traced graph with every instance of its repeated blocks traced
(``trace_model(regional=False)``) and with them stamped (``regional=True``, the default), compared
node by node (name, op, target, args, kwargs, every ``autopar.*`` meta key, ``nn_module_stack``,
the fake values' shapes, strides, dtypes) and by the generated code; the instances traced and
stamped and why stamping stopped; the CPU seconds of each trace (the better of two). ``--plans``:
also ``autopar.plan`` on ``Cluster.local(4)`` (free) both ways, and whether the plans' fingerprints
and JSON are equal. Models: the example GPT at 4 layers (untied and with its head tied to the
embedding), its 96-layer GPT-3 175B on meta, the example MoE GPT at 4 layers, every model of
``examples/real_models.py`` at 4 layers (CNNs as written; the Hugging Face decoders also with
``use_cache=False``: with their KV cache each layer reads its ``layer_idx`` and is traced), and the start-up Llamas of
``benchmarks/start_up.py`` (100M, 400M, depth family, on meta).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch

import autopar
import autopar.trace as trace_mod
from autopar.stamp import STAMPED_KEY, graph_signature, stamp_repeated_blocks
from autopar.trace import trace_model


@contextlib.contextmanager
def full_trace():
    """``autopar.plan`` with every instance traced (the stamping context disabled)."""
    orig = trace_mod.stamp_repeated_blocks
    trace_mod.stamp_repeated_blocks = lambda model, enabled=True: stamp_repeated_blocks(model, False)
    try:
        yield
    finally:
        trace_mod.stamp_repeated_blocks = orig


def models():
    """(name, model, example inputs, loss_fn, target)."""
    from examples import real_models
    from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss, gpt_shape
    from examples.moe import MoEConfig, MoEGPT, moe_loss
    from examples.moe import example_batch as moe_batch

    cfg = GPTConfig(n_layer=4)
    idx, tgt = example_batch(cfg, 8)
    yield "gpt-4", GPT(cfg), (idx,), gpt_loss, tgt
    tied = GPT(cfg)
    tied.lm_head.weight = tied.wte.weight
    yield "gpt-4-tied", tied, (idx,), gpt_loss, tgt
    big = gpt_shape("gpt3-175b")
    with torch.device("meta"):
        g3 = GPT(big)
    i3 = torch.empty(1536, big.block_size, dtype=torch.long, device="meta")
    yield "gpt3-175b", g3, (i3,), gpt_loss, i3
    mcfg = MoEConfig(n_layer=4)
    mx, mt = moe_batch(mcfg, 8)
    yield "moe-gpt-4", MoEGPT(mcfg), (mx,), moe_loss, mt
    real_models._HIDDEN["num_hidden_layers"] = 4
    for name in real_models.REAL_MODELS:
        model, batches, loss = real_models.build_real(name, steps=1)
        x, t = batches[0]
        yield f"{name}-4", model, (x if isinstance(x, tuple) else (x,)), loss, t
        if getattr(getattr(model, "config", None), "use_cache", False):  # without the KV cache: stamped
            model, batches, loss = real_models.build_real(name, steps=1)
            model.config.use_cache = False
            yield f"{name}-4-no-cache", model, (x,), loss, t
    import transformers
    from start_up import batch, llama_config, lm_loss

    for size in ("100M", "400M"):
        with torch.device("meta"):
            m = transformers.LlamaForCausalLM(llama_config(size, "depth"))
        x, t = batch(4, 32)
        yield f"start-up-llama-{size}", m, (x,), lm_loss, t


def cpu_s(fn):
    best, out = None, None
    for _ in range(2):
        t0 = time.process_time()
        out = fn()
        s = time.process_time() - t0
        best = s if best is None else min(best, s)
    return best, out


def check(name, model, inputs, loss_fn, target, plans: bool, want_plans: bool) -> bool:
    full_s, full = cpu_s(lambda: trace_model(model, inputs, loss_fn=loss_fn, example_target=target, regional=False))
    reg_s, reg = cpu_s(lambda: trace_model(model, inputs, loss_fn=loss_fn, example_target=target))
    same = graph_signature(full.gm) == graph_signature(reg.gm)
    stats = reg.gm.meta.get(STAMPED_KEY, {})
    stamped = sum(s.stamped for s in stats.values())
    refused = "; ".join(f"{k}: {r}" for s in stats.values() for k, r in s.refused.items())
    line = f"| {name} | {len(full.gm.graph.nodes)} | {'yes' if same else '**NO**'} | {stamped} | {full_s:.3f} | {reg_s:.3f} |"
    if plans:
        kw = dict(loss_fn=loss_fn, example_target=target)
        cluster = autopar.Cluster.local(4)
        with full_trace():
            a = autopar.plan(model, cluster, inputs, **kw)
        b = autopar.plan(model, cluster, inputs, **kw)
        plan_same = a.fingerprint == b.fingerprint and a.to_json() == b.to_json()
        same = same and plan_same
        line += f" {'yes' if plan_same else '**NO**'} |"
    elif want_plans:
        line += " - |"
    print(line + f" {refused or '-'} |", flush=True)
    return same


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", action="store_true")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    print("| model | nodes | same graph | instances stamped | full trace CPU s | regional CPU s |"
          + (" same plan |" if args.plans else "") + " stamping refused |")
    print("|---|---|---|---|---|---|" + ("---|" if args.plans else "") + "---|")
    ok = True
    for name, model, inputs, loss_fn, target in models():
        if only and name not in only:
            continue
        plans = args.plans and name != "gpt3-175b"  # (a 175B plan for 4 local devices does not fit)
        ok = check(name, model, inputs, loss_fn, target, plans, args.plans) and ok
    print("all equal" if ok else "SOME DIFFER")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
