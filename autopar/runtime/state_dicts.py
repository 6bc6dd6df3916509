"""A ``ParallelModel``'s full (gathered) state dicts, and full tensors cut into its shards.

``pm.state_dict()`` is torch's (the sharded DTensors, for torch.distributed.checkpoint); these
are the one-device views: ``full_state_dict`` and ``full_optimizer_state_dict`` gather every
entry whole on every rank (pipeline stages merged, stacked experts unstacked under their own
names), and ``shards_of_full`` cuts plain full tensors into this rank's shards locally (no
communication), as DCP's ``set_model_state_dict(..., full_state_dict=True)`` does. Stateless:
everything is read from the model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.layouts import replicated
from autopar.resharding import reshard_steps_for
from autopar.runtime.collectives import apply_steps
from autopar.stack_experts import unstack_entries

__all__ = ["full_optimizer_state_dict", "full_state_dict", "shards_of_full"]


def shards_of_full(pm, state_dict) -> dict:
    """``state_dict`` with each plain full tensor that fills a DTensor of ``pm`` replaced by
    a DTensor of this rank's shard of it (cut locally: no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    sd = dict(state_dict)
    for fqn, members in pm._traced.stacked.items():  # per-expert entries -> the stacked parameter
        if fqn not in sd and all(m in sd and not isinstance(sd[m], DTensor) for m in members):
            sd[fqn] = torch.stack([sd.pop(m) for m in members])
    own = torch.nn.Module.state_dict(pm, keep_vars=True)
    members = {m for group in pm._traced.stacked.values() for m in group}
    for key in list(sd):
        if key not in own and (key in pm._model_keys or key in members):
            del sd[key]  # another pipeline stage's (or a stacked expert's, given whole): not held here
    for key, value in sd.items():
        mine = own.get(key)
        if not isinstance(mine, DTensor) or isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
            continue
        if tuple(value.shape) != tuple(mine.shape):
            raise AutoparError(f"load_state_dict: {key} has shape {tuple(value.shape)} in the state dict, "
                               f"{tuple(mine.shape)} in the model; load a state dict of this model")
        full = value.detach().to(device=mine.to_local().device, dtype=mine.dtype)
        sd[key] = distribute_tensor(full, mine.device_mesh, mine.placements, src_data_rank=None)
    return sd


@torch.no_grad()
def full_optimizer_state_dict(pm) -> dict[str, torch.Tensor]:
    """train_step's optimizer state, gathered whole on every rank: ``"<fqn>/<state key>"`` ->
    tensor (what a checkpoint's ``optim/`` entries hold, as one device would)."""
    from torch.distributed.tensor import DTensor

    from autopar.runtime.checkpoint_state import optimizer_entries

    tensors, _ = optimizer_entries(pm, pm.optimizer)
    full = {k[len("optim/"):]: (t.full_tensor() if isinstance(t, DTensor) else t).to("cpu", copy=True)
            for k, t in sorted(tensors.items())}
    return unstack_entries(merged_over_stages(pm._pp_group, full), pm._traced.stacked)


@torch.no_grad()
def full_state_dict(pm) -> dict[str, torch.Tensor]:
    """Full (gathered) copies under the user's ``model.state_dict()`` keys, on every rank."""
    store, comm = pm.store, pm.comm
    full: dict[str, torch.Tensor] = {}
    ndim = len(comm.sizes)
    for ph, fqn in list(pm._traced.param_fqns.items()) + list(pm._traced.buffer_fqns.items()):
        if ph not in pm._layouts:
            continue  # another pipeline stage's (gathered below)
        shape = pm._shapes[ph]
        steps = reshard_steps_for(shape, pm._layouts[ph], replicated(ndim), comm.sizes)
        local = store.slots[ph].local.detach() if ph in store.slots else store.buffers[ph]
        # a copy: for a replicated tensor no step runs, and the live parameter would be returned
        full[fqn] = apply_steps(local, steps, comm, shape).to("cpu", copy=True)
    full = unstack_entries(merged_over_stages(pm._pp_group, full), pm._traced.stacked)
    return {k: full[pm._param_of_key.get(k, k)] for k in pm._model_keys if pm._param_of_key.get(k, k) in full}


def merged_over_stages(pp_group, mine: dict) -> dict:
    """``mine`` (this rank's stage's entries) merged with every other pipeline stage's, on every
    rank; as is without pipelining (``pp_group`` None)."""
    if pp_group is None:
        return mine
    parts: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(parts, mine, group=pp_group)
    return {k: v for part in parts for k, v in part.items()}
