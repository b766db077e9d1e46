"""Reading checkpoints of Megatron-Core's deprecated ``zarr`` backend (megatron-core
<= 0.14), without zarr-python 2 and without unpickling code.

What Megatron wrote (``megatron/core/dist_checkpointing/strategies/zarr.py``, tested on
0.14.0's own output, ``tests/fixtures/legacy/megatron-0.14.0-zarr``):

* ``metadata.json`` naming the backend ``zarr``; ``common.pt``;
* one Zarr v2 array per ShardedTensor key at ``<key>/`` (``/`` in a key nests
  directories): ``.zarray`` with ``compressor`` and ``filters`` null, C order, chunks
  the shape of the first rank's block, and every chunk written
  (``write_empty_chunks``), as ``i.j`` files of raw little-endian bytes. bfloat16 is the
  dtype name ``"bfloat16"`` (Megatron rewrote NumPy's ``"<V2"``);
* flattened ranges (the distributed optimizer) written into the same arrays, with a
  ``<key>.sync/`` directory of empty lock files beside them (skipped here);
* ShardedObjects as ``<key>/shard_<offset>_<shape>.pt`` (``torch.save``).

Records are read through a size bound, every file through ``OtherCheckpoint.read_file``,
and a chunk file must hold exactly its chunk's bytes. Compressors, filters, Fortran
order, big-endian and object dtypes are refused with a clear error (Megatron never
wrote them).
"""

from __future__ import annotations

__all__ = ["MEGATRON_ZARR_FORMAT", "MegatronZarrCheckpoint", "ZarrV2Array"]

import json
import math
import os
import re
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import numpy as np
import torch

from shardstore.errors import CheckpointingException
from shardstore.format.config import CONFIG_FNAME
from shardstore.format.dtypes import from_torch, numpy_to_tensor
from shardstore.format.records import COMMIT_RECORD, sharded_backend
from shardstore.other_formats.base import OtherCheckpoint, OtherFormat, OtherTensor
from shardstore.stores.base import Location

