"""Looking at checkpoints without loading them into a model: what one holds
(``describe_checkpoint``), what a run root holds (``describe_root``: a manager's or a
Megatron-LM run's directory of ``iter_*`` checkpoints), and how two differ
(``diff_checkpoints``).

Both are plain data (frozen dataclasses with ``to_json``) that the ``shardstore``
command prints; neither is collective.
"""

from __future__ import annotations

__all__ = [
    "ONLY_IN_FIRST", "ONLY_IN_SECOND", "ArrayDifference", "ArraySummary", "CheckpointDiff",
    "CheckpointSummary", "RootEntry", "RootSummary", "ValueDifference", "describe_checkpoint",
    "describe_root", "diff_checkpoints", "value_differences",
]

import argparse
import math
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from shardstore.engine.other_formats import open_other_format
from shardstore.engine.strategies import LoadCommonStrategy
from shardstore.errors import CheckpointingException
from shardstore.format import (
    StorageLayout,
    from_zarr_name,
    is_exact_conversion,
    tensor_to_numpy,
)
from shardstore.mapping import ShardedObject
from shardstore.opened import OpenedCheckpoint, bare_location, open_read
from shardstore.stores import Location
from shardstore.tools.convert import DEFAULT_MEMORY_BYTES, read_tensors


@dataclass(frozen=True)
class ArraySummary:
    """One array: ``pack`` names the zip pack holding it (``packs/<rank>-<n>.zip``; a
    plain reader opens it as a ``zarr.storage.ZipStore``), "" where it is a directory
    of its own."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    chunks: int
    nbytes: int
    pack: str = ""


@dataclass(frozen=True)
class CheckpointSummary:
    """What a checkpoint holds: a committed shardstore checkpoint, from its commit
    record and common state; another tool's (``kind``: its format's name in
    ``shardstore.other_formats.registry``, e.g. ``torch_dist``), from its own metadata,
    where the commit-record fields are empty (0, "") and an array's ``chunk_shape`` is
    empty when its saved chunks differ in shape."""

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
    reused_from: dict[str, Any] | None = None  # ReusedChunks.to_json(): what the save shared
    requires: tuple[str, ...] = ()  # the features a reader must understand (``format.features``)
    layout: str = ""  # the storage layout the save wrote by (``StorageLayout.describe``), or "" (older records)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "nbytes": self.nbytes}


def describe_checkpoint(checkpoint: str | os.PathLike) -> CheckpointSummary:
    """The arrays (shape, dtype, chunking, bytes), sharded objects, common-state keys,
    format version and saving world size of a committed checkpoint."""
    return _described(open_read(bare_location(checkpoint)))


def _described(opened: OpenedCheckpoint) -> CheckpointSummary:
    """``describe_checkpoint`` of a checkpoint opened already."""
    from shardstore.engine.load import load_common_state_dict

    if opened.other_format is not None:
        return describe_other_format(opened.location)
    location, record = opened.location, opened.require_record()
    arrays = tuple(
        ArraySummary(a.key, a.shape, a.dtype, a.chunk_shape, a.chunk_count, a.nbytes, a.pack or "")
        for _, a in sorted(record.arrays.items())
    )
    common = load_common_state_dict(opened)
    return CheckpointSummary(
        checkpoint=location.describe(),
        format_version=record.format_version,
        library_version=record.library_version,
        created=record.created,
        world_size=record.world_size,
        save_id=record.save_id,
        arrays=arrays,
        objects=_shards_by_key(record.object_shard_files),  # Megatron's own save's included
        common_keys=tuple(sorted(str(k) for k in common)),
        reused_from=record.reused_from.to_json() if record.reused_from else None,
        requires=record.requires,
        layout=StorageLayout.from_json(record.layout).describe() if record.layout else "",
    )


def describe_other_format(checkpoint: Location) -> CheckpointSummary:
    """What another tool's checkpoint (a format in ``shardstore.other_formats.registry``)
    holds, read as ``load`` reads it (no code from it runs)."""
    source = open_other_format(checkpoint)
    arrays = tuple(
        ArraySummary(key, t.shape, source.stored_dtype(key).zarr_name, t.chunk_shape, t.chunk_count, t.nbytes)
        for key, t in sorted(source.tensors.items())
    )
    parts = _NonArrayParts.of(open_read(checkpoint))
    return CheckpointSummary(
        checkpoint=str(source.path), format_version=0, library_version="", created=0.0, world_size=0, save_id="",
        arrays=arrays, objects=_shards_by_key(sorted(parts.objects)),
        common_keys=tuple(sorted(str(k) for k in parts.common)), kind=source.kind,
    )


@dataclass(frozen=True)
class RootEntry:
    """One checkpoint under a run root, from its commit record alone; ``error``: why
    its record does not read (the other fields then empty)."""

    name: str
    checkpoint: str
    format_version: int = 0
    created: float = 0.0
    world_size: int = 0
    save_id: str = ""
    arrays: int = 0
    nbytes: int = 0
    error: str = ""


@dataclass(frozen=True)
class RootSummary:
    """A directory whose entries are checkpoints (``iter_0000007``, ...), in name order,
    and the leftovers of interrupted saves beside them."""

    root: str
    checkpoints: tuple[RootEntry, ...]
    leftovers: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def describe_root(root: str | os.PathLike) -> RootSummary | None:
    """What a run root holds: each checkpoint directly under it (a commit record, damaged
    ones included), or None where ``root`` is itself a checkpoint or holds none."""
    from shardstore.format import read_commit_record
    from shardstore.tools.root_verify import entries_under, holds_commit_record

    location = bare_location(root)
    if holds_commit_record(location):
        return None
    found, leftovers = entries_under(location)
    if not found:
        return None
    entries = []
    for name, child in sorted(found.items()):
        try:
            record = read_commit_record(child)
        except (CheckpointingException, OSError, ValueError) as error:  # damaged: listed with its error
            entries.append(RootEntry(name, child.describe(), error=f"{type(error).__name__}: {error}"))
            continue
        entries.append(RootEntry(
            name, child.describe(), record.format_version, record.created, record.world_size, record.save_id,
            len(record.arrays), sum(a.nbytes for a in record.arrays.values()),
        ))
    return RootSummary(location.describe(), tuple(entries), tuple(leftovers))


def _shards_by_key(unique_keys: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Sharded object shards' unique keys (``rng_state/shard_0_2``), in their order,
    grouped by their object's key, the keys sorted."""
    shards: dict[str, list[str]] = {}
    for unique_key in unique_keys:
        shards.setdefault(unique_key.rsplit("/", 1)[0], []).append(unique_key)
    return {key: tuple(shards[key]) for key in sorted(shards)}


