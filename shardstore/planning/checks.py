"""The global checks on a gathered layout, pure: what every key, tensor and object of a
save or load must satisfy before anything is written or read.

The coordinator runs them over every rank's shard records (``protocol.plan_stage.gather_and_plan``),
which then sends every rank either its part of the plan or the same error.
``shardstore.validation`` gives them Megatron-Core's names.
"""

from __future__ import annotations

__all__ = [
    "FORMAT_NAME_LIMITS", "admits_names", "check_layout", "check_storable_data", "check_storable_keys",
    "layout_of_global_metadata", "local_records", "name_lengths_needed",
    "ranks_with_differing_common_state",
]

import itertools
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from shardstore.errors import CheckpointingException
from shardstore.format.dtypes import UnsupportedDTypeError, from_torch, from_zarr_name
from shardstore.format.records import ZARR_JSON, array_group_collisions, check_key, object_path
from shardstore.format.records.names import check_storable_key, chunk_key
from shardstore.mapping import ShardedBase, ShardedObject, ShardedTensor
from shardstore.planning.layout import GatheredShards, ObjectShardRecord, ShardRecord
from shardstore.stores.base import REFUSABLE_TEXTS, NameLimits

logger = logging.getLogger(__name__)

# Grid cells the coverage check may allocate (``_Boxes.cover_counts``); past it, the
# blocks' total volume and a search for two that overlap (``_Boxes.first_overlap``).
MAX_COVERAGE_CELLS = 16_000_000
# Pairs of blocks that search compares at most, and at once (``_Boxes.overlap_candidates``);
# past the first, only the total volume is checked, and a warning says so.
MAX_OVERLAP_PAIRS = 100_000_000
_PAIR_BATCH = 1 << 22
MAX_REPORTED_PROBLEMS = 10
# What a layout's keys are checked against where no storage is named (a layout checked
# on its own; every save passes its target's, ``protocol.plan_stage.gather_and_plan``): the
# format's own names and limits only.
FORMAT_NAME_LIMITS = NameLimits()


def local_records(
    sharded_tensors: list[ShardedTensor], sharded_objects: list[ShardedObject], rank: int, where: str | None = None,
    record: Callable[[ShardedTensor, int, int], ShardRecord] = ShardRecord.from_sharded_tensor,
) -> tuple[list[ShardRecord], list[ObjectShardRecord]]:
    """This rank's contribution to the layout, each tensor's record made by ``record``
    (a save's; ``ShardRecord.of_request`` for a load's); raises on invalid keys (naming
    the checkpoint ``where``) or dtypes."""
    for item in (*sharded_tensors, *sharded_objects):
        check_key(item.key, where)
    tensors = [record(t, rank, i) for i, t in enumerate(sharded_tensors)]
    objects = [ObjectShardRecord.from_sharded_object(o, rank) for o in sharded_objects]
    return tensors, objects


def check_storable_data(tensor: ShardedTensor, where: str | None = None) -> None:
    """A save's check of what it writes: raises a CheckpointingException naming the key,
    the checkpoint ``where`` and what to do when ``tensor``'s data is none an array can
    be written from (``ShardedTensor.unstorable_data``: sparse, nested, meta, fake) or
    is of a dtype the format does not store. A load's request may hold any tensor (a
    load that cannot read into it returns a new one)."""
    problem = tensor.unstorable_data()
    if problem is None:
        try:
            from_torch(tensor.held_dtype)
        except UnsupportedDTypeError as exc:
            problem = f"{exc}; cast it to one of them before saving (keep the original in the common state if needed)"
    if problem is not None:
        context = f" in {where}" if where else ""
        raise CheckpointingException(f"ShardedTensor {tensor.key!r}{context}: {problem}")


def ranks_with_differing_common_state(digests: list[dict[str, str] | None]) -> list[int]:
    """The ranks whose common-state digests (a checksum per top-level entry, one dict
    per rank, on the coordinator) differ from rank 0's: the only ones whose common
    state ``check_common_state_consistency`` then compares in full."""
    reference = digests[0] or {}
    return [rank for rank, theirs in enumerate(digests[1:], start=1) if (theirs or {}) != reference]


