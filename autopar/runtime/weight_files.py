"""Weight files, one tensor at a time: Hugging Face safetensors (single or sharded with an index)
and torch ``state_dict`` files, read by slices and written as a stream.

Invariants:
* reading: ``WeightFiles.read(key, slices)`` returns only the requested slice of one tensor
  (safetensors: ``safe_open(...).get_slice(key)[slices]``; torch files: loaded with ``mmap=True``,
  then the slice is copied out of the mapping) and adds its bytes to ``bytes_read``;
* writing: every file's layout (its safetensors header, or a torch file's skeleton) is written
  first from the tensors' shapes and dtypes, then each tensor's bytes are written in place as it
  arrives; the writer never holds more than the one tensor it is given;
* the Hugging Face layout is ``save_pretrained``'s: ``model.safetensors``, or past
  ``max_shard_size`` ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``
  (``{"metadata": {"total_size": ...}, "weight_map": {key: file}}``), tensors greedily packed in
  key order as ``transformers`` does.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from autopar.errors import WeightsError

__all__ = ["Entry", "WeightFiles", "SafetensorsWriter", "TorchFileWriter", "shard_files", "parse_size", "WeightsError",
           "SAFE_INDEX", "SAFE_SINGLE", "TORCH_INDEX", "TORCH_SINGLE"]

SAFE_SINGLE, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_SINGLE, TORCH_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    """One tensor of a weight source: its global shape and stored dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or ``transformers``' spelling ("5GB" = 5e9, "500MiB" = 500 * 2**20)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B\s*", str(size), re.I)
    if not m:
        raise WeightsError(f"max_shard_size={size!r}: give bytes as an int > 0 or a size such as '5GB' or '500MiB'")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** "_KMGT".index(m.group(2).upper() or "_"))


