"""Conversions between checkpoints and single-process formats, with bounded memory.

Sources: a shardstore checkpoint; another tool's checkpoint of any format in
``shardstore.other_formats.registry`` (PyTorch DCP, Megatron-Core torch_dist or zarr, read
without running its pickles); a ``torch.save`` file; Hugging Face style safetensors (one
file, or a model directory with ``model.safetensors`` or shards and
``model.safetensors.index.json``). Targets: a shardstore checkpoint (``from_torch_file``,
``from_safetensors``, ``from_other_format``), one
``torch.save`` file (``to_torch_file``) and a safetensors model directory
(``to_safetensors``), from any source of another format (``open_export_source``).

Reading a checkpoint here means whole global arrays, a batch at a time
(``read_arrays``): at most ``memory_bytes`` of them are alive at once (an array larger
than that alone); another tool's checkpoint, one tensor at a time. Writing a shardstore
checkpoint means a save at world size 1 from tensors that are memory-mapped from the
source file, so neither direction holds the model in memory, except ``to_torch_file``,
whose single pickle needs every tensor at once.

Keys: a tensor at ``sd["model"]["fc1"]`` of a ``torch.save`` file becomes the array
``model/fc1`` and comes back to the same place; the other values form the common
state. A sharded object's shard sits in a ``torch.save`` file at its unique key
(``sd["rng_state/shard_0_2"]``), as the Python object it is, and comes back as a
sharded object. A plain DCP checkpoint's values, and those of a save through
``ShardstoreWriter``, go where they were in the state dict DCP saved (its planner's
paths, as ``dcp_to_torch_save`` puts them). Safetensors names
(``model.layers.0.weight``) are array keys as they are. An export records which of its
tensors were arrays, under which key, and which were values of the common state
(``convert_layout``): a ``.pt`` file in an archive entry, safetensors in its metadata,
with the common state as JSON; an import of such a file gives the checkpoint back as it
was. Sharded objects and values JSON cannot hold are left out of safetensors, and named.

Nothing is left behind by a conversion that fails: a checkpoint is staged and
published by its commit (``shardstore.format.commit``), a file is written under a temporary
name beside its destination and renamed at the end, a safetensors directory is filled
under a temporary name and renamed; files and directories get the modes ``open()`` and
``mkdir()`` give (the umask applies). Conversions run in one process (the ``shardstore
convert`` command); they refuse to run inside an initialized process group, where
``save`` would be collective.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from shardstore.core import CheckpointingException
from shardstore.format.dtypes import ShapedTensorSize, from_zarr_name
from shardstore.format.pickles import load_torch_file
from shardstore.mapping import ShardedObject, ShardedTensor, StateDict
from shardstore.opened import bare_location, open_read
from shardstore.other_formats.base import place_value
from shardstore.protocol.collectives import Group
from shardstore.stores.base import Location
from shardstore.tools.convert_layout import (
    Layout,
    common_tensor_names,
    decode_common,
    encode_common,
    read_safetensors_layout,
    read_torch_layout,
    safetensors_metadata,
    save_torch_file,
    value_at,
    without_places,
)
from shardstore.tools.model_files import (
    SAFETENSORS_INDEX,
    SAFETENSORS_SINGLE,
    SafetensorsModel,
    open_model_file,
    safetensors_model,
)

DEFAULT_MEMORY_BYTES = 2**30
DEFAULT_SHARD_BYTES = 5 * 10**9  # Hugging Face's default max_shard_size, "5GB"
_MAX_SAFETENSORS_HEADER = 100 * 2**20  # the format's own limit

# safetensors dtype names (the format's spec) and ours.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_SAFETENSORS_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


T = TypeVar("T")
TORCH_SUFFIXES = (".pt", ".pth", ".bin")


# --------------------------------------------------------------------------- reading


def array_batches(
    arrays: Sequence[T], memory_bytes: int, nbytes: Callable[[T], int] = attrgetter("nbytes")
) -> list[list[T]]:
    """The arrays (records, tensors, anything ``nbytes`` sizes in bytes) in order, cut
    into batches of at most ``memory_bytes`` (an array larger than that is a batch of
    its own)."""
    batches: list[list[T]] = []
    size = 0
    for array in arrays:
        if not batches or size + nbytes(array) > memory_bytes:
            batches.append([])
            size = 0
        batches[-1].append(array)
        size += nbytes(array)
    return batches


def read_arrays(
    checkpoint: str | os.PathLike | Location,
    keys: list[str] | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(key, whole global tensor)`` for the checkpoint's arrays (or ``keys``),
    sorted by key, reading a batch of at most ``memory_bytes`` at a time.

    Not collective; the tensors of a batch are freed when the caller drops them.
    """
    from shardstore.strategies.zarr import ZarrLoadShardedStrategy

    opened = open_read(checkpoint)
    location, record = opened.location, opened.require_record()
    wanted = sorted(record.arrays) if keys is None else sorted(keys)
    unknown = [k for k in wanted if k not in record.arrays]
    if unknown:
        raise CheckpointingException(f"Checkpoint {location.describe()} has no array {unknown[0]!r}")
    strategy = ZarrLoadShardedStrategy()
    for batch in array_batches([record.arrays[k] for k in wanted], memory_bytes):
        request = {
            a.key: ShardedTensor.from_rank_offsets(
                a.key, torch.empty(a.shape, dtype=from_zarr_name(a.dtype).torch_dtype)
            )
            for a in batch
        }
        loaded = strategy.load_with_record(request, location, record, Group.local())
        for array in batch:
            yield array.key, loaded.pop(array.key)


