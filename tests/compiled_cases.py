"""Cases and a loopback mesh for the compiled-program tests (``test_compiled``); ``autopar.launch``
ranks import this module by name: keep it top-level and free of test state."""
from __future__ import annotations

import collections
import copy

import torch

import autopar
from autopar.runtime.comm import MeshComm


def model_case(name: str, steps: int = 1, seed: int = 0):
    """(model, batches, loss_fn) of the example ``name``, seeded: "gpt", "mlp", "moe" (the example
    MoE GPT, capacity routing), or a model of ``examples.real_models`` ("llama": a tiny Hugging Face
    Llama, "resnet": the CNN)."""
    torch.manual_seed(seed)
    if name == "moe":
        from examples.moe import MoEConfig, MoEGPT, example_batch, moe_loss

        cfg = MoEConfig()
        return MoEGPT(cfg), [example_batch(cfg, 8, seed=s) for s in range(steps)], moe_loss
    if name not in ("gpt", "mlp"):
        from examples.real_models import build_real

        return build_real(name, seed, steps)
    if name == "mlp":
        from examples.mlp import MLP, example_batch, mlp_loss

        return MLP(64, 256, 2), [example_batch(64, 16, seed=s) for s in range(steps)], mlp_loss
    from examples.gpt import GPT, GPTConfig, example_batch, gpt_loss

    cfg = GPTConfig()
    return GPT(cfg), [example_batch(cfg, 8, seed=s) for s in range(steps)], gpt_loss


class _Done:
    def wait(self, *a, **k):
        return None

    def is_completed(self) -> bool:
        return True


class LoopbackComm(MeshComm):
    """A mesh of ``sizes`` in one process: every collective returns what it would if every rank
    held this rank's tensor (shapes and bytes exact, values not), for tracing without peers."""

    def __init__(self, sizes, coords):
        super().__init__(groups=("loopback",) * len(sizes), sizes=sizes, coords=coords)

    def _local(self, kind: str, nbytes: int, axis: int, fn, async_op: bool):
        if self.sizes[axis] > 1:
            self.stats.record(kind, nbytes)
            fn()
        return _Done() if async_op else None

    def all_reduce(self, t, axis, *, async_op=False):
        return self._local("all_reduce", t.numel() * t.element_size(), axis, lambda: t.mul_(self.sizes[axis]), async_op)

    def all_gather(self, out, inp, axis, *, async_op=False):
        n = self.sizes[axis]
        return self._local("all_gather", out.numel() * out.element_size(), axis,
                           lambda: out.copy_(inp.repeat((n,) + (1,) * (inp.dim() - 1))), async_op)

    def reduce_scatter(self, out, inp, axis, *, async_op=False):
        n, c = self.sizes[axis], self.coords[axis]
        rows = out.shape[0]
        return self._local("reduce_scatter", inp.numel() * inp.element_size(), axis,
                           lambda: out.copy_(inp[c * rows:(c + 1) * rows] * n), async_op)

    def all_to_all(self, out, inp, axis, *, async_op=False):
        return self._local("all_to_all", inp.numel() * inp.element_size(), axis, lambda: out.copy_(inp), async_op)


def program_on_loopback(name: str, world: int, constraints: dict, coords=None):
    """(program, args, comm) of rank ``coords`` of ``name``'s training program planned for
    ``world`` CPU devices under ``constraints``, with its shards cut from the model (no process
    group: the collectives run on a ``LoopbackComm``)."""
    from autopar.layouts import parse_layout
    from autopar.runtime.collectives import shard_tensor
    from autopar.runtime.compile import build_program
    from autopar.trace import trace_model

    model, batches, loss_fn = model_case(name)
    x, t = batches[0]
    plan = autopar.plan(model, autopar.Cluster.local(world), (x,), loss_fn=loss_fn, example_target=t,
                        constraints=autopar.Constraints(**constraints))
    traced = trace_model(model, (x,), loss_fn=loss_fn, example_target=t)
    traced, program, _ = build_program(model, (x,), t, loss_fn, traced, plan, "cpu", None)
    sizes = tuple(n for _, n in plan.mesh_axes)
    comm = LoopbackComm(sizes, coords or (0,) * len(sizes))
    full = dict(model.named_parameters())
    full.update(dict(model.named_buffers()))
    layouts = {n.name: n.outs[0] for n in plan.nodes.values() if n.outs and n.outs[0] != "-"}
    feed = {traced.input_names[0]: x, traced.target_name: t}
    args = []
    for ph in (n for n in program.graph.nodes if n.op == "placeholder"):
        fqn = ph.meta.get("autopar.fqn")
        if fqn is not None and fqn in plan.params:
            local = shard_tensor(full[fqn].detach(), parse_layout(plan.params[fqn].layout), comm).clone()
            args.append(local.requires_grad_(full[fqn].requires_grad))
        elif fqn is not None:
            args.append(full[fqn].detach().clone())
        else:
            args.append(shard_tensor(feed[ph.name], parse_layout(layouts[ph.name]), comm))
    return program, args, comm


