"""A ParallelModel's parameters and buffers as DTensors over the plan's mesh, under the user's names.

What makes the torch-native loop work (``opt = torch.optim.SGD(pm.parameters())``,
``clip_grad_norm_``, LR schedulers, ``torch.distributed.checkpoint.state_dict``), as FSDP2's
sharded parameters do. Invariants:

* a parameter's DTensor shares storage with what the program and the optimizer use: its local
  tensor is ``ParamSlot.opt`` (the slot's local shard; under ZeRO-1/2 its ``Shard(state_dim)``
  view on the zero axes), so an optimizer updating the DTensor in place updates the program's
  parameter; a buffer's wraps the store's buffer;
* after backward, ``publish_grads`` sets every trainable parameter's ``.grad`` to a DTensor over
  the gradient the plan reduced (views of the store's buffers: no copy);
* before a plan exists (``autopar.compile`` plans at the first call) the parameters are
  placeholders: DTensors over a meta tensor on a one-axis mesh of all ranks; ``swap_in`` exchanges
  each for its planned DTensor in place (``torch.utils.swap_tensors``), so an optimizer or a
  scheduler built before the first call holds the planned parameters afterwards.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

__all__ = ["make_dtensor", "register_tree", "register_stacked", "placeholder", "slot_placements", "swap_in", "drop_registered", "StateView", "tied_keys"]


def make_dtensor(local: torch.Tensor, mesh, placements, shape, requires_grad: bool) -> DTensor:
    """A leaf DTensor over ``local`` (no copy, no communication): the global ``shape`` is given, so
    uneven (``torch.chunk``-cut) shards need no check across ranks."""
    shape = torch.Size(shape)
    out = DTensor.from_local(local.detach(), mesh, list(placements), run_check=False, shape=shape,
                             stride=torch.empty(shape, device="meta").stride())
    return out.requires_grad_(requires_grad) if requires_grad else out


def placeholder(t: torch.Tensor, mesh) -> DTensor:
    """A stand-in for ``t`` until the plan exists: its shape and dtype, no storage."""
    from torch.distributed.tensor import Replicate

    local = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
    return make_dtensor(local, mesh, [Replicate()] * mesh.ndim, t.shape, t.requires_grad)


def slot_placements(slot) -> tuple:
    """The DTensor placements of what the optimizer sees of a slot: its layout, and under
    ZeRO-1/2 ``Shard(state_dim)`` on each zero axis (where the layout keeps it whole)."""
    out = list(slot.layout)
    for a in slot.zero_axes:
        out[a] = Shard(slot.state_dim)
    return tuple(out)


class _Holder(torch.nn.Module):
    """A node of the user's module tree inside a ParallelModel: it holds parameters and buffers."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module is part of a ParallelModel: call the ParallelModel itself")


def _holder(root: torch.nn.Module, path: str) -> torch.nn.Module:
    """The module at ``path`` under ``root``, made (a ``_Holder``) where missing."""
    node = root
    for part in path.split(".") if path else []:
        if part not in node._modules:
            node._modules[part] = _Holder()
        node = node._modules[part]
    return node


def register_stacked(root: torch.nn.Module, tensors: dict, param_of_key: dict, state: "StateView",
                     stacked: dict[str, tuple[str, ...]]) -> None:
    """Experts the trace merged (``autopar.stack_experts``): the per-expert placeholders leave
    ``tensors`` (name -> registered tensor; the module tree dropped them already, as no rank holds
    them), and the stacked DTensors this rank holds take the names ``P.*.suffix`` in the tree.
    An optimizer built over ``parameters()`` before the plan (compile without example_inputs)
    holds the per-expert placeholders, which no step would update: refused, naming them."""
    import gc

    from autopar.errors import AutoparError

    members = {m for group in stacked.values() for m in group}
    gone = {n: tensors.pop(n) for n in list(tensors) if param_of_key.get(n, n) in members}
    values = list(gone.values())
    # a tensor object cannot tell who keeps it: a list still holding one is an optimizer's param group
    held = [n for n, t in gone.items() if any(isinstance(r, list) and r is not values for r in gc.get_referrers(t))]
    if held:
        raise AutoparError(
            f"the plan stacks the experts {held[0]} .. (an nn.ModuleList called in a loop) into one parameter per weight "
            f"({next(iter(stacked))} ...), but an optimizer built over pm.parameters() before the first call holds the "
            "per-expert ones, which no step would update; build the optimizer after the first call, or compile with "
            "example_inputs= (it plans at once), or pass optimizer= to compile")
    for fqn in stacked:
        if state.holds(fqn):
            tensors[fqn] = state.params[fqn]
            path, _, leaf = fqn.rpartition(".")
            _holder(root, path)._parameters[leaf] = state.params[fqn]


