"""The files of a checkpoint: folders, the manifest, verification, and reading DCP metadata safely.

A checkpoint is the folder ``root/step-<step>/``, holding what torch.distributed.checkpoint
wrote (``.metadata``, ``__<rank>_<n>.distcp``), each rank's ``extra-rank<r>.pt`` (step, RNG
states, optimizer hyperparameters, tracked objects' states), the plan (``plan.json``) and, last,
``manifest.json``. Invariants:

* a save writes into ``step-<step>.partial`` and only a complete save is renamed to
  ``step-<step>``, after its manifest is written: a folder without a valid ``manifest.json``
  (a save that died midway) is never loaded;
* the manifest names every other file of the folder with its size and sha256; ``verify`` finds a
  missing, truncated or altered file and names it;
* loading runs no pickled code: tensors and extras load with ``torch.load(weights_only=True)``
  and DCP's ``.metadata`` pickle (torch reads it with plain ``pickle.load``) is read here with an
  unpickler that accepts only DCP's own metadata classes, tensor dtypes and shapes.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

from autopar.errors import CheckpointError

__all__ = ["CheckpointError", "MANIFEST", "FORMAT", "step_dir", "partial_dir", "complete_steps", "sha256_of",
           "write_manifest", "read_manifest", "verify", "prune", "SafeReader", "Manifest"]

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_RE = re.compile(r"^step-(\d+)$")
_CHUNK = 1 << 20


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step}"


def partial_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step}.partial"


def complete_steps(root: str | os.PathLike) -> list[int]:
    """Steps of the folders under ``root`` that hold a manifest, oldest first (``.partial``
    folders, and folders without a manifest, are not checkpoints)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m and (child / MANIFEST).is_file():
            out.append(int(m.group(1)))
    return sorted(out)


def sha256_of(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` says (see the module docstring)."""
    step: int
    world_size: int
    plan_fingerprint: str
    mesh: str
    model_class: str
    params: dict  # fqn -> [shape, dtype]: what identifies the model
    files: dict  # relative path -> {"bytes": n, "sha256": hex}
    versions: dict
    optimizer: str | None
    batch_rows: int | None = None  # rows of the global batch the saving run compiled for (None: not recorded)


def write_manifest(folder: Path, manifest: Manifest) -> None:
    """Write ``manifest.json`` atomically (a temporary file renamed over it, fsynced)."""
    data = {"format": FORMAT, **manifest.__dict__}
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)


def read_manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder} is not a complete checkpoint: it has no {MANIFEST} (a save that did not "
                              "finish); load another step, or load_latest(root), which skips such folders") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}): the checkpoint's manifest is damaged") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {data.get('format') if isinstance(data, dict) else data!r} "
                              f"(this autopar reads format {FORMAT})")
    data.pop("format")
    try:
        return Manifest(**data)
    except TypeError as exc:
        raise CheckpointError(f"{path} is not an autopar manifest ({exc})") from None


def verify(folder: Path, manifest: Manifest, files: list[str] | None = None) -> list[str]:
    """Problems with ``files`` (default: every file the manifest lists): missing, another size
    (truncated or grown), another sha256 (altered). Empty when every file is as saved."""
    problems = []
    for rel in sorted(manifest.files if files is None else files):
        want = manifest.files[rel]
        path = folder / rel
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            problems.append(f"{path} has {size} bytes, the manifest says {want['bytes']} (truncated or overwritten)")
        elif sha256_of(path) != want["sha256"]:
            problems.append(f"{path} does not match its sha256 in the manifest (altered or corrupted on disk)")
    return problems


def prune(root: Path, keep: int, newest: int) -> None:
    """Delete complete checkpoints beyond the newest ``keep`` and leftover ``.partial`` folders
    of steps before ``newest`` (saves that died)."""
    steps = complete_steps(root)
    for step in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
    for child in root.iterdir():
        m = re.match(r"^step-(\d+)\.partial$", child.name)
        if m and int(m.group(1)) < newest:
            shutil.rmtree(child, ignore_errors=True)


# --------------------------------------------------------------------------- safe metadata
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = frozenset({
    (_DCP_METADATA, name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                       "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
                                       "StorageMeta", "MetadataIndex")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
} | {
    # DCP records the checkpoint path; Python 3.13 pickles pathlib classes from ``pathlib._local``
    (module, name) for module in ("pathlib", "pathlib._local")
    for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
})


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata`` and nothing else: exactly the (module, name) pairs its metadata
    classes, tensor dtypes, layouts and shapes need. A dotted name (which ``find_class`` would
    follow attribute by attribute, e.g. to ``os.system`` through a module's namespace) and any
    other global are refused: they are what a crafted ``.metadata`` would need to run code."""

    def find_class(self, module: str, name: str):
        if "." not in name:
            if (module, name) in _ALLOWED:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
                return getattr(torch, name)
        raise CheckpointError(f"the checkpoint's DCP metadata names {module}.{name}, which a checkpoint never needs; "
                              "refusing to load it (it could run code)")


class SafeReader(FileSystemReader):
    """torch.distributed.checkpoint's file reader with the metadata read by ``_MetadataUnpickler``."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        if hasattr(self, "_get_metadata_path"):  # torch >= 2.12 (rank-local metadata files)
            path = self._get_metadata_path(rank)
        else:
            path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