def graph_breaks(fn, args, comm) -> tuple[int, int, dict]:
    """(graphs, graph breaks, reasons counted) of ``torch._dynamo.explain(fn)(*args)`` with
    ``comm`` the active mesh; the backward runs too (a compiled backward must trace as well)."""
    from autopar.runtime.collectives import active_mesh

    torch._dynamo.reset()
    with active_mesh(comm):
        ex = torch._dynamo.explain(fn)(*args)
    reasons = collections.Counter(str(b.reason).split("\n")[0][:100] for b in ex.break_reasons)
    return ex.graph_count, ex.graph_break_count, dict(reasons)


def loopback_step(fn, args, comm) -> tuple[torch.Tensor, list, dict]:
    """(loss, gradients of the arguments, bytes per collective kind) of one forward and backward of
    ``fn`` on fresh copies of ``args`` with ``comm`` the active mesh."""
    from autopar.runtime.collectives import active_mesh

    from autopar.runtime.prefetch import drain_gradient_reductions

    args = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad:
            a.grad = torch.zeros_like(a)  # the gradient buffers a ParamStore gives (ZeRO-3 adds into them)
    comm.stats.reset()
    with active_mesh(comm):
        out = fn(*args)
        loss = out[0] if isinstance(out, (tuple, list)) else out
        loss.backward()
        drain_gradient_reductions(comm)
    return loss.detach(), [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad], dict(comm.stats.bytes)


def adamw(ps):
    """The AdamW factory of the compiled-training tests."""
    return torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)


def _one_device(model, batches, loss_fn, optimizer) -> list[float]:
    from helpers import one_device_losses

    return one_device_losses(copy.deepcopy(model), batches, loss_fn, optimizer)


def compiled_training_worker(cases: list, backend: str, steps: int = 3) -> list[dict]:
    """Per case ``(name, constraints, optimizer name, path)``: the losses of ``steps`` steps of
    ``autopar.compile(..., compile=backend)`` ("train_step" or the torch-native loop "native"),
    one device's, and dynamo's graph and graph-break counts over the run."""
    from torch._dynamo.utils import counters

    from helpers import sgd

    out = []
    for name, constraints, opt_name, path in cases:
        optimizer = {"sgd": sgd, "adamw": adamw}[opt_name]
        model, batches, loss_fn = model_case(name, steps)
        want = _one_device(model, batches, loss_fn, optimizer)
        torch._dynamo.reset()
        counters.clear()
        x0, t0 = batches[0]
        cons = autopar.Constraints(**constraints)
        losses = []
        if path == "train_step":
            pm = autopar.compile(model, autopar.Cluster.local(), (x0,), example_target=t0, loss_fn=loss_fn,
                                 optimizer=optimizer, constraints=cons, compile=backend)
            losses = [float(pm.train_step(x, target=t)) for x, t in batches]
        else:
            pm = autopar.compile(model, autopar.Cluster.local(), (x0,), constraints=cons, compile=backend)
            opt = optimizer(pm.parameters())
            for x, t in batches:
                loss = loss_fn(pm(x), t)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(float(loss.detach()))
        pm.close()
        out.append({"losses": losses, "want": want, "graphs": int(counters["stats"]["unique_graphs"]),
                    "breaks": sum(counters["graph_break"].values()), "reasons": dict(counters["graph_break"])})
    return out
