"""``ParallelModel``: the per-rank program of a plan, its local parameters, and the train step.

Invariants:
* every rank holds exactly its local shard of each parameter (per the plan's layout), and the
  gradient that backward leaves on it is already reduced (the program's ``reshard`` edges carry the
  gradient synchronisation, data-parallel all-reduce and FSDP reduce-scatter alike);
* parameters with ``zero_axes`` (ZeRO-1/2) stay replicated for compute; the optimizer updates a
  flat 1/n slice per rank (``_ZeroShard``) and the slices are all-gathered after the step;
* ``full_state_dict()`` has the keys of the user's ``model.state_dict()``.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from autopar.errors import AutoparError
from autopar.layouts import Partial, Replicate, Shard, parse_layout, replicated
from autopar.resharding import reshard_steps, reshard_steps_for
from autopar.runtime.collectives import MeshComm, active_mesh, apply_steps, shard_tensor

__all__ = ["ParallelModel"]


@dataclass
class _ZeroShard:
    """A replicated parameter whose optimizer state lives in flat slices over ``axes``."""

    param: torch.nn.Parameter  # the replicated local parameter used by the program
    shard: torch.nn.Parameter  # what the optimizer sees
    axes: tuple[int, ...]
    numel: int


class ParallelModel:
    """A model compiled for this rank. Build it with ``autopar.compile``."""

    def __init__(self, *, plan, traced, program: fx.GraphModule, device_mesh, model: torch.nn.Module,
                 optimizer: Callable, device: torch.device, precision: str, loss_reduction: str = "mean"):
        self.plan = plan
        self.program = program
        self.device_mesh = device_mesh
        self.comm = MeshComm.from_device_mesh(device_mesh)
        self.step = 0
        self._traced = traced
        self._device = device
        self._precision = precision
        self._loss_reduction = loss_reduction  # how microbatch losses combine: "mean" or "sum"
        self._model_keys = list(model.state_dict().keys())
        self._placeholders = [n.name for n in program.graph.nodes if n.op == "placeholder"]
        self._gathers_params = _gathers_params(program)
        self._layouts = {n.name: parse_layout(n.outs[0]) for n in plan.stages[0].nodes if n.outs and n.outs[0] != "-"}
        self._shapes = {n.name: tuple(n.meta["autopar.outputs"][0].shape) for n in traced.graph.nodes
                        if n.op == "placeholder" and (n.meta.get("autopar.outputs") or (None,))[0] is not None}
        self._params: dict[str, torch.nn.Parameter] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._zero: list[_ZeroShard] = []
        self._param_of_key = _tied_keys(model)
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        plan_params = plan.params
        for ph, fqn in traced.param_fqns.items():
            full = _materialize(model, fqn, params[fqn])
            local = shard_tensor(full.detach().to(device), self._layouts[ph], self.comm).clone()
            p = torch.nn.Parameter(local, requires_grad=params[fqn].requires_grad)
            self._params[ph] = p
            axes = tuple(plan.mesh_axes_index(a) for a in plan_params[fqn].zero_axes)
            axes = tuple(a for a in axes if self.comm.sizes[a] > 1)
            if axes and p.requires_grad:
                self._zero.append(self._make_zero_shard(p, axes))
        for ph, fqn in traced.buffer_fqns.items():
            full = _materialize(model, fqn, buffers[fqn])
            self._buffers[ph] = shard_tensor(full.detach().to(device), self._layouts[ph], self.comm).clone()
        from autopar.passes.defer_gradient_sync import GRAD_SYNC_KEY
        from autopar.runtime.grad_sync import GradBucketer

        deferred = program.meta.get(GRAD_SYNC_KEY, {})
        self._grad_sync = GradBucketer(
            {self._params[ph]: axes for ph, axes in deferred.items() if self._params[ph].requires_grad},
            self.comm.groups,
        )
        from autopar.passes.insert_collectives import LOSS_LAYOUT_KEY

        self._loss_layout = parse_layout(program.meta[LOSS_LAYOUT_KEY]) if LOSS_LAYOUT_KEY in program.meta else None
        zero_ids = {id(z.param) for z in self._zero}
        opt_params = [p for p in self._params.values() if p.requires_grad and id(p) not in zero_ids]
        opt_params += [z.shard for z in self._zero]
        self.optimizer = optimizer(opt_params)

    # ------------------------------------------------------------------ ZeRO-1/2 slices
    def _zero_slice(self, flat: torch.Tensor, axes) -> torch.Tensor:
        for a in axes:
            n, c = self.comm.sizes[a], self.comm.coords[a]
            pad = (-flat.numel()) % n
            if pad:
                flat = torch.cat([flat, flat.new_zeros(pad)])
            flat = flat.chunk(n)[c]
        return flat

    def _make_zero_shard(self, p: torch.nn.Parameter, axes) -> _ZeroShard:
        shard = torch.nn.Parameter(self._zero_slice(p.detach().reshape(-1), axes).clone())
        return _ZeroShard(p, shard, axes, p.numel())

    def _zero_gather(self, z: _ZeroShard) -> None:
        flat = z.shard.detach()
        sizes = []
        numel = z.numel
        for a in z.axes:  # sizes after each slicing level, to undo padding in reverse
            sizes.append(numel)
            numel = math.ceil(numel / self.comm.sizes[a])
        for a, before in zip(reversed(z.axes), reversed(sizes)):
            flat = apply_steps(flat, reshard_steps((Shard(0),), (Replicate(),)), _axis_comm(self.comm, a))[:before]
        with torch.no_grad():
            z.param.copy_(flat.view_as(z.param))

    # ------------------------------------------------------------------ steps
    def _args(self, inputs: tuple, target: Any) -> list:
        names = self._traced.input_names
        if len(inputs) != len(names):
            raise AutoparError(f"train_step got {len(inputs)} inputs; the model was compiled with {len(names)}")
        feed = dict(zip(names, inputs))
        if self._traced.target_name is not None:
            if target is None:
                raise AutoparError("train_step needs target= (the loss_fn's second argument)")
            feed[self._traced.target_name] = target
        args = []
        for ph in self._placeholders:
            if ph in self._params:
                args.append(self._params[ph])
            elif ph in self._buffers:
                args.append(self._buffers[ph])
            else:
                x = feed[ph]
                if isinstance(x, torch.Tensor):
                    x = shard_tensor(x.to(self._device), self._layouts[ph], self.comm)
                args.append(x)
        return args

    def _run(self, args):
        import contextlib

        from autopar.runtime.param_regather import regather_saved_params

        # saved-tensor hooks only where a parameter is gathered (ZeRO-3): they cost a Python call
        # per saved tensor
        with regather_saved_params() if self._gathers_params else contextlib.nullcontext():
            if self._precision == "bf16-mixed":
                with torch.autocast(self._device.type, dtype=torch.bfloat16):
                    return self.program(*args)
            return self.program(*args)

    def _microbatches(self, inputs: tuple, target: Any) -> list[tuple[tuple, Any]]:
        m = self.plan.microbatches
        if m == 1:
            return [(inputs, target)]
        split = lambda t: t.chunk(m, dim=0) if isinstance(t, torch.Tensor) else [t] * m  # noqa: E731
        parts = [split(x) for x in inputs]
        targets = split(target) if target is not None else [None] * m
        return [(tuple(p[i] for p in parts), targets[i]) for i in range(m)]

    def train_step(self, *inputs: torch.Tensor, target: Any = None) -> float:
        """One optimizer step on the global batch ``inputs`` (identical on every rank).

        With ``plan.microbatches = m`` the batch runs as m slices whose gradients accumulate
        (data-parallel reductions happen once, after the last slice). Returns the global loss
        (the same value on every rank).
        """
        micro = self._microbatches(inputs, target)
        m = len(micro)
        weight = 1.0 / m if self._loss_reduction == "mean" else 1.0
        values, pending = [], []
        with active_mesh(self.comm):
            for i, (x, t) in enumerate(micro):
                self._grad_sync.enabled = i == m - 1
                loss = self._run(self._args(x, t))
                if isinstance(loss, (tuple, list)):
                    loss = loss[0]
                value, works = self._reduce_loss_async(loss)
                values.append(value)
                pending += works
                (loss * (self._loss_grad_scale() * weight)).backward()
            self._grad_sync.wait()
            for z in self._zero:
                g = z.param.grad
                z.shard.grad = None if g is None else self._zero_slice(g.reshape(-1), z.axes).clone()
                z.param.grad = None
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            for z in self._zero:
                self._zero_gather(z)
            for w in pending:
                w.wait()
            total = sum(float(self._finish_loss(v)) for v in values) * weight
        self.step += 1
        return total

    @torch.no_grad()
    def eval_step(self, *inputs: torch.Tensor, target: Any = None) -> float:
        micro = self._microbatches(inputs, target)
        weight = 1.0 / len(micro) if self._loss_reduction == "mean" else 1.0
        total = 0.0
        with active_mesh(self.comm):
            for x, t in micro:
                loss = self._run(self._args(x, t))
                if isinstance(loss, (tuple, list)):
                    loss = loss[0]
                value, pending = self._reduce_loss_async(loss)
                for w in pending:
                    w.wait()
                total += float(self._finish_loss(value))
        return total * weight

    # ------------------------------------------------------------------ the loss value
    def _partial_axes(self) -> list[tuple[int, str]]:
        if self._loss_layout is None:
            return []
        return [(a, p.reduce_op) for a, p in enumerate(self._loss_layout)
                if isinstance(p, Partial) and self.comm.sizes[a] > 1]

    def _loss_grad_scale(self) -> float:
        """d(global loss)/d(local loss): 1/n for each axis the loss is averaged over."""
        scale = 1.0
        for a, op in self._partial_axes():
            if op == "avg":
                scale /= self.comm.sizes[a]
        return scale

    def _reduce_loss_async(self, loss: torch.Tensor):
        value = loss.detach().clone().reshape(1).float()
        works = [dist.all_reduce(value, group=self.comm.groups[a], async_op=True) for a, _ in self._partial_axes()[:1]]
        return value, works

    def _finish_loss(self, value: torch.Tensor) -> float:
        for a, _ in self._partial_axes()[1:]:
            dist.all_reduce(value, group=self.comm.groups[a])
        for a, op in self._partial_axes():
            if op == "avg":
                value = value / self.comm.sizes[a]
        return float(value)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Sharded state (DTensors over the plan's mesh), for torch.distributed.checkpoint."""
        out = {}
        for ph, fqn in self._traced.param_fqns.items():
            out[fqn] = self._dtensor(ph, self._params[ph].detach())
        for ph, fqn in self._traced.buffer_fqns.items():
            out[fqn] = self._dtensor(ph, self._buffers[ph])
        return out

    def _dtensor(self, ph: str, local: torch.Tensor):
        from torch.distributed.tensor import DTensor

        shape = self._shapes[ph]
        # uneven (ZeRO-3) shards need the global shape: DTensor cannot infer it from local sizes
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, self.device_mesh, list(self._layouts[ph]), run_check=False,
                                  shape=torch.Size(shape), stride=stride)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (gathered) tensors under the user's ``model.state_dict()`` keys, on every rank."""
        full: dict[str, torch.Tensor] = {}
        ndim = len(self.comm.sizes)
        with active_mesh(self.comm):
            for ph, fqn in list(self._traced.param_fqns.items()) + list(self._traced.buffer_fqns.items()):
                local = self._params[ph].detach() if ph in self._params else self._buffers[ph]
                shape = self._shapes[ph]
                steps = reshard_steps_for(shape, self._layouts[ph], replicated(ndim), self.comm.sizes)
                full[fqn] = apply_steps(local, steps, self.comm, shape).cpu()
        return {k: full[self._param_of_key.get(k, k)] for k in self._model_keys if self._param_of_key.get(k, k) in full}


