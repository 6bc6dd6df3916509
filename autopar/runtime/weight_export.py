"""The full tensors of a ParallelModel, one at a time, wherever their shards live: for
``weights.save_weights`` (to rank 0) and for ``in_place`` (``export_module`` and the eager
``model(x)``: to every rank).

``owners(pm, held)``: per tensor name, its global shape, dtype and the ranks holding it: those of
the lowest pipeline stage holding it (every rank without pipelining); the same on every rank (one
small all-gather of what each rank holds). ``fetch_whole``: on those ranks
``DTensor.full_tensor()`` (a collective over the stage's mesh); the first of them sends it to rank
0 (``to=0``) or broadcasts it to every rank (``to=None``) where the others do not hold it (pipeline
stages): a receiver allocates it from the shape and dtype ``owners`` gave. Every rank calls it for
the same tensors in the same order, so the collectives and sends match: no rank holds more than its
shards plus the full tensors its caller keeps.

``export_plan(pm)``: the ordered list ``save_weights`` writes (the model's ``state_dict`` order, one
key per tied group: the first, as ``save_pretrained`` keeps it; an expert the plan stacks under its
own key, as the one-device model holds it, the rows of one stacked parameter next to each other),
each with its owner; ``gather_one`` fetches one item to rank 0 (a stacked parameter once for all
its rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.runtime.agreement import gathered
from autopar.runtime.weight_files import Entry

__all__ = ["Owner", "owners", "fetch_whole", "ExportItem", "ExportPlan", "export_plan", "gather_one"]


@dataclass(frozen=True)
class Owner:
    """Where one tensor lives: its global shape, dtype and ``requires_grad``, and the ranks holding
    it (one pipeline stage's, in rank order: ``ranks[0]`` sends it to the others)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    ranks: tuple[int, ...]


def owners(pm, held: dict[str, torch.Tensor]) -> dict[str, Owner]:
    """name -> ``Owner`` for every name some rank holds (``held``: this rank's tensors by name),
    in one order on every rank. A collective: every rank calls it."""
    stage = pm._stage if pm._stage is not None else 0
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = {k: (tuple(t.shape), t.dtype, bool(t.requires_grad)) for k, t in held.items()}
    every = gathered((rank, stage, mine))
    out = {}
    for key in dict.fromkeys(k for _, _, meta in every for k in meta):
        holders = [(s, r, meta[key]) for r, s, meta in every if key in meta]
        first = min(s for s, _, _ in holders)
        shape, dtype, grad = holders[0][2]
        out[key] = Owner(shape, dtype, grad, tuple(sorted(r for s, r, _ in holders if s == first)))
    return out


@torch.no_grad()
def fetch_whole(t: torch.Tensor | None, owner: Owner, rank: int, device, to: int | None = None) -> torch.Tensor | None:
    """The full tensor ``t`` (this rank's DTensor or plain tensor; None where this rank does not
    hold it) on rank ``to``, or on every rank where ``to`` is None; None on the other ranks. Every
    rank calls it (see the module docstring). The result may share storage with ``t`` (a replicated
    DTensor's local tensor)."""
    from torch.distributed.tensor import DTensor

    full = None
    if rank in owner.ranks:
        assert t is not None, f"internal: rank {rank} owns a tensor it does not hold"
        full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
    sender = owner.ranks[0]
    if to is None:
        if len(owner.ranks) < (dist.get_world_size() if dist.is_initialized() else 1):
            if full is None:
                full = torch.empty(owner.shape, dtype=owner.dtype, device=device)
            full = full.contiguous()
            # gloo broadcasts no bool: its bytes as uint8
            dist.broadcast(full.view(torch.uint8) if full.dtype is torch.bool else full, src=sender)
        return full
    if to in owner.ranks:
        return full if rank == to else None
    if rank == sender:
        dist.send(full.contiguous(), dst=to)
    elif rank == to:
        full = torch.empty(owner.shape, dtype=owner.dtype, device=device)
        dist.recv(full, src=sender)
    return full if rank == to else None


@dataclass(frozen=True)
class ExportItem:
    key: str
    entry: Entry  # the shape and the dtype written
    owner: Owner  # where it lives, at the dtype the model holds (what is gathered and sent)
    stacked: str | None = None  # an expert the plan stacks: its stacked parameter is gathered ...
    row: int | None = None  # ... and this row written under ``key``

    @property
    def ranks(self) -> tuple[int, ...]:  # the ranks gathering it (one stage's); ranks[0] sends it to rank 0
        return self.owner.ranks


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
    mine = {key: t for key, t in held.items() if first_of.get(id(t)) == key}
    mine.update((fqn, held[fqn]) for fqn in pm._traced.stacked if fqn in held)
    where = owners(pm, mine)
    row_of = {m: (fqn, i) for fqn, members in pm._traced.stacked.items() for i, m in enumerate(members)}
    items = []
    for key in pm._model_keys:
        if name_of[canon.get(key, key)] != key:
            continue
        stacked, row = row_of.get(key, (None, None))
        o = where.get(stacked or key)
        assert o is not None, f"internal: no rank holds {stacked or key}"
        shape = o.shape[1:] if stacked is not None else o.shape
        written = dtype if dtype is not None and o.dtype.is_floating_point else o.dtype
        items.append(ExportItem(key, Entry(shape, written), o, stacked, row))
    items = _rows_together(items)
    aliases = {k: name_of[canon.get(k, k)] for k in pm._model_keys if name_of[canon.get(k, k)] != k}
    return ExportPlan(items, aliases, list(pm._model_keys))


def _rows_together(items: list[ExportItem]) -> list[ExportItem]:
    """``items`` with each stacked parameter's rows moved up to its first row (the state_dict order
    interleaves experts' weights), so that it is gathered once and dropped before the next."""
    out, rows = [], {}
    for item in items:
        if item.stacked is None:
            out.append([item])
        elif item.stacked not in rows:
            rows[item.stacked] = [item]
            out.append(rows[item.stacked])
        else:
            rows[item.stacked].append(item)
    return [i for group in out for i in group]


def gather_one(held: dict[str, torch.Tensor], item: ExportItem, rank: int, device,
               cache: dict | None = None) -> torch.Tensor | None:
    """``item``'s full tensor on rank 0 (on CPU), None elsewhere; every rank calls it in plan order.
    ``held``: this rank's ``pm.state_dict(keep_vars=True)``. A stacked expert's row: its stacked
    parameter is fetched once and kept in ``cache`` (one at a time, on every rank: None where it
    did not arrive) for the rows that follow."""
    name = item.stacked or item.key
    if cache is not None and name in cache:
        full = cache[name]
    else:
        full = fetch_whole(held.get(name), item.owner, rank, device, to=0)
        if cache is not None:
            cache.clear()
            if item.stacked is not None:
                cache[name] = full
    if full is not None and item.row is not None:
        full = full[item.row]
    return full.cpu() if full is not None else None
