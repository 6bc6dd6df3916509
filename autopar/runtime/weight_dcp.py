"""A DCP checkpoint folder as a source of pretrained weights (``weights.load_weights``).

``torch.distributed.checkpoint.load`` reads into the DTensors themselves (its planner resolves
each rank's slices); ``CountingReader`` counts the tensor bytes it reads: ``FileSystemReader``
reads every saved chunk that overlaps a slice whole (then narrows it), so a checkpoint saved from
one device is read a whole tensor per rank, one saved sharded as this plan is only its slices.
An autopar checkpoint's ``step-<n>`` folder holds the model under ``model/<key>`` (beside the
optimizer's ``optim/...`` entries and extras): its model entries are the source.

Experts the plan stacks (``P.*.suffix``, member ``i`` in row ``i``) load from per-expert keys (a
checkpoint ``dcp.save`` wrote from the one-device model) through ``row_targets``: each row this
rank holds is a DTensor over that row of the local shard (a view, no copy) standing for member
``i`` whole, so ``dcp.load`` plans, reads and writes member ``i``'s slice straight into the row.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

from autopar.runtime.weight_files import Entry, WeightsError

__all__ = ["dcp_entries", "load_dcp", "row_targets", "CountingReader"]

_AUTOPAR_PREFIX = "model/"


def _metadata(folder: Path):
    try:
        return FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - named with the folder
        raise WeightsError(f"{folder}: its DCP .metadata does not read: {type(exc).__name__}: {exc}") from exc


def _prefix(keys) -> str:
    return _AUTOPAR_PREFIX if any(k.startswith(_AUTOPAR_PREFIX) for k in keys) else ""


def dcp_entries(folder: Path) -> tuple[dict[str, Entry], list[str]]:
    """(the checkpoint's tensors by model key, its other keys): an autopar checkpoint's non-model
    entries (optimizer, extras) are not weights and are left out of both."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = _metadata(folder).state_dict_metadata
    prefix = _prefix(md)
    entries, others = {}, []
    for key, m in md.items():
        if prefix and not key.startswith(prefix):
            continue
        if isinstance(m, TensorStorageMetadata):
            entries[key[len(prefix):]] = Entry(tuple(m.size), m.properties.dtype)
        else:
            others.append(key[len(prefix):])
    return entries, others


class CountingReader(FileSystemReader):
    """``FileSystemReader`` counting the bytes of the saved chunks it reads (``bytes_read``)."""

    bytes_read = 0

    def read_data(self, plan, planner):
        self.bytes_read += sum(self.storage_data[item.storage_index].length for item in plan.items)
        return super().read_data(plan, planner)


@torch.no_grad()
def load_dcp(folder: Path, targets: dict[str, tuple[torch.Tensor, str]], entries: dict[str, Entry]) -> int:
    """Load ``targets`` (model key -> (this rank's tensor, source key)) from the DCP ``folder``;
    returns the bytes read. Every rank calls it (``dcp.load`` plans over all ranks). A tensor whose
    stored dtype differs is read into a shard of that dtype, then converted."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from autopar.runtime.copyable_state import copyable
    from autopar.runtime.dtensor_params import make_dtensor

    prefix = _prefix(_metadata(folder).state_dict_metadata)
    state, converts = {}, []
    for key, (t, src) in targets.items():
        want = entries[src].dtype
        if want == t.dtype:
            state[prefix + src] = copyable(t.detach())
            continue
        local = t._local_tensor if isinstance(t, DTensor) else t
        tmp = torch.empty(local.shape, dtype=want, device=local.device)
        state[prefix + src] = make_dtensor(tmp, t.device_mesh, t.placements, t.shape, False) if isinstance(t, DTensor) else tmp
        converts.append((local, tmp))
    reader = CountingReader(str(folder))
    dcp.load(state, storage_reader=reader)
    for local, tmp in converts:
        local.copy_(tmp)
    return reader.bytes_read


def row_targets(held: dict[str, torch.Tensor], rows_of: dict[str, tuple[str | None, ...]]) -> dict[str, tuple[torch.Tensor, str]]:
    """For ``load_dcp``: each row ``i`` of a stacked parameter this rank holds, whose member the
    checkpoint has (``rows_of[key][i]``), as member ``i``'s global tensor: a DTensor over
    ``local[i - first row]`` whose placements are the stacked one's with the expert dim dropped
    (``Shard(0)``, the axes splitting the experts, becomes ``Replicate``: this rank holds member
    ``i``'s every element along them; ``Shard(d)`` becomes ``Shard(d - 1)``). Its chunk is the
    row's chunk of the stacked tensor without dim 0 (checked)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from autopar.runtime.dtensor_params import make_dtensor

    out = {}
    for key, rows in rows_of.items():
        t = held[key]
        if not isinstance(t, DTensor):  # held whole: every row
            out.update({f"{key}[{i}]": (t[i], src) for i, src in enumerate(rows) if src is not None})
            continue
        local = t._local_tensor
        if local.numel() == 0:
            continue
        (chunk,) = t.__create_chunk_list__()
        first, held_rows = chunk.offsets[0], chunk.sizes[0]
        placements = [Replicate() if isinstance(p, Shard) and p.dim == 0 else Shard(p.dim - 1) if isinstance(p, Shard) else p
                      for p in t.placements]
        for i in range(first, first + held_rows):
            if rows[i] is None:
                continue
            row = make_dtensor(local[i - first], t.device_mesh, placements, t.shape[1:], False)
            (got,) = row.__create_chunk_list__()
            if (tuple(got.offsets), tuple(got.sizes)) != (tuple(chunk.offsets[1:]), tuple(chunk.sizes[1:])):
                raise WeightsError(f"load_weights: internal: row {i} of {key} ({t.placements}) maps to the chunk "
                                   f"{tuple(got.offsets)}+{tuple(got.sizes)} of {rows[i]}, not {tuple(chunk.offsets[1:])}"
                                   f"+{tuple(chunk.sizes[1:])}")
            out[f"{key}[{i}]"] = (row, rows[i])
    return out