def read_tensors(
    checkpoint: str | os.PathLike | Location,
    keys: list[str] | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``read_arrays`` of any checkpoint ``load`` reads: a shardstore checkpoint's
    arrays a batch at a time, another tool's tensors (a registered other format) one at
    a time; sorted by key. Not collective."""
    from shardstore.strategies.other_formats import open_other_format

    opened = open_read(checkpoint)
    if opened.other_format is None:
        yield from read_arrays(opened, keys, memory_bytes)
        return
    source = open_other_format(opened.location)
    for key in sorted(source.tensors if keys is None else keys):
        if key not in source.tensors:
            raise CheckpointingException(f"{source.path} has no tensor {key!r}")
        yield key, source.read_tensor(key)


def read_non_tensor_state(checkpoint: str | os.PathLike | Location) -> StateDict:
    """The common state, with every sharded object's shards added at their unique keys
    (``rng_state/shard_0_2``), each the Python object it holds; of a shardstore
    checkpoint or of another tool's (a plain DCP checkpoint's values nested where they
    were in the state dict it saved)."""
    from shardstore.serialization import load, load_sharded_metadata

    _refuse_process_group("reading a checkpoint's common state for conversion")
    opened = open_read(checkpoint)
    objects = {k: v for k, v in load_sharded_metadata(opened).items() if not isinstance(v, ShardedTensor)}
    state = load(objects, opened)
    return state


# --------------------------------------------------------------------------- what an export reads


@dataclass(frozen=True)
class TensorSpec(ShapedTensorSize):
    """A source tensor's dtype and shape, known before its bytes are read (a streamed
    safetensors file's header comes first)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tensor.dtype, tuple(tensor.shape))


@dataclass(frozen=True)
class ExportSource:
    """A source opened for ``to_torch_file`` and ``to_safetensors``, whatever its
    format, so that each target is written by one function.

    Attributes:
        tensors: each tensor's key (an array key; a ``torch.save`` file's tensors by
            their ``/``-joined path) -> its dtype and shape, sorted by key.
        read: ``read(keys, memory_bytes)`` yields ``(key, whole tensor)`` for ``keys``,
            at most ``memory_bytes`` alive at once (a larger tensor alone).
        other_values: everything else (common state, sharded object shards at their
            unique keys), nested as a ``torch.save`` file of the source holds it.
        place: where a tensor goes in that file: its dict keys and list indices.
        objects: the top-level keys of ``other_values`` that are sharded object shards.
    """

    tensors: dict[str, TensorSpec]
    read: Callable[[list[str], int], Iterator[tuple[str, torch.Tensor]]]
    other_values: Callable[[], dict[Any, Any]]
    place: Callable[[str], tuple[str | int, ...]]
    objects: Callable[[], tuple[str, ...]] = tuple

    @property
    def tensor_bytes(self) -> dict[str, int]:
        """Each tensor's size in bytes, by key."""
        return {key: spec.nbytes for key, spec in self.tensors.items()}

    def places(self) -> dict[str, tuple[str | int, ...]]:
        """Each tensor's place, for the layout that lets an export convert back exactly."""
        return {key: self.place(key) for key in self.tensor_bytes}


