"""Pretrained weights into a ParallelModel's shards, and trained weights out.

``load_weights(pm, source)``: a Hugging Face folder (``model.safetensors``, or sharded with
``model.safetensors.index.json``; ``pytorch_model.bin`` likewise), a DCP checkpoint folder, or a
torch state dict (a dict of full tensors, or a ``.pt``/``.bin`` file, mapped with ``mmap=True``)
is copied into the plan's shards. Invariants:

* each rank reads only the slices its DTensors hold (the chunk each DTensor's local tensor is of
  the global tensor, ``DTensor.__create_chunk_list__``, the protocol DCP plans with); the bytes it
  read are counted and returned (``WeightsLoad.bytes_read``) beside what its slices hold at the
  source's dtype (``slice_bytes``);
* safetensors are sliced directly, each slice read from the file straight into the local shard
  (``WeightFiles.read_into``: no temporary unless the dtype differs, then one slice; nothing stays
  mapped), not through torch's ``HuggingFaceStorageReader``: that reader slices with
  ``safe_open(...).get_slice`` and reads the same bytes (measured equal per rank under
  dp=2 x tp=2 by tests/test_weights.py), but it plans collectively over every rank and names
  neither a missing nor an unexpected key nor a tie; direct slicing needs no collective;
* a DCP folder is read by ``torch.distributed.checkpoint.load`` into the DTensors (its
  ``FileSystemReader`` reads each saved chunk that overlaps a slice whole: the slices when the
  checkpoint was saved sharded as this plan is, whole tensors when one device saved it);
* values are converted to each parameter's dtype; a checkpoint may omit a key tied to another
  (Hugging Face drops ``lm_head.weight`` tied to ``embed_tokens``): fine where the model ties
  them, missing where it does not; missing and unexpected keys and shape mismatches are named in
  one ``WeightsError``, raised on every rank (``strict=False`` returns the missing and unexpected
  keys instead; a shape mismatch is always an error);
* ZeRO-1/2 parameters, loaded into their optimizer shard, are gathered whole again afterwards.
* experts the plan stacks into one parameter (``autopar.stack_experts``: ``P.*.suffix`` holds
  members ``P.0.suffix`` ..., row ``i`` member ``i``) load from their per-expert keys, as the
  one-device model and Hugging Face checkpoints hold them: member ``i``'s slice of the other dims
  fills row ``i`` of the local shard where this rank holds that row (``_load_rows``: only those
  bytes are read); or from the stacked key itself (``pm.state_dict()``, ``model.state_dict()``
  of the module sharded in place, a DCP checkpoint of either). A DCP checkpoint with per-expert
  keys (``dcp.save`` of the one-device model) fills the rows the same way: each row is a DTensor
  over the local shard's row standing for its member (``weight_dcp.row_targets``).

``save_weights(pm, path)``: the full weights written by rank 0, gathered one tensor at a time
(``DTensor.full_tensor()`` on the ranks holding it; every rank takes part), so that no rank holds
more than its shards plus one full tensor. Pipeline stages: each tensor is gathered over the
stage that holds it and its first rank sends it to rank 0 (point to point, in one agreed order),
so one writer writes every file. Tied tensors are written once under the first key, as
``save_pretrained`` does; a stacked expert is written under each member's key (its row; the
stacked parameter gathered once for all its rows); formats: ``"safetensors"`` (what ``from_pretrained`` reads, with the
model's ``config.json`` where it has a Hugging Face config) and ``"torch"`` (one
``torch.save``-able state dict file, as ``model.state_dict()`` holds it, ties included).
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopar.runtime.agreement import decided_by_rank0, gathered
from autopar.runtime.weight_files import (
    SAFE_INDEX, Entry, SafetensorsWriter, TorchFileWriter, WeightFiles, WeightsError, parse_size, shard_files,
)

__all__ = ["load_weights", "save_weights", "WeightsLoad", "WeightsError"]


@dataclass(frozen=True)
class WeightsLoad:
    """What ``load_weights`` did on this rank."""

    source: str  # "safetensors", "torch" or "dcp"
    loaded: tuple[str, ...]  # keys copied into this rank's shards
    tied: tuple[str, ...] = ()  # keys the source omits, filled through the key they are tied to
    missing: tuple[str, ...] = ()  # keys of the model the source lacks (strict=False only)
    unexpected: tuple[str, ...] = ()  # keys of the source the model lacks (strict=False only)
    bytes_read: int = 0  # tensor bytes this rank read from the source
    slice_bytes: int = 0  # bytes of this rank's slices at the source's dtype (the least it can read)
    converted: dict[str, tuple[str, str]] = field(default_factory=dict)  # key -> (source dtype, model dtype)


def load_weights(pm, source: Any, *, strict: bool = True) -> WeightsLoad:
    """Copy pretrained weights into ``pm``'s shards; each rank reads only its slices. Call on every rank.

    ``source``: a folder ``save_pretrained`` wrote (safetensors, single or sharded with an index;
    or ``pytorch_model.bin``), a DCP checkpoint folder (``dcp.save`` of a state dict, or an autopar
    checkpoint's ``step-<n>`` folder: its model entries), a ``torch.save``'d state dict file, or a
    dict of full tensors. Keys are the model's ``state_dict()`` keys.

    >>> pm = autopar.compile(model, cluster, (ids,), example_target=labels, loss_fn=loss_fn, optimizer=opt)
    >>> report = autopar.load_weights(pm, "llama-folder")   # doctest: +SKIP
    """
    pm = _parallel_model(pm)
    pm._require_plan("load_weights")
    kind = _source_kind(source)
    held = _held(pm)
    files, entries, others, problem = None, {}, [], None
    try:
        if kind == "dcp":
            from autopar.runtime.weight_dcp import dcp_entries

            entries, others = dcp_entries(Path(source))
        else:
            files = WeightFiles(source)
            entries = files.entries
    except WeightsError as exc:  # raised on every rank below: a rank that went on alone would wait in a collective
        problem = str(exc)
    _raise_everywhere([problem] if problem else [], "the source does not read")
    unfilled = _never_loaded(pm, held)
    if unfilled:  # a warning, not a refusal: the user may fill them after compile (no collective depends on it)
        warnings.warn(f"load_weights: compile(init='skip') left {', '.join(unfilled)} uninitialised: the model's own "
                      "init did not write them and no checkpoint holds them (they are not in state_dict()): write "
                      "them yourself before the first step (e.g. as the module's __init__ computes them), or compute "
                      "them in the model's init (a module's reset_parameters() or init_weights(), Hugging Face's "
                      "_init_weights), which init='skip' runs for such buffers", UninitialisedBufferWarning,
                      stacklevel=2)
    match = _match(pm, held, entries)
    match.unexpected += others  # a DCP checkpoint's non-tensor entries
    _raise_everywhere(match.problems(strict), "the weights do not fit the model",
                      ". Pass strict=False to load what fits and get the missing and unexpected keys back"
                      if match.missing or match.unexpected else "")
    if kind == "dcp":
        from autopar.runtime.weight_dcp import load_dcp, row_targets

        targets = {k: (held[k], src) for k, src in match.source_of.items()}
        rows, problem = {}, None
        try:  # per-expert keys into the stacked rows
            rows = row_targets(held, match.rows_of)
        except WeightsError as exc:  # on every rank: none goes on into dcp.load alone
            problem = str(exc)
        _raise_everywhere([problem] if problem else [], f"{source}")
        bytes_read = load_dcp(Path(source), {**targets, **rows}, entries)
    else:
        try:
            _load_rows(files, held, match.rows_of)
            bytes_read = _load_slices(files, held, match.source_of)
        except Exception as exc:  # noqa: BLE001 - a damaged file met on one rank: every rank raises
            problem = f"{type(exc).__name__}: {exc}"
        finally:
            files.close()
        _raise_everywhere([problem] if problem else [], f"reading {files.path} failed")
    pm._after_state_load()  # ZeRO-1/2: the optimizer shards were written; gather them whole again
    firsts = {**match.source_of, **{k: next(m for m in ms if m is not None) for k, ms in match.rows_of.items()}}
    slice_bytes = sum(_local_numel(held[k]) * _itemsize(entries[s].dtype) for k, s in firsts.items())
    converted = {k: (str(entries[s].dtype), str(held[k].dtype)) for k, s in firsts.items()
                 if entries[s].dtype != held[k].dtype}
    return WeightsLoad(kind, tuple(firsts), tuple(match.tied), tuple(match.missing) if not strict else (),
                       tuple(match.unexpected) if not strict else (), bytes_read, slice_bytes, converted)


def _source_kind(source: Any) -> str:
    if isinstance(source, dict):
        return "torch"
    if not isinstance(source, (str, os.PathLike)):
        raise WeightsError(f"load_weights: source must be a folder, a file or a state dict, got {type(source).__name__}")

    def decide() -> str:
        p = Path(source)
        if not p.exists():
            raise WeightsError(f"load_weights: {p} does not exist")
        if p.is_dir() and (p / ".metadata").is_file():
            return "dcp"
        files = [p] if p.is_file() else list(p.iterdir())
        return "safetensors" if any(f.suffix == ".safetensors" for f in files) else "torch"

    return decided_by_rank0(decide)  # what a folder holds decides whether dcp.load (a collective) runs


class UninitialisedBufferWarning(UserWarning):
    """``load_weights`` into a model compiled with ``init="skip"`` left buffers no checkpoint holds
    and the model's own init did not write uninitialised (their shards are empty memory until the
    user writes them)."""


def _never_loaded(pm, held: dict) -> list[str]:
    """Buffers of a meta-built model still uninitialised after ``compile(init="skip")`` (which runs
    the model's init for them, ``runtime.shard_init``) that are not in ``state_dict()``
    (non-persistent): no checkpoint can fill them, and an empty shard would silently poison the
    step (a NaN loss)."""
    from autopar.runtime.shard_init import SKIP

    if getattr(pm._builder, "init", None) != SKIP:
        return []  # the model's own init ran over every deferred tensor (``runtime.shard_init``)
    store = pm.store
    return [f"{fqn} (a non-persistent buffer)" for ph, fqn in pm._traced.buffer_fqns.items()
            if ph in store.deferred and fqn not in held]


def _held(pm) -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers under their state_dict keys (tied: each key)."""
    return dict(pm.state_dict(keep_vars=True))


@dataclass
class _Match:
    source_of: dict[str, str]  # held key (one per tied group) -> source key
    tied: list[str]
    missing: list[str]
    unexpected: list[str]
    shapes: list[str]
    rows_of: dict[str, tuple[str | None, ...]] = field(default_factory=dict)  # stacked key -> each row's source key

    def problems(self, strict: bool) -> list[str]:
        out = list(self.shapes)
        if strict and self.missing:
            out.append(f"missing from the source: {', '.join(self.missing)}" + _tie_hint(self.missing))
        if strict and self.unexpected:
            out.append(f"unexpected in the source (not keys of the model): {', '.join(self.unexpected)}")
        return out


def _tie_hint(missing: list[str]) -> str:
    if any(k.endswith("lm_head.weight") for k in missing):
        return (" (a checkpoint omits lm_head.weight when it is tied to the input embedding; this model does not tie "
                "them: build it with config.tie_word_embeddings=True, or load a checkpoint that has the head)")
    return ""


def _targets(pm, entries: dict[str, Entry]) -> dict[str, object]:
    """Every key of the model (all stages) -> what it fills: the name of the tensor it holds (tied
    keys: one name), or ``(stacked fqn, row)`` for an expert the plan stacks (``autopar.stack_experts``:
    member ``i`` is row ``i``). A source holding a stacked parameter whole under its own key
    (``pm.state_dict()``'s, a DCP checkpoint of it) fills it as any tensor: its members then map to it."""
    canon = pm._param_of_key
    out = {key: canon.get(key, key) for key in pm._model_keys}
    for fqn, members in pm._traced.stacked.items():
        for i, member in enumerate(members):
            out[member] = fqn if fqn in entries else (fqn, i)
        if fqn in entries:
            out[fqn] = fqn
    return out


def _match(pm, held: dict[str, torch.Tensor], entries: dict[str, Entry]) -> _Match:
    """Which source key fills each held tensor (a stacked one: which fills each row); what the whole
    model (every stage) misses, what the source has beyond it, and the shapes that differ on this rank."""
    target = _targets(pm, entries)
    groups: dict[object, list[str]] = {}
    for key, t in target.items():
        groups.setdefault(t, []).append(key)
    missing, tied = [], []
    for members in groups.values():
        present = [k for k in members if k in entries]
        if not present:
            missing.extend(members)
        else:  # (the members of a stacked parameter the source holds whole are not ties)
            tied.extend(k for k in members if k not in entries and target[k] not in pm._traced.stacked)
    unexpected = [k for k in entries if k not in target]
    source_of, rows_of, shapes, seen = {}, {}, [], set()
    for key, t in held.items():
        if id(t) in seen:
            continue
        if key in pm._traced.stacked and key not in entries:  # one source key per row
            seen.add(id(t))
            rows = tuple(next((k for k in groups.get((key, i), []) if k in entries), None)
                         for i in range(len(pm._traced.stacked[key])))
            bad = [f"{src} has shape {tuple(entries[src].shape)} in the source, {tuple(t.shape[1:])} in the model "
                   f"(row {i} of {key})" for i, src in enumerate(rows)
                   if src is not None and tuple(entries[src].shape) != tuple(t.shape[1:])]
            shapes.extend(bad)
            if not bad and any(r is not None for r in rows):
                rows_of[key] = rows
            continue
        members = groups.get(target.get(key, key), [key])
        src = key if key in entries else next((k for k in members if k in entries), None)
        if src is None:
            continue
        seen.add(id(t))
        if tuple(entries[src].shape) != tuple(t.shape):
            shapes.append(f"{src} has shape {tuple(entries[src].shape)} in the source, {tuple(t.shape)} in the model")
            continue
        source_of[key] = src
    return _Match(source_of, sorted(tied), missing, unexpected, shapes, rows_of)


def _raise_everywhere(problems: list[str], what: str, fix: str = "") -> None:
    """Raise one ``WeightsError`` on every rank naming every rank's problems (pipeline stages check
    different tensors: a rank without problems must not go on into a collective alone)."""
    every = gathered(problems)
    found = list(dict.fromkeys(p for rank in every for p in rank))
    if found:
        raise WeightsError(f"load_weights: {what}: " + "; ".join(found) + fix)


def _chunk(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of the part of the global tensor this rank's local tensor holds."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return (0,) * t.dim(), tuple(t.shape)
    chunks = t.__create_chunk_list__()
    assert len(chunks) == 1, f"internal: a DTensor local shard in {len(chunks)} chunks"
    offsets, sizes = tuple(chunks[0].offsets), tuple(chunks[0].sizes)
    assert sizes == tuple(_local(t).shape), f"internal: chunk {sizes} but local shard {tuple(_local(t).shape)}"
    return offsets, sizes


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t  # to_local() would record autograd


def _local_numel(t: torch.Tensor) -> int:
    return _local(t).numel()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@torch.no_grad()
def _load_slices(files: WeightFiles, held: dict[str, torch.Tensor], source_of: dict[str, str]) -> int:
    for key, src in source_of.items():
        local = _local(held[key])
        if local.numel() == 0:
            continue
        offsets, sizes = _chunk(held[key])
        files.read_into(src, tuple(slice(o, o + n) for o, n in zip(offsets, sizes)), local)
    return files.bytes_read


@torch.no_grad()
def _load_rows(files: WeightFiles, held: dict[str, torch.Tensor], rows_of: dict[str, tuple[str | None, ...]]) -> None:
    """Stacked experts: member ``i``'s slice of the other dims into row ``i`` of the local shard, for
    the rows this rank holds (only those members, only those slices, are read)."""
    for key, rows in rows_of.items():
        local = _local(held[key])
        if local.numel() == 0:
            continue
        offsets, sizes = _chunk(held[key])
        rest = tuple(slice(o, o + n) for o, n in zip(offsets[1:], sizes[1:]))
        for i in range(offsets[0], offsets[0] + sizes[0]):
            if rows[i] is not None:
                files.read_into(rows[i], rest, local[i - offsets[0]])  # straight into the row, as _load_slices


def _parallel_model(model):
    """The ``ParallelModel`` behind ``model``: itself, or the one the user's module (sharded in
    place by ``autopar.compile``) runs."""
    from autopar.runtime.in_place import is_sharded_in_place, parallel_model_of

    return parallel_model_of(model) if is_sharded_in_place(model) else model


# ----------------------------------------------------------------------------- export


def save_weights(pm, path: str | os.PathLike, *, format: str = "safetensors", max_shard_size: int | str = "5GB",
                 dtype: torch.dtype | None = None, config: Any = None) -> str | None:
    """Write ``pm``'s full weights under the model's ``state_dict()`` keys; call on every rank.
    Rank 0 writes; returns the path on rank 0, None on the others.

    ``format="safetensors"``: ``path`` is a folder laid out as ``save_pretrained`` lays it out
    (``model.safetensors``, or shards of at most ``max_shard_size`` with ``model.safetensors.index.json``),
    plus ``config.json`` when the model has a Hugging Face config (or ``config=`` is given): what
    ``from_pretrained(path)`` reads. ``format="torch"``: ``path`` is one file that
    ``model.load_state_dict(torch.load(path))`` reads. ``dtype``: convert floating tensors (e.g.
    ``torch.bfloat16``). No rank holds more than its shards plus one full tensor.

    >>> autopar.save_weights(pm, "llama-finetuned")   # doctest: +SKIP
    >>> transformers.LlamaForCausalLM.from_pretrained("llama-finetuned")   # doctest: +SKIP
    """
    from autopar.runtime.weight_export import export_plan, gather_one

    pm = _parallel_model(pm)
    pm._require_plan("save_weights")
    if format not in ("safetensors", "torch"):
        raise WeightsError(f"save_weights: format={format!r}; the formats are 'safetensors' (Hugging Face) and 'torch'")
    limit = parse_size(max_shard_size)
    plan = export_plan(pm, dtype)
    rank = dist.get_rank() if dist.is_initialized() else 0
    writer = _Writer(Path(path), format, plan, limit, config if config is not None else _hf_config(pm)) if rank == 0 else None
    failure = writer.failure if writer is not None else None
    held = _held(pm)
    cache: dict = {}  # a stacked parameter, gathered once for its experts' rows (weight_export.gather_one)
    for item in plan.items:
        full = gather_one(held, item, rank, pm._device, cache)
        if writer is not None and full is not None and failure is None:
            try:
                writer.write(item.key, full.to(item.entry.dtype))
            except Exception as exc:  # noqa: BLE001 - the others keep gathering; raised after, on every rank
                failure = f"writing {item.key}: {type(exc).__name__}: {exc}"
        del full
    cache.clear()
    if writer is not None and failure is None:
        try:
            writer.close()
        except Exception as exc:  # noqa: BLE001
            failure = f"finishing the files: {type(exc).__name__}: {exc}"
    verdict = decided_by_rank0(lambda: failure)  # rank 0's writes decide the outcome on every rank
    if verdict:
        raise WeightsError(f"save_weights: {path}: {verdict}")
    return str(path) if rank == 0 else None


def _hf_config(pm):
    model = getattr(pm._builder, "model", None)
    cfg = getattr(model, "config", None)
    return cfg if callable(getattr(cfg, "save_pretrained", None)) else None


class _Writer:
    """Rank 0's files of one export (``failure``: why they could not be prepared, else None)."""

    def __init__(self, path: Path, format: str, plan, limit: int, config):
        self.failure = None
        self._writers: dict[str, Any] = {}
        self._file_of: dict[str, str] = {}
        try:
            if format == "torch":
                path.parent.mkdir(parents=True, exist_ok=True)
                entries = [(k, plan.entry_of(k)) for k in plan.all_keys]
                self._writers[str(path)] = TorchFileWriter(path, entries, plan.aliases)
                self._file_of = {i.key: str(path) for i in plan.items}
                return
            path.mkdir(parents=True, exist_ok=True)
            for stale in [*path.glob("model*.safetensors"), path / SAFE_INDEX]:
                stale.unlink(missing_ok=True)  # a previous export's shards would mix into this one
            files = shard_files([(i.key, i.entry) for i in plan.items], limit, "model", "safetensors")
            entry = {i.key: i.entry for i in plan.items}
            for name, keys in files.items():
                self._writers[name] = SafetensorsWriter(path / name, [(k, entry[k]) for k in keys])
                self._file_of.update(dict.fromkeys(keys, name))
            if len(files) > 1:
                total = sum(_itemsize(e.dtype) * int(torch.Size(e.shape).numel()) for e in entry.values())
                index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(self._file_of.items()))}
                (path / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
            if config is not None:
                config.save_pretrained(str(path))
        except Exception as exc:  # noqa: BLE001 - agreed after the gathers (save_weights)
            self.failure = f"preparing the files: {type(exc).__name__}: {exc}"

    def write(self, key: str, t: torch.Tensor) -> None:
        self._writers[self._file_of[key]].write(key, t)

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
