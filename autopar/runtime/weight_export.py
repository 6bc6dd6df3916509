"""The full weights of a ParallelModel, one tensor at a time, for ``weights.save_weights``.

``export_plan(pm)``: the same ordered list of tensors on every rank (the model's ``state_dict``
order, one key per tied group: the first, as ``save_pretrained`` keeps it), each with the ranks
that take part in gathering it: those of the lowest pipeline stage holding it (every rank without
pipelining). ``gather_one``: on those ranks ``DTensor.full_tensor()`` (a collective over the
stage's mesh; each rank holds the full tensor until the caller drops it); the first of them sends
it to rank 0 where that is another rank (pipeline stages but the first). Every rank walks the same
list, so the collectives and sends match: no rank holds more than its shards plus one full tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.runtime.agreement import gathered
from autopar.runtime.weight_files import Entry

__all__ = ["ExportItem", "ExportPlan", "export_plan", "gather_one"]


@dataclass(frozen=True)
class ExportItem:
    key: str
    entry: Entry  # the shape and the dtype written
    held_dtype: torch.dtype  # the dtype the model holds (what is gathered and sent)
    ranks: tuple[int, ...]  # the ranks gathering it (one stage's); ranks[0] sends it to rank 0


@dataclass(frozen=True)
class ExportPlan:
    items: list[ExportItem]  # one per tensor, in the model's state_dict order
    aliases: dict[str, str]  # a tied key -> the key written for it
    all_keys: list[str]  # every state_dict key, in order

    def entry_of(self, key: str) -> Entry:
        return next(i.entry for i in self.items if i.key == self.aliases.get(key, key))


def export_plan(pm, dtype: torch.dtype | None = None) -> ExportPlan:
    """The agreed export order (one small all-gather of what each rank holds)."""
    held = dict(pm.state_dict(keep_vars=True))
    first_of: dict[int, str] = {}
    for key in pm._model_keys:  # the first key of a tie names it, on every rank
        if key in held:
            first_of.setdefault(id(held[key]), key)
    canon = pm._param_of_key
    name_of = {}  # tensor name -> the key written: the first state_dict key holding it
    for key in pm._model_keys:
        name_of.setdefault(canon.get(key, key), key)
    mine = {first_of[id(t)]: (tuple(t.shape), t.dtype) for key, t in held.items() if first_of.get(id(t)) == key}
    stage = pm._stage if pm._stage is not None else 0
    rank = dist.get_rank() if dist.is_initialized() else 0
    every = gathered((rank, stage, mine))
    items = []
    for key in pm._model_keys:
        if name_of[canon.get(key, key)] != key:
            continue
        holders = [(s, r, meta[key]) for r, s, meta in every if key in meta]
        assert holders, f"internal: no rank holds {key}"
        owner = min(s for s, _, _ in holders)
        ranks = tuple(sorted(r for s, r, _ in holders if s == owner))
        shape, held_dtype = holders[0][2]
        written = dtype if dtype is not None and held_dtype.is_floating_point else held_dtype
        items.append(ExportItem(key, Entry(shape, written), held_dtype, ranks))
    aliases = {k: name_of[canon.get(k, k)] for k in pm._model_keys if name_of[canon.get(k, k)] != k}
    return ExportPlan(items, aliases, list(pm._model_keys))


@torch.no_grad()
def gather_one(held: dict[str, torch.Tensor], item: ExportItem, rank: int, device) -> torch.Tensor | None:
    """``item``'s full tensor on rank 0 (on CPU), None elsewhere; every rank calls it in plan order.
    ``held``: this rank's ``pm.state_dict(keep_vars=True)``."""
    from torch.distributed.tensor import DTensor

    full = None
    if rank in item.ranks:
        t = held[item.key]
        full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
        sender = item.ranks[0]
        if rank == sender and sender != 0:
            dist.send(full.contiguous(), dst=0)
            return None
    elif rank == 0:
        full = torch.empty(item.entry.shape, dtype=item.held_dtype, device=device)
        dist.recv(full, src=item.ranks[0])
    return full.cpu() if rank == 0 else None
