"""Hugging Face safetensors, as a format shardstore converts from and to: one
``*.safetensors`` file, or a model directory with ``model.safetensors`` or shards named
by ``model.safetensors.index.json`` (whose files ``model_files`` opens safely).

The format (its own one-page spec): an 8-byte little-endian header size, a JSON header
naming each tensor's dtype, shape and byte offsets (and an optional ``__metadata__`` of
strings), then the data. Here:

* ``map_safetensors`` memory-maps a file's tensors after checking its header as the
  safetensors library checks one (``safetensors_entries``): nothing is read until used;
* ``write_safetensors`` streams a file: its header first, then each tensor at its
  offset as it comes, laid out as the library lays it out;
* ``open_safetensors`` opens a model as an export's source: its tensors by name, its
  first file's ``__metadata__`` and, where a shardstore export wrote its layout
  (``layout``: the common state and each array's place), the checkpoint as it was; ``state_to_save`` is what an import saves;
* ``SAFETENSORS_FORMAT`` is its registry entry (``registry``): a file whose name ends
  in ``.safetensors``, or a directory holding the index or ``model.safetensors``.
"""

from __future__ import annotations

__all__ = [
    "SAFETENSORS_FORMAT",
    "SAFETENSORS_SUFFIX",
    "holds_safetensors",
    "map_safetensors",
    "open_safetensors",
    "safetensors_entries",
    "safetensors_tensors",
    "state_to_save",
    "write_safetensors",
]

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardstore.errors import CheckpointingException
from shardstore.format.dtypes import byte_view
from shardstore.format.records import is_committed
from shardstore.mapping import ShardedTensor, StateDict
from shardstore.other_formats.base import ExportSource, FileFormat, TensorSpec, place_value
from shardstore.other_formats.layout import (
    ExportStructure,
    common_tensor_names,
    decode_common,
    read_safetensors_layout,
    read_safetensors_metadata,
    refuse_sparse_lists,
)
from shardstore.other_formats.model_files import (
    SAFETENSORS_INDEX,
    SAFETENSORS_SINGLE,
    SafetensorsModel,
    open_model_file,
    safetensors_model,
)
from shardstore.stores.base import Location

SAFETENSORS_SUFFIX = ".safetensors"
_MAX_SAFETENSORS_HEADER = 100 * 2**20  # the format's own limit

# safetensors dtype names (the format's spec) and ours.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "C64": torch.complex64,
}
_SAFETENSORS_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}
_METADATA_KEY = "__metadata__"  # the header's entry for the file's metadata, never a tensor's


