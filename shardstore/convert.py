"""Conversions between a shardstore checkpoint and single-process formats, with
bounded memory: a ``torch.save`` file, and Hugging Face style safetensors (one file, or
shards with a ``model.safetensors.index.json``); and imports of PyTorch DCP and
Megatron-Core torch_dist and zarr checkpoints (``from_foreign``, one tensor in memory at
a time).

Reading a checkpoint here means whole global arrays, a batch at a time
(``read_arrays``): at most ``memory_bytes`` of them are alive at once (an array larger
than that alone). Writing one means a save at world size 1 from tensors that are
memory-mapped from the source file, so neither direction holds the model in memory,
except ``to_torch_file``, whose single pickle needs every tensor at once.

Keys: a tensor at ``sd["model"]["fc1"]`` of a ``torch.save`` file becomes the array
``model/fc1`` and comes back to the same place; the other values form the common
state. Safetensors names (``model.layers.0.weight``) are array keys as they are; a
safetensors file holds tensors only, so ``to_safetensors`` leaves the common state and
sharded objects out and says which keys it left.

Conversions run in one process (the ``shardstore convert`` command); they refuse to run
inside an initialized process group, where ``save`` would be collective.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shardstore.core import CheckpointingException
from shardstore.distributed import Group
from shardstore.dtypes import from_zarr_name
from shardstore.format import ArrayRecord
from shardstore.integrity import open_committed
from shardstore.mapping import ShardedTensor, StateDict
from shardstore.pickles import load_torch_file
from shardstore.storage import Location

DEFAULT_MEMORY_BYTES = 2**30
DEFAULT_SHARD_BYTES = 5 * 10**9  # Hugging Face's default max_shard_size, "5GB"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
_MAX_SAFETENSORS_HEADER = 100 * 2**20  # the format's own limit

# safetensors dtype names (the format's spec) and ours.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


# --------------------------------------------------------------------------- reading


def array_batches(arrays: list[ArrayRecord], memory_bytes: int) -> list[list[ArrayRecord]]:
    """The arrays in order, cut into batches of at most ``memory_bytes`` (an array
    larger than that is a batch of its own)."""
    batches: list[list[ArrayRecord]] = []
    size = 0
    for array in arrays:
        if not batches or size + array.nbytes > memory_bytes:
            batches.append([])
            size = 0
        batches[-1].append(array)
        size += array.nbytes
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

    location = open_committed(checkpoint)
    record = location.record
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


def read_non_tensor_state(checkpoint: str | os.PathLike | Location) -> StateDict:
    """The common state, with every sharded object's shards added at their unique keys
    (``rng_state/shard_0_2``)."""
    from shardstore.serialization import load, load_sharded_metadata

    _refuse_process_group("reading a checkpoint's common state for conversion")
    location = open_committed(checkpoint)
    objects = {k: v for k, v in load_sharded_metadata(location).items() if not isinstance(v, ShardedTensor)}
    state = load(objects, location)
    return state


# --------------------------------------------------------------------------- torch.save


def to_torch_file(checkpoint: str | os.PathLike | Location, path: str | os.PathLike) -> None:
    """Writes the checkpoint as one ``torch.save`` file: the common state, with each
    array at its key's place (``model/fc1`` -> ``sd["model"]["fc1"]``) and each sharded
    object shard at its unique key. Needs memory for the whole checkpoint (one pickle)."""
    state = read_non_tensor_state(checkpoint)
    for key, tensor in read_arrays(checkpoint):
        _put(state, key.split("/"), tensor, key)
    _write_new_file(Path(path), lambda p: torch.save(state, p))


def _put(state: dict, parts: list[str], value: Any, key: str) -> None:
    node = state
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise CheckpointingException(
                f"Cannot place array {key!r}: the common state holds a non-dict value at {part!r}"
            )
    if parts[-1] in node:
        raise CheckpointingException(f"Cannot place array {key!r}: the common state already holds that key")
    node[parts[-1]] = value


def from_torch_file(
    path: str | os.PathLike, checkpoint: str | os.PathLike | Location, overwrite: bool = False
) -> int:
    """Saves a ``torch.save`` file (loaded with ``weights_only=True``, memory-mapped) as a
    shardstore checkpoint; returns the number of arrays written."""
    from shardstore.serialization import save

    _refuse_process_group("converting a torch.save file")
    state = load_torch_file(path, f"{path} (a torch.save file)")
    if not isinstance(state, dict):
        raise CheckpointingException(f"{path} holds a {type(state).__name__}, not a state dict")
    count = _shard_tensors(state, ())
    save(state, checkpoint, overwrite=overwrite)
    return count


def _shard_tensors(node: dict | list, path: tuple[str, ...]) -> int:
    """Replaces every tensor leaf by a whole-tensor ShardedTensor keyed by its path."""
    count = 0
    for k, v in list(node.items()) if isinstance(node, dict) else list(enumerate(node)):
        here = (*path, str(k))
        if isinstance(v, torch.Tensor):
            node[k] = ShardedTensor.from_rank_offsets("/".join(here), v)
            count += 1
        elif isinstance(v, (dict, list)):
            count += _shard_tensors(v, here)
    return count


# --------------------------------------------------------------------------- safetensors


@dataclass(frozen=True)
class SafetensorsExport:
    """What ``to_safetensors`` wrote: its files and the keys it could not write."""

    files: tuple[str, ...]
    tensors: int
    total_bytes: int
    left_out: tuple[str, ...]


def to_safetensors(
    checkpoint: str | os.PathLike | Location,
    out_dir: str | os.PathLike,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> SafetensorsExport:
    """Writes the arrays as Hugging Face style safetensors into a new (or empty)
    ``out_dir``: ``model.safetensors``, or ``model-00001-of-0000N.safetensors`` shards
    of at most ``max_shard_bytes`` with ``model.safetensors.index.json`` (written last).
    At most one shard is in memory at once."""
    from safetensors.torch import save_file

    location = open_committed(checkpoint)
    record = location.record
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise CheckpointingException(f"{out} is not empty; convert into a new directory")
    out.mkdir(parents=True, exist_ok=True)
    arrays = [record.arrays[k] for k in sorted(record.arrays)]
    shards = array_batches(arrays, max_shard_bytes)
    names = (
        [SAFETENSORS_SINGLE]
        if len(shards) <= 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for name, shard in zip(names, shards):
        tensors = dict(read_arrays(location, [a.key for a in shard], memory_bytes))
        _write_new_file(out / name, lambda p, t=tensors: save_file(t, p, metadata={"format": "pt"}))
        del tensors
        weight_map.update({a.key: name for a in shard})
    total = sum(a.nbytes for a in arrays)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_new_file(out / SAFETENSORS_INDEX, lambda p: p.write_text(json.dumps(index, indent=2)))
    left_out = tuple(sorted(_leaf_paths(read_non_tensor_state(location))))
    return SafetensorsExport(tuple(names[: len(shards)]), len(arrays), total, left_out)


def _leaf_paths(state: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(state, dict) and state:
        for k, v in state.items():
            yield from _leaf_paths(v, f"{prefix}/{k}" if prefix else str(k))
    elif prefix:
        yield prefix


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The files of a safetensors model: ``path`` itself, or the shards its directory's
    index names, or the directory's single ``model.safetensors``."""
    root = Path(path)
    if root.is_file():
        return [root]
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointingException(f"{index} is not a safetensors index: {exc}") from exc
        names = sorted(set(weight_map.values()))
        if any("/" in n or n.startswith(".") for n in names):
            raise CheckpointingException(f"{index} names files outside its directory")
        return [root / n for n in names]
    if (root / SAFETENSORS_SINGLE).is_file():
        return [root / SAFETENSORS_SINGLE]
    raise CheckpointingException(f"{root} holds no safetensors model ({SAFETENSORS_INDEX} or {SAFETENSORS_SINGLE})")