def check_layout(layout: GatheredShards, storage: NameLimits | None = FORMAT_NAME_LIMITS, where: str = "") -> None:
    """The global checks on a gathered layout, run by the coordinator before anything is
    written or read (``validation.validate_sharding_integrity`` is Megatron's name for
    it): every key can be stored in ``storage`` (None: a load's request, whose keys name
    what is stored), every element of every global tensor is covered exactly once by
    main replicas, shapes and dtypes agree across ranks, ShardedObjects are complete.

    Raises:
        CheckpointingException: naming the checkpoint (``where``), listing up to ten
            problems, each naming its key, and saying what a save (``storage`` given)
            or a load (None) must change.
    """
    if storage is not None:
        check_storable_keys(layout, storage, where)
    problems: list[str] = [
        f"{key!r} names both a ShardedTensor and a ShardedObject" for key in sorted(set(layout.tensors) & set(layout.objects))
    ]
    problems += array_group_collisions([*layout.tensors, *layout.objects])
    dtensors: list[str] = []  # keys of DTensors with a problem
    for key, shards in sorted(layout.tensors.items()):
        found = _tensor_problems(key, shards)
        if found and any(s.mesh_replica for s in shards):
            dtensors.append(key)
        problems += found
        if len(problems) >= MAX_REPORTED_PROBLEMS:
            break
    for key, shards in sorted(layout.objects.items()):
        problems += _object_problems(key, shards)
    if problems:
        shown = "\n  ".join(problems[:MAX_REPORTED_PROBLEMS])
        raise CheckpointingException(
            f"Invalid global sharding{f' of {where}' if where else ''} ({len(problems)} problem(s)):\n  {shown}\n"
            + (_LOAD_SHARDING_HINT if storage is None else _SAVE_SHARDING_HINT) + _dtensor_hint(dtensors)
        )


_SAVE_SHARDING_HINT = (
    "Nothing was written. Every rank must give a key the same global shape and dtype, and each element of a "
    "tensor needs exactly one main replica (replica_id 0) among the ranks: give the duplicates a nonzero "
    "replica_id, and a main replica to each part that has none."
)
_LOAD_SHARDING_HINT = (
    "Nothing was read. A load's request is checked as a save's shards are (validate_access_integrity): each "
    "element of a requested tensor needs exactly one main replica (replica_id 0) among the ranks: request each "
    "part with replica_id 0 on one rank and a nonzero replica_id on the others."
)


def _dtensor_hint(keys: list[str]) -> str:
    """What the user of a DTensor among ``keys`` (a problem's keys) can change: its
    replica ids come from its placements (``inputs.dtensors``), not from the user, and
    copies of it on several ranks are replicas only where their blocks are equal
    (``planning.layout.GatheredShards.from_gathered``). Empty for no such key."""
    if not keys:
        return ""
    named = ", ".join(map(repr, keys[:MAX_REPORTED_PROBLEMS]))
    return (f" A DTensor's replica ids come from its placements, not from you (DTensors here: {named}): the copies "
            "of a DTensor on several ranks (each data-parallel group's, on its own mesh) are replicas only where their "
            "blocks are equal: give every copy the same global shape, dtype and placements on meshes of the same "
            "shape, or a name of its own.")


def layout_of_global_metadata(global_metadata: list[list[ShardedBase]]) -> GatheredShards:
    """The layout of Megatron-Core's global metadata (one list of sharded items per rank)."""
    per_rank = []
    for rank, items in enumerate(global_metadata):
        tensors = [x for x in items if isinstance(x, ShardedTensor)]
        objects = [x for x in items if isinstance(x, ShardedObject)]
        per_rank.append(local_records(tensors, objects, rank))
    return GatheredShards.from_gathered(per_rank)