@dataclass(frozen=True)
class ArrayDifference:
    """One array in both checkpoints, its values compared exactly: bit for bit in one
    dtype (when the dtypes differ, the one whose values the other holds exactly, e.g.
    bfloat16 -> float32, int32 -> int64), so NaNs with equal bits are equal and -0.0
    differs from 0.0.

    Attributes:
        differing: how many elements differ; None when the values were not compared
            (the shapes differ, or neither dtype holds the other's values exactly).
        first_difference: the index of the first element that differs (C order).
        max_abs_diff: the largest ``|a - b|`` over the elements that differ, as extra
            information: exact for integers (a Python int, also for int64 and uint64),
            a float otherwise (NaN where a NaN differs; 0.0 when only the sign of a zero
            or a NaN's bits differ); 0 when none differ.
    """

    key: str
    shape: tuple[tuple[int, ...], tuple[int, ...]]
    dtype: tuple[str, str]
    max_abs_diff: int | float | None
    differing: int | None = None
    first_difference: tuple[int, ...] | None = None

    @property
    def identical(self) -> bool:
        return self.shape[0] == self.shape[1] and self.dtype[0] == self.dtype[1] and self.differing == 0

    def describe(self) -> str:
        """What differs, in words ("" when nothing does): ``shape [8, 6] -> [8, 4]``,
        ``dtype bfloat16 -> float32``, ``max |difference| 0.25, 1 element(s) differ,
        first at [3, 2]``."""
        changes = []
        if self.shape[0] != self.shape[1]:
            changes.append(f"shape {list(self.shape[0])} -> {list(self.shape[1])}")
        if self.dtype[0] != self.dtype[1]:
            changes.append(f"dtype {self.dtype[0]} -> {self.dtype[1]}")
            if self.differing is None and self.shape[0] == self.shape[1]:
                changes.append("values not compared (neither dtype holds the other's values exactly)")
        if self.differing:
            changes.append(_differences_text(self.differing, self.first_difference, self.max_abs_diff))
        return ", ".join(changes)


