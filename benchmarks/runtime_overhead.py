"""autopar's program vs torch's own parallel wrappers on the same processes, model and batch.

    python benchmarks/runtime_overhead.py [--nproc 4] [--steps 10] [--dim 512] [--layers 4] [--wait both]

Three pairs, each measured in the same run, interleaved (A, B, A, B, ...) to share the noise:
* autopar forced data parallel (dp=N, zero=0)     vs torch DDP
* autopar forced ZeRO-3 (dp=N, zero=3)            vs torch FSDP2 ``fully_shard``
* autopar forced tensor parallel (tp=N, Megatron) vs ``parallelize_module`` (Colwise/Rowwise)
and two for the torch-native loop (``loss_fn(pm(x), y).backward(); opt.step()`` over
``pm.parameters()``, the same plan forced):
* the native loop with local batches (dp=N)         vs torch DDP (the loop DDP users write)
* the native loop with the global batch (dp=N)      vs autopar's fused ``train_step`` (what
  handing whole outputs to the user's loss costs: the all-gather of the outputs)
Prints the median step times and the ratio A / B (goal: <= 1.0 against torch, <= 1.05 for the
native loop against DDP).

Like for like (issue 44 item 5):
* The same collective wait on both sides, one launch per mode (``--wait``): ``block`` sets
  ``AUTOPAR_COLLECTIVE_WAIT=block`` (autopar waits inside torch) and the baselines wait as torch
  does; ``poll`` is autopar's default (``runtime.comm.wait_for``: yield the CPU between
  ``is_completed()`` checks) and gives the baselines the same polled wait where torch 2.13 lets
  a user: DDP through a comm hook whose works are polled by an autograd-engine callback queued
  before DDP's own finalize (``Variable._execution_engine.queue_callback``, as FSDP uses it);
  FSDP2's all-gathers through ``FSDPModule.set_custom_all_gather`` (its reduce-scatters are
  waited for in torch: gloo's reduce-scatter never reports completion when polled, and autopar
  does not poll it either); ``parallelize_module``'s all-reduces by routing DTensor's
  ``funcol.all_reduce`` through ``dist.all_reduce`` + the polled wait (benchmark-only patch of a
  torch module attribute).
* The same loss reduction: autopar's data-parallel ``train_step`` adds the loss to the last
  gradient bucket's all-reduce (``GradSync.carry``), so DDP folds its loss into one gradient
  bucket's all-reduce too (the first, DDP's 1 MiB bucket: a copy of it, in and out); under ZeRO-3
  autopar has no all-reduce to ride and reduces the loss by an asynchronous all-reduce of its own,
  as FSDP2's step does; under tensor parallelism the loss is whole on every rank (none). The
  native loop reduces its loss by its own asynchronous all-reduce, and so does the DDP it is
  compared with there.
* DDP with ``gradient_as_bucket_view=True`` (autopar's gradients are views of its buckets too).
"""
from __future__ import annotations

import argparse
import os
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


def _wait(work, poll: bool) -> None:
    from autopar.runtime.comm import wait_for

    wait_for(work, poll=poll)


def _step(model, opt, loss_fn, xs, t, *, reduce_loss: bool, poll: bool, before_backward=None, carried=None):
    """Zero grads, forward, loss, backward, optimizer step; the global loss as a float on every rank.
    ``reduce_loss``: an asynchronous all-reduce of the loss started before backward, waited for
    (polled or not) after the step. ``before_backward(value)``: hand the loss to a gradient hook
    that carries it; ``carried()``: read it back (already averaged)."""
    world = dist.get_world_size()

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(*xs), t)
        value = loss.detach().clone().reshape(1)
        work = dist.all_reduce(value, async_op=True) if reduce_loss else None
        if before_backward is not None:
            before_backward(value)
        loss.backward()
        opt.step()
        if work is not None:
            _wait(work, poll)
            value /= world
        return float(carried()) if carried is not None else float(value)

    return step


