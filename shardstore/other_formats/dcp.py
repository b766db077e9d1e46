"""Reading PyTorch DCP checkpoints, and Megatron-Core's ``torch_dist`` ones (DCP files
plus Megatron's ``metadata.json`` and ``common.pt``), without executing their pickles.

A DCP checkpoint is a ``.metadata`` file (a pickled ``Metadata``: every tensor's global
shape, dtype and saved chunks, and where each chunk's bytes are) and ``__<rank>_<n>.distcp``
files holding, at those offsets, one ``torch.save`` archive per tensor chunk, or the raw
bytes of a non-tensor item. Here:

* ``.metadata`` is unpickled by ``shardstore.format.pickles.load_restricted``, which admits
  exactly DCP's own metadata classes, ``torch.Size``, dtypes, layouts and paths by
  their full names, and refuses anything else, so a hostile checkpoint cannot run code;
* each chunk is read with ``shardstore.format.pickles.load_torch`` (weights_only) from its byte range,
  checked to lie inside its file, and checked against the metadata's shape and dtype;
* non-tensor items (Megatron's ShardedObjects, ``<key>/shard_<offset>_<shape>``, or a
  plain DCP's Python values) load with ``weights_only=True`` too.
* a plain DCP save's 0-dim tensors (AdamW's ``step``) are items too, not tensors: they
  were plain tensors of the state dict, which shardstore keeps in the common state, so
  that an import or a load gives them where a shardstore save of the same state has them.

* Megatron-Core <= 0.14 stored flattened ranges (the distributed optimizer's)
  "reformulated": a tensor of shape ``G`` cut into blocks ``b`` becomes a
  ``(G_0/b_0, ..., G_n/b_n, prod(b))`` tensor, one flat row per block, its original shape
  kept in the metadata's ``mcore_data``. Such a tensor is presented in its original
  shape, each region assembled from the rows of the blocks it overlaps.

DCP's storage transforms (compression extensions) are refused with an error that says so.
"""

from __future__ import annotations

__all__ = ["DCP_FORMAT", "TORCH_DIST_FORMAT", "DcpCheckpoint", "DcpChunk", "DcpItem", "DcpTensor"]

import math
import os
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

import torch

from shardstore.errors import CheckpointingException
from shardstore.format.config import CONFIG_FNAME
from shardstore.format.pickles import dcp_metadata_globals, load_restricted, load_torch
from shardstore.format.records import COMMON_FILE, sharded_backend, state_paths
from shardstore.other_formats.base import OtherCheckpoint, OtherFormat, OtherTensor
from shardstore.stores.base import Location

DCP_METADATA = ".metadata"
MAX_METADATA_BYTES = 2**30
TORCH_DIST = "torch_dist"  # Megatron-Core's name of the backend, in its metadata.json
DISTCP_SUFFIX = ".distcp"  # the data files of DCP's FileSystemWriter
MEGATRON_FILES = (CONFIG_FNAME, COMMON_FILE)  # what Megatron-Core's save adds to DCP's files

@dataclass(frozen=True)
class DcpChunk:
    """One saved chunk of a tensor: its box and where its ``torch.save`` bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpTensor(OtherTensor):
    """A tensor as DCP stored it. ``shape`` is its global shape; for Megatron's
    reformulated flattened ranges, ``stored_shape`` is the shape of the stored
    block-rows tensor (else equal to ``shape``)."""

    chunks: tuple[DcpChunk, ...] = ()
    stored_shape: tuple[int, ...] = ()

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """The shape of every saved chunk; () where they differ, and for reformulated
        ranges, whose chunks are rows of ``stored_shape``, not boxes of ``shape``."""
        sizes = {chunk.sizes for chunk in self.chunks}
        return sizes.pop() if len(sizes) == 1 and self.shape == self.stored_shape else ()

    @property
    def chunk_count(self) -> int:
        return len(self.chunks)


@dataclass(frozen=True)
class DcpItem:
    """A non-tensor item: its bytes' place."""

    key: str
    file: str
    offset: int
    length: int