@dataclass(frozen=True)
class ValueDifference:
    """One difference in the common state or in a sharded object shard: ``path`` is
    the ``/``-joined dict keys, list indices and attribute names from the top (for an
    object, its unique key first: ``rng_state/shard_0_2``); ``change`` says what
    differs (``only in first``, ``only in second``, or the two values)."""

    path: str
    change: str


ONLY_IN_FIRST, ONLY_IN_SECOND = "only in first", "only in second"


@dataclass(frozen=True)
class CheckpointDiff:
    """Everything ``load`` returns, compared: arrays (by key; ``arrays`` lists every
    array both hold, identical ones too), sharded object shards (by unique key) and the
    common state (recursively)."""

    only_in_first: tuple[str, ...]
    only_in_second: tuple[str, ...]
    arrays: tuple[ArrayDifference, ...]
    common_differences: tuple[ValueDifference, ...]
    object_differences: tuple[ValueDifference, ...] = ()

    @property
    def identical(self) -> bool:
        return not (
            self.only_in_first
            or self.only_in_second
            or self.common_differences
            or self.object_differences
            or not all(a.identical for a in self.arrays)
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN and infinite differences as strings, so the document
        stays strict JSON)."""
        return _strict_json({**asdict(self), "identical": self.identical})


def diff_checkpoints(
    first: str | os.PathLike,
    second: str | os.PathLike,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> CheckpointDiff:
    """Compares everything ``load`` returns from the two checkpoints, exactly: array
    keys, shapes, dtypes and values (``ArrayDifference``), sharded object shards and the
    common state (``ValueDifference``: keys on one side only, changed values, tensors
    bit for bit). Reads the arrays a batch at a time (``memory_bytes`` per checkpoint;
    another tool's checkpoint, one tensor at a time) and one object shard of each at a
    time. Either may be another tool's checkpoint (``describe_other_format``), e.g. to check
    a conversion against its source. Not collective."""
    opened_a, opened_b = open_read(bare_location(first)), open_read(bare_location(second))
    ra = {a.key: a for a in _described(opened_a).arrays}
    rb = {a.key: a for a in _described(opened_b).arrays}
    shared = sorted(set(ra) & set(rb))
    comparable = {
        k: common
        for k in shared
        if ra[k].shape == rb[k].shape and (common := _common_dtype(ra[k].dtype, rb[k].dtype)) is not None
    }
    compared: dict[str, TensorComparison] = {}
    keys = sorted(comparable)
    pairs = zip(read_tensors(opened_a, keys, memory_bytes), read_tensors(opened_b, keys, memory_bytes))
    for (key, x), (_, y) in pairs:
        compared[key] = compare_tensors(x, y, comparable[key])
    arrays = tuple(_array_difference(ra[k], rb[k], compared.get(k)) for k in shared)
    parts_a, parts_b = _NonArrayParts.of(opened_a), _NonArrayParts.of(opened_b)
    return CheckpointDiff(
        tuple(sorted(set(ra) - set(rb))),
        tuple(sorted(set(rb) - set(ra))),
        arrays,
        tuple(value_differences(parts_a.common, parts_b.common)),
        tuple(_object_differences(parts_a, parts_b)),
    )


def _array_difference(a: ArraySummary, b: ArraySummary, compared: TensorComparison | None) -> ArrayDifference:
    if compared is None:
        return ArrayDifference(a.key, (a.shape, b.shape), (a.dtype, b.dtype), None)
    return ArrayDifference(
        a.key, (a.shape, b.shape), (a.dtype, b.dtype), compared.max_abs_diff, compared.differing, compared.first
    )


def _common_dtype(first: str, second: str) -> torch.dtype | None:
    """The dtype to compare two arrays' values in: the one that holds the other's
    values exactly, or None when neither does (int64 vs float32)."""
    a, b = from_zarr_name(first).torch_dtype, from_zarr_name(second).torch_dtype
    if is_exact_conversion(a, b):
        return b
    if is_exact_conversion(b, a):
        return a
    return None


# ------------------------------------------------------------------ exact comparison


@dataclass(frozen=True)
class TensorComparison:
    """How two equal-shaped tensors differ (see ``ArrayDifference``)."""

    differing: int
    first: tuple[int, ...] | None
    max_abs_diff: int | float


def compare_tensors(x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None = None,
                    block: int = 2**22) -> TensorComparison:
    """Compares two equal-shaped tensors bit for bit in ``dtype`` (default: ``x``'s;
    each is converted to it, which the caller has checked is exact), ``block`` elements
    at a time, so the temporary copies stay small."""
    dtype = dtype or x.dtype
    xs, ys = x.detach().reshape(-1), y.detach().reshape(-1)
    differing, first = 0, None
    largest: int | float = 0.0 if dtype.is_floating_point or dtype.is_complex else 0
    for start in range(0, xs.numel(), block):
        a = xs[start : start + block].to(dtype).contiguous()
        b = ys[start : start + block].to(dtype).contiguous()
        mismatch = (_bits(a) != _bits(b)).any(dim=1)
        count = int(mismatch.sum())
        if not count:
            continue
        if first is None:
            first = start + int(mismatch.nonzero()[0, 0])
        differing += count
        if not _is_nan(largest):  # a NaN against a number stays the answer
            block_largest = _max_abs_difference(a[mismatch], b[mismatch])
            largest = block_largest if _is_nan(block_largest) else max(largest, block_largest)
    position = None if first is None else tuple(int(i) for i in np.unravel_index(first, tuple(x.shape)))
    return TensorComparison(differing, position, largest)


def _is_nan(value: int | float) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D tensor's elements as rows of integer words (their bit patterns)."""
    size = t.element_size()
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32}.get(size, torch.int64)
    return t.view(word).reshape(t.numel(), -1)