def _ddp(model, opt_fn, loss_fn, x, t, *, poll: bool, ride: bool):
    """DDP (``gradient_as_bucket_view=True``) with an averaging all-reduce comm hook: the works are
    waited for by polling when ``poll``; ``ride``: the loss rides bucket 0's all-reduce."""
    from torch.autograd import Variable
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autopar.testing import baselines as bl

    world = dist.get_world_size()
    xs, tl = bl.rank_rows((x, t), dist.get_rank(), world)
    wrapped = DDP(model, gradient_as_bucket_view=True)
    opt = opt_fn(list(wrapped.parameters()))
    st = {"loss": None, "out": None, "works": [], "queued": False}

    def drain():  # runs before DDP's finalize_backward (queued earlier), which then finds them done
        for w in st["works"]:
            _wait(w, True)
        st["works"].clear()
        st["queued"] = False

    def hook(_state, bucket):
        buf = bucket.buffer()
        if poll and not st["queued"]:
            Variable._execution_engine.queue_callback(drain)
            st["queued"] = True
        if ride and bucket.index() == 0:
            flat = torch.cat([buf, st["loss"]]).div_(world)
            work = dist.all_reduce(flat, async_op=True)

            def done(_f, flat=flat, buf=buf):
                buf.copy_(flat[:-1])
                st["out"] = flat[-1:].clone()
                return buf
        else:
            buf.div_(world)
            work = dist.all_reduce(buf, async_op=True)

            def done(_f, buf=buf):
                return buf
        if poll:
            st["works"].append(work)
        return work.get_future().then(done)

    wrapped.register_comm_hook(None, hook)
    hand = (lambda v: st.__setitem__("loss", v)) if ride else None
    return _step(wrapped, opt, loss_fn, (xs,), tl, reduce_loss=not ride, poll=poll, before_backward=hand,
                 carried=(lambda: st["out"]) if ride else None)


def _polled_fsdp_all_gather():
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class PolledWork(dist.Work):
        def __init__(self, work):
            super().__init__()
            self._work = work

        def is_completed(self):
            return self._work.is_completed()

        def wait(self, timeout=None):
            _wait(self._work, True)
            return True

    class PolledAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            work = super().__call__(output_tensor, input_tensor, group, async_op=True)
            if async_op:
                return PolledWork(work)
            _wait(work, True)
            return None

    return PolledAllGather()


def _fsdp2(model, opt_fn, loss_fn, x, t, *, poll: bool):
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from autopar.testing import baselines as bl

    world = dist.get_world_size()
    xs, tl = bl.rank_rows((x, t), dist.get_rank(), world)
    for unit in bl.fsdp2_units(model):
        fully_shard(unit)
    fully_shard(model)
    if poll:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_all_gather(_polled_fsdp_all_gather())
    opt = opt_fn(list(model.parameters()))
    return _step(model, opt, loss_fn, (xs,), tl, reduce_loss=True, poll=poll)