def check_storable_keys(layout: GatheredShards, storage: NameLimits, where: str = "") -> None:
    """The one check of a save's keys against its target, on the coordinator before
    anything is written: every ShardedTensor key, ShardedObject key and shard key, with
    the files each will be written to, against ``storage``'s limits (``format.
    check_key``). The tensors' and objects' keys passed ``check_key``'s own checks when
    their records were made (``local_records``, on each rank): only what ``storage``
    adds is checked of them again (``check_storable_key``).

    Raises:
        CheckpointingException: naming the checkpoint (``where``), up to ten keys with
            the ranks holding each, why it cannot be stored and what to do.
    """
    problems = []
    for key, what, files, shards in _keys_and_files(layout):
        try:
            for text, why in storage.refused_texts:  # any layout: a key packed today is a path tomorrow
                if text in key:
                    raise CheckpointingException(f"Key {key!r} holds {text!r}: {why}; rename the key")
            if what in _RECORDED_KEYS:
                check_storable_key(key, where, storage, files)
            else:
                check_key(key, where, storage, files)
        except CheckpointingException as exc:
            ranks = ", ".join(map(str, sorted({s.rank for s in shards})))
            problems.append(f"{exc} ({what}, held by rank(s) {ranks})")
    if problems:
        shown = "\n  ".join(problems[:MAX_REPORTED_PROBLEMS])
        raise CheckpointingException(
            f"{len(problems)} key(s) cannot be stored{f' in {where}' if where else ''}; nothing was written:\n  {shown}"
        )


def name_lengths_needed(layout: GatheredShards) -> NameLimits:
    """The tightest limits ``check_storable_keys`` passes the layout under: the longest
    file name and file path its keys' files have, in bytes of UTF-8 (what ``check_key``
    compares with a storage's limits; its other refusals do not depend on them). A plan
    made for one target stays valid for another whose limits ``admits_names`` these."""
    name = path = 0
    held: set[str] = set()
    for key, _, files, _ in _keys_and_files(layout):
        held.update(text for text in REFUSABLE_TEXTS if text in key)
        for rel in files:
            path = max(path, len(rel.encode()))
            name = max(name, *(len(n.encode()) for n in rel.split("/")))
    return NameLimits(name, path, "the layout's longest file name and path", tuple((t, "") for t in sorted(held)))


def admits_names(storage: NameLimits, needed: NameLimits) -> bool:
    """Whether ``storage`` stores names and paths as long as ``needed``
    (``name_lengths_needed``), and refuses no text they hold."""
    if {t for t, _ in storage.refused_texts} & {t for t, _ in needed.refused_texts}:
        return False
    return all(
        limit is None or (need is not None and need <= limit)
        for limit, need in ((storage.max_name_bytes, needed.max_name_bytes),
                            (storage.max_path_bytes, needed.max_path_bytes))
    )


_TENSOR, _OBJECT = "ShardedTensor", "ShardedObject"
# What ``local_records`` checked the key of (``_keys_and_files``' kinds).
_RECORDED_KEYS = frozenset({_TENSOR, _OBJECT})


def _keys_and_files(
    layout: GatheredShards,
) -> Iterator[tuple[str, str, tuple[str, ...], list[ShardRecord] | list[ObjectShardRecord]]]:
    """Every key a save writes, what it is, its longest files (relative to the
    checkpoint) and the shards that hold it: an array's ``zarr.json`` and its last chunk
    (an upper bound: the grid has at most as many chunks along an axis as the shape has
    elements), a ShardedObject's key (its files are its shards') and each shard's file."""
    for key, shards in layout.tensors.items():
        last = [n - 1 if n else 0 for n in shards[0].global_shape]
        yield key, _TENSOR, (f"{key}/{ZARR_JSON}", f"{key}/{chunk_key(last)}"), shards  # type: ignore[arg-type]
    for key, objects in layout.objects.items():
        yield key, _OBJECT, (), objects
        by_shard: dict[str, list[ObjectShardRecord]] = defaultdict(list)
        for s in objects:
            by_shard[s.unique_key].append(s)
        for unique_key, holders in by_shard.items():
            yield unique_key, f"a shard of ShardedObject {key!r}", (object_path(unique_key),), holders