class WeightFiles:
    """The tensors of a folder of weight files (or one file), opened for slicing.

    ``folder`` holds ``model.safetensors.index.json`` or ``pytorch_model.bin.index.json`` (sharded),
    else ``model.safetensors`` or ``pytorch_model.bin``, else any ``*.safetensors`` files; a file path
    is one safetensors or torch file."""

    def __init__(self, path: str | os.PathLike | dict):
        """``path``: a folder or a file as above, or a state dict of full tensors (read in place)."""
        self.bytes_read = 0
        self._handles: dict[Path, object] = {}
        self.file_of: dict[str, Path] = {}
        self.entries: dict[str, Entry] = {}
        given = isinstance(path, dict)
        self.path = Path("the state dict given") if given else Path(path)
        for file in [self.path] if given else self._files():
            for key, entry in (self._take(path, file) if given else self._open(file)).items():
                self.file_of[key] = file
                self.entries[key] = entry

    def _files(self) -> list[Path]:
        p = self.path
        if p.is_file():
            return [p]
        for index in (SAFE_INDEX, TORCH_INDEX):
            if (p / index).is_file():
                weight_map = json.loads((p / index).read_text())["weight_map"]
                return [p / name for name in dict.fromkeys(weight_map.values())]
        for single in (SAFE_SINGLE, TORCH_SINGLE):
            if (p / single).is_file():
                return [p / single]
        found = sorted(p.glob("*.safetensors"))
        if not found:
            raise WeightsError(f"{p} holds no weights: expected {SAFE_SINGLE}, {SAFE_INDEX}, {TORCH_SINGLE} or "
                               f"{TORCH_INDEX} (what save_pretrained writes), or a DCP checkpoint (.metadata)")
        return found

    def _open(self, file: Path) -> dict[str, Entry]:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            f = safe_open(str(file), framework="pt")
            self._handles[file] = f
            return {k: Entry(tuple(f.get_slice(k).get_shape()), _DTYPES[f.get_slice(k).get_dtype()]) for k in f.keys()}
        try:
            sd = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - named with the file and the fix
            raise WeightsError(f"{file} is not a torch state dict that loads with torch.load(weights_only=True, "
                               f"mmap=True): {type(exc).__name__}: {exc}") from exc
        return self._take(sd, file)

    def _take(self, sd: dict, file: Path) -> dict[str, Entry]:
        """A state dict of full tensors as the source of its keys; their entries."""
        from torch.distributed.tensor import DTensor

        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
                                               for v in sd.values()):
            raise WeightsError(f"{file} is not a state dict of full tensors (a dict of plain tensors): save one with "
                               "torch.save(model.state_dict(), path); DTensors (pm.state_dict()) load with "
                               "pm.load_state_dict")
        self._handles[file] = sd
        return {k: Entry(tuple(v.shape), v.dtype) for k, v in sd.items()}

    def read(self, key: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """The ``slices`` of tensor ``key`` (only those bytes are read)."""
        h = self._handles[self.file_of[key]]
        if isinstance(h, dict):
            t = h[key]
            out = t[slices] if t.dim() else t
        else:
            out = h.get_slice(key)[slices] if slices else h.get_tensor(key)
        self.bytes_read += out.numel() * out.element_size()
        return out

    def close(self) -> None:
        self._handles.clear()


def shard_files(entries: list[tuple[str, Entry]], max_bytes: int, stem: str, ext: str) -> dict[str, list[str]]:
    """file name -> its keys, in order: one ``stem.ext`` file when everything fits in ``max_bytes``,
    else ``stem-0000i-of-0000n.ext`` packed greedily in key order (a tensor larger than the limit gets
    a file of its own), as ``transformers``' ``save_pretrained`` names and packs them."""
    groups: list[list[str]] = [[]]
    size = 0
    for key, e in entries:
        n = _nbytes(e)
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    if len(groups) == 1:
        return {f"{stem}.{ext}": groups[0]}
    return {f"{stem}-{i + 1:05d}-of-{len(groups):05d}.{ext}": keys for i, keys in enumerate(groups)}


def _nbytes(e: Entry) -> int:
    n = 1
    for d in e.shape:
        n *= d
    return n * torch.empty((), dtype=e.dtype).element_size()


class SafetensorsWriter:
    """One safetensors file written as a stream: the header from the entries at once, then each
    tensor's bytes in the header's order (``write`` must be called in that order)."""

    def __init__(self, file: Path, entries: list[tuple[str, Entry]]):
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for key, e in entries:
            if e.dtype not in _NAMES:
                raise WeightsError(f"{key}: safetensors has no dtype {e.dtype}; save with format='torch'")
            header[key] = {"dtype": _NAMES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + _nbytes(e)]}
            offset += _nbytes(e)
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._order = [k for k, _ in entries]
        self._f = open(file, "wb")
        self._f.write(struct.pack("<Q", len(text)) + text)

    def write(self, key: str, t: torch.Tensor) -> None:
        expected = self._order.pop(0)
        assert key == expected, f"internal: wrote {key} where the header has {expected} next"
        self._f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    def close(self) -> None:
        assert not self._order, f"internal: {self._order[:3]} never written"
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


class TorchFileWriter:
    """A ``torch.save`` state dict file written one tensor at a time: the file is saved first with
    its storages left empty (``torch.serialization.skip_data``; the skeleton's tensors are
    allocated but never touched), then mapped shared (``mmap=True``, ``MAP_SHARED``) and each
    tensor copied into its place. Tied keys (``aliases``: key -> the key holding its tensor) share
    one storage, as in ``model.state_dict()``."""

    def __init__(self, file: Path, entries: list[tuple[str, Entry]], aliases: dict[str, str]):
        """``entries``: every key in the state dict's order (an alias after the key it shares)."""
        from torch.serialization import set_default_mmap_options, skip_data

        skeleton: dict[str, torch.Tensor] = {}
        for k, e in entries:
            skeleton[k] = skeleton[aliases[k]] if k in aliases else torch.empty(e.shape, dtype=e.dtype)
        with skip_data():
            torch.save(skeleton, file)
        del skeleton
        with set_default_mmap_options(mmap.MAP_SHARED):
            self._mapped = torch.load(file, mmap=True, weights_only=True)

    def write(self, key: str, t: torch.Tensor) -> None:
        self._mapped[key].copy_(t)

    def close(self) -> None:
        self._mapped = None  # unmapping flushes the shared pages into the file
