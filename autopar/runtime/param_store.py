"""This rank's parameters, buffers and gradients, laid out as the plan says.

Invariants:
* every parameter is held as its local shard of the plan's layout (``ParamSlot.local``, what the
  program consumes); ZeRO-3 parameters are that layout's (possibly uneven, ``torch.chunk``-cut)
  shard on the data axes;
* ZeRO-1/2 parameters stay whole on their zero axes for compute; the optimizer sees
  ``ParamSlot.opt``, a *view* of ``local`` cut along ``state_dim`` (DTensor ``Shard(state_dim)``
  on each zero axis), so its state is sharded and the update writes into ``local`` in place;
* gradients live in persistent flat buffers (``grads``, a ``runtime.grad_buffers.GradBuffers``),
  which own every trainable slot's ``.grad`` (and re-attach it where the user took it away);
* replicas start equal: full tensors are broadcast from rank 0 before each rank takes its shard
  (as DDP does), whatever seed each process used; a tensor on the meta device (in rank 0's model:
  the set is agreed, ``meta_fqns``) is not broadcast: its shard is allocated empty (``deferred``)
  and initialised where it lives by the model's own init (``runtime.shard_init``). Where rank 0
  holds a real tensor and another rank a meta one (FSDP1's ``sync_module_states`` habit), that rank
  receives rank 0's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.layouts import Layout, chunk_range, parse_layout, state_dim, zero_gather_in_place
from autopar.runtime.agreement import decided_by_rank0
from autopar.runtime.collectives import gather_dim, shard_tensor
from autopar.runtime.comm import MeshComm
from autopar.runtime.grad_buffers import GradBuffers

__all__ = ["ParamSlot", "ParamStore", "state_chunk"]


@dataclass
class ParamSlot:
    ph: str  # placeholder name in the program
    fqn: str
    shape: tuple[int, ...]  # global shape
    layout: Layout  # the layout the program consumes (ZeRO-3: sharded on the data axes)
    zero_axes: tuple[int, ...]  # ZeRO-1/2: optimizer state (and for stage 2 the gradient) sharded here
    zero_stage: int  # 0, 1, 2 (ZeRO-3 is expressed by ``layout``)
    state_dim: int | None
    local: torch.nn.Parameter
    opt: torch.nn.Parameter | None = None  # what the optimizer updates (None: frozen)

    @property
    def trainable(self) -> bool:
        return self.local.requires_grad


def state_chunk(size: int, zero_axes: Iterable[int], comm: MeshComm) -> tuple[int, int]:
    """(start, length) of this rank's ZeRO state chunk of a dim of ``size``: cut on each zero axis in
    turn (DTensor's order for ``Shard(d)`` on several mesh axes), as ``torch.chunk`` cuts."""
    start, length = 0, size
    for a in sorted(zero_axes):
        s, length = chunk_range(length, comm.sizes[a], comm.coords[a])
        start += s
    return start, length


class ParamStore:
    """Local parameters, buffers and gradient buffers of one rank (see module docstring)."""

    def __init__(self, *, plan, traced, model: torch.nn.Module, comm: MeshComm, device: torch.device,
                 order: list[str], only: set[str] | None = None):
        """``only``: the placeholders this rank holds (a pipeline stage's); every parameter is still
        broadcast from rank 0 in the same order on every rank (the collectives must match), but
        those on the meta device in rank 0's model, which are left for ``shard_init``."""
        self.comm = comm
        self.device = device
        self.slots: dict[str, ParamSlot] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.layouts: dict[str, Layout] = {}
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        # agreed: which tensors the init makes (rank 0's meta ones) and the seed it derives from
        self.meta_fqns, self.init_seed = decided_by_rank0(lambda: (
            frozenset(f for f, t in list(params.items()) + list(buffers.items()) if t.is_meta), torch.initial_seed()))
        self.deferred: set[str] = set()  # placeholders whose shard awaits ``shard_init``
        placed = plan.params
        layouts = {n.name: n.outs[0] for n in plan.nodes.values() if n.outs and n.outs[0] != "-"}
        for ph, fqn in traced.param_fqns.items():
            pp = placed[fqn]
            layout = parse_layout(layouts[ph])
            members = traced.stacked.get(fqn, (fqn,))  # experts stacked on dim 0 (autopar.stack_experts)
            deferred = any(f in self.meta_fqns for f in members)
            if deferred:
                full = None
            else:
                whole = [_materialize(params[f]).detach().to(device) for f in members]
                full = _replicate_from_rank0(torch.stack(whole) if fqn in traced.stacked else whole[0])
                del whole
            if only is not None and ph not in only:
                continue
            self.layouts[ph] = layout
            trainable = params[members[0]].requires_grad
            local = _empty_shard(pp.shape, params[members[0]].dtype, layout, comm, device) if deferred else (
                shard_tensor(full, layout, comm).clone())
            local = torch.nn.Parameter(local, requires_grad=trainable)
            del full
            if deferred:
                self.deferred.add(ph)
            zero_axes = tuple(a for a in (plan.mesh_axes_index(n) for n in pp.zero_axes) if comm.sizes[a] > 1)
            stage = pp.zero_stage if zero_axes else 0
            d = state_dim(pp.shape, layout) if zero_axes else None
            if zero_axes and d is None:
                raise AutoparError(f"internal: the plan ZeRO-shards {fqn} {pp.shape} {pp.layout} but it has no whole dim")
            self.slots[ph] = ParamSlot(ph, fqn, tuple(pp.shape), layout, zero_axes, stage, d, local)
        for ph, fqn in traced.buffer_fqns.items():
            layout = parse_layout(layouts[ph])
            t = buffers[fqn]
            deferred = fqn in self.meta_fqns
            full = None if deferred else _replicate_from_rank0(_materialize(t).detach().to(device))
            if only is not None and ph not in only:
                continue
            self.layouts[ph] = layout
            self.buffers[ph] = _empty_shard(t.shape, t.dtype, layout, comm, device) if deferred else (
                shard_tensor(full, layout, comm).clone())
            if deferred:
                self.deferred.add(ph)
        self.grad_order = [ph for ph in order if ph in self.slots and self.slots[ph].trainable]
        for ph in self.grad_order:  # what the optimizer updates: the slot, or its ZeRO-1/2 piece
            s = self.slots[ph]
            s.opt = self._opt_view(s) if s.zero_stage in (1, 2) else s.local
        self.grads = GradBuffers(self.slots, self.grad_order, device,
                                 lambda s: state_chunk(s.local.shape[s.state_dim], s.zero_axes, comm))

    # ------------------------------------------------------------------ the optimizer's view
    def _opt_view(self, s: ParamSlot) -> torch.nn.Parameter:
        start, length = state_chunk(s.local.shape[s.state_dim], s.zero_axes, self.comm)
        return torch.nn.Parameter(s.local.detach().narrow(s.state_dim, start, length))

    def persistent_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What stays allocated across steps, by memory category (for measurement)."""
        return {
            "params": [s.local for s in self.slots.values()] + list(self.buffers.values()),
            "grads": self.grads.tensors(),
        }

    def optimizer_params(self) -> list[torch.nn.Parameter]:
        return [s.opt for s in self.slots.values() if s.trainable]

    def zero_slots(self) -> list[ParamSlot]:
        return [s for s in self.slots.values() if s.trainable and s.zero_stage in (1, 2)]

    @torch.no_grad()
    def gather_zero_params(self) -> None:
        """ZeRO-1/2, after the optimizer step: all-gather the updated ``Shard(state_dim)`` pieces
        back into the whole parameter. In place where each shard is a contiguous block of it
        (``layouts.zero_gather_in_place``: no buffer, no copy back; on 4 gloo processes an 8 MiB
        gather so took 8.3 ms against 13.6 into a new buffer copied back), else through a buffer.
        Each parameter's version counter moves, as any in-place write's would (c10d's and a
        ``no_grad`` copy into a leaf's storage may not move it): a graph saved before the step
        then refuses to backward through the overwritten values instead of using them."""
        comm = self.comm
        for s in self.zero_slots():
            d = s.state_dim
            if s.local.is_contiguous() and zero_gather_in_place(s.local.shape, d, s.zero_axes, comm.sizes):
                comm.all_gather(s.local, s.opt.detach(), s.zero_axes[0])
                _written(s.local)
                continue
            lengths = [s.local.shape[d]]  # the dim's length before each level of chunking
            for a in sorted(s.zero_axes)[:-1]:
                lengths.append(chunk_range(lengths[-1], comm.sizes[a], comm.coords[a])[1])
            x = s.opt.detach()
            for a, size in zip(reversed(sorted(s.zero_axes)), reversed(lengths)):
                x = gather_dim(x, d, comm, a, size if size % comm.sizes[a] else None)
            s.local.copy_(x)
            _written(s.local)


def _written(t: torch.Tensor) -> None:
    """Move ``t``'s version counter once, whatever the write into its storage already did."""
    torch.autograd.graph.increment_version(t)


def _replicate_from_rank0(t: torch.Tensor) -> torch.Tensor:
    """Make every rank hold rank 0's values (processes seeded differently initialise differently)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = t.contiguous()
        dist.broadcast(t, src=0)
    return t


def _materialize(t: torch.Tensor) -> torch.Tensor:
    """A real tensor for ``t``: as is, or for a meta tensor (rank 0 holds a real one, which
    ``_replicate_from_rank0`` broadcasts into it) an uninitialised one of its shape."""
    return torch.empty(t.shape, dtype=t.dtype) if t.is_meta else t


def _empty_shard(shape, dtype: torch.dtype, layout: Layout, comm: MeshComm, device: torch.device) -> torch.Tensor:
    """This rank's shard of a ``shape`` tensor under ``layout``, allocated and uninitialised."""
    local_shape = shard_tensor(torch.empty(tuple(shape), device="meta"), layout, comm).shape
    return torch.empty(local_shape, dtype=dtype, device=device)