def _max_abs_difference(a: torch.Tensor, b: torch.Tensor) -> int | float:
    """The largest ``|a - b|``: exact (a Python int) for integers and bool, where the
    difference of two int64 values may need 64 unsigned bits; in float64 (complex128)
    for floating-point values, which holds every float type's values exactly, with two
    NaNs no distance apart (a NaN against a number: NaN)."""
    if a.dtype.is_floating_point or a.dtype.is_complex:
        wide = torch.complex128 if a.dtype.is_complex else torch.float64
        distance = (a.to(wide) - b.to(wide)).abs()
        return float(distance.masked_fill(a.isnan() & b.isnan(), 0.0).max())
    signed = a.dtype != torch.bool and torch.iinfo(a.dtype).min < 0
    wide = np.int64 if signed else np.uint64
    x, y = tensor_to_numpy(a).astype(wide), tensor_to_numpy(b).astype(wide)
    # max - min, taken modulo 2**64 in unsigned words: exact, as it lies in [0, 2**64)
    return int((np.maximum(x, y).view(np.uint64) - np.minimum(x, y).view(np.uint64)).max())


def value_differences(first: Any, second: Any, path: tuple[str, ...] = ()) -> Iterator[ValueDifference]:
    """The differences of two nested values (the common state, an object shard):
    dicts by key, lists and tuples by index, ``argparse.Namespace`` by attribute,
    tensors and numpy arrays exactly (dtype, shape, bits), numbers (floats, complex,
    numpy scalars) by their bits, sets by their members so compared, other values by
    type and ``==``."""
    if type(first) is not type(second):
        yield ValueDifference(_joined(path), f"{type(first).__name__} -> {type(second).__name__}")
    elif isinstance(first, argparse.Namespace):
        yield from value_differences(vars(first), vars(second), path)
    elif isinstance(first, dict):
        yield from _mapping_differences(first, second, path)
    elif isinstance(first, (list, tuple)):
        yield from _mapping_differences(dict(enumerate(first)), dict(enumerate(second)), path)
    else:
        change = _leaf_change(first, second)
        if change:
            yield ValueDifference(_joined(path), change)