def source_kind(source: str | os.PathLike | Location) -> str:
    """What a conversion's source is: ``"torch"`` (a ``torch.save`` file),
    ``"safetensors"`` (a file, or a model directory with ``model.safetensors`` or an
    index), the name of another tool's format in ``shardstore.other_formats.registry``
    (``"dcp"``, ``"torch_dist"``, ``"zarr"``) or ``"shardstore"``; anything else is
    refused by ``read_commit_record``, which says what it is (nothing, an unfinished
    save, a file or directory of something else)."""
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        local = bare_location(text).local_path()
        if text.endswith(".safetensors") and (local is None or local.is_file()):
            return "safetensors"
        if local is not None and local.is_file():
            return "torch"
        if local is not None and any(os.path.lexists(local / n) for n in (SAFETENSORS_INDEX, SAFETENSORS_SINGLE)):
            return "safetensors"
    opened = open_read(source)
    return opened.other_format.name if opened.other_format is not None else "shardstore"


def open_export_source(source: str | os.PathLike | Location) -> ExportSource:
    """The source of an export, opened (see ``source_kind``)."""
    kind = source_kind(source)
    if kind == "torch":
        return _torch_file_source(Path(source))  # type: ignore[arg-type]
    if kind == "safetensors":
        return _safetensors_source(source)  # type: ignore[arg-type]
    return _checkpoint_source(source)


def _safetensors_source(path: str | os.PathLike) -> ExportSource:
    """A safetensors model: its tensors by name (memory-mapped), and, where a shardstore
    export wrote its layout, the common state and each array's place back."""
    model = safetensors_model(path)
    tensors = safetensors_tensors(model, path)
    layout = read_safetensors_layout(model.files[0]) or Layout()
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
    )


def _checkpoint_source(checkpoint: str | os.PathLike | Location) -> ExportSource:
    """A shardstore checkpoint, or another tool's: arrays by key (``model/fc1`` goes to
    ``sd["model"]["fc1"]``), except the values of a save through DCP's API (a plain DCP
    save, or one through ``ShardstoreWriter`` whose record keeps DCP's planner paths),
    which go where they were in the state dict DCP saved, as ``dcp_to_torch_save`` puts
    them."""
    from shardstore.strategies.other_formats import open_other_format

    opened = open_read(checkpoint)
    saved_paths: Mapping[str, tuple[str | int, ...]] = {}
    if opened.record is not None:
        specs = {
            key: TensorSpec(from_zarr_name(a.dtype).torch_dtype, a.shape) for key, a in opened.record.arrays.items()
        }
        if opened.record.dcp is not None and opened.record.dcp.paths is not None:
            saved_paths = opened.record.dcp.paths
    else:
        other = open_other_format(opened.location)
        specs = {key: TensorSpec(t.dtype, t.shape) for key, t in other.tensors.items()}
        saved_paths = other.saved_paths

    def other_values() -> dict[Any, Any]:
        state: dict[Any, Any] = {}
        for key, value in read_non_tensor_state(opened).items():
            place_value(state, saved_paths.get(key, (key,)), value, key)
        return state

    def objects() -> tuple[str, ...]:
        from shardstore.serialization import load_sharded_metadata

        return tuple(k for k, v in load_sharded_metadata(opened).items() if isinstance(v, ShardedObject))

    return ExportSource(
        dict(sorted(specs.items())),
        lambda keys, memory_bytes: read_tensors(opened, keys, memory_bytes), other_values,
        lambda key: saved_paths.get(key) or tuple(key.split("/")), objects,
    )


def _torch_file_source(path: Path) -> ExportSource:
    """A ``torch.save`` file: its tensors by their ``/``-joined paths (memory-mapped),
    or, where a shardstore export wrote its layout, its arrays by their keys."""
    state = _load_state_dict_file(path)
    layout = read_torch_layout(path)
    if layout is None:
        tensors = _tensors_by_key(state, str(path))
        objects = tuple(k for k in state if _is_object_shard_key(k))
        return ExportSource(
            {k: TensorSpec.of(t) for k, (_, t) in sorted(tensors.items())},
            lambda keys, _: ((k, tensors[k][1]) for k in keys), lambda: _without_tensors(state),
            lambda key: tensors[key][0], lambda: objects,
        )
    tensors = _layout_arrays(state, layout, path)
    return ExportSource(
        {k: TensorSpec.of(t) for k, (_, t) in sorted(tensors.items())},
        lambda keys, _: ((k, tensors[k][1]) for k in keys), lambda: without_places(state, set(layout.arrays.values())),
        lambda key: tensors[key][0], lambda: layout.objects,
    )


