"""Compile time of ``autopar.compile(..., compile="inductor")`` against depth (issue 47).

    python benchmarks/compile_time.py [--layers 1,2,4,8] [--mesh tp=2] [--nproc 2]

A tiny Hugging Face Llama (``examples.real_models``' config: hidden 64, 4 heads, 2 kv heads, batch
8 x 16 tokens) with ``--layers`` decoder layers, ``train_step`` with SGD on ``--nproc`` gloo processes under
``--mesh``. Each depth runs in fresh processes with an empty Inductor cache
(``TORCHINDUCTOR_CACHE_DIR``): the compile time is the first step's time less a later step's.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

import autopar


VOCAB = 128


def _lm_loss(out, target):
    return torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), target.reshape(-1))


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.01)


def worker(layers: int, mesh: dict, cache: str):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                   vocab_size=VOCAB, max_position_embeddings=64, num_hidden_layers=layers)
    model = transformers.LlamaForCausalLM(cfg).train()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, VOCAB, (8, 16), generator=g)
    t = torch.randint(1, VOCAB, (8, 16), generator=g)
    pm = autopar.compile(model, autopar.Cluster.local(), (x,), example_target=t, loss_fn=_lm_loss, optimizer=_sgd,
                         constraints=autopar.Constraints(**mesh), check_inputs="never", compile="inductor")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        float(pm.train_step(x, target=t))
        times.append(time.perf_counter() - t0)
    pm.close()
    return times[0] - min(times[1:]), min(times[1:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="1,2,4,8")
    ap.add_argument("--mesh", default="tp=2")
    ap.add_argument("--nproc", type=int, default=2)
    a = ap.parse_args()
    mesh = {k: int(v) for k, v in (p.split("=") for p in a.mesh.split(","))}
    print(f"tiny HF Llama, {a.nproc} gloo processes, {a.mesh}, compile='inductor', empty Inductor cache (rank 0)")
    print(f"{'layers':>6} {'compile s':>10} {'step ms':>8}")
    for layers in (int(v) for v in a.layers.split(",")):
        with tempfile.TemporaryDirectory() as cache:
            compile_s, step_s = autopar.launch(worker, a.nproc, layers, mesh, cache, timeout_s=900)[0]
        print(f"{layers:6d} {compile_s:10.1f} {step_s * 1e3:8.1f}", flush=True)


if __name__ == "__main__":
    main()
