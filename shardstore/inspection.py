"""Looking at checkpoints without loading them into a model: what one holds
(``describe_checkpoint``), and how two differ (``diff_checkpoints``).

Both are plain data (frozen dataclasses with ``to_json``) that the ``shardstore``
command prints; neither is collective.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from shardstore.convert import DEFAULT_MEMORY_BYTES, read_arrays
from shardstore.dict_utils import diff
from shardstore.integrity import open_committed
from shardstore.storage import Location
from shardstore.strategies.foreign import reads_as_foreign


@dataclass(frozen=True)
class ArraySummary:
    key: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    chunks: int
    nbytes: int


@dataclass(frozen=True)
class CheckpointSummary:
    """What a checkpoint holds: a committed shardstore checkpoint, from its commit
    record and common state; another tool's (``kind`` names it: ``torch_dist``, ``dcp``,
    ``zarr``), from its own metadata, where the commit-record fields are empty (0, "")
    and an array's ``chunk_shape`` is empty when its saved chunks differ in shape."""

    checkpoint: str
    format_version: int
    library_version: str
    created: float
    world_size: int
    save_id: str
    arrays: tuple[ArraySummary, ...]
    objects: dict[str, tuple[str, ...]]
    common_keys: tuple[str, ...]
    kind: str = "shardstore"

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "nbytes": self.nbytes}


def describe_checkpoint(checkpoint: str | os.PathLike | Location) -> CheckpointSummary:
    """The arrays (shape, dtype, chunking, bytes), sharded objects, common-state keys,
    format version and saving world size of a committed checkpoint."""
    from shardstore.serialization import load_common_state_dict

    if reads_as_foreign(checkpoint):
        return describe_foreign(checkpoint)
    location = open_committed(checkpoint)
    record = location.record
    arrays = tuple(
        ArraySummary(a.key, a.shape, a.dtype, a.chunk_shape, a.chunk_count, a.nbytes)
        for _, a in sorted(record.arrays.items())
    )
    common = load_common_state_dict(location)
    return CheckpointSummary(
        checkpoint=location.describe(),
        format_version=record.format_version,
        library_version=record.library_version,
        created=record.created,
        world_size=record.world_size,
        save_id=record.save_id,
        arrays=arrays,
        objects={k: o.shard_keys for k, o in sorted(record.objects.items())},
        common_keys=tuple(sorted(str(k) for k in common)),
    )


def describe_foreign(checkpoint: str | os.PathLike | Location) -> CheckpointSummary:
    """What another tool's checkpoint (PyTorch DCP, Megatron-Core torch_dist or zarr)
    holds, read as ``load`` reads it (no code from it runs)."""
    from shardstore.dtypes import from_torch
    from shardstore.strategies.foreign import ForeignLoadCommonStrategy, open_foreign

    source = open_foreign(checkpoint)
    arrays = tuple(
        ArraySummary(key, t.shape, from_torch(t.dtype).zarr_name, t.chunk_shape, t.chunk_count, t.nbytes)
        for key, t in sorted(source.tensors.items())
    )
    shards = ForeignLoadCommonStrategy().load_sharded_metadata(source.path)
    objects: dict[str, list[str]] = {}
    for unique_key, obj in sorted(shards.items()):
        objects.setdefault(obj.key, []).append(unique_key)
    common = ForeignLoadCommonStrategy().load_common(source.path)
    return CheckpointSummary(
        checkpoint=str(source.path), format_version=0, library_version="", created=0.0, world_size=0, save_id="",
        arrays=arrays, objects={k: tuple(v) for k, v in objects.items()},
        common_keys=tuple(sorted(str(k) for k in common)), kind=source.kind,
    )


@dataclass(frozen=True)
class ArrayDifference:
    """One array in both checkpoints: ``max_abs_diff`` is None when the shapes differ
    (nothing to compare element-wise); dtypes may differ, values are compared in
    float64 (or as integers)."""

    key: str
    shape: tuple[tuple[int, ...], tuple[int, ...]]
    dtype: tuple[str, str]
    max_abs_diff: float | None


@dataclass(frozen=True)
class CheckpointDiff:
    only_in_first: tuple[str, ...]
    only_in_second: tuple[str, ...]
    arrays: tuple[ArrayDifference, ...]
    common_differences: tuple[str, ...]

    @property
    def identical(self) -> bool:
        return not (
            self.only_in_first
            or self.only_in_second
            or self.common_differences
            or any(a.shape[0] != a.shape[1] or a.dtype[0] != a.dtype[1] or a.max_abs_diff != 0 for a in self.arrays)
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "identical": self.identical}


def diff_checkpoints(
    first: str | os.PathLike | Location,
    second: str | os.PathLike | Location,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> CheckpointDiff:
    """Keys, shapes, dtypes and the largest absolute difference of every array the two
    checkpoints share, and the common-state entries that differ; reads the arrays a
    batch at a time (``memory_bytes`` per checkpoint; another tool's checkpoint, one
    tensor at a time). Either may be another tool's checkpoint (``describe_foreign``),
    e.g. to check a conversion against its source."""
    from shardstore.serialization import load_common_state_dict

    ra = {a.key: a for a in describe_checkpoint(first).arrays}
    rb = {a.key: a for a in describe_checkpoint(second).arrays}
    shared = sorted(set(ra) & set(rb))
    comparable = [k for k in shared if ra[k].shape == rb[k].shape]
    largest: dict[str, float] = {}
    pairs = zip(_whole_arrays(first, comparable, memory_bytes), _whole_arrays(second, comparable, memory_bytes))
    for (key, x), (_, y) in pairs:
        largest[key] = _max_abs_diff(x, y)
    arrays = tuple(
        ArrayDifference(k, (ra[k].shape, rb[k].shape), (ra[k].dtype, rb[k].dtype), largest.get(k)) for k in shared
    )
    only_a, only_b, mismatched = diff(load_common_state_dict(first), load_common_state_dict(second))
    paths = [*only_a, *only_b, *(path for path, _, _ in mismatched)]
    common = tuple(sorted("/".join(map(str, path)) for path in paths))
    return CheckpointDiff(tuple(sorted(set(ra) - set(rb))), tuple(sorted(set(rb) - set(ra))), arrays, common)


def _whole_arrays(
    checkpoint: str | os.PathLike | Location, keys: list[str], memory_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, whole tensor)`` of ``keys``, sorted by key."""
    if reads_as_foreign(checkpoint):
        from shardstore.strategies.foreign import open_foreign

        source = open_foreign(checkpoint)
        for key in sorted(keys):
            yield key, source.read_tensor(key)
        return
    yield from read_arrays(checkpoint, keys, memory_bytes)


def _max_abs_diff(x: torch.Tensor, y: torch.Tensor, block: int = 2**22) -> float:
    """Largest ``|x - y|`` over equal-shaped tensors, in blocks of ``block`` elements (so
    the float64 copies stay small); equal infinities and two NaNs count as equal."""
    largest = 0.0
    xs, ys = x.reshape(-1), y.reshape(-1)
    for start in range(0, xs.numel(), block):
        a = xs[start : start + block].to(torch.float64)
        b = ys[start : start + block].to(torch.float64)
        same = (a == b) | (a.isnan() & b.isnan())
        block_largest = float((a - b).abs().masked_fill(same, 0.0).max())
        if math.isnan(block_largest):  # NaN against a number
            return block_largest
        largest = max(largest, block_largest)
    return largest