def _layout_arrays(
    state: dict[Any, Any], layout: Layout, path: Path
) -> dict[str, tuple[tuple[str | int, ...], torch.Tensor]]:
    """The arrays a ``torch.save`` file's layout names, by key, with their places."""
    found = {}
    for key, place in layout.arrays.items():
        value = value_at(state, place, str(path))
        if not isinstance(value, torch.Tensor):
            raise CheckpointingException(
                f"{path}: its shardstore layout names array {key!r} at {list(place)}, which holds a "
                f"{type(value).__name__}; convert the file again from its checkpoint"
            )
        found[key] = (place, value)
    missing = [k for k in layout.objects if k not in state]
    if missing:
        raise CheckpointingException(f"{path}: its shardstore layout names object shard {missing[0]!r}, not in the file")
    return found


# --------------------------------------------------------------------------- torch.save


def to_torch_file(
    source: str | os.PathLike | Location, path: str | os.PathLike, memory_bytes: int = DEFAULT_MEMORY_BYTES
) -> Export:
    """Writes a checkpoint (shardstore, PyTorch DCP, Megatron-Core torch_dist or zarr)
    or a safetensors model as one new ``torch.save`` file: every value at its place
    (``ExportSource.place``), each sharded object shard at its unique key as the Python
    object it holds; a plain DCP checkpoint gives what ``dcp_to_torch_save`` gives.
    Needs memory for the whole model (one pickle); nothing is written if it fails."""
    if source_kind(source) == "torch":
        raise CheckpointingException(f"{source} is a torch.save file already")
    opened = open_export_source(source)
    state = opened.other_values()
    for key, tensor in opened.read(list(opened.tensor_bytes), memory_bytes):
        place_value(state, opened.place(key), tensor, key)
    out = Path(path)
    layout = Layout(opened.places(), opened.objects())
    _write_new_file(out, lambda p: save_torch_file(state, p, out, layout))
    return Export((out.name,), len(opened.tensor_bytes), sum(opened.tensor_bytes.values()), ())


def from_torch_file(
    path: str | os.PathLike, checkpoint: str | os.PathLike | Location, overwrite: bool = False
) -> int:
    """Saves a ``torch.save`` file (loaded with ``weights_only=True``, memory-mapped) as a
    shardstore checkpoint: each tensor an array keyed by its path, each value at a
    sharded object's unique key (how ``to_torch_file`` writes one) that sharded object,
    the rest the common state. Returns the number of arrays written."""
    from shardstore.serialization import save

    _refuse_process_group("converting a torch.save file")
    state = _load_state_dict_file(Path(path))
    layout = read_torch_layout(Path(path))
    if layout is None:
        tensors = _tensors_by_key(state, str(path))
        objects: Sequence[str] = [k for k in state if _is_object_shard_key(k)]
    else:  # written by to_torch_file: each value goes back where it was, arrays and common state
        tensors, objects = _layout_arrays(state, layout, Path(path)), layout.objects
    for key in objects:
        state[key] = replace(ShardedObject.empty_from_unique_key(key), data=state[key])
    for key, (where, tensor) in tensors.items():
        _parent(state, where)[where[-1]] = ShardedTensor.from_rank_offsets(key, tensor)
    save(state, checkpoint, overwrite=overwrite)
    return len(tensors)


def _load_state_dict_file(path: Path) -> dict[Any, Any]:
    state = load_torch_file(path, f"{path} (a torch.save file)")
    if not isinstance(state, dict):
        raise CheckpointingException(f"{path} holds a {type(state).__name__}, not a state dict")
    return state


def _is_object_shard_key(key: Any) -> bool:
    """A top-level key of a ``torch.save`` file that names a sharded object's shard
    (``rng_state/shard_0_2``): its value stays one object, whatever it holds."""
    from shardstore.strategies.other_formats import _is_object_shard

    return isinstance(key, str) and _is_object_shard(key)


def _tensors_by_key(state: dict[Any, Any], where: str) -> dict[str, tuple[tuple[Any, ...], torch.Tensor]]:
    """Every tensor of a ``torch.save`` state dict (in dicts and lists, not in sharded
    object shards), by its ``/``-joined path, with the path."""
    found: dict[str, tuple[tuple[Any, ...], torch.Tensor]] = {}
    for path, tensor in _tensor_leaves(state, ()):
        key = "/".join(map(str, path))
        if key in found:
            raise CheckpointingException(f"{where}: two tensors have the key {key!r} (their paths joined by '/')")
        found[key] = (path, tensor)
    return found