def _poll_dtensor_all_reduce() -> None:
    """DTensor's Partial -> Replicate goes through ``funcol.all_reduce``; route its sums through
    ``dist.all_reduce`` and the polled wait (this process only; benchmark-only)."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.distributed_c10d import _resolve_process_group

    original = funcol.all_reduce

    def all_reduce(self, reduceOp, group, tag=""):
        if reduceOp.lower() != "sum":
            return original(self, reduceOp, group, tag)
        out = self.contiguous().clone()
        work = dist.all_reduce(out, group=_resolve_process_group(funcol._resolve_group_name(group, tag)),
                               async_op=True)
        _wait(work, True)
        return out

    funcol.all_reduce = all_reduce


def _tp(model, opt_fn, loss_fn, x, t, *, poll: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from autopar.testing import baselines as bl

    n = dist.get_world_size()
    parallelize_module(model, init_device_mesh("cpu", (n,)), bl.hand_tp_plan(model, n)[0])
    opt = opt_fn(list(model.parameters()))
    return _step(model, opt, loss_fn, (x,), t, reduce_loss=False, poll=poll)


def worker(dim, layers, batch, steps):
    import autopar
    from examples.mlp import mlp_loss

    from autopar.bench import time_interleaved
    from autopar.testing import baselines as bl
    from autopar.runtime.comm import _wait_mode
    from autopar.runtime.launch import init_distributed

    n = int(os.environ["WORLD_SIZE"])
    init_distributed("gloo", n)
    poll = _wait_mode() == "poll"
    if poll:
        _poll_dtensor_all_reduce()
    x, t = _batch(dim, batch)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    cluster = autopar.Cluster.local()
    megatron = {"layers.*.up.weight": {"tp": "S(0)"}, "layers.*.down.weight": {"tp": "S(1)"}}

    def autopar_step(constraints):
        pm = autopar.compile(_model(dim, layers), cluster, (x,), example_target=t, loss_fn=mlp_loss, optimizer=opt,
                             constraints=autopar.Constraints(**constraints))
        return lambda: float(pm.train_step(x, target=t))  # read as the baselines read theirs

    def native_step(pm, local: bool):
        """The torch-native loop over autopar's DTensor parameters: the global loss as a float on
        every rank, as train_step returns it (reduced by its own all-reduce with local batches)."""
        xs, ts = bl.rank_rows((x, t), dist.get_rank(), n) if local else (x, t)
        return _step(pm, opt(list(pm.parameters())), mlp_loss, (xs,), ts, reduce_loss=local, poll=poll)

    ddp = _ddp(_model(dim, layers), opt, mlp_loss, x, t, poll=poll, ride=True)
    pairs = {"data parallel vs DDP": (autopar_step({"dp": n, "tp": 1, "zero": 0}), ddp)}
    fsdp = _fsdp2(_model(dim, layers), opt, mlp_loss, x, t, poll=poll)
    pairs["zero=3 vs FSDP2 fully_shard"] = (autopar_step({"dp": n, "zero": 3}), fsdp)
    tp = _tp(_model(dim, layers), opt, mlp_loss, x, t, poll=poll)
    pairs["tensor parallel vs parallelize_module"] = (autopar_step({"tp": n, "placements": megatron}), tp)
    native_local = autopar.compile(_model(dim, layers), cluster, (x,), constraints=autopar.Constraints(dp=n, tp=1, zero=0),
                                   batch="local")
    ddp2 = _ddp(_model(dim, layers), opt, mlp_loss, x, t, poll=poll, ride=False)
    pairs["native loop, local batches vs DDP"] = (native_step(native_local, True), ddp2)
    native_global = autopar.compile(_model(dim, layers), cluster, constraints=autopar.Constraints(dp=n, tp=1, zero=0))
    pairs["native loop, global batch vs train_step"] = (native_step(native_global, False),
                                                        autopar_step({"dp": n, "tp": 1, "zero": 0}))
    # the same loss on both sides of each pair (the models start equal and see the same batch)
    losses = {name: (a(), b()) for name, (a, b) in pairs.items()}
    results = {}
    for name, (a, b) in pairs.items():  # two rounds, interleaved to share drift
        walls, _ = time_interleaved({"a": (a, None), "b": (b, None)}, steps, rounds=2, warmup=2)
        results[name] = (statistics.median(walls["a"]), statistics.median(walls["b"]))
    return results, losses


def main():
    import autopar

    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--wait", choices=("block", "poll", "both"), default="both",
                    help="the collective wait on both sides (one launch per mode)")
    a = ap.parse_args()
    for mode in (("block", "poll") if a.wait == "both" else (a.wait,)):
        os.environ["AUTOPAR_COLLECTIVE_WAIT"] = mode
        res, losses = autopar.launch(worker, a.nproc, a.dim, a.layers, a.batch, a.steps)[0]
        print(f"MLP dim={a.dim} hidden={4 * a.dim} layers={a.layers} batch={a.batch}, {a.nproc} gloo processes, "
              f"median of {a.steps} steps; both sides {'polling' if mode == 'poll' else 'blocking'} "
              f"(AUTOPAR_COLLECTIVE_WAIT={mode})")
        print(f"{'pair (A vs B)':<42} {'A ms':>9} {'B ms':>9} {'A/B':>6}  first-step loss A, B")
        for name, (ta, tb) in res.items():
            la, lb = losses[name]
            print(f"{name:<42} {ta * 1e3:>9.2f} {tb * 1e3:>9.2f} {ta / tb:>6.2f}  {la:.6f}, {lb:.6f}")


if __name__ == "__main__":
    main()
