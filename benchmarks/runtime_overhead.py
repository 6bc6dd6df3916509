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
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def _model(dim, layers):
    from examples.mlp import MLP

    torch.manual_seed(0)
    return MLP(dim, 4 * dim, layers)


def _batch(dim, batch):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, dim, generator=g), torch.randn(batch, dim, generator=g)


def _time(step, steps):
    for _ in range(2):
        step()
    out = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def worker(dim, layers, batch, steps):
    import autopar
    from examples.mlp import mlp_loss
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

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

    def eager_step(model, inputs, target, global_loss: bool):
        """A torch training step doing what autopar's train_step does: the step, and the global
        loss value as a float on every rank (averaged over the data-parallel ranks, reduced
        asynchronously while the step runs, as autopar reduces it)."""
        o = opt(list(model.parameters()))

        def step():
            o.zero_grad(set_to_none=True)
            loss = mlp_loss(model(inputs), target)
            value = loss.detach().clone()
            work = dist.all_reduce(value, async_op=True) if global_loss else None
            loss.backward()
            o.step()
            if work is not None:
                work.wait()
                value /= dist.get_world_size()
            return float(value)
        return step

    rank = dist.get_rank()
    lo, hi = rank * batch // n, (rank + 1) * batch // n
    results = {}
    # 1. data parallel vs DDP
    ddp = DDP(_model(dim, layers))
    pairs = {"data parallel vs DDP": (autopar_step({"dp": n, "tp": 1, "zero": 0}), eager_step(ddp, x[lo:hi], t[lo:hi], True))}
    # 2. ZeRO-3 vs FSDP2
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (n,))
    fsdp = _model(dim, layers)
    for layer in fsdp.layers:
        fully_shard(layer["up"], mesh=mesh)
        fully_shard(layer["down"], mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    pairs["zero=3 vs FSDP2 fully_shard"] = (autopar_step({"dp": n, "zero": 3}), eager_step(fsdp, x[lo:hi], t[lo:hi], True))
    # 3. tensor parallel vs parallelize_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = _model(dim, layers)
    plan = {}
    for i in range(layers):
        plan[f"layers.{i}.up"] = ColwiseParallel()
        plan[f"layers.{i}.down"] = RowwiseParallel()
    parallelize_module(tp, mesh, plan)
    pairs["tensor parallel vs parallelize_module"] = (autopar_step({"tp": n, "placements": megatron}), eager_step(tp, x, t, False))
    # 4-5. the torch-native loop
    native_local = autopar.compile(_model(dim, layers), cluster, (x,), constraints=autopar.Constraints(dp=n, tp=1, zero=0),
                                   batch="local")
    ddp2 = DDP(_model(dim, layers))
    pairs["native loop, local batches vs DDP"] = (eager_step(native_local, x[lo:hi], t[lo:hi], True),
                                                  eager_step(ddp2, x[lo:hi], t[lo:hi], True))
    native_global = autopar.compile(_model(dim, layers), cluster, constraints=autopar.Constraints(dp=n, tp=1, zero=0))
    pairs["native loop, global batch vs train_step"] = (eager_step(native_global, x, t, False),
                                                        autopar_step({"dp": n, "tp": 1, "zero": 0}))
    for name, (a, b) in pairs.items():
        ta, tb = [], []
        for _ in range(2):  # interleave to share drift
            ta += _time(a, steps // 2)
            tb += _time(b, steps // 2)
        results[name] = (statistics.median(ta), statistics.median(tb))
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
