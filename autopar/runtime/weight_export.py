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
    stacked: str | None = None  # an expert the plan stacks: the stacked parameter gathered ...
    row: int | None = None  # ... and its row written under ``key``


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
    mine.update(_member_meta(pm, held))
    stage = pm._stage if pm._stage is not None else 0
    rank = dist.get_rank() if dist.is_initialized() else 0
    every = gathered((rank, stage, mine))
    row_of = {m: (fqn, i) for fqn, members in pm._traced.stacked.items() for i, m in enumerate(members)}
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
        items.append(ExportItem(key, Entry(shape, written), held_dtype, ranks, *row_of.get(key, (None, None))))
    items = _rows_together(items)
    aliases = {k: name_of[canon.get(k, k)] for k in pm._model_keys if name_of[canon.get(k, k)] != k}
    return ExportPlan(items, aliases, list(pm._model_keys))


def _member_meta(pm, held: dict) -> dict:
    """Experts the plan stacks (``autopar.stack_experts``), held here: each member key -> its row's
    (shape, dtype), so that each is exported under its own key as the one-device model holds it."""
    return {m: (tuple(held[fqn].shape[1:]), held[fqn].dtype)
            for fqn, members in pm._traced.stacked.items() if fqn in held for m in members}


def _rows_together(items: list[ExportItem]) -> list[ExportItem]:
    """``items`` with each stacked parameter's rows moved up to its first row (the state_dict order
    interleaves experts' weights), so that it is gathered once and dropped before the next."""
    out, rows = [], {}
    for item in items:
        if item.stacked is None:
            out.append(item)
        elif item.stacked not in rows:
            rows[item.stacked] = [item]
            out.append(rows[item.stacked])
        else:
            rows[item.stacked].append(item)
    return [i for x in out for i in (x if isinstance(x, list) else [x])]


@torch.no_grad()
def gather_one(held: dict[str, torch.Tensor], item: ExportItem, rank: int, device,
               cache: dict | None = None) -> torch.Tensor | None:
    """``item``'s full tensor on rank 0 (on CPU), None elsewhere; every rank calls it in plan order.
    ``held``: this rank's ``pm.state_dict(keep_vars=True)``. A stacked expert's row: its stacked
    parameter is gathered once and kept in ``cache`` (one at a time) for the rows that follow."""
    from torch.distributed.tensor import DTensor

    full = None
    if rank in item.ranks:
        name = item.stacked or item.key
        if cache is not None and name in cache:
            full = cache[name]
        else:
            if cache is not None:
                cache.clear()
            t = held[name]
            full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
            if cache is not None and item.stacked is not None:
                cache[name] = full
        if item.row is not None:
            full = full[item.row]
        sender = item.ranks[0]
        if rank == sender and sender != 0:
            dist.send(full.contiguous(), dst=0)
            return None
    elif rank == 0:
        full = torch.empty(item.entry.shape, dtype=item.held_dtype, device=device)
        dist.recv(full, src=item.ranks[0])
    return full.cpu() if rank == 0 else None