def _tensor_problems(key: str, shards: list[ShardRecord]) -> list[str]:
    first = shards[0]
    if any(n < 0 for n in first.global_shape):
        return [f"{key!r}: rank {first.rank}'s global shape {first.global_shape} has a negative extent"]
    if len(shards) == 1 and first.main and first.flat_range is None and len(first.offset) == len(first.global_shape) and (
            not any(first.offset) and first.block_shape == first.global_shape):  # held whole: only its size can be wrong
        too_big = _too_big_to_address(key, first)
        return [too_big] if too_big else []
    if len({s.global_shape for s in shards}) > 1 or len({s.dtype for s in shards}) > 1:  # name the first that differs
        return [_inconsistency(key, first, next(s for s in shards if (s.global_shape, s.dtype) != (
            first.global_shape, first.dtype)))]
    too_big = _too_big_to_address(key, first)
    if too_big:
        return [too_big]
    main = [s for s in shards if s.main]
    if not main:
        return [f"{key!r}: no rank holds a main replica (replica_id 0) of it"]
    ndim = len(first.global_shape)
    offsets, extents = [s.offset for s in main], [s.block_shape for s in main]
    if set(map(len, offsets)) | set(map(len, extents)) != {ndim}:
        s = next(s for s in main if (len(s.offset), len(s.block_shape)) != (ndim, ndim))
        return [f"{key!r}: rank {s.rank}'s shard has offset {s.offset} and shape {s.block_shape}, not one entry "
                f"per axis of the global shape {s.global_shape}"]
    if all(s.flat_range is None for s in main) and _tile_one_axis(offsets, extents, first.global_shape):
        # the common split (FSDP2's Shard(0), tensor parallel): no grid to count
        return []
    try:
        boxes = _Boxes.of_axes(offsets, extents, ndim)
        outside = boxes.first_outside(first.global_shape)
    except OverflowError:  # a number beyond 64 bits, so outside any tensor a reader can address
        outside = next(i for i, s in enumerate(main) if _lies_outside(s))
    if outside is not None:
        s = main[outside]
        what = ("has a negative extent" if any(b < 0 for b in s.block_shape)
                else f"lies outside the global shape {s.global_shape}")
        return [f"{key!r}: rank {s.rank}'s shard at offset {s.offset} with shape {s.block_shape} {what}"]
    flat = [s.flat_range is not None for s in main]
    if any(flat) and not all(flat):
        ranks = sorted({s.rank for s, f in zip(main, flat) if f}), sorted({s.rank for s, f in zip(main, flat) if not f})
        return [f"{key!r}: some main replicas are flattened (ranks {ranks[0]}) and some are not (ranks {ranks[1]}): "
                "give every rank's main replica the same form, or mark the others' replica_id nonzero"]
    if all(flat):
        problems = _flat_problems(key, main)
        if problems:
            return problems
        main = list({s.offset: s for s in main}.values())
        boxes = _Boxes.of(main)
    return _coverage_problems(key, main, first.global_shape, boxes)


def _tile_one_axis(offsets: list[tuple[int, ...]], extents: list[tuple[int, ...]], shape: tuple[int, ...]) -> bool:
    """Whether the blocks cover ``shape`` exactly once by splitting one axis alone: each
    whole along every other axis, and along that one, in order of their offsets, each
    starting where the one before ended, from 0 to its extent. False does not mean a
    problem: the general count (``_coverage_problems``) decides and names it."""
    if not shape:
        return False
    split = [a for a in range(len(shape)) if any(o[a] or e[a] != shape[a] for o, e in zip(offsets, extents))]
    if len(split) > 1:
        return False
    axis = split[0] if split else 0
    position = 0
    for start, extent in sorted((o[axis], e[axis]) for o, e in zip(offsets, extents)):
        if start != position or extent < 0:
            return False
        position += extent
    return position == shape[axis] and (bool(split) or len(offsets) == 1)


def _inconsistency(key: str, first: ShardRecord, other: ShardRecord) -> str:
    """Why ``other`` disagrees with ``first`` on the tensor's global shape or dtype."""
    if other.global_shape != first.global_shape:
        return (f"{key!r}: inconsistent global shape: rank {first.rank} has {first.global_shape}, "
                f"rank {other.rank} has {other.global_shape}")
    return (f"{key!r}: inconsistent dtype: rank {first.rank} has {first.dtype}, rank {other.rank} has {other.dtype} "
            "(every rank saves a key in one dtype, and a load asks for it in one: cast after loading)")


def _lies_outside(shard: ShardRecord) -> bool:
    """Whether the block starts before the tensor, ends after it or has a negative
    extent (``_Boxes.first_outside``, in Python's integers)."""
    return any(o < 0 or b < 0 or o + b > g for o, b, g in zip(shard.offset, shard.block_shape, shard.global_shape))


