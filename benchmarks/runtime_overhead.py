"""autopar's program vs torch's own parallel wrappers on the same processes, model and batch.

    python benchmarks/runtime_overhead.py [--nproc 4] [--steps 10] [--dim 512] [--layers 4]

Three pairs, each measured in the same run, interleaved (A, B, A, B, ...) to share the noise:
* autopar forced data parallel (dp=N, zero=0)     vs torch DDP
* autopar forced ZeRO-3 (dp=N, zero=3)            vs torch FSDP2 ``fully_shard``
* autopar forced tensor parallel (tp=N, Megatron) vs ``parallelize_module`` (Colwise/Rowwise)
and two for the torch-native loop (``loss_fn(pm(x), y).backward(); opt.step()`` over
``pm.parameters()``, the same plan forced):
* the native loop with local batches (dp=N)         vs torch DDP (the loop DDP users write)
* the native loop with the global batch (dp=N)      vs autopar's fused ``train_step`` (what
  handing whole outputs to the user's loss costs: the all-gather of the outputs)
Prints the median step times and the ratio autopar / torch (goal: <= 1.05). Like for like: both
sides return the global loss as a float on every rank (the torch side all-reduces it
asynchronously where each rank saw part of the batch; under tensor parallelism it is whole).
The torch setups, the eager step and the interleaved timing are those of ``autopar bench``
(``autopar.runtime.baselines``, ``autopar.bench.time_interleaved``); DDP here keeps its default
separate gradient buckets, as in the recorded results (``autopar bench`` uses bucket views).
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist


def _model(dim, layers):
    from examples.mlp import MLP

    torch.manual_seed(0)
    return MLP(dim, 4 * dim, layers)


def _batch(dim, batch):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, dim, generator=g), torch.randn(batch, dim, generator=g)


def worker(dim, layers, batch, steps):
    import autopar
    from examples.mlp import mlp_loss

    from autopar.bench import time_interleaved
    from autopar.runtime import baselines as bl
    from autopar.runtime.launch import init_distributed

    n = int(__import__("os").environ["WORLD_SIZE"])
    init_distributed("gloo", n)
    x, t = _batch(dim, batch)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    cluster = autopar.Cluster.local()
    megatron = {"layers.*.up.weight": {"tp": "S(0)"}, "layers.*.down.weight": {"tp": "S(1)"}}

    def autopar_step(constraints):
        pm = autopar.compile(_model(dim, layers), cluster, (x,), example_target=t, loss_fn=mlp_loss, optimizer=opt,
                             constraints=autopar.Constraints(**constraints))
        return lambda: pm.train_step(x, target=t)

    def native_step(pm, local: bool):
        """The torch-native loop over autopar's DTensor parameters (``runtime.baselines.eager_step``:
        the global loss as a float on every rank, as train_step returns it)."""
        rows = bl.rank_rows((x, t), dist.get_rank(), n) if local else (x, t)
        return bl.eager_step(pm, opt(list(pm.parameters())), mlp_loss, rows[:1], rows[1], global_loss=local)

    # the torch baselines (runtime.baselines), each on the global batch: a rank trains on its rows
    ddp = bl.ddp(_model(dim, layers), opt, mlp_loss, (x,), t, bucket_view=False).step
    pairs = {"data parallel vs DDP": (autopar_step({"dp": n, "tp": 1, "zero": 0}), ddp)}
    fsdp = bl.fsdp2(_model(dim, layers), opt, mlp_loss, (x,), t).step
    pairs["zero=3 vs FSDP2 fully_shard"] = (autopar_step({"dp": n, "zero": 3}), fsdp)
    model = _model(dim, layers)
    tp = bl.tensor_parallel(model, opt, mlp_loss, (x,), t, bl.hand_tp_plan(model, n)[0]).step
    pairs["tensor parallel vs parallelize_module"] = (autopar_step({"tp": n, "placements": megatron}), tp)
    # the torch-native loop
    native_local = autopar.compile(_model(dim, layers), cluster, (x,), constraints=autopar.Constraints(dp=n, tp=1, zero=0),
                                   batch="local")
    ddp2 = bl.ddp(_model(dim, layers), opt, mlp_loss, (x,), t, bucket_view=False).step
    pairs["native loop, local batches vs DDP"] = (native_step(native_local, True), ddp2)
    native_global = autopar.compile(_model(dim, layers), cluster, constraints=autopar.Constraints(dp=n, tp=1, zero=0))
    pairs["native loop, global batch vs train_step"] = (native_step(native_global, False),
                                                        autopar_step({"dp": n, "tp": 1, "zero": 0}))
    results = {}
    for name, (a, b) in pairs.items():  # two rounds, interleaved to share drift
        walls, _ = time_interleaved({"a": (a, None), "b": (b, None)}, steps, rounds=2, warmup=2)
        results[name] = (statistics.median(walls["a"]), statistics.median(walls["b"]))
    return results


def main():
    import autopar

    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    res = autopar.launch(worker, a.nproc, a.dim, a.layers, a.batch, a.steps)[0]
    print(f"MLP dim={a.dim} hidden={4 * a.dim} layers={a.layers} batch={a.batch}, {a.nproc} gloo processes, "
          f"median of {a.steps} steps")
    print(f"{'pair (A vs B)':<42} {'A ms':>9} {'B ms':>9} {'A/B':>6}")
    for name, (ta, tb) in res.items():
        print(f"{name:<42} {ta * 1e3:>9.2f} {tb * 1e3:>9.2f} {ta / tb:>6.2f}")


if __name__ == "__main__":
    main()