def map_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, memory-mapped (nothing is read until used).

    The safetensors library's readers copy each tensor into memory; this maps the file,
    whose layout the format fixes: an 8-byte little-endian header size, a JSON header
    naming each tensor's dtype, shape and byte offsets, then the data."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= _MAX_SAFETENSORS_HEADER:
                raise ValueError(f"header size {size} out of range")
            header = json.loads(f.read(size))
        data = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + size) if path.stat().st_size > 8 + size else None
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES[info["dtype"]]
            shape = [int(n) for n in info["shape"]]
            start, stop = (int(o) for o in info["data_offsets"])
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if stop - start != nbytes or start < 0 or (nbytes and (data is None or stop > data.size)):
                raise ValueError(f"tensor {name!r} has inconsistent offsets {start}:{stop}")
            raw = torch.from_numpy(data[start:stop]) if nbytes else torch.empty(0, dtype=torch.uint8)
            tensors[name] = raw.view(dtype).reshape(shape)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointingException(f"Cannot read {path} as a safetensors file: {exc}") from exc
    return tensors


def from_safetensors(
    path: str | os.PathLike, checkpoint: str | os.PathLike | Location, overwrite: bool = False
) -> int:
    """Saves a safetensors file or model directory as a shardstore checkpoint (one array
    per tensor name); returns the number of arrays written."""
    from shardstore.serialization import save

    _refuse_process_group("converting safetensors")
    state: dict[str, Any] = {}
    for file in safetensors_files(path):
        for name, tensor in map_safetensors(file).items():
            if name in state:
                raise CheckpointingException(f"Tensor {name!r} appears in two files of {path}")
            state[name] = ShardedTensor.from_rank_offsets(name, tensor)
    save(state, checkpoint, overwrite=overwrite)
    return len(state)