@dataclass(frozen=True)
class _Boxes:
    """The blocks of a tensor's main shards as arrays: ``starts`` and ``extents``,
    one row per shard (in the shards' order), one column per axis. The checks below
    run over them at numpy's speed: a 4,096-rank layout has millions of shards.
    Every shard has one offset and extent per axis (checked before)."""

    starts: np.ndarray
    extents: np.ndarray

    @classmethod
    def of(cls, shards: list[ShardRecord]) -> _Boxes:
        """Raises OverflowError where a number does not fit in 64 bits."""
        return cls.of_axes([s.offset for s in shards], [s.block_shape for s in shards], len(shards[0].global_shape))

    @classmethod
    def of_axes(cls, offsets: list[tuple[int, ...]], extents: list[tuple[int, ...]], ndim: int) -> _Boxes:
        """The boxes at ``offsets`` of ``extents``, each of ``ndim`` entries. Raises
        OverflowError where a number does not fit in 64 bits."""
        shape = (len(offsets), ndim)
        starts = np.fromiter(itertools.chain.from_iterable(offsets), np.int64, math.prod(shape))
        stretch = np.fromiter(itertools.chain.from_iterable(extents), np.int64, math.prod(shape))
        return cls(starts.reshape(shape), stretch.reshape(shape))

    @property
    def stops(self) -> np.ndarray:
        """Where each box ends: only for boxes within the tensor (``first_outside``),
        whose ends cannot overflow."""
        return self.starts + self.extents

    def first_outside(self, global_shape: tuple[int, ...]) -> int | None:
        """The index of the first box that ``_lies_outside`` ``global_shape``, or None
        (``global_shape`` minus an extent, not start plus extent: no overflow)."""
        limits = np.array(global_shape, dtype=np.int64)
        outside = ((self.starts < 0) | (self.extents < 0) | (self.starts > limits - self.extents)).any(axis=1)
        return int(np.argmax(outside)) if outside.any() else None

    def grid(self, global_shape: tuple[int, ...]) -> list[np.ndarray]:
        """Along each axis, every box edge and the tensor's own, sorted: the cells
        between them are what the boxes cover whole or not at all."""
        stops = self.stops
        return [np.unique(np.concatenate(([0, g], self.starts[:, a], stops[:, a]))) for a, g in enumerate(global_shape)]

    def cover_counts(self, grid: list[np.ndarray]) -> np.ndarray:
        """How many boxes cover each cell of ``grid``: +1 and -1 at the corners of
        each box (a difference array), summed along every axis."""
        cells = tuple(len(b) - 1 for b in grid)
        if not cells:  # a 0-d tensor: every box is its one element
            return np.full((), len(self.starts))
        stops = self.stops
        lo, hi = np.empty_like(self.starts), np.empty_like(stops)
        for a, b in enumerate(grid):
            lo[:, a], hi[:, a] = np.searchsorted(b, self.starts[:, a]), np.searchsorted(b, stops[:, a])
        padded = tuple(c + 1 for c in cells)
        corners = list(itertools.product((False, True), repeat=len(cells)))
        if max(math.prod(padded), len(corners) * len(lo)) > MAX_COVERAGE_CELLS:  # many axes: 3**d values for 2**d cells
            counts = np.zeros(cells, dtype=np.int32)
            for start, stop in zip(lo.tolist(), hi.tolist()):
                counts[tuple(map(slice, start, stop))] += 1
            return counts
        at = np.concatenate([np.ravel_multi_index(tuple(np.where(c, hi, lo).T), padded) for c in corners])
        signs = np.repeat([(-1.0) ** sum(c) for c in corners], len(lo))
        counts = np.bincount(at, weights=signs, minlength=math.prod(padded)).reshape(padded)
        # in place, 8 bytes a value (exact in float64), at most MAX_COVERAGE_CELLS values (128 MB)
        for axis in range(len(cells)):
            np.cumsum(counts, axis=axis, out=counts)
        return counts[tuple(slice(0, c) for c in cells)]

    def overlap_candidates(self) -> tuple[int, np.ndarray, np.ndarray]:
        """The pairs of boxes a sweep along one axis compares, along the axis where they
        are fewest: their number, the boxes' order by their start along that axis and,
        for each box in that order, the end of the run of later ones that start before
        it ends there (only they can share an element with it). Boxes of no element
        must be left out first: they start inside others without sharing anything."""
        best: tuple[int, np.ndarray, np.ndarray] | None = None
        stops, ahead = self.stops, np.arange(len(self.starts))
        for axis in range(self.starts.shape[1]):
            order = np.argsort(self.starts[:, axis], kind="stable")
            ends = np.searchsorted(self.starts[order, axis], stops[order, axis], side="left")
            pairs = int(np.clip(ends - ahead - 1, 0, None).sum())
            if best is None or pairs < best[0]:
                best = (pairs, order, ends)
        if best is None:
            raise ValueError("overlap_candidates of boxes without an axis")
        return best

    def first_overlap(self, order: np.ndarray, ends: np.ndarray) -> tuple[int, int] | None:
        """Two boxes that share an element (their rows), or None where no two do: the
        pairs ``overlap_candidates`` names, compared ``_PAIR_BATCH`` at a time."""
        stops = self.stops
        runs = np.clip(ends - np.arange(len(order)) - 1, 0, None)
        done = np.cumsum(runs)
        first = 0
        while first < len(order):
            last = max(first + 1, int(np.searchsorted(done, done[first] - runs[first] + _PAIR_BATCH, side="right")))
            counts = runs[first:last]
            mine = np.repeat(np.arange(first, last), counts)
            later = mine + 1 + np.arange(len(mine)) - np.repeat(np.cumsum(counts) - counts, counts)
            a, b = order[mine], order[later]
            shared = ((self.starts[a] < stops[b]) & (self.starts[b] < stops[a])).all(axis=1)
            if shared.any():
                at = int(np.argmax(shared))
                return int(a[at]), int(b[at])
            first = last
        return None