def _tensor_leaves(node: dict | list, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    for k, v in node.items() if isinstance(node, dict) else enumerate(node):
        if not path and _is_object_shard_key(k):
            continue
        if isinstance(v, torch.Tensor):
            yield (*path, k), v
        elif isinstance(v, (dict, list)):
            yield from _tensor_leaves(v, (*path, k))


def _without_tensors(node: dict | list, top: bool = True) -> dict | list:
    """``node`` without its tensors (nor the dicts and lists that held only tensors),
    sharded object shards kept whole: what a safetensors file cannot hold."""
    kept = []
    for k, v in node.items() if isinstance(node, dict) else enumerate(node):
        if not (top and _is_object_shard_key(k)):
            if isinstance(v, torch.Tensor):
                continue
            if isinstance(v, (dict, list)) and v:
                v = _without_tensors(v, top=False)
                if not v:
                    continue
        kept.append((k, v))
    return dict(kept) if isinstance(node, dict) else [v for _, v in kept]


# --------------------------------------------------------------------------- safetensors


@dataclass(frozen=True)
class Export:
    """What ``to_torch_file`` or ``to_safetensors`` wrote: its files (names in the
    output directory, or the file's name), its tensors and their bytes, and the keys of
    the values it could not write (safetensors holds tensors only)."""

    files: tuple[str, ...]
    tensors: int
    total_bytes: int
    left_out: tuple[str, ...]


def to_safetensors(
    source: str | os.PathLike | Location,
    out_dir: str | os.PathLike,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> Export:
    """Writes the tensors of a checkpoint (shardstore, PyTorch DCP, Megatron-Core
    torch_dist or zarr) or ``torch.save`` file as a new Hugging Face style safetensors
    directory ``out_dir`` (or into an empty one): ``model.safetensors``, or
    ``model-00001-of-0000N.safetensors`` shards of at most ``max_shard_bytes`` with
    ``model.safetensors.index.json``. At most one shard is in memory at once. The
    common state goes into the first file's metadata with the checkpoint's layout
    (``convert_layout``), its tensors into the files by their paths; sharded objects and
    values that JSON cannot hold are left out, and named. The directory is filled under
    a temporary name and renamed at the end: a failure leaves nothing."""
    opened = open_export_source(source)
    # read first: a source whose other values cannot be read fails before anything is written
    other = opened.other_values()
    objects = opened.objects()
    common, common_tensors, left = encode_common({k: v for k, v in other.items() if k not in objects})
    left_out = tuple(sorted([*objects, *left]))
    clash = sorted(set(common_tensors) & set(opened.tensor_bytes))
    if clash:
        raise CheckpointingException(
            f"{source}: the common state's tensor {clash[0]!r} has the name of an array; safetensors needs one name each"
        )
    specs = {**opened.tensors, **{name: TensorSpec.of(t) for name, t in common_tensors.items()}}
    sizes = {key: spec.nbytes for key, spec in specs.items()}
    shards = array_batches(list(sizes.items()), max_shard_bytes, itemgetter(1)) or [[]]
    names = (
        [SAFETENSORS_SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    out = Path(out_dir)
    metadata = {"format": "pt", **safetensors_metadata(Layout(opened.places(), common=common))}
    with _new_directory(out) as staging:
        for name, shard in zip(names, shards):
            keys = [key for key, _ in shard]

            def tensors(keys: list[str] = keys) -> Iterator[tuple[str, torch.Tensor]]:
                yield from ((key, common_tensors[key]) for key in keys if key in common_tensors)
                yield from opened.read([key for key in keys if key not in common_tensors], memory_bytes)

            _write_new_file(
                staging / name,
                lambda p, k=keys, t=tensors, n=name, m=metadata: write_safetensors(
                    p, out / n, {key: specs[key] for key in k}, t(), m
                ),
            )
            metadata = {"format": "pt"}  # the layout is in the first file
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {key: name for name, shard in zip(names, shards) for key, _ in shard}}
            _write_new_file(staging / SAFETENSORS_INDEX, lambda p: p.write_text(json.dumps(index, indent=2)))
    return Export(tuple(names), len(sizes), sum(sizes.values()), left_out)


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
    bytes, as the format allows."""
    order = sorted(specs, key=lambda key: (-specs[key].itemsize, key))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
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
                f.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
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
    except (OSError, ValueError) as exc:
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
    metadata = header.get("__metadata__")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise ValueError("its __metadata__ is not an object of strings")
    entries = sorted(
        (_safetensors_entry(name, info) for name, info in header.items() if name != "__metadata__"),
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


def from_safetensors(
    path: str | os.PathLike, checkpoint: str | os.PathLike | Location, overwrite: bool = False
) -> int:
    """Saves a safetensors file or model directory as a shardstore checkpoint (one array
    per tensor name; where a shardstore export wrote its layout, the common state and
    the arrays as they were); returns the number of arrays written."""
    from shardstore.serialization import save

    _refuse_process_group("converting safetensors")
    opened = _safetensors_source(path)
    state = opened.other_values()
    for key, tensor in opened.read(list(opened.tensor_bytes), 0):
        place_value(state, (key,), ShardedTensor.from_rank_offsets(key, tensor), key)  # its key says where it goes
    save(state, checkpoint, overwrite=overwrite)
    return len(opened.tensor_bytes)


# --------------------------------------------------------------------------- other tools' formats


def from_other_format(
    path: str | os.PathLike, checkpoint: str | os.PathLike | Location, overwrite: bool = False
) -> int:
    """Imports another tool's checkpoint, of any format in
    ``shardstore.other_formats.registry`` (PyTorch DCP, Megatron-Core torch_dist or zarr;
    read without running its pickles): every tensor becomes the array of its key, whole,
    written one at a time; Megatron's ShardedObjects (``<key>/shard_<offset>_<shape>``)
    stay sharded objects; Megatron's ``common.pt`` and a plain DCP's other values form
    the common state. Returns the number of arrays."""
    from shardstore.strategies.other_formats import OtherFormatLoadCommonStrategy, open_other_format
    from shardstore.tools.array_writer import CheckpointWriter

    source = open_other_format(path)
    object_keys = list(OtherFormatLoadCommonStrategy().load_sharded_metadata(source.path))
    planned = {key: torch.empty(t.shape, dtype=t.dtype, device="meta") for key, t in source.tensors.items()}
    with CheckpointWriter(checkpoint, overwrite, planned_arrays=planned, planned_objects=object_keys) as writer:
        for key, tensor in source.iter_tensors():
            writer.write_array(key, tensor)
        common = OtherFormatLoadCommonStrategy().load_common(source.path)
        writer.commit(common, {key: source.read_object_shard(key) for key in object_keys})
    return len(source.tensors)


# --------------------------------------------------------------------------- helpers


def _refuse_process_group(what: str) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise CheckpointingException(
            f"{what} runs in one process, but a process group of {dist.get_world_size()} ranks is initialized; "
            "run it in a separate process (the `shardstore convert` command)"
        )


def _parent(state: dict[Any, Any], path: tuple[Any, ...]) -> Any:
    """The dict or list that holds the value at ``path``."""
    node: Any = state
    for part in path[:-1]:
        node = node[part]
    return node


def _write_new_file(path: Path, write: Callable[[Path], Any]) -> None:
    """Has ``write`` write a temporary file beside ``path`` that is then renamed to
    ``path``, so a failed conversion leaves no file (nor the directories made for it);
    refuses to replace a file. The file gets the mode ``open()`` gives a new file (0666
    less the umask), whatever ``write`` does: safetensors' writer makes 0600 files."""
    if path.exists():
        raise CheckpointingException(f"{path} exists; choose a new output path")
    made = _make_directories(path.parent)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
        mode = stat.S_IMODE(os.fstat(descriptor).st_mode)
        os.close(descriptor)
        write(temporary)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        _remove_directories(made)
        raise


@contextmanager
def _new_directory(path: Path) -> Iterator[Path]:
    """A directory filled under a temporary name beside ``path`` (the one yielded) and
    renamed to ``path`` at the end, replacing an empty directory there; if anything
    fails, removed, with the directories made for it."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise CheckpointingException(f"{path} exists and is not an empty directory; convert into a new directory")
    made = _make_directories(path.parent)
    staging = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
    try:
        staging.mkdir()  # the umask applies, as to any mkdir
        yield staging
        os.rename(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_directories(made)
        raise


def _make_directories(directory: Path) -> list[Path]:
    """Makes ``directory`` and its missing parents; returns those it made, deepest first."""
    missing = []
    for candidate in (directory, *directory.parents):
        if candidate.exists():
            break
        missing.append(candidate)
    for candidate in reversed(missing):
        candidate.mkdir(exist_ok=True)
    return missing


def _remove_directories(made: list[Path]) -> None:
    for directory in made:
        with suppress(OSError):  # not empty: someone else's files arrived meanwhile
            directory.rmdir()