def write_safetensors(
    path: Path, where: Path, specs: dict[str, TensorSpec], tensors: Iterator[tuple[str, torch.Tensor]],
    metadata: dict[str, str],
) -> None:
    """Writes one safetensors file at ``path`` (``where``: its name in errors) from
    ``tensors``, streamed: the header (from ``specs``, every tensor's dtype and shape,
    which ``tensors`` must yield, in any order) first, then each tensor's bytes at its
    offset as it comes, so no more of the model is in memory than ``tensors`` holds
    (the safetensors library's writer takes them all at once).

    The data are laid out as the library lays them out: by item size, largest first,
    then by name, so that every tensor starts at a multiple of its item size and a
    memory-mapped reader can view it in place; the header is padded with spaces to 8
    bytes, as the format allows.

    A tensor named ``__metadata__`` (the header's entry for the metadata) is refused
    before anything is written: no reader could read the file."""
    if _METADATA_KEY in specs:
        raise CheckpointingException(
            f"Cannot write {where} as safetensors: a tensor is named {_METADATA_KEY!r}, the name safetensors keeps "
            "for a file's metadata; rename that tensor, or convert to a torch.save file, which holds it"
        )
    order = sorted(specs, key=lambda key: (-specs[key].itemsize, key))
    header: dict[str, Any] = {_METADATA_KEY: metadata} if metadata else {}
    offset = 0
    for key in order:
        spec = specs[key]
        name = _SAFETENSORS_NAMES.get(spec.dtype)
        if name is None:
            raise CheckpointingException(
                f"Cannot write {where} as safetensors: tensor {key!r} is {spec.dtype}, which safetensors cannot hold"
            )
        header[key] = {"dtype": name, "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    start = 8 + len(encoded)
    pending = dict(specs)
    try:
        with open(path, "wb") as f:
            f.write(len(encoded).to_bytes(8, "little") + encoded)
            for key, tensor in tensors:
                spec = pending.pop(key, None)
                if spec != TensorSpec.of(tensor):
                    raise CheckpointingException(
                        f"Cannot write {where}: the source gave tensor {key!r} as {TensorSpec.of(tensor)}, "
                        f"where its metadata said {spec}; is it being changed? Convert it again"
                    )
                f.seek(start + header[key]["data_offsets"][0])
                f.write(byte_view(tensor.cpu()).numpy().data)
                del tensor
            f.truncate(start + offset)
    except OSError as exc:
        raise CheckpointingException(f"Cannot write {where} as safetensors: {exc.strerror or exc}") from exc
    if pending:
        raise CheckpointingException(f"Cannot write {where}: the source gave no tensor {sorted(pending)[0]!r}")


def map_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, memory-mapped (nothing is read until used).

    The safetensors library's readers copy each tensor into memory; this maps the file,
    whose layout the format fixes: an 8-byte little-endian header size, a JSON header
    naming each tensor's dtype, shape and byte offsets, then the data. The header is
    checked as the library checks it (``safetensors_entries``) before any view is made.

    Raises:
        CheckpointingException: naming the file and what is wrong with it.
    """
    try:
        with os.fdopen(open_model_file(path), "rb") as f:  # a regular file, never a FIFO
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= _MAX_SAFETENSORS_HEADER:
                raise ValueError(f"header size {size} out of range")
            header = json.loads(f.read(size))
            data_bytes = max(0, os.fstat(f.fileno()).st_size - 8 - size)
            entries = safetensors_entries(header, data_bytes)
            data = np.memmap(f, dtype=np.uint8, mode="c", offset=8 + size) if data_bytes else None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested past the parser's depth
        raise CheckpointingException(f"Cannot read {path} as a safetensors file: {exc}") from exc
    tensors = {}
    for name, spec, start, stop in entries:
        raw = torch.from_numpy(data[start:stop]) if data is not None and stop > start else torch.empty(0, dtype=torch.uint8)
        tensors[name] = raw.view(spec.dtype).reshape(spec.shape)
    return tensors


# The format's integers are unsigned 64-bit; torch's sizes are signed.
_MAX_SAFETENSORS_INT = 2**64 - 1
_MAX_TORCH_DIMENSION = 2**63 - 1


def safetensors_entries(header: Any, data_bytes: int) -> list[tuple[str, TensorSpec, int, int]]:
    """Each tensor of a safetensors header as ``(name, spec, start, stop)`` (byte offsets
    into the data), checked as the safetensors library checks a header before it reads
    one: ``__metadata__`` maps strings to strings; every tensor names a known dtype, a
    shape of non-negative integers whose element count (multiplied in order) and byte
    size stay within 64 bits, and exactly two offsets; sorted by offset, the tensors
    cover the ``data_bytes`` bytes of data exactly, each its own (no gap, no overlap,
    nothing past the end), each ``dtype size x element count`` bytes long.

    Raises:
        ValueError: saying which tensor and what is wrong (the caller names the file).
    """
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    metadata = header.get(_METADATA_KEY)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise ValueError("its __metadata__ is not an object of strings")
    entries = sorted(
        (_safetensors_entry(name, info) for name, info in header.items() if name != _METADATA_KEY),
        key=lambda entry: (entry[2], entry[3]),
    )
    end = 0
    for name, spec, start, stop in entries:
        if start != end or stop < start:
            raise ValueError(
                f"tensor {name!r} has offsets {start}:{stop}, where the previous tensor ends at {end} "
                "(tensors must follow one another without gaps or overlaps)"
            )
        if stop - start != spec.nbytes:
            raise ValueError(f"tensor {name!r} of {spec.dtype} {list(spec.shape)} needs {spec.nbytes} bytes, not "
                             f"the {stop - start} of its offsets {start}:{stop}")
        end = stop
    if end != data_bytes:
        raise ValueError(f"its tensors cover {end} bytes of data, but the file holds {data_bytes}")
    return entries


def _safetensors_entry(name: str, info: Any) -> tuple[str, TensorSpec, int, int]:
    """One tensor of a header, its fields checked (``safetensors_entries``)."""
    if not isinstance(info, dict):
        raise ValueError(f"tensor {name!r} is described by {type(info).__name__}, not an object")
    named = info.get("dtype")
    dtype = _SAFETENSORS_DTYPES.get(named) if isinstance(named, str) else None
    if dtype is None:
        raise ValueError(f"tensor {name!r} has dtype {named!r}, which shardstore cannot read "
                         f"(it reads {sorted(_SAFETENSORS_DTYPES)})")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not _unsigned_ints(shape, _MAX_TORCH_DIMENSION):
        raise ValueError(f"tensor {name!r} has shape {shape!r}, not a list of non-negative integers")
    if not _unsigned_ints(offsets, _MAX_SAFETENSORS_INT) or len(offsets) != 2:
        raise ValueError(f"tensor {name!r} has data_offsets {offsets!r}, not two non-negative integers")
    spec = TensorSpec(dtype, tuple(shape))
    elements = 1
    for dimension in (*shape, spec.itemsize):  # in the library's order: it stops at the first overflow
        elements *= dimension
        if elements > _MAX_SAFETENSORS_INT:
            raise ValueError(f"tensor {name!r} has shape {shape}, whose byte size overflows 64 bits")
    return name, spec, offsets[0], offsets[1]


def _unsigned_ints(value: Any, limit: int) -> bool:
    """``value`` is a list of integers (not booleans) from 0 to ``limit``."""
    return isinstance(value, list) and all(type(n) is int and 0 <= n <= limit for n in value)


def safetensors_tensors(model: SafetensorsModel, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors ``model`` (opened from ``path``, its name in
    errors), by name, memory-mapped; each tensor its index names must be there."""
    held = {file: map_safetensors(file) for file in model.files}
    model.refuse_unheld(held)
    tensors: dict[str, torch.Tensor] = {}
    for file_tensors in held.values():
        for name, tensor in file_tensors.items():
            if name in tensors:
                raise CheckpointingException(f"Tensor {name!r} appears in two files of {path}")
            tensors[name] = tensor
    return tensors


def open_safetensors(path: str | os.PathLike) -> ExportSource:
    """A safetensors model: its tensors by name (memory-mapped), and, where a shardstore
    export wrote its layout, the common state and each array's place back."""
    model = safetensors_model(path)
    tensors = safetensors_tensors(model, path)
    layout = read_safetensors_layout(model.files[0]) or ExportStructure()
    refuse_sparse_lists(layout, str(model.files[0]))
    in_common = set(common_tensor_names(layout.common)) if layout.common is not None else set()
    missing = [key for key in layout.arrays if key not in tensors or key in in_common]
    if missing:
        raise CheckpointingException(
            f"{path}: its shardstore layout names the array {missing[0]!r}, which the files do not hold as one; "
            "convert it again from the checkpoint"
        )
    arrays = {k: t for k, t in tensors.items() if k not in in_common}
    return ExportSource(
        {k: TensorSpec.of(t) for k, t in sorted(arrays.items())},
        lambda keys, _: ((k, arrays[k]) for k in keys),
        lambda: {} if layout.common is None else decode_common(layout.common, tensors, str(path)),
        lambda key: layout.arrays.get(key) or tuple(key.split("/")),
        metadata=lambda: read_safetensors_metadata(model.files[0]),
    )


def state_to_save(path: str | os.PathLike) -> StateDict:
    """What an import of the safetensors model at ``path`` saves: one array per tensor
    name, memory-mapped; where a shardstore export wrote its layout, the common state
    and the arrays as they were, each at its place (where the layout's common state
    kept the containers it emptied, which the save then drops)."""
    opened = open_safetensors(path)
    state = opened.other_values()
    for key, tensor in opened.read(list(opened.tensor_bytes), 0):
        place_value(state, opened.place(key), ShardedTensor.from_rank_offsets(key, tensor), key)
    return state


def holds_safetensors(location: Location) -> bool:
    """A file named ``*.safetensors`` (any on S3, which the reader then refuses: it reads
    local paths), or a local directory holding ``model.safetensors.index.json`` or
    ``model.safetensors``; by names alone. Not a committed shardstore checkpoint, whose
    array ``model.safetensors`` is a directory of that name."""
    local = location.local_path()
    if local is None:
        return location.describe().rstrip("/").endswith(SAFETENSORS_SUFFIX)
    if local.is_file():
        return local.name.endswith(SAFETENSORS_SUFFIX)
    return (
        local.is_dir()
        and not is_committed(location)
        and any(os.path.lexists(local / n) for n in (SAFETENSORS_INDEX, SAFETENSORS_SINGLE))
    )


SAFETENSORS_FORMAT = FileFormat(
    "safetensors", "a safetensors model", holds_safetensors, open_safetensors, state_to_save, (SAFETENSORS_SUFFIX,)
)