# The largest array numpy (and so every reader) addresses, in bytes: one ``np.iinfo`` per
# array cost 1 us of a 10,000-array plan's 10 us per array.
_MAX_ADDRESSABLE_BYTES = int(np.iinfo(np.intp).max)


def _too_big_to_address(key: str, shard: ShardRecord) -> str | None:
    """Why the array cannot be held in memory by any reader, or None: numpy (and so
    every reader) refuses an array whose extents, an empty axis counted as 1, times its
    item size exceed the largest ``intp``, even when it holds no element (a crafted
    ``[0, 2**62]``)."""
    itemsize = from_zarr_name(shard.dtype).numpy_dtype.itemsize
    if math.prod(max(n, 1) for n in shard.global_shape) * itemsize <= _MAX_ADDRESSABLE_BYTES:
        return None
    return (f"{key!r}: global shape {shard.global_shape} of {shard.dtype} spans more than "
            f"{_MAX_ADDRESSABLE_BYTES} bytes, which no reader can address; save it with a smaller shape")


def _flat_problems(key: str, main: list[ShardRecord]) -> list[str]:
    """Each block's flattened main ranges tile it exactly; the message starts with
    Megatron-Core's words, which its users and tests look for."""
    blocks: dict[tuple[int, ...], list[ShardRecord]] = defaultdict(list)
    for s in main:
        blocks[s.offset].append(s)
    for offset, ranges in blocks.items():
        if len({r.block_shape for r in ranges}) > 1:
            return [f"{key!r}: flattened shards of block {offset} disagree on the block shape"]
        position, volume = 0, ranges[0].block_volume
        shard = f"Flattened ranges dont cover the whole shard ShardedTensor(key={key!r}, block at {offset}) of size {volume}"
        for r in sorted(ranges, key=lambda r: r.flat_range):
            start, stop = r.flat_range
            if start > position:
                return [f"{shard}: flat elements [{position}, {start}) are not covered"]
            if start < position:
                return [f"{shard}: flat ranges overlap at element {start} (rank {r.rank})"]
            position = stop
        if position != volume:
            return [f"{shard}: flat elements [{position}, {volume}) are not covered"]
    return []