ZARRAY = ".zarray"
BACKEND = "zarr"
MAX_ZARRAY_BYTES = 2**20
MAX_ARRAYS = 1_000_000
MAX_DEPTH = 64
MAX_CHUNKS = 2**26
_SYNC_SUFFIX = ".sync"  # zarr.ProcessSynchronizer lock directories beside flattened arrays
_OBJECT_FILE = re.compile(r"^shard_[0-9.]*_[0-9.]*\.pt$")
# Megatron's numpy dtypes (its numpy_to_torch_dtype_dict) by Zarr v2 dtype string
_DTYPES = {
    "|b1": torch.bool, "|u1": torch.uint8, "|i1": torch.int8, "<i2": torch.int16, "<i4": torch.int32,
    "<i8": torch.int64, "<f2": torch.float16, "<f4": torch.float32, "<f8": torch.float64,
    "<c8": torch.complex64, "<c16": torch.complex128, "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class ZarrV2Array(OtherTensor):
    """One array: its chunk grid and where its chunk files are."""

    chunks: tuple[int, ...] = ()
    separator: str = "."

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return self.chunks

    @property
    def chunk_count(self) -> int:
        return math.prod(-(-s // c) for s, c in zip(self.shape, self.chunks))

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of every chunk file (Zarr v2 stores edge chunks at full size)."""
        return math.prod(self.chunks) * self.itemsize

    def chunk_file(self, index: tuple[int, ...]) -> str:
        return f"{self.key}/{self.separator.join(map(str, index)) if index else '0'}"


class MegatronZarrCheckpoint(OtherCheckpoint):
    """A Megatron-Core ``zarr`` checkpoint directory, opened for reading."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.kind = BACKEND
        config = self.config()
        if config is None or config.sharded_backend != BACKEND:
            raise CheckpointingException(
                f"{self.path} is not a Megatron-Core zarr checkpoint ({CONFIG_FNAME} does not name the 'zarr' backend)"
            )
        self.tensors: dict[str, ZarrV2Array] = {}
        self.items: dict[str, str] = {}
        self._scan()

    def _scan(self) -> None:
        """Finds every array (a directory with ``.zarray``) and object file, without
        following links."""
        for directory, subdirs, files in os.walk(self.path, followlinks=False):
            rel = Path(directory).relative_to(self.path)
            if len(rel.parts) > MAX_DEPTH:
                raise CheckpointingException(f"{self.path}: directories nested deeper than {MAX_DEPTH} levels")
            key = rel.as_posix()
            if ZARRAY in files and key != ".":
                subdirs.clear()  # chunk files only below an array
                if key.endswith(_SYNC_SUFFIX) and os.lstat(Path(directory) / ZARRAY).st_size == 0:
                    continue  # a lock directory of zarr's ProcessSynchronizer, not an array
                self.tensors[key] = self._array(key)
                if len(self.tensors) > MAX_ARRAYS:
                    raise CheckpointingException(f"{self.path} holds more than {MAX_ARRAYS} arrays")
                continue
            for name in files:
                if _OBJECT_FILE.match(name) and key != ".":
                    self.items[f"{key}/{name[:-3]}"] = f"{key}/{name}"

    def _array(self, key: str) -> ZarrV2Array:
        where = f"{self.path / key / ZARRAY}"
        data = self.read_bounded(f"{key}/{ZARRAY}", MAX_ZARRAY_BYTES, f"the metadata of {key!r}")
        try:
            meta = json.loads(data)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser's depth
            raise CheckpointingException(f"{where} is not valid JSON: {exc}") from exc
        if not isinstance(meta, dict) or meta.get("zarr_format") != 2:
            raise CheckpointingException(f"{where} is not a Zarr v2 array")
        shape, chunks = _dims(meta.get("shape"), where, "shape"), _dims(meta.get("chunks"), where, "chunks")
        if len(shape) != len(chunks) or any(c < 1 for c in chunks):
            raise CheckpointingException(f"{where}: chunks {chunks} do not fit the shape {shape}")
        if math.prod(-(-s // c) for s, c in zip(shape, chunks)) > MAX_CHUNKS:
            raise CheckpointingException(f"{where}: more than {MAX_CHUNKS} chunks")
        for field, allowed in (("compressor", (None,)), ("filters", (None, [])), ("order", ("C",))):
            if meta.get(field) not in allowed:
                raise CheckpointingException(
                    f"{where}: {field} {meta.get(field)!r} is not supported (Megatron-Core wrote {allowed[0]!r}); "
                    "read this array with zarr-python 2"
                )
        dtype = _DTYPES.get(meta.get("dtype"))
        if dtype is None:
            raise CheckpointingException(f"{where}: dtype {meta.get('dtype')!r} is not supported")
        separator = meta.get("dimension_separator", ".")
        if separator not in (".", "/"):
            raise CheckpointingException(f"{where}: dimension_separator {separator!r} is not supported")
        return ZarrV2Array(key, shape, dtype, chunks, separator)

    def read_region(self, key: str, region: tuple[slice, ...]) -> torch.Tensor:
        array = self.tensors[key]
        ranges = [range(s.start // c, -(-s.stop // c)) for s, c in zip(region, array.chunks)]
        self._check_sizes(array, list(product(*ranges)))
        out = np.empty([s.stop - s.start for s in region], dtype=_numpy_dtype(array.dtype))
        for index in product(*ranges):
            start = [i * c for i, c in zip(index, array.chunks)]
            chunk = self._read_chunk(array, index)
            lo = [max(s.start, b) for s, b in zip(region, start)]
            hi = [min(s.stop, b + c) for s, b, c in zip(region, start, array.chunks)]
            out[tuple(slice(a - s.start, b - s.start) for a, b, s in zip(lo, hi, region))] = chunk[
                tuple(slice(a - b0, b - b0) for a, b, b0 in zip(lo, hi, start))
            ]
        return numpy_to_tensor(out, array.dtype)

    def _check_sizes(self, array: ZarrV2Array, indices: list[tuple[int, ...]]) -> None:
        """Every chunk file of a region holds its chunk's bytes, checked before anything
        is allocated: the memory a read takes is bounded by what is on disk, not by what
        a ``.zarray`` claims."""
        for index in indices:
            rel = array.chunk_file(index)
            self._check_chunk_size(array, rel, self.file_size(rel, f"a chunk of {array.key!r}"))

    def _check_chunk_size(self, array: ZarrV2Array, rel: str, size: int | None) -> None:
        """Raises unless the chunk file ``rel`` exists (``size`` not None) and holds
        exactly one chunk's bytes."""
        if size is None:
            raise CheckpointingException(
                f"{self.path}: chunk {rel!r} of {array.key!r} is missing (Megatron-Core writes every chunk)"
            )
        if size != array.chunk_nbytes:
            raise CheckpointingException(
                f"{self.path}: chunk {rel!r} of {array.key!r} holds {size} bytes, expected {array.chunk_nbytes}"
            )

    def _read_chunk(self, array: ZarrV2Array, index: tuple[int, ...]) -> np.ndarray:
        """One chunk file, whole (checked again as read: it may have changed since)."""
        rel = array.chunk_file(index)
        data = self.read_file(rel, missing_ok=True, what=f"a chunk of {array.key!r}")
        self._check_chunk_size(array, rel, None if data is None else len(data))
        return np.frombuffer(data, dtype=_numpy_dtype(array.dtype)).reshape(array.chunks)

    def read_item(self, key: str, allow_unsafe_pickle: bool = False) -> object:
        data = self.read_file(self.items[key], what=repr(key))
        return self.load_pickled(data, f"sharded object {key!r}", allow_unsafe_pickle)


def _dims(value: object, where: str, field: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                for v in value):
        raise CheckpointingException(f"{where}: {field} must be a list of non-negative integers, got {value!r}")
    return tuple(value)


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype holding ``dtype``'s bytes (bfloat16 through ml_dtypes)."""
    return from_torch(dtype).numpy_dtype


def _holds_megatron_zarr(location: Location) -> bool:
    """``metadata.json`` names the ``zarr`` backend, and no root ``zarr.json``: shardstore's
    own first checkpoints named their backend ``zarr`` too, but are a Zarr v3 group."""
    return sharded_backend(location) == BACKEND and not location.exists(COMMIT_RECORD)


MEGATRON_ZARR_FORMAT = OtherFormat(
    BACKEND, "a Megatron-Core zarr checkpoint (Zarr v2 arrays)", _holds_megatron_zarr, MegatronZarrCheckpoint,
    CONFIG_FNAME,
)