class DcpCheckpoint(OtherCheckpoint):
    """A DCP (or Megatron torch_dist) checkpoint directory, opened for reading; ``kind``
    is ``"torch_dist"`` (Megatron-Core) or ``"dcp"``; ``saved_paths``: where each key was
    in the state dict that was saved (``_saved_paths``)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._sizes: dict[str, int] = {}  # data file -> size in bytes
        metadata = self._read_metadata()
        config = self.config()
        self.kind = TORCH_DIST if config is not None and config.sharded_backend == TORCH_DIST else "dcp"
        original_shapes = {
            key: tuple(value["nd_reformulated_orig_global_shape"])
            for key, value in (getattr(metadata, "mcore_data", None) or {}).items()
            if isinstance(value, dict) and "nd_reformulated_orig_global_shape" in value
        }
        self.tensors: dict[str, DcpTensor] = {}
        self.items: dict[str, DcpItem] = {}
        self._scalars: dict[str, DcpTensor] = {}  # 0-dim tensors of a plain DCP save: common state
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
            stored = tuple(entry.size)
            shape = original_shapes.get(key, stored)
            if shape != stored:
                _check_reformulated(self.path, key, shape, stored)
            tensor = DcpTensor(key, shape, entry.properties.dtype, chunks, stored)
            if self.kind == "dcp" and stored == () and len(chunks) == 1:
                # a plain tensor of the state dict, as shardstore keeps it (AdamW's step)
                self._scalars[key] = tensor
                self.items[key] = DcpItem(key, chunks[0].file, chunks[0].offset, chunks[0].length)
            else:
                self.tensors[key] = tensor
        if self.kind == "dcp":  # Megatron's keys are its own names, nested by "/" as in shardstore
            self.saved_paths = _saved_paths(getattr(metadata, "planner_data", None), len(self.tensors) + len(self.items))

    def _read_metadata(self) -> Any:
        data = self.read_bounded(DCP_METADATA, MAX_METADATA_BYTES, "the metadata")
        return load_restricted(data, dcp_metadata_globals(), str(self.path / DCP_METADATA), "PyTorch DCP metadata")

    def _place(self, places: dict, key: str, offset: tuple[int, ...] | None) -> tuple[str, int, int]:
        info = places.get((key, offset))
        if info is None:
            raise CheckpointingException(f"{self.path}: the metadata names no storage for {key!r} at {offset}")
        name = str(info.relative_path)
        if "/" in name or "\\" in name or name.startswith(".") or not name:
            raise CheckpointingException(f"{self.path}: item {key!r} points outside the checkpoint ({name!r})")
        offset, length = int(info.offset), int(info.length)
        size = self._file_size(name)
        if offset < 0 or length < 0 or offset + length > size:
            raise CheckpointingException(
                f"{self.path / name}: {key!r} at bytes [{offset}, {offset + length}) lies outside the {size}-byte file"
            )
        return name, offset, length

    def _file_size(self, name: str) -> int:
        """The size of a data file (once per file), which bounds what may be read from it."""
        if name not in self._sizes:
            size = self.file_size(name, "a data file")
            if size is None:
                raise CheckpointingException(f"{self.path}: the data file {name!r} is missing")
            self._sizes[name] = size
        return self._sizes[name]

    def read_chunk(self, tensor: DcpTensor, chunk: DcpChunk) -> torch.Tensor:
        """One saved chunk, checked against the metadata."""
        data = self.read_file(chunk.file, chunk.offset, chunk.length, what=repr(tensor.key))
        where = f"{self.path / chunk.file} ({tensor.key!r} at {chunk.offsets})"
        value = load_torch(data, f"the chunk {where}")
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
        if tensor.shape != tensor.stored_shape:
            return self._read_reformulated(tensor, region)
        return self._read_stored(tensor, region)

    def _read_stored(self, tensor: DcpTensor, region: tuple[slice, ...]) -> torch.Tensor:
        overlapping = []
        for chunk in tensor.chunks:
            lo = [max(s.start, o) for s, o in zip(region, chunk.offsets)]
            hi = [min(s.stop, o + n) for s, o, n in zip(region, chunk.offsets, chunk.sizes)]
            if not any(a >= b for a, b in zip(lo, hi)):
                overlapping.append((chunk, lo, hi))
        # what is allocated is bounded by the bytes on disk, not by what the metadata claims
        needed = math.prod(s.stop - s.start for s in region) * tensor.itemsize
        if sum(chunk.length for chunk, _, _ in overlapping) < needed:
            raise CheckpointingException(
                f"{self.path}: the saved chunks of {tensor.key!r} hold fewer bytes than the {needed} its region "
                f"{region} needs: the metadata does not match the data files"
            )
        out = torch.empty([s.stop - s.start for s in region], dtype=tensor.dtype)
        covered = 0
        for chunk, lo, hi in overlapping:
            value = self.read_chunk(tensor, chunk)
            source = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, chunk.offsets))
            target = tuple(slice(a - s.start, b - s.start) for a, b, s in zip(lo, hi, region))
            out[target] = value[source]
            covered += math.prod(b - a for a, b in zip(lo, hi))
        if covered < out.numel():
            raise CheckpointingException(f"{self.path}: the saved chunks of {tensor.key!r} do not cover {region}")
        return out

    def _read_reformulated(self, tensor: DcpTensor, region: tuple[slice, ...]) -> torch.Tensor:
        """A region of a tensor stored as one flat row per block: the rows of the
        blocks it overlaps, each reshaped to the block and cut to the region."""
        block = tuple(g // f for g, f in zip(tensor.shape, tensor.stored_shape[:-1]))
        out = torch.empty([s.stop - s.start for s in region], dtype=tensor.dtype)
        ranges = [range(s.start // b, -(-s.stop // b)) if s.stop > s.start else range(0)
                  for s, b in zip(region, block)]
        for index in product(*ranges):
            row = (*(slice(i, i + 1) for i in index), slice(0, tensor.stored_shape[-1]))
            value = self._read_stored(tensor, row).reshape(block)
            start = [i * b for i, b in zip(index, block)]
            lo = [max(s.start, a) for s, a in zip(region, start)]
            hi = [min(s.stop, a + b) for s, a, b in zip(region, start, block)]
            out[tuple(slice(a - s.start, b - s.start) for a, b, s in zip(lo, hi, region))] = value[
                tuple(slice(a - a0, b - a0) for a, b, a0 in zip(lo, hi, start))
            ]
        return out

    def read_item(self, key: str, allow_unsafe_pickle: bool = False) -> Any:
        """A non-tensor item, loaded with ``weights_only=True`` (unless
        ``allow_unsafe_pickle``), or a plain DCP save's 0-dim tensor (checked against its
        metadata)."""
        if key in self._scalars:
            return self._read_stored(self._scalars[key], ())
        item = self.items[key]
        data = self.read_file(item.file, item.offset, item.length, what=repr(key))
        return self.load_pickled(data, f"item {key!r}", allow_unsafe_pickle)

    def read_object_shard(self, unique_key: str, allow_unsafe_pickle: bool = False) -> Any:
        """Megatron's torch_dist saves the list of the rank's copies of a ShardedObject
        shard (one), which is unwrapped."""
        value = self.read_item(unique_key, allow_unsafe_pickle)
        if self.kind == TORCH_DIST and isinstance(value, list) and len(value) == 1:
            return value[0]
        return value


def _check_reformulated(path: Path, key: str, shape: tuple[int, ...], stored: tuple[int, ...]) -> None:
    """A reformulated tensor's stored shape must be (blocks per axis..., block volume)."""
    blocks = stored[:-1]
    ok = (
        len(stored) == len(shape) + 1
        and all(f > 0 and g % f == 0 for g, f in zip(shape, blocks))
        and stored[-1] == math.prod(g // f for g, f in zip(shape, blocks))
    )
    if not ok:
        raise CheckpointingException(
            f"{path}: {key!r} is stored with shape {stored}, which is not a reformulation of its original "
            f"shape {shape} (blocks per axis, then the block's volume)"
        )


def _saved_paths(planner_data: Any, entries: int) -> dict[str, tuple[str | int, ...]]:
    """Where each flattened key was in the state dict DCP was given
    (``records.state_paths``), by which ``dcp_to_torch_save`` rebuilds the nesting; {}
    where the metadata records none, or records something else (a custom planner's data)."""
    return state_paths(planner_data, entries) or {}


def _holds_torch_dist(location: Location) -> bool:
    """Megatron-Core's torch_dist: its ``metadata.json`` names the backend, DCP's files hold the data."""
    return sharded_backend(location) == TORCH_DIST and location.exists(DCP_METADATA)


def _holds_plain_dcp(location: Location) -> bool:
    """DCP's ``.metadata``, and no ``metadata.json`` saying the directory is a torch_dist
    checkpoint or one of shardstore's saves."""
    return location.exists(DCP_METADATA) and sharded_backend(location) not in (TORCH_DIST, "shardstore")


def _dcp_files(location: Location) -> list[str]:
    """A DCP checkpoint's own entries: ``.metadata`` and the ``*.distcp`` files its
    ``FileSystemWriter`` writes beside it (each rank's ``__<rank>_<n>.distcp``)."""
    return sorted(name for name in location.list_top(None) if name == DCP_METADATA or name.endswith(DISTCP_SUFFIX))


def _torch_dist_files(location: Location) -> list[str]:
    """A torch_dist checkpoint's own entries: DCP's, and Megatron-Core's ``metadata.json``
    and ``common.pt``."""
    return sorted({*_dcp_files(location), *(name for name in MEGATRON_FILES if location.exists(name))})


TORCH_DIST_FORMAT = OtherFormat(
    TORCH_DIST, "a Megatron-Core 'torch_dist' checkpoint", _holds_torch_dist, DcpCheckpoint, DCP_METADATA,
    _torch_dist_files,
)
DCP_FORMAT = OtherFormat("dcp", "a PyTorch DCP checkpoint", _holds_plain_dcp, DcpCheckpoint, DCP_METADATA, _dcp_files)