def _coverage_problems(key: str, main: list[ShardRecord], global_shape: tuple[int, ...], boxes: _Boxes) -> list[str]:
    if math.prod(global_shape) == 0:
        return []
    if len(main) == 1 and main[0].block_shape == global_shape:  # the common whole-tensor case, no grid to count
        return []
    grid = boxes.grid(global_shape)
    if global_shape and math.prod(len(b) - 1 for b in grid) > MAX_COVERAGE_CELLS:  # too irregular to count cells
        return _sparse_coverage_problems(key, main, global_shape, boxes)
    counts = boxes.cover_counts(grid)
    problems = []
    for bad, what in ((counts == 0, _GAP), (counts > 1, _OVERLAP)):
        if bad.any():
            cell = np.argwhere(bad)[0]
            problems.append(_region_problem(key, tuple(int(b[i]) for b, i in zip(grid, cell)), what))
    return problems


_GAP, _OVERLAP = "is not covered by any main replica (gap)", "is covered by more than one main replica (overlap)"


def _region_problem(key: str, start: tuple[int, ...], what: str) -> str:
    """The message for a gap or an overlap (``_GAP``, ``_OVERLAP``) found at ``start``."""
    return f"Invalid access pattern for {key!r}: the region starting at {start} {what}"


def _sparse_coverage_problems(
    key: str, main: list[ShardRecord], global_shape: tuple[int, ...], boxes: _Boxes,
) -> list[str]:
    """``_coverage_problems`` for blocks on a grid of more than ``MAX_COVERAGE_CELLS``
    cells: blocks within the tensor tile it exactly where no two share an element and
    their volumes add up to its own. An overlap is named where it starts; a gap by the
    elements missing (where is not sought). Past ``MAX_OVERLAP_PAIRS`` pairs to compare,
    only the volumes are, which an overlap and a gap of one size pass: logged."""
    volume, total = sum(s.block_volume for s in main), math.prod(global_shape)
    full = (boxes.extents > 0).all(axis=1)
    solid = _Boxes(boxes.starts[full], boxes.extents[full])
    pairs, order, ends = solid.overlap_candidates()
    if pairs > MAX_OVERLAP_PAIRS:
        logger.warning(
            "%r: its %d main blocks are too irregular to check for overlaps (%d pairs to compare, more than %d): "
            "only their total volume is checked", key, len(solid.starts), pairs, MAX_OVERLAP_PAIRS,
        )
    elif (pair := solid.first_overlap(order, ends)) is not None:
        start = tuple(int(v) for v in np.maximum(solid.starts[pair[0]], solid.starts[pair[1]]))
        return [_region_problem(key, start, _OVERLAP)]
    if volume < total:
        return [f"Invalid access pattern for {key!r}: main replicas cover {volume} of the {total} elements of the "
                f"global shape {global_shape}: {total - volume} are not covered by any main replica (gap)"]
    if volume > total:  # only where the overlaps were not sought: blocks that do not overlap fit in the tensor
        return [f"Invalid access pattern for {key!r}: main replicas cover {volume} elements, more than the {total} "
                f"of the global shape {global_shape}: some are covered by more than one main replica (overlap)"]
    return []


def _object_problems(key: str, shards: list[ObjectShardRecord]) -> list[str]:
    shapes = {s.global_shape for s in shards}
    if len(shapes) > 1:
        return [f"ShardedObject {key!r}: inconsistent global shapes {sorted(shapes)}"]
    outside = next((s for s in shards if len(s.offset) != len(s.global_shape)
                    or any(not 0 <= o < n for o, n in zip(s.offset, s.global_shape))), None)
    if outside is not None:  # counting the shards alone would take one outside for a missing one
        return [f"ShardedObject {key!r}: rank {outside.rank}'s shard at offset {outside.offset} lies outside its "
                f"global shape {outside.global_shape}; give each shard an offset within the shape"]
    main_keys = [s.unique_key for s in shards if s.main]
    if len(main_keys) != len(set(main_keys)):
        return [f"ShardedObject {key!r}: a shard has more than one main replica"]
    expected = math.prod(shards[0].global_shape)
    if len(main_keys) != expected:
        missing = expected - len(main_keys)
        return [f"Invalid access pattern: {missing} ShardedObject are missing. ShardedObject {key!r}: "
                f"{missing} of {expected} shards have no main replica"]
    return []
