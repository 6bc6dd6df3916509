"""Weight files, one tensor at a time: Hugging Face safetensors (single or sharded with an index)
and torch ``state_dict`` files, read by slices and written as a stream.

Invariants:
* reading: ``WeightFiles.read_into(key, slices, dest)`` writes only the requested slice of one
  tensor into ``dest`` and adds its bytes to ``bytes_read`` (``read`` returns it in a new tensor).
  Safetensors: the header (8 bytes of length, then JSON with each tensor's ``data_offsets``, the
  format's specification) gives where the slice's contiguous runs lie, and they are read with
  ``os.preadv`` straight into ``dest`` (into one slice-sized temporary only when the dtype
  differs). Not ``safe_open(...).get_slice(key)[slices]``: safetensors 0.8's torch binding returns
  that slice as a view of the whole tensor's private file mapping, so a memory count by storage
  counts the whole tensor, and every page read stays mapped into the process (its resident set)
  until the file is closed: one more shard-sized set at the end of a load (measured in
  benchmarks/start_up.py). Torch files: loaded with ``mmap=True``, the slice copied out of the
  mapping;
* writing: every file's layout (its safetensors header, or a torch file's skeleton) is written
  first from the tensors' shapes and dtypes, then each tensor's bytes are written in place as it
  arrives; the writer never holds more than the one tensor it is given;
* the Hugging Face layout is ``save_pretrained``'s: ``model.safetensors``, or past
  ``max_shard_size`` ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``
  (``{"metadata": {"total_size": ...}, "weight_map": {key: file}}``), tensors greedily packed in
  key order as ``transformers`` does.
"""
from __future__ import annotations

import itertools
import json
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from autopar.errors import WeightsError

__all__ = ["Entry", "WeightFiles", "SafetensorsWriter", "TorchFileWriter", "shard_files", "parse_size", "WeightsError",
           "SAFE_INDEX", "SAFE_SINGLE", "TORCH_INDEX", "TORCH_SINGLE"]

SAFE_SINGLE, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_SINGLE, TORCH_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"

_DTYPES = MappingProxyType({"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                            "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2})
_NAMES = MappingProxyType({v: k for k, v in _DTYPES.items()})


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
            handle = _Safetensors(file)
            self._handles[file] = handle
            return {k: e for k, (e, _) in handle.tensors.items()}
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
        """The ``slices`` of tensor ``key`` in a new tensor of its stored dtype (only those bytes are read)."""
        full = self.entries[key].shape
        shape = [len(range(*s.indices(n))) for s, n in zip(slices, full)] + list(full[len(slices):])
        out = torch.empty(shape, dtype=self.entries[key].dtype)
        self.read_into(key, slices, out)
        return out

    def read_into(self, key: str, slices: tuple[slice, ...], dest: torch.Tensor) -> None:
        """Write the ``slices`` (steps of 1, one per dim) of tensor ``key`` into ``dest`` (their
        shape; converted to its dtype), reading only those bytes."""
        h = self._handles[self.file_of[key]]
        if isinstance(h, _Safetensors):
            self.bytes_read += h.read_into(key, slices, dest)
            return
        t = h[key]
        part = t[slices] if t.dim() else t
        dest.copy_(part)
        self.bytes_read += part.numel() * part.element_size()

    def close(self) -> None:
        for h in self._handles.values():
            if isinstance(h, _Safetensors):
                h.close()
        self._handles.clear()


class _Safetensors:
    """One safetensors file read by slices with ``os.preadv`` (see the module docstring)."""

    def __init__(self, file: Path):
        self.file = file
        self._fd = os.open(file, os.O_RDONLY)
        size = os.fstat(self._fd).st_size
        try:
            (n,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
            if not 0 < n <= size - 8:
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(os.pread(self._fd, n, 8))
            header.pop("__metadata__", None)
            self.tensors: dict[str, tuple[Entry, int]] = {}  # key -> (entry, file offset of its first byte)
            for key, h in header.items():
                if h["dtype"] not in _DTYPES:
                    raise ValueError(f"{key} has dtype {h['dtype']}, which autopar does not read (it reads "
                                     f"{', '.join(_DTYPES)})")
                e = Entry(tuple(h["shape"]), _DTYPES[h["dtype"]])
                begin, end = h["data_offsets"]
                if end - begin != _nbytes(e) or 8 + n + end > size:
                    raise ValueError(f"{key}: data_offsets {begin}..{end} do not hold {e.shape} {h['dtype']}")
                self.tensors[key] = (e, 8 + n + begin)
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            self.close()
            raise WeightsError(f"{file} is not a safetensors file (what save_pretrained writes): "
                               f"{type(exc).__name__}: {exc}") from exc

    def read_into(self, key: str, slices: tuple[slice, ...], dest: torch.Tensor) -> int:
        """Read ``key``'s slice into ``dest``; returns the bytes read."""
        entry, begin = self.tensors[key]
        item = torch.empty((), dtype=entry.dtype).element_size()
        direct = dest.dtype == entry.dtype and dest.is_contiguous()
        buf = dest if direct else torch.empty(dest.shape, dtype=entry.dtype)
        if buf.numel() == 0:
            return 0
        flat = memoryview(buf.view(-1).view(torch.uint8).numpy())
        pos = 0
        for offset, count in _runs(entry.shape, slices):
            n = count * item
            _pread_exactly(self._fd, flat[pos: pos + n], begin + offset * item, self.file)
            pos += n
        assert pos == len(flat), f"internal: read {pos} bytes of a {len(flat)}-byte slice of {key}"
        if not direct:
            dest.copy_(buf)
        return pos

    def close(self) -> None:
        if getattr(self, "_fd", None) is not None:  # (None, or never set where os.open failed)
            os.close(self._fd)
            self._fd = None

    __del__ = close  # a load that stopped at a refusal before WeightFiles.close() leaks no descriptor


def _runs(shape: tuple[int, ...], slices: tuple[slice, ...]):
    """(element offset, element count) of the contiguous runs of a row-major tensor's slice, in order."""
    if not shape:
        yield 0, 1
        return
    bounds = [s.indices(n)[:2] for s, n in zip(slices, shape)] + [(0, n) for n in shape[len(slices):]]
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    # the last dim not taken whole: everything inside it is one run per index of the dims before it
    cut = max((d for d, (a, b) in enumerate(bounds) if (a, b) != (0, shape[d])), default=0)
    a, b = bounds[cut]
    count = (b - a) * strides[cut]
    for index in itertools.product(*(range(lo, hi) for lo, hi in bounds[:cut])):
        yield sum(i * st for i, st in zip(index, strides)) + a * strides[cut], count


def _pread_exactly(fd: int, into: memoryview, offset: int, file: Path) -> None:
    while len(into):
        got = os.preadv(fd, [into], offset)
        if got <= 0:
            raise WeightsError(f"{file} ends before byte {offset}: the file is truncated")
        into, offset = into[got:], offset + got


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