def register_tree(root: torch.nn.Module, model: torch.nn.Module, make) -> dict[str, torch.Tensor]:
    """Register ``make(name, tensor, is_param)`` under every ``model.state_dict()``-style name of
    ``model`` on ``root`` (tied parameters: one object under each name, as in the model; buffers
    keep their ``persistent`` flag). Returns name -> registered tensor (first name of a tie)."""
    made: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}

    for mod_name, mod in model.named_modules(remove_duplicate=False):
        target = _holder(root, mod_name)
        for is_param, own, into in ((True, mod._parameters, target._parameters), (False, mod._buffers, target._buffers)):
            for leaf, t in own.items():
                if t is None:
                    continue
                full = f"{mod_name}.{leaf}" if mod_name else leaf
                if id(t) not in made:
                    made[id(t)] = out[full] = make(full, t, is_param)
                into[leaf] = made[id(t)]
        target._non_persistent_buffers_set.update(mod._non_persistent_buffers_set)
    return out


def drop_registered(root: torch.nn.Module, name: str) -> None:
    """Unregister the parameter or buffer ``name`` (a dotted ``state_dict`` key) from ``root``'s tree."""
    path, _, leaf = name.rpartition(".")
    owner = root.get_submodule(path) if path else root
    owner._parameters.pop(leaf, None)
    owner._buffers.pop(leaf, None)


def swap_in(current: torch.Tensor, planned: torch.Tensor) -> None:
    """Make ``current`` (a placeholder held by the module tree, and maybe by an optimizer) the
    planned tensor, in place."""
    torch.utils.swap_tensors(current, planned)


class StateView:
    """The planned DTensors of one rank's store (see the module docstring)."""

    def __init__(self, store, traced, mesh):
        self.store = store
        self.mesh = mesh
        self.params: dict[str, torch.nn.Parameter] = {}  # fqn -> DTensor parameter
        self.buffers: dict[str, DTensor] = {}
        self._placements: dict[str, tuple] = {}
        for ph, s in store.slots.items():
            local = s.opt if s.opt is not None else s.local
            self._placements[ph] = slot_placements(s) if s.opt is not None else tuple(s.layout)
            self.params[s.fqn] = torch.nn.Parameter(
                make_dtensor(local, mesh, self._placements[ph], s.shape, s.trainable), requires_grad=s.trainable)
        for ph, fqn in traced.buffer_fqns.items():
            if ph not in store.buffers:  # another pipeline stage's
                continue
            shape = traced.node(ph).meta["autopar.outputs"][0].shape
            self.buffers[fqn] = make_dtensor(store.buffers[ph], mesh, store.layouts[ph], shape, False)

    def placements_of(self, ph: str) -> tuple:
        """The DTensor placements of the parameter or buffer ``ph`` as this view serves it."""
        return self._placements[ph]

    def holds(self, fqn: str) -> bool:
        """Whether this rank holds ``fqn`` (a pipeline stage holds only its own)."""
        return fqn in self.params or fqn in self.buffers

    def swap_into(self, fqn: str, current: torch.Tensor) -> None:
        """Make ``current`` (the placeholder registered for ``fqn``) this planned tensor, in place;
        from now on ``current`` is the one this view serves."""
        table = self.params if fqn in self.params else self.buffers
        swap_in(current, table[fqn])
        table[fqn] = current

    def publish_grads(self) -> None:
        """Each trainable parameter's ``.grad``: a DTensor over its reduced gradient (a view)."""
        for ph, s in self.store.slots.items():
            if not s.trainable:
                continue
            p = self.params[s.fqn]
            g = (s.opt if s.opt is not None else s.local).grad
            p.grad = make_dtensor(g, self.mesh, self._placements[ph], p.shape, False)

    def user_grads_cleared(self) -> list[str]:
        """Placeholders whose DTensor ``.grad`` the user set to None (``zero_grad()``)."""
        return [ph for ph, s in self.store.slots.items() if s.trainable and self.params[s.fqn].grad is None]


def tied_keys(model: torch.nn.Module) -> dict[str, str]:
    """state_dict key -> the named_parameters/named_buffers name holding the same tensor."""
    canonical = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        canonical.setdefault(id(t), name)
    out = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        out[name] = canonical.get(id(t), name)
    return out