def _mapping_differences(first: dict, second: dict, path: tuple[str, ...]) -> Iterator[ValueDifference]:
    for key in sorted(first.keys() | second.keys(), key=str):
        if key not in second:
            yield ValueDifference(_joined(path + (str(key),)), ONLY_IN_FIRST)
        elif key not in first:
            yield ValueDifference(_joined(path + (str(key),)), ONLY_IN_SECOND)
        else:
            yield from value_differences(first[key], second[key], path + (str(key),))


def _leaf_change(first: Any, second: Any) -> str | None:
    """What differs between two values of one type that are not containers, or None."""
    if isinstance(first, torch.Tensor):
        return _tensor_change(first.cpu(), second.cpu())
    if isinstance(first, np.ndarray):
        if first.dtype != second.dtype or first.shape != second.shape:
            return f"array {first.dtype}{list(first.shape)} -> {second.dtype}{list(second.shape)}"
        if first.dtype.hasobject:
            return _summary(list(value_differences(first.tolist(), second.tolist())))
        return None if first.tobytes() == second.tobytes() else "array values differ"
    if isinstance(first, (float, complex, np.generic)):
        return _number_change(first, second)
    if isinstance(first, (set, frozenset)):
        same = {_member_key(m) for m in first} == {_member_key(m) for m in second}
        return None if same else f"{_short(first)} -> {_short(second)}"
    try:
        equal = bool(first == second)
    except Exception:  # noqa: BLE001  (an == that cannot answer: compared by repr)
        equal = repr(first) == repr(second)
    return None if equal else f"{_short(first)} -> {_short(second)}"


def _number_change(first: float | complex | np.generic, second: float | complex | np.generic) -> str | None:
    """What differs between two numbers of one type (a Python float or complex, a numpy
    scalar), by their bits, as tensors are compared: NaNs with equal bits are equal,
    -0.0 differs from 0.0."""
    bits = _number_bits(first), _number_bits(second)
    if bits[0] == bits[1]:
        return None
    shown = f"{first!r} -> {second!r}"
    return shown if repr(first) != repr(second) else f"{shown} (bits {bits[0]} -> {bits[1]})"  # NaNs


def _member_key(value: Any) -> Any:
    """A set member as sets compare by it: numbers by their type and bits (a NaN loaded
    on each side is another object, and NaN != NaN), tuples and frozensets member by
    member, the rest as they are (``value_differences`` takes any values; a safe load
    of a checkpoint admits no frozenset, an unsafe one does)."""
    if isinstance(value, (float, complex, np.generic)):
        return type(value).__name__, _number_bits(value)
    if isinstance(value, tuple):  # keys tagged: a key is never a member's own value
        return "tuple", tuple(_member_key(m) for m in value)
    if isinstance(value, frozenset):
        return "frozenset", frozenset(_member_key(m) for m in value)
    return value


def _number_bits(value: float | complex | np.generic) -> str:
    """Its bits in hex (a float's, and numpy's float64 and complex128, big-endian)."""
    if isinstance(value, float):
        return struct.pack(">d", value).hex()
    if isinstance(value, complex):
        return struct.pack(">dd", value.real, value.imag).hex()
    return value.tobytes().hex()


