"""Reading PyTorch DCP checkpoints, and Megatron-Core's ``torch_dist`` ones (DCP files
plus Megatron's ``metadata.json`` and ``common.pt``), without executing their pickles.

A DCP checkpoint is a ``.metadata`` file (a pickled ``Metadata``: every tensor's global
shape, dtype and saved chunks, and where each chunk's bytes are) and ``__<rank>_<n>.distcp``
files holding, at those offsets, one ``torch.save`` archive per tensor chunk, or the raw
bytes of a non-tensor item. Here:

* ``.metadata`` is unpickled by ``MetadataUnpickler``, which admits only DCP's own
  metadata classes, ``torch.Size``, dtypes and layouts, and refuses anything else, so a
  hostile checkpoint cannot run code;
* each chunk is read with ``torch.load(weights_only=True)`` from its byte range,
  checked to lie inside its file, and checked against the metadata's shape and dtype;
* non-tensor items (Megatron's ShardedObjects, ``<key>/shard_<offset>_<shape>``, or a
  plain DCP's Python values) load with ``weights_only=True`` too.

Megatron 0.14's reformulated flattened ranges and DCP's storage transforms (compression
extensions) are refused with an error that says so.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardstore.core import CheckpointingException, maybe_load_config
from shardstore.format import COMMON_FILE

DCP_METADATA = ".metadata"
MAX_METADATA_BYTES = 2**30

_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
)
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    # StorageMeta.checkpoint_id, as the saving process named the directory
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` admitting only its metadata classes (dataclasses and
    enums of ``torch.distributed.checkpoint``), ``torch.Size``, dtypes, layouts and paths."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


@dataclass(frozen=True)
class DcpChunk:
    """One saved chunk of a tensor: its box and where its ``torch.save`` bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpTensor:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[DcpChunk, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class DcpItem:
    """A non-tensor item: its bytes' place."""

    key: str
    file: str
    offset: int
    length: int


class DcpCheckpoint:
    """A DCP (or Megatron torch_dist) checkpoint directory, opened for reading.

    Attributes:
        path: the directory.
        kind: ``"torch_dist"`` (Megatron-Core) or ``"dcp"``.
        tensors: every tensor by key.
        items: every non-tensor item by key.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        metadata = self._read_metadata()
        config = maybe_load_config(str(self.path))
        self.kind = "torch_dist" if config is not None and config.sharded_backend == "torch_dist" else "dcp"
        if getattr(metadata, "mcore_data", None) and any(
            "nd_reformulated_orig_global_shape" in (v or {}) for v in metadata.mcore_data.values()
        ):
            raise CheckpointingException(
                f"{self.path} holds Megatron-Core flattened ranges saved in the reformulated torch_dist layout "
                "(megatron-core <= 0.14), which this reader does not support yet"
            )
        self.tensors: dict[str, DcpTensor] = {}
        self.items: dict[str, DcpItem] = {}
        places: dict[tuple[str, tuple[int, ...] | None], Any] = {}
        for index, info in metadata.storage_data.items():
            if getattr(info, "transform_descriptors", None):
                raise CheckpointingException(
                    f"{self.path}: item {index.fqn!r} is stored with DCP transforms {info.transform_descriptors} "
                    "(e.g. compression), which this reader does not support"
                )
            offset = tuple(index.offset) if index.offset is not None else None
            places[(index.fqn, offset)] = info
        for key, entry in metadata.state_dict_metadata.items():
            if type(entry).__name__ == "BytesStorageMetadata":
                info = self._place(places, key, None)
                self.items[key] = DcpItem(key, *info)
                continue
            chunks = tuple(
                DcpChunk(tuple(c.offsets), tuple(c.sizes), *self._place(places, key, tuple(c.offsets)))
                for c in entry.chunks
            )
            self.tensors[key] = DcpTensor(key, tuple(entry.size), entry.properties.dtype, chunks)

    def _read_metadata(self) -> Any:
        file = self.path / DCP_METADATA
        try:
            with open(file, "rb") as f:
                data = f.read(MAX_METADATA_BYTES + 1)
        except OSError as exc:
            raise CheckpointingException(f"{self.path} is not a distributed checkpoint: cannot read {file}: {exc}") \
                from exc
        if len(data) > MAX_METADATA_BYTES:
            raise CheckpointingException(f"{file} is larger than {MAX_METADATA_BYTES} bytes")
        try:
            return MetadataUnpickler(io.BytesIO(data)).load()
        except Exception as exc:  # any malformed or hostile pickle
            raise CheckpointingException(f"{file} is not valid PyTorch DCP metadata: {exc}") from exc

    def _place(self, places: dict, key: str, offset: tuple[int, ...] | None) -> tuple[str, int, int]:
        info = places.get((key, offset))
        if info is None:
            raise CheckpointingException(f"{self.path}: the metadata names no storage for {key!r} at {offset}")
        name = str(info.relative_path)
        if "/" in name or "\\" in name or name.startswith(".") or not name:
            raise CheckpointingException(f"{self.path}: item {key!r} points outside the checkpoint ({name!r})")
        return name, int(info.offset), int(info.length)

    def _read_bytes(self, key: str, file: str, offset: int, length: int) -> bytes:
        path = self.path / file
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if offset < 0 or length < 0 or offset + length > size:
                    raise CheckpointingException(
                        f"{path}: {key!r} at bytes [{offset}, {offset + length}) lies outside the {size}-byte file"
                    )
                f.seek(offset)
                return f.read(length)
        except OSError as exc:
            raise CheckpointingException(f"Cannot read {key!r} from {path}: {exc}") from exc

    def read_chunk(self, tensor: DcpTensor, chunk: DcpChunk) -> torch.Tensor:
        """One saved chunk, checked against the metadata."""
        data = self._read_bytes(tensor.key, chunk.file, chunk.offset, chunk.length)
        where = f"{self.path / chunk.file} ({tensor.key!r} at {chunk.offsets})"
        try:
            value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointingException(f"Cannot load the chunk {where}: {exc}") from exc
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != chunk.sizes or value.dtype != tensor.dtype:
            raise CheckpointingException(
                f"Chunk {where} holds {type(value).__name__} {getattr(value, 'shape', '')} "
                f"{getattr(value, 'dtype', '')}, the metadata says {chunk.sizes} {tensor.dtype}"
            )
        return value

    def read_region(self, key: str, region: tuple[slice, ...]) -> torch.Tensor:
        """The part ``region`` of the global tensor ``key``, from every saved chunk
        that overlaps it; a part no chunk covers is an error."""
        tensor = self.tensors[key]
        out = torch.empty([s.stop - s.start for s in region], dtype=tensor.dtype)
        covered = 0
        for chunk in tensor.chunks:
            lo = [max(s.start, o) for s, o in zip(region, chunk.offsets)]
            hi = [min(s.stop, o + n) for s, o, n in zip(region, chunk.offsets, chunk.sizes)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            value = self.read_chunk(tensor, chunk)
            source = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, chunk.offsets))
            target = tuple(slice(a - s.start, b - s.start) for a, b, s in zip(lo, hi, region))
            out[target] = value[source]
            covered += math.prod(b - a for a, b in zip(lo, hi))
        if covered < out.numel():
            raise CheckpointingException(f"{self.path}: the saved chunks of {key!r} do not cover {region}")
        return out

    def read_tensor(self, key: str) -> torch.Tensor:
        """The whole global tensor ``key``."""
        return self.read_region(key, tuple(slice(0, n) for n in self.tensors[key].shape))

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, whole, one at a time (sorted by key)."""
        for key in sorted(self.tensors):
            yield key, self.read_tensor(key)

    def read_item(self, key: str) -> Any:
        """A non-tensor item, loaded with ``weights_only=True``."""
        item = self.items[key]
        data = self._read_bytes(key, item.file, item.offset, item.length)
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointingException(f"Cannot load item {key!r} of {self.path}: {exc}") from exc

    def common_state(self) -> dict[str, Any]:
        """Megatron's ``common.pt`` (weights_only), or {} for a plain DCP checkpoint."""
        if not (self.path / COMMON_FILE).exists():
            return {}
        from shardstore.strategies.common import TorchCommonLoadStrategy

        return TorchCommonLoadStrategy().load_common(str(self.path))


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    """A directory with DCP's ``.metadata`` (plain DCP, or Megatron's torch_dist)."""
    return (Path(path) / DCP_METADATA).is_file()


__all__ = ["DcpCheckpoint", "DcpChunk", "DcpItem", "DcpTensor", "MetadataUnpickler", "is_dcp_checkpoint"]