# --------------------------------------------------------------------------- DCP, Megatron torch_dist and zarr


def from_foreign(
    path: str | os.PathLike, checkpoint: str | os.PathLike | Location, overwrite: bool = False
) -> int:
    """Imports a PyTorch DCP checkpoint, or a Megatron-Core torch_dist or zarr one (read
    without running its pickles, ``shardstore.strategies.foreign``): every tensor becomes
    the array of its key, whole, written one at a time; Megatron's ShardedObjects
    (``<key>/shard_<offset>_<shape>``) stay sharded objects; Megatron's ``common.pt``
    and a plain DCP's other values form the common state. Returns the number of arrays."""
    from shardstore.strategies.foreign import (
        ForeignLoadCommonStrategy,
        open_foreign,
        read_sharded_object,
    )
    from shardstore.writer import CheckpointWriter

    source = open_foreign(path)
    object_keys = list(ForeignLoadCommonStrategy().load_sharded_metadata(source.path))
    planned = {key: torch.empty(t.shape, dtype=t.dtype, device="meta") for key, t in source.tensors.items()}
    with CheckpointWriter(checkpoint, overwrite, planned_arrays=planned, planned_objects=object_keys) as writer:
        for key, tensor in source.iter_tensors():
            writer.write_array(key, tensor)
        common = ForeignLoadCommonStrategy().load_common(source.path)
        writer.commit(common, {key: read_sharded_object(source, key) for key in object_keys})
    return len(source.tensors)


# --------------------------------------------------------------------------- helpers


def _refuse_process_group(what: str) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise CheckpointingException(
            f"{what} runs in one process, but a process group of {dist.get_world_size()} ranks is initialized; "
            "run it in a separate process (the `shardstore convert` command)"
        )


def _write_new_file(path: Path, write: Callable[[Path], Any]) -> None:
    """Has ``write`` write a temporary file that is then renamed to ``path``, so a
    failed conversion leaves no file that looks complete; refuses to replace a file."""
    if path.exists():
        raise CheckpointingException(f"{path} exists; choose a new output path")
    temporary = path.with_name(f".{path.name}.partial")
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