def _gathers_params(program: fx.GraphModule) -> bool:
    """Whether any parameter reaches its consumers through an all-gather (ZeRO-3 style)."""
    from autopar.runtime.collectives import reshard

    for n in program.graph.nodes:
        if n.op == "call_function" and n.target is reshard and n.args[0].op == "placeholder" \
                and n.args[0].meta.get("autopar.kind") == "param":
            src, dst = parse_layout(n.args[1]), parse_layout(n.args[2])
            # an unevenly stored parameter (shape given) is always gathered first, whatever dst is
            if n.kwargs.get("shape") is not None or any(step.kind == "all_gather" for step in reshard_steps(src, dst)):
                return True
    return False


def _axis_comm(comm: MeshComm, axis: int) -> MeshComm:
    return MeshComm((comm.groups[axis],), (comm.sizes[axis],), (comm.coords[axis],))


def _tied_keys(model: torch.nn.Module) -> dict[str, str]:
    """state_dict key -> the named_parameters/named_buffers name holding the same tensor."""
    canonical = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        canonical.setdefault(id(t), name)
    out = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        out[name] = canonical.get(id(t), name)
    return out


def _materialize(model: torch.nn.Module, fqn: str, t: torch.Tensor) -> torch.Tensor:
    """A real tensor for ``fqn``: as is, or for a meta tensor, the owning module re-initialised
    alone on CPU (peak memory: one module, not the model)."""
    if not t.is_meta:
        return t
    path, _, leaf = fqn.rpartition(".")
    owner = model.get_submodule(path) if path else model
    if not hasattr(owner, "reset_parameters"):
        raise AutoparError(
            f"parameter {fqn!r} is on the meta device and {type(owner).__name__} has no reset_parameters(); "
            "initialise the model before compile or give the module a reset_parameters()"
        )
    clone = copy.deepcopy(owner).to_empty(device="cpu", recurse=False)
    clone.reset_parameters()
    return getattr(clone, leaf)