def _tensor_change(first: torch.Tensor, second: torch.Tensor) -> str | None:
    if first.dtype != second.dtype or first.shape != second.shape or first.layout != second.layout:
        return f"tensor {_tensor_kind(first)} -> {_tensor_kind(second)}"
    if first.layout in _SPARSE_LAYOUTS:
        return _summary(list(value_differences(_sparse_parts(first), _sparse_parts(second))))
    if first.is_quantized:  # its values are not its bits: whole tensors by equal()
        return None if torch.equal(first, second) else "tensor values differ"
    compared = compare_tensors(first, second)
    return _differences_text(compared.differing, compared.first, compared.max_abs_diff) if compared.differing else None


_SPARSE_LAYOUTS = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc})


def _tensor_kind(t: torch.Tensor) -> str:
    """``torch.float32[2, 3]``, and the layout where it is not strided."""
    return f"{t.dtype}{list(t.shape)}" + ("" if t.layout == torch.strided else f" ({t.layout})")


def _sparse_parts(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The strided tensors that define a sparse tensor: a COO tensor's indices and
    values (coalesced: one value per index, in order), a compressed layout's index
    tensors and values."""
    if t.layout == torch.sparse_coo:
        t = t.coalesce()
        return {"indices": t.indices(), "values": t.values()}
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return {"crow_indices": t.crow_indices(), "col_indices": t.col_indices(), "values": t.values()}
    return {"ccol_indices": t.ccol_indices(), "row_indices": t.row_indices(), "values": t.values()}


def _differences_text(differing: int, first: tuple[int, ...] | None, largest: int | float | None) -> str:
    """``max |difference| 0.25, 1 element(s) differ, first at [3, 2]`` (an integer's
    difference in full, a float's to 6 significant digits)."""
    shown = str(largest) if isinstance(largest, int) else f"{largest:.6g}"
    return f"max |difference| {shown}, {differing} element(s) differ, first at {list(first or ())}"


def _summary(differences: list[ValueDifference]) -> str | None:
    if not differences:
        return None
    return "; ".join(f"{d.path or '[]'}: {d.change}" for d in differences[:3]) + ("; ..." if len(differences) > 3 else "")


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _joined(path: tuple[str, ...]) -> str:
    return "/".join(path)


def _strict_json(value: Any) -> Any:
    """``value`` with NaN and infinite floats as strings ("nan", "inf", "-inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


# ------------------------------------------------------------------ objects and common state


@dataclass(frozen=True)
class _NonArrayParts:
    """What ``load`` returns besides arrays: the common state, and the sharded object
    shards (data-less, by unique key), read through the checkpoint's own common
    strategy (safe unpickling; checksummed for a shardstore checkpoint)."""

    location: Location
    strategy: LoadCommonStrategy
    common: dict[str, Any]
    objects: dict[str, ShardedObject]

    @classmethod
    def of(cls, opened: OpenedCheckpoint) -> _NonArrayParts:
        from shardstore.engine.load import verify_checkpoint_and_load_strategy

        _, strategy = verify_checkpoint_and_load_strategy(opened)
        location = opened.location
        return cls(location, strategy, strategy.load_common(location), strategy.load_sharded_metadata(location))

    def read(self, unique_key: str) -> Any:
        """One object shard's value."""
        return self.strategy.load_sharded_objects({unique_key: self.objects[unique_key]}, self.location)[unique_key]


def _object_differences(first: _NonArrayParts, second: _NonArrayParts) -> Iterator[ValueDifference]:
    """Object shards on one side only, then the shards whose values differ (read one
    pair at a time)."""
    for key in sorted(first.objects.keys() | second.objects.keys()):
        if key not in second.objects:
            yield ValueDifference(key, ONLY_IN_FIRST)
        elif key not in first.objects:
            yield ValueDifference(key, ONLY_IN_SECOND)
        else:
            yield from value_differences(first.read(key), second.read(key), (key,))
