"""Save and load plans: decided once, by the coordinator, from the gathered layout; each
rank receives only its own part. Pure functions.

Save protocol (``serialization.save``; "coordinator" is group rank 0):

    every rank   records     its shards' metadata (``planning.checks.local_records``)
    collective   gather      the records travel to the coordinator only
    coordinator  validate    the global layout (``validation.validate_sharding_integrity``)
    coordinator  plan        ``plan_save``: writers of replicated blocks (fully parallel),
                             the chunk grid of every array, every rank's chunk writes,
                             straddling-chunk exchanges and metadata files, the commit
                             record to be
    collective   scatter     rank r receives ``RankSavePlan`` r (or the error, on every rank)

So a rank's work and the bytes it receives grow with its own shards, not with the
world size; the coordinator's grow linearly with all records (``scripts/plan_scaling.py``
measures both).

Load protocol (``serialization.load``):

    every rank   records     the regions it requests (``planning.checks.local_records``)
    collective   gather      to the coordinator only
    coordinator  plan        ``validation.plan_load``: missing and unexpected keys
                             (``StrictHandling``), the access-integrity check, and the
                             strategy's read plan (``plan_reads``: which rank reads each
                             requested block from storage, who sends it to whom; a
                             sharded array's shards each by one rank where the
                             strategy asks, by default from 32 ranks)
    collective   scatter     rank r receives ``RankLoadPlan`` r (or the error)
    collective   read        its reads only; agree; exchange

A plan names a rank's tensors by their index in its own list of ShardedTensors (the
order of ``utils.local_sharded_items``), so it is applied to the same state dict
whose records were gathered (for a load: after dropping the unexpected keys the plan
names, which ``validation.plan_load`` renumbers for).
"""

from __future__ import annotations

__all__ = [
    "MAX_FORWARDED_BYTES", "RankLoadPlan", "RankReadPlan", "RankSavePlan", "exchange_waves", "largest_shard_bytes",
    "largest_shard_data_bytes", "plan_flat_writes", "plan_reads", "plan_save", "planned_requests", "stored_at_most",
]

import bisect
import itertools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from shardstore.errors import CheckpointingException
from shardstore.format.codecs import BYTES_CRC32C, CRC_BYTES
from shardstore.format.dtypes import ITEMSIZE_BY_ZARR_NAME, from_zarr_name
from shardstore.format.records import (
    ArrayRecord,
    CommitRecord,
    ObjectRecord,
    parent_groups,
)
from shardstore.format.sharding import MAX_FLAT_INNER_CHUNKS, InnerGrid, ShardIndex, ShardingIndexed
from shardstore.format.storage_layout import SHARD_SLACK
from shardstore.planning.columns import (
    ForwardedBlocks,
    record_rows,
    row_width,
    split_by_peer,
    widened,
)
from shardstore.planning.layout import (
    DirectFlatWrite,
    FlatChunk,
    GlobalLayout,
    ShardRecord,
    balance_writers,
    block_chunks,
    bound_chunk,
    chunk_shape_for,
    largest_divisor_at_most,
    pick_balanced,
)
from shardstore.planning.read_grain import read_grained_record


@dataclass(frozen=True)
class RankSavePlan:
    """What one rank does in a save.

    Attributes:
        rank: the group rank it is for.
        records: the arrays it writes chunks or metadata of, or sends pieces of.
        shards: its main shards (after writer balancing): the blocks it writes, and its
            flattened ranges.
        flat_direct: chunks inside one of its flattened ranges, written directly.
        straddling: ``(tag, chunk)`` of the chunks that straddle flattened ranges and
            that it assembles (``chunk.writer``) or sends a piece of; the tag pairs the
            sends and receives, and is unique within the save.
        array_metadata: arrays whose ``zarr.json`` it writes: it holds a block of each,
            and the arrays whose blocks several ranks hold take their writers in turn
            (FSDP2's arrays, held by every rank, spread their files over all ranks).
        gathered: arrays whose blocks are gathered to a writer (``straddling``), not
            written block by block: into shards (``plan_gathered_writes``), or, for a
            packing save, whole into one chunk that writer packs (``plan_packed_whole``).
        assembled_bytes: the most bytes any rank assembles by exchange (the sum of
            its ``straddling`` chunks' sizes), and
        largest_assembled: the largest chunk any rank assembles, both the same in
            every rank's part: with ``FlatChunk.at``, what ``exchange_waves`` cuts into
            waves.
        group_metadata: groups whose ``zarr.json`` it writes (the coordinator).
        checkpoint_nbytes: tensor bytes of the whole checkpoint (for logging).
        commit: the coordinator's: the commit record to bind chunk checksums into.
    """

    rank: int
    records: dict[str, ArrayRecord]
    shards: tuple[ShardRecord, ...]
    flat_direct: tuple[DirectFlatWrite, ...]
    straddling: tuple[tuple[int, FlatChunk], ...]
    array_metadata: tuple[str, ...]
    group_metadata: tuple[str, ...]
    checkpoint_nbytes: int
    commit: CommitRecord | None = None
    gathered: frozenset[str] = frozenset()
    assembled_bytes: int = 0
    largest_assembled: int = 0


# An array's blocks are gathered into shards only where that makes at most this share of
# the files an unsharded save writes for it (``sharded_record``): a gather costs bytes
# between ranks. Not flattened arrays (``_flat_sharded_record``): unsharded, their chunks
# are gathered from the fragments anyway, and a load at the save's layout reads 3.2x what
# it asks for where sharded inner chunks read 1.07x (docs/measurements/scale.md), so they
# are sharded even where that makes more files (a ``shard_bytes`` under the chunks' size).
# At 124 FSDP2 ranks the embedding's and output layer's 34 MB blocks (and their moments)
# were 124 files each, now 66 shards (shards crossing the blocks' edges), for a gather of
# about half their bytes; blocks of 134 rows of 1 MiB in shards of 3 MiB would be 179
# shards where an unsharded save writes 16 chunks: not sharded.
SHARDED_FILES_SHARE = 0.75
# How far a shard may exceed ``shard_bytes`` (``_shard_shape``): shards of 1-1.25 times
# the size where fewer, evenly cut, are closer to it than more, smaller ones. Megatron
# GPT-175B's attention projection's optimizer blocks are 72 MiB: one shard each, not two
# of 36 MiB.


def largest_shard_data_bytes(shard_bytes: int) -> int:
    """The most data bytes one shard of a save with ``shard_bytes`` holds: ``SHARD_SLACK``
    times it (``_shard_shape``)."""
    return math.floor(shard_bytes * SHARD_SLACK)


def largest_shard_bytes(shard_bytes: int) -> int:
    """The most bytes one stored shard of a save with ``shard_bytes`` takes: its data
    (``largest_shard_data_bytes``) and index (``stored_at_most``). S3's object limit is
    checked against it (``ZarrSaveShardedStrategy.object_bounds``)."""
    return stored_at_most(largest_shard_data_bytes(shard_bytes))


def stored_at_most(data_bytes: int) -> int:
    """The most bytes an object of ``data_bytes`` of data is stored in: a chunk's crc32c
    after its data, or a shard's per inner chunk (a trailer, an entry of the crc table
    and of the index: ``ShardIndex.suffix_nbytes``), for inner chunks of at least
    ``MIN_INNER_BYTES``. Shards of smaller inner chunks (blocks whose starts share only a
    small divisor) take 24 bytes more per chunk than this assumes: a save whose
    ``shard_bytes`` puts them within that of S3's 5 GiB fails at that shard's PUT, its
    checkpoint abandoned, instead of being refused up front."""
    count = data_bytes // MIN_INNER_BYTES  # none: a chunk's crc32c, as the index's alone
    return data_bytes + count * CRC_BYTES + ShardIndex.suffix_nbytes(count)


def array_records(
    layout: GlobalLayout, max_chunk_bytes: int, shard_bytes: int | None = None, read_grain: int | None = None,
) -> tuple[dict[str, ArrayRecord], dict[str, BlockGrid]]:
    """Every array's metadata: its chunk grid aligned with the sharding of its main
    shards; with ``shard_bytes``, an array of small blocks on a grid (split along any
    axes), or of flattened ranges of such blocks, is stored in shards of about that
    many bytes (``sharded_record``), and one whose blocks split a later axis in shards
    inside its blocks (``in_block_sharded_record``); other chunks cut for reads at
    ``read_grain`` (``read_grained_record``). Also the grid of each array whose
    shards are gathered, which ``plan_gathered_writes`` maps its shards onto."""
    records, grids = {}, {}
    for key, shards in layout.tensors.items():
        main = [s for s in shards if s.main]
        # shards gather chunks contiguous in their blocks, however small (``bound_chunk``)
        record = _unsharded_record(key, shards[0], main, max_chunk_bytes, contiguous=shard_bytes is not None)
        if shard_bytes is None:
            records[key] = read_grained_record(record, read_grain)
            continue
        grid = _shardable_grid(record, main)
        if grid is not None and (own := in_block_sharded_record(record, shard_bytes)) is not None:
            records[key] = own  # written by the blocks' holders
            continue
        # chunks as an unsharded save makes them: what a gather must beat, and what is stored without one
        loose = _unsharded_record(key, shards[0], main, max_chunk_bytes, contiguous=False)
        if grid is not None and (gathered := sharded_record(record, main, shard_bytes, grid, loose)) is not record:
            records[key], grids[key] = gathered, grid
        else:
            records[key] = read_grained_record(loose, read_grain)
    return records, grids


def _unsharded_record(
    key: str, first: ShardRecord, main: list[ShardRecord], max_chunk_bytes: int, contiguous: bool
) -> ArrayRecord:
    """The record of ``key`` in chunks of at most ``max_chunk_bytes`` aligned with its
    ``main`` blocks (``chunk_shape_for``; ``contiguous``: in their blocks)."""
    itemsize = from_zarr_name(first.dtype).itemsize
    chunk = chunk_shape_for(main, first.global_shape, itemsize, max_chunk_bytes, contiguous)
    return ArrayRecord(key, first.global_shape, first.dtype, chunk, flattened_block=flattened_block(main))


def _shardable_grid(record: ArrayRecord, main: list[ShardRecord]) -> BlockGrid | None:
    """The grid of an array's main blocks (``BlockGrid.of``), for an array that is not
    0-d and whose flattened ranges, if any, were cut from blocks of one shape; else None."""
    if not record.shape or (record.flattened_block is None and any(s.flat_range is not None for s in main)):
        return None
    return BlockGrid.of(main, record.shape)


def sharded_record(
    record: ArrayRecord, main: list[ShardRecord], shard_bytes: int, grid: BlockGrid, loose: ArrayRecord,
) -> ArrayRecord:
    """``record`` stored in shards (Zarr v3 ``sharding_indexed``, ``format.sharding``)
    when its chunks are small: its main blocks form ``grid`` (``BlockGrid``) of whole
    chunks split along any axes (FSDP2's ``Shard(0)``; Megatron's layer x TP blocks
    ``[1, n/TP]``, ``[1, out, in/TP]``), each inner chunk is contiguous in its block (one
    element along the axes before the chunk's first longer one, the whole block along
    those after it), a chunk fits in ``shard_bytes``, and the array has more than one.
    A shard then holds as many inner chunks as fit, merged along the leading axes first
    (``_shard_shape``), so the files of the array no longer multiply with the ranks.
    Where two chunks do not fit in a shard (blocks of more than half of it: the
    embedding's at 124 FSDP2 ranks), shards cross the blocks' edges. Shards are kept
    only when they make at most ``SHARDED_FILES_SHARE`` of the files of ``loose``, the
    array as an unsharded save stores it: they cost a
    gather the unsharded chunks do not. Flattened arrays: ``_flat_sharded_record``;
    large blocks split along a later axis: ``in_block_sharded_record`` first. Otherwise
    ``record`` as it is."""
    if record.flattened_block is not None:
        return _flat_sharded_record(record, main, shard_bytes, grid)
    shape, chunk = record.shape, record.chunk_shape
    chunk_bytes = math.prod(chunk) * record.itemsize
    if not _whole_inner_chunks(grid, chunk) or shard_bytes < chunk_bytes or _count(shape, chunk) < 2:
        return record
    inner = list(chunk)
    split = _split_axis(chunk)
    if chunk[1:] == shape[1:]:  # whole rows (FSDP2's Shard(0), one row each included): rows, as ever
        split = 0
    if split < len(chunk):
        inner[split] = _inner_rows(chunk[split], math.prod(chunk[split + 1 :]) * record.itemsize)
    codec = ShardingIndexed(tuple(inner), record.itemsize)
    sharded = replace(record, chunk_shape=_shard_shape(shape, codec.chunk_shape, shard_bytes / codec.inner_nbytes),
                      codec=codec)
    if sharded.chunk_count > loose.chunk_count * SHARDED_FILES_SHARE:
        return record
    return sharded


def in_block_sharded_record(record: ArrayRecord, shard_bytes: int) -> ArrayRecord | None:
    """``record`` stored in shards that lie inside its blocks, each written by the
    block's holder as its unsharded chunks are (no gather), when its blocks split an
    axis after the first longer one of its chunks (Megatron's row-parallel weights:
    ``[out, in/TP]``, layer-stacked ``[1, out, in/TP]``), whose chunks hold at least
    ``shard_bytes / IN_BLOCK_PARTS`` (smaller ones gather across blocks,
    ``sharded_record``, where inner chunks of whole rows make a TP 4 reader of a TP 2
    block read all of it: 2x); else None. Not flattened arrays (``_flat_sharded_record``).

    The shard: the chunk (the files are an unsharded save's; ``shard_bytes`` merges small
    chunks, it does not cut large ones). Its inner chunks: along each split later axis
    a ``k``-th of the shard, ``k`` the largest divisor of its length up to
    ``INNER_PARTS`` (8), so a reader of part of a block's columns reads at most one
    inner chunk more per end that is off the inner grid (TP 2 -> 4: 1.0x; 2 -> 3:
    1.125x); then leading axes split to at most ``MAX_INNER_BYTES`` (1 MiB: a reader
    of a few rows, plain ones included, reads little more), or a
    ``MAX_FLAT_INNER_CHUNKS``-th of the shard where that is more. None where the inner
    chunk would be under ``MIN_INNER_BYTES`` or the shard would hold more than
    ``MAX_FLAT_INNER_CHUNKS`` of them (lengths without small divisors). A shard's decoded bytes are then not its C order: its
    writer packs them (``ShardingIndexed.pack``, one copy; ``execution.save``)."""
    shape, chunk, itemsize = record.shape, record.chunk_shape, record.itemsize
    split = _split_axis(chunk)
    later = [a for a in range(split + 1, len(chunk)) if chunk[a] < shape[a]]
    if record.flattened_block is not None or not later or math.prod(chunk) * itemsize * IN_BLOCK_PARTS < shard_bytes:
        return None
    columns = list(chunk)
    for axis in later:
        columns[axis] //= largest_divisor_at_most(chunk[axis], INNER_PARTS)
    most = max(MAX_INNER_BYTES, math.prod(chunk) * itemsize // MAX_FLAT_INNER_CHUNKS)
    inner = bound_chunk(tuple(columns), itemsize, most)
    if all(columns[a] == chunk[a] for a in later) or math.prod(inner) * itemsize < MIN_INNER_BYTES:
        return None
    if _count(chunk, inner) > MAX_FLAT_INNER_CHUNKS:
        return None
    return replace(record, codec=ShardingIndexed(inner, itemsize))


def _flat_sharded_record(record: ArrayRecord, main: list[ShardRecord], shard_bytes: int, grid: BlockGrid) -> ArrayRecord:
    """``record`` of an array saved from flattened ranges (the distributed optimizer's
    fragments; ``grid``: one block per distinct block, ``FlatBlockGrid``) stored in
    shards: inner chunks contiguous in their block (``record``'s chunks, split further
    by ``bound_chunk``) of at most an eighth of the array's smallest non-empty fragment
    but the few smallest (``FRAGMENT_PARTS``, ``_sizing_fragment``: a load at the save's
    layout reads at most two inner chunks more than a fragment, 1.25x), at least
    ``MIN_INNER_BYTES`` and a ``MAX_FLAT_INNER_CHUNKS``-th of ``shard_bytes``; shards of
    about ``shard_bytes`` (``_shard_shape``) and at most that many inner chunks, grown in
    the blocks' flattened order first (along the inner chunk's first longer axis, then the axes before it, then those after), so a
    shard is a run of one block's fragments where the blocks are large and spans blocks
    (layers, TP parts) where they are small. Otherwise ``record`` as it is, and so where
    the block's lengths have no divisor that makes an inner chunk of at least a quarter
    of that floor (a prime row length: thousands of inner chunks of a few bytes)."""
    sizes = [s.flat_range[1] - s.flat_range[0] for s in main if s.flat_range and s.flat_range[1] > s.flat_range[0]]
    if not sizes:
        return record
    floor = max(MIN_INNER_BYTES, shard_bytes // MAX_FLAT_INNER_CHUNKS)
    fragment = _sizing_fragment(sizes) * record.itemsize
    inner = bound_chunk(record.chunk_shape, record.itemsize, max(fragment // FRAGMENT_PARTS, floor))
    inner_bytes = math.prod(inner) * record.itemsize
    count = min(shard_bytes / inner_bytes, MAX_FLAT_INNER_CHUNKS)
    if (
        (inner != record.chunk_shape and inner_bytes < floor // 4)
        or not _whole_inner_chunks(grid, inner) or count < 2 or _count(record.shape, inner) < 2
    ):
        return record
    split = min(_split_axis(inner), len(inner) - 1)
    order = [*range(split, -1, -1), *range(split + 1, len(inner))]
    shard = _shard_shape(record.shape, inner, count, order, cap=MAX_FLAT_INNER_CHUNKS)
    return replace(record, chunk_shape=shard, codec=ShardingIndexed(inner, record.itemsize))


def _sizing_fragment(sizes: list[int]) -> int:
    """The fragment length a flattened array's inner chunks are cut for: the smallest
    of the fragments that hold all but ``1 / SMALL_FRAGMENT_SHARE`` of its elements.
    The smaller ones left out (a bucket's edge that cuts a parameter a few elements in)
    read at most two inner chunks more each; sized for them, every inner chunk of the
    array would be the floor, and the coordinator plans per inner chunk (about 0.65 us
    and 180 bytes each: one 3-element fragment per block of a 20 GiB array took its
    plan from 0.22 to 0.87 s and 236 MiB)."""
    ordered = sorted(sizes)
    total, left_out = sum(ordered), 0
    for size in ordered:
        if (left_out + size) * SMALL_FRAGMENT_SHARE > total:
            return size
        left_out += size
    return ordered[-1]


def _split_axis(chunk: tuple[int, ...]) -> int:
    """A chunk's first axis longer than one element (its number of axes if none)."""
    return next((a for a, n in enumerate(chunk) if n > 1), len(chunk))


def _count(shape: tuple[int, ...], chunk: tuple[int, ...]) -> int:
    """Chunks of ``chunk`` in an array of ``shape``."""
    return math.prod(-(-n // c) for n, c in zip(shape, chunk))


def _whole_inner_chunks(grid: BlockGrid, chunk: tuple[int, ...]) -> bool:
    """Whether every block of ``grid`` is whole chunks of ``chunk``, each contiguous in
    its block: the blocks start on the chunk grid and are no longer than the chunk
    along the axes after its first longer one."""
    split = _split_axis(chunk)
    return all(o % c == 0 for axis, c in zip(grid.starts, chunk) for o in axis.tolist()) and not (
        grid.shapes[:, split + 1 :] > np.asarray(chunk[split + 1 :], dtype=np.int64)).any()


def _shard_shape(
    shape: tuple[int, ...], inner: tuple[int, ...], count: float, order: list[int] | None = None,
    cap: float | None = None,
) -> tuple[int, ...]:
    """A shard of about ``count`` inner chunks (``shard_bytes`` over an inner chunk's):
    as many as the array has along the first axis of ``order`` (default: the array's
    axes in order), then, where all of it fits, along the next, and so on. Along an axis
    the shards are as many as ``count`` gives, rounded to the nearest (halves down: 192
    inner chunks at 42.7 per shard are four shards of 48, not five of 39), but each of
    at most ``SHARD_SLACK`` times ``count``, and as even as their number allows (33 inner
    chunks at 32 per shard: one of 33; at 20 per shard: 17 + 16, not 20 + 13), since an
    edge shard is stored padded to the full shape. Rounding, not rounding up, keeps the
    shards' mean size near ``count``, so an array's files follow its bytes (a block of
    1.125 shards is one shard, not two of half the size). Where a shard merges several
    axes, the later ones take what is left of ``count`` rounded down, so 2-D grids of
    blocks of most of a shard stay one block per shard. ``cap``: the most inner chunks
    of a shard where that is less (``MAX_FLAT_INNER_CHUNKS``)."""
    out = list(inner)
    cap = count * SHARD_SLACK if cap is None else min(cap, count * SHARD_SLACK)
    for axis in range(len(shape)) if order is None else order:
        total = -(-shape[axis] // inner[axis])
        shards = max(-(-total // max(1, math.floor(cap))), math.ceil(total / max(count, 1) - 0.5), 1)
        along = -(-total // shards)
        out[axis] = along * inner[axis]
        count, cap = count / along, cap / along
    return tuple(out)


@dataclass(frozen=True, eq=False)
class BlockGrid:
    """An array's main blocks when they form a grid: along each axis the blocks' starts
    (``starts``, sorted) cut it into intervals (of ``extents``), and every cell of the
    product of those intervals is one block (their ``shapes``, holders' ``ranks`` and
    tensor ``indices``; ``by_cell``: the position of each cell's, C order over the cells).

    Every block's shape is then its cell's: a regular grid whose last blocks along an
    axis may be shorter, or uneven ones (FSDP2's ``Shard(0)``); empty blocks are left out."""

    starts: tuple[np.ndarray, ...]
    extents: tuple[np.ndarray, ...]
    shapes: np.ndarray
    ranks: np.ndarray
    indices: np.ndarray
    by_cell: np.ndarray

    @classmethod
    def of(cls, main: list[ShardRecord], shape: tuple[int, ...]) -> BlockGrid | None:
        """The grid of the ``main`` blocks of an array of ``shape`` (of their distinct
        blocks for flattened ranges: ``FlatBlockGrid``), or None when they form none
        (or none holds anything)."""
        if any(s.flat_range is not None for s in main):
            return FlatBlockGrid.of_fragments(main, shape)
        return cls._of_blocks(main, shape)

    @classmethod
    def _of_blocks(cls, main: list[ShardRecord], shape: tuple[int, ...]) -> BlockGrid | None:
        ndim = len(shape)
        columns = 2 * ndim + 2
        table = np.fromiter(itertools.chain.from_iterable([(*s.offset, *s.block_shape, s.rank, s.index) for s in main]),
                            np.int64, len(main) * columns).reshape(len(main), columns)
        held = np.flatnonzero((table[:, ndim : 2 * ndim] > 0).all(axis=1)) if len(main) else np.zeros(0, np.int64)
        if not len(held):
            return None
        table = table[held]
        offsets, shapes, ranks, indices = table[:, :ndim], table[:, ndim : 2 * ndim], table[:, -2], table[:, -1]
        starts = tuple(np.unique(offsets[:, a]) for a in range(len(shape)))
        counts = tuple(len(axis) for axis in starts)
        if len(table) != math.prod(counts):
            return None
        if any(axis[0] != 0 for axis in starts):  # a validated layout covers the array from 0
            return None
        extents = tuple(np.diff(axis, append=n) for axis, n in zip(starts, shape))
        cells = np.stack([np.searchsorted(axis, offsets[:, a]) for a, axis in enumerate(starts)], 1)
        if not np.array_equal(np.stack([e[cells[:, a]] for a, e in enumerate(extents)], 1), shapes):
            return None
        by_cell = np.full(len(table), -1, dtype=np.int64)
        by_cell[np.ravel_multi_index(tuple(cells.T), counts)] = np.arange(len(table))
        return None if (by_cell < 0).any() else cls(starts, extents, shapes, ranks, indices, by_cell)

    def pieces(self, blocks: np.ndarray, src: np.ndarray, stop: np.ndarray, dst: np.ndarray) -> list[Piece]:
        """``FlatChunk.pieces`` of runs ``[src, stop)`` (elements, in the flattened order
        of block ``blocks``, a position in ``ranks``) landing at ``dst``: its holder's."""
        return list(zip(self.ranks[blocks].tolist(), self.indices[blocks].tolist(), src.tolist(), stop.tolist(),
                        dst.tolist()))


# ``FlatChunk.pieces``' entries: (rank, tensor index, local start, local stop, start in the buffer).
Piece = tuple[int, int, int, int, int]


@dataclass(frozen=True, eq=False)
class FlatBlockGrid(BlockGrid):
    """The grid of the blocks an array's flattened ranges were cut from: one
    representative range per block in ``ranks`` and ``indices``, and each block's
    non-empty ranges (``fragments``: ``(flat start, flat stop, rank, index)``, in order;
    a validated layout's tile the block) and their starts (``fragment_starts``)."""

    fragments: tuple[tuple[tuple[int, int, int, int], ...], ...] = ()
    fragment_starts: tuple[list[int], ...] = ()

    @classmethod
    def of_fragments(cls, main: list[ShardRecord], shape: tuple[int, ...]) -> FlatBlockGrid | None:
        by_block: dict[tuple[int, ...], list[ShardRecord]] = defaultdict(list)
        for s in main:
            by_block[s.offset].append(s)
        grid = BlockGrid._of_blocks([held[0] for held in by_block.values()], shape)
        if grid is None:
            return None
        offsets = {(held[0].rank, held[0].index): offset for offset, held in by_block.items()}
        fragments = tuple(
            tuple(sorted((*s.flat_range, s.rank, s.index) for s in by_block[offsets[(rank, index)]]
                         if s.flat_range[1] > s.flat_range[0]))
            for rank, index in zip(grid.ranks.tolist(), grid.indices.tolist())
        )
        return cls(grid.starts, grid.extents, grid.shapes, grid.ranks, grid.indices, grid.by_cell, fragments,
                   tuple([f[0] for f in held] for held in fragments))

    def pieces(self, blocks: np.ndarray, src: np.ndarray, stop: np.ndarray, dst: np.ndarray) -> list[Piece]:
        """Each run split at its block's fragments: a piece per fragment it crosses,
        from that fragment's holder, in elements of the fragment."""
        out: list[Piece] = []
        for block, lo, hi, at in zip(blocks.tolist(), src.tolist(), stop.tolist(), dst.tolist()):
            held = self.fragments[block]
            k = bisect.bisect_right(self.fragment_starts[block], lo) - 1
            while lo < hi:
                start, end, rank, index = held[k] if 0 <= k < len(held) else (hi, hi, -1, -1)
                if start > lo:
                    raise CheckpointingException(
                        f"Internal error: no fragment holds element {lo} of block {block} of a flattened array, whose "
                        "layout was validated; please report it")
                cut = min(hi, end)
                out.append((rank, index, lo - start, cut - start, at))
                at, lo, k = at + cut - lo, cut, k + 1
        return out


# A sharded array's chunk rows are split into at most INNER_PARTS inner chunks of at
# least MIN_INNER_BYTES: a load at another layout reads at most about two inner chunks
# more than it needs per range (4 -> 3 ranks with 8 parts: about 1.2x), and each inner
# chunk costs 24 bytes of trailer, crc table and index. A flattened array's inner chunks
# are at most a FRAGMENT_PARTS-th of its smallest fragment (``_flat_sharded_record``),
# leaving out the smallest that hold a SMALL_FRAGMENT_SHARE-th of its elements
# (``_sizing_fragment``).
INNER_PARTS = 8
MIN_INNER_BYTES = 16 << 10
FRAGMENT_PARTS = 8
SMALL_FRAGMENT_SHARE = 16
# Shards inside blocks (``in_block_sharded_record``): chunks of at least an
# IN_BLOCK_PARTS-th of ``shard_bytes`` (a gathered shard would hold at most that many:
# files multiply little), inner chunks of at most MAX_INNER_BYTES.
IN_BLOCK_PARTS = 8
MAX_INNER_BYTES = 1 << 20


def _inner_rows(rows: int, row_bytes: int) -> int:
    """The rows of an inner chunk of a chunk of ``rows`` rows: a divisor of ``rows``
    (so blocks stay whole inner chunks), as small as ``INNER_PARTS`` and
    ``MIN_INNER_BYTES`` allow."""
    for parts in range(min(INNER_PARTS, rows), 1, -1):
        if rows % parts == 0 and rows // parts * row_bytes >= MIN_INNER_BYTES:
            return rows // parts
    return rows


def plan_gathered_writes(key: str, record: ArrayRecord, grid: BlockGrid, load: list[int]) -> list[FlatChunk]:
    """The shards of the sharded array ``key`` (``sharded_record``) whose main blocks
    form ``grid``, each assembled by one writer: the holder of one of its pieces with
    the fewest bytes to write so far (``load``, updated), so shard writing spreads over
    the ranks.

    The writer's buffer holds the shard's inner chunks in C order over its inner grid,
    each its part inside the array, C-contiguous (``format.sharding.InnerGrid``; the
    shard's C order when its inner chunks split the first axis only). An inner chunk is
    a contiguous range of its block (``sharded_record``), so each piece is one flat range
    of a block and of the buffer; adjacent ones of one block merge (where the shard
    also merges blocks along a later axis, a block's inner chunks interleave with its
    neighbours' and each is a piece of its own: a larger plan, its small pieces still
    packed into a message per pair of ranks; a flattened block's runs are split at its
    fragments, ``FlatBlockGrid``). The runs of all the shards are found at once (``ShardRuns``)."""
    shard, inner = record.chunk_shape, record.codec.chunk_shape  # type: ignore[attr-defined]
    runs = ShardRuns.of(grid, record.shape, shard, inner)
    chunks = []
    for ordinal, index in enumerate(itertools.product(*map(range, record.chunk_grid))):
        pieces = runs.pieces(grid, ordinal)
        if not pieces:
            raise CheckpointingException(
                f"Internal error: no rank holds shard {index} of {key!r}, whose layout was validated; please report it"
            )
        origin = [i * c for i, c in zip(index, shard)]
        valid = [min(c, n - o) for c, n, o in zip(shard, record.shape, origin)]
        writer = min({p[0] for p in pieces}, key=lambda r: (load[r], r))
        load[writer] += math.prod(valid) * record.itemsize
        region = tuple(slice(o, o + v) for o, v in zip(origin, valid))
        chunks.append(FlatChunk(key, region, writer, tuple(pieces)))
    return chunks


@dataclass(frozen=True, eq=False)
class ShardRuns:
    """Every shard's runs of inner chunks (packed, ``InnerGrid``: each its part inside
    the array) that lie one after another in one block, computed for all the shards of
    an array at once: per run its block (a position in the grid's ``ranks``), ``[src,
    stop)`` in the block's flattened order and ``dst`` in its shard's buffer, in
    elements; shard ``i`` (C order over the shard grid) has the runs
    ``bounds[i]:bounds[i + 1]``."""

    blocks: np.ndarray
    src: np.ndarray
    stop: np.ndarray
    dst: np.ndarray
    bounds: np.ndarray

    @classmethod
    def of(cls, grid: BlockGrid, shape: tuple[int, ...], shard: tuple[int, ...], inner: tuple[int, ...]) -> ShardRuns:
        ndim = len(shape)
        axes = np.meshgrid(*(np.arange(0, n, c, dtype=np.int64) for n, c in zip(shape, shard)), indexing="ij")
        origins = np.stack([a.reshape(-1) for a in axes], 1)
        in_shard = InnerGrid.of(shard, inner, shard).starts
        starts = (origins[:, None, :] + in_shard[None, :, :]).reshape(-1, ndim)
        volumes = np.clip(np.asarray(shape, dtype=np.int64) - starts, 0, np.asarray(inner, dtype=np.int64)).prod(1)
        shard_of = np.repeat(np.arange(len(origins)), len(in_shard))
        keep = volumes > 0
        starts, volumes, shard_of = starts[keep], volumes[keep], shard_of[keep]
        at = np.cumsum(volumes) - volumes  # each inner chunk's place in all the shards' buffers, back to back
        dst = at - at[np.searchsorted(shard_of, shard_of)]
        cells = np.stack([np.searchsorted(axis, starts[:, a], side="right") - 1 for a, axis in enumerate(grid.starts)], 1)
        extents = np.stack([e[cells[:, a]] for a, e in enumerate(grid.extents)], 1)
        strides = np.concatenate((np.cumprod(extents[:, :0:-1], axis=1)[:, ::-1], np.ones((len(cells), 1), np.int64)), 1)
        block_starts = np.stack([axis[cells[:, a]] for a, axis in enumerate(grid.starts)], 1)
        src = ((starts - block_starts) * strides).sum(axis=1)
        cell_ids = np.ravel_multi_index(tuple(cells.T), tuple(len(axis) for axis in grid.starts))
        new_run = np.ones(len(src), dtype=bool)
        new_run[1:] = ((cell_ids[1:] != cell_ids[:-1]) | (src[1:] != src[:-1] + volumes[:-1])
                       | (shard_of[1:] != shard_of[:-1]))
        firsts = np.flatnonzero(new_run)
        run_src = src[firsts]
        return cls(grid.by_cell[cell_ids[firsts]], run_src, run_src + np.diff(at[firsts], append=int(volumes.sum())),
                   dst[firsts], np.searchsorted(shard_of[firsts], np.arange(len(origins) + 1)))

    def pieces(self, grid: BlockGrid, shard: int) -> list[Piece]:
        """``FlatChunk.pieces`` of shard number ``shard``: ``(rank, index, start in the
        block, stop, start in the shard's buffer)`` per run (``BlockGrid.pieces``)."""
        lo, hi = self.bounds[shard], self.bounds[shard + 1]
        return grid.pieces(self.blocks[lo:hi], self.src[lo:hi], self.stop[lo:hi], self.dst[lo:hi])


def plan_packed_whole(
    record: ArrayRecord, main: list[ShardRecord], pack_up_to: int, load: list[int],
) -> tuple[ArrayRecord, FlatChunk] | None:
    """An array of at most ``pack_up_to`` bytes (``SaveOptions.pack_arrays_up_to``) whose
    whole blocks several ranks hold (FSDP2's ``Shard(0)``), each block a contiguous run
    of the array's C order: stored as ONE ``[bytes, crc32c]`` chunk (the whole array),
    assembled from every block by exchange on the holder of one of them with the fewest
    bytes to write so far (``load``, updated: the shard writers' balance), which packs
    it (``execution.save.packed_keys``), so such arrays cost a pack per rank instead of
    a chunk or shard each and a document. Its record and that chunk; None where this
    does not apply (no packing, larger arrays, one holder, flattened ranges)."""
    shape = record.shape
    nbytes = math.prod(shape) * record.itemsize
    held = [s for s in main if math.prod(s.block_shape)]
    if (
        not pack_up_to or not shape or not 0 < nbytes <= pack_up_to or len({s.rank for s in held}) < 2
        or any(s.flat_range is not None or s.allow_shape_mismatch or not _runs_in_c_order(s.block_shape, shape)
               for s in main)
    ):
        return None
    strides = [math.prod(shape[a + 1 :]) for a in range(len(shape))]
    pieces = tuple(
        (s.rank, s.index, 0, math.prod(s.block_shape), sum(o * st for o, st in zip(s.offset, strides)))
        for s in held
    )
    writer = min({s.rank for s in held}, key=lambda r: (load[r], r))
    load[writer] += nbytes
    whole = replace(record, chunk_shape=shape, codec=BYTES_CRC32C)
    return whole, FlatChunk(record.key, tuple(slice(0, n) for n in shape), writer, pieces)


def _runs_in_c_order(block: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether a block of shape ``block`` is one contiguous run of an array of ``shape``
    in C order: single elements along the axes before its first longer one, whole
    along those after it."""
    lead = next((a for a, b in enumerate(block) if b != 1), len(block))
    return tuple(block[lead + 1 :]) == tuple(shape[lead + 1 :])


def flattened_block(main_shards: list[ShardRecord]) -> tuple[int, ...] | None:
    """The block shape that the caller's flattened ranges were cut from, when every main
    shard is such a range of a block of that one shape (what the commit record keeps
    for ``strategies.resharding``); else None (whole blocks, irregular cuts)."""
    shapes = {s.block_shape for s in main_shards if s.flat_range is not None and not s.irregular}
    if len(shapes) != 1 or any(s.flat_range is None or s.irregular for s in main_shards):
        return None
    return shapes.pop()


def plan_flat_writes(
    key: str, main_shards: list[ShardRecord], chunk_shape: tuple[int, ...]
) -> tuple[list[DirectFlatWrite], list[FlatChunk]]:
    """Every rank's chunk writes of the flattened tensor ``key``: the chunks inside one
    range (written directly by their holder, ``DirectFlatWrite.rank``) and the chunks
    straddling ranges (assembled by exchange)."""
    direct: list[DirectFlatWrite] = []
    straddling: list[FlatChunk] = []
    blocks: dict[tuple[int, ...], list[ShardRecord]] = defaultdict(list)
    for r in main_shards:
        blocks[r.offset].append(r)
    for offset in sorted(blocks):
        ranges = sorted(blocks[offset], key=lambda r: r.flat_range[0])
        range_starts = [r.flat_range[0] for r in ranges]
        for region, fs, fe in block_chunks(ranges[0], chunk_shape, ranges[0].global_shape):
            first = bisect.bisect_right(range_starts, fs) - 1
            holder = ranges[first]
            if holder.flat_range[1] >= fe:
                lo = fs - holder.flat_range[0]
                direct.append(DirectFlatWrite(key, holder.index, region, lo, lo + fe - fs, holder.rank))
                continue
            pieces = []
            for r in ranges[first:]:
                lo, hi = max(fs, r.flat_range[0]), min(fe, r.flat_range[1])
                if lo >= hi:
                    if r.flat_range[0] >= fe:
                        break
                    continue
                start = r.flat_range[0]
                pieces.append((r.rank, r.index, lo - start, hi - start, lo - fs))
            straddling.append(FlatChunk(key, region, holder.rank, tuple(pieces)))
    return direct, straddling


def plan_save(
    layout: GlobalLayout, max_chunk_bytes: int, fully_parallel: bool, shard_bytes: int | None = None,
    pack_arrays_up_to: int = 0, read_grain: int | None = None,
) -> list[RankSavePlan]:
    """Every rank's part of the save of a validated layout (index = group rank);
    ``shard_bytes``: store arrays of small blocks in shards of about that size
    (``sharded_record``), each gathered to one writer, or, for large blocks split
    along a later axis, one per chunk inside its block, written by its holder
    (``in_block_sharded_record``). ``pack_arrays_up_to`` (the save's
    ``SaveOptions.pack_arrays_up_to``): arrays of at most that many bytes split over
    ranks are gathered whole to one writer, who packs them (``plan_packed_whole``);
    ``read_grain``: ``array_records``."""
    if fully_parallel:
        layout = balance_writers(layout)
    records, grids = array_records(layout, max_chunk_bytes, shard_bytes, read_grain)
    world = layout.world_size
    load = [0] * world  # bytes each rank writes of gathered shards
    gathered: list[set[str]] = [set() for _ in range(world)]
    shards: list[list[ShardRecord]] = [[] for _ in range(world)]
    direct: list[list[DirectFlatWrite]] = [[] for _ in range(world)]
    straddling: list[list[tuple[int, FlatChunk]]] = [[] for _ in range(world)]
    metadata: list[list[str]] = [[] for _ in range(world)]
    touched: list[set[str]] = [set() for _ in range(world)]
    assembling = [0] * world  # bytes each rank assembles by exchange so far: ``FlatChunk.at``
    largest_assembled = 0
    tag = 0
    for ordinal, (key, key_shards) in enumerate(sorted(layout.tensors.items())):
        main = [s for s in key_shards if s.main]
        for s in main:
            shards[s.rank].append(s)
            touched[s.rank].add(key)
        whole = plan_packed_whole(records[key], main, pack_arrays_up_to, load) if main else None
        if whole is not None:  # its writer packs it, document included
            records[key] = whole[0]
            metadata[whole[1].writer].append(key)
        elif main:
            metadata[main[ordinal % len(main)].rank].append(key)
        gathered_key = key in grids  # shards inside blocks (not in ``grids``) are written as blocks are
        if not main or (main[0].flat_range is None and not gathered_key and whole is None):
            continue
        if whole is not None or gathered_key:  # whole into one chunk, or into shards
            key_direct = []
            key_straddling = [whole[1]] if whole is not None else plan_gathered_writes(key, records[key], grids[key], load)
            for rank in {s.rank for s in main} | {c.writer for c in key_straddling}:
                gathered[rank].add(key)
        else:
            key_direct, key_straddling = plan_flat_writes(key, main, records[key].chunk_shape)
        for write in key_direct:
            direct[write.rank].append(write)
        itemsize = records[key].itemsize
        for chunk in key_straddling:
            # FlatChunk's own constructor, not ``replace``: a 4,096-rank save makes a copy
            # per contributor, hundreds of thousands
            writer, nbytes = chunk.writer, chunk.volume * itemsize
            chunk = FlatChunk(key, chunk.region, writer, chunk.pieces, assembling[writer])
            assembling[writer] += nbytes
            largest_assembled = max(largest_assembled, nbytes)
            straddling[writer].append((tag, chunk))
            touched[writer].add(key)
            # a contributor needs only its own pieces (a small tensor's one chunk, or a
            # shard, may gather pieces from every rank): grouped once, not per rank
            by_rank: dict[int, list] = defaultdict(list)
            for piece in chunk.pieces:
                if piece[0] != writer:
                    by_rank[piece[0]].append(piece)
            for rank in sorted(by_rank):
                straddling[rank].append((tag, FlatChunk(key, chunk.region, writer, tuple(by_rank[rank]), chunk.at)))
                touched[rank].add(key)
            tag += 1
    commit = CommitRecord(
        arrays=records,
        objects={
            key: ObjectRecord(key, tuple(sorted({o.unique_key for o in shards_ if o.main})))
            for key, shards_ in layout.objects.items()
        },
        world_size=world,
    )
    # the arrays' bytes: what the main shards of a valid layout cover, each element once
    nbytes, assembled_bytes = sum(r.nbytes for r in records.values()), max(assembling)
    return [
        RankSavePlan(
            rank=rank,
            records={k: records[k] for k in sorted(touched[rank])},
            shards=tuple(shards[rank]),
            flat_direct=tuple(direct[rank]),
            straddling=tuple(straddling[rank]),
            array_metadata=tuple(metadata[rank]),
            group_metadata=tuple(parent_groups(list(records))) if rank == 0 else (),
            checkpoint_nbytes=nbytes,
            commit=commit if rank == 0 else None,
            gathered=frozenset(gathered[rank]),
            assembled_bytes=assembled_bytes,
            largest_assembled=largest_assembled,
        )
        for rank in range(world)
    ]


def exchange_waves(plan: RankSavePlan, wave_bytes: int | None) -> list[tuple[tuple[int, FlatChunk], ...]]:
    """``plan.straddling`` cut into the exchange waves of a save that assembles at most
    about ``wave_bytes`` per rank at once (None: one wave): chunk ``c`` is in wave
    ``c.at // window``, so a rank's wave holds the chunks that start in its window (at
    most ``window`` plus the last one's size). The window is ``wave_bytes``, or the
    largest chunk where that is larger, so that the waves are never more than a
    rank's chunks. A pure function of the plan's global part and ``wave_bytes``: every
    rank gets as many waves, and each chunk's writer and contributors put it in the
    same one, as long as they pass the same ``wave_bytes`` (``execution.save.stage_save``
    has the ranks agree on it)."""
    if not wave_bytes or plan.assembled_bytes <= wave_bytes:
        return [plan.straddling]
    window = max(wave_bytes, plan.largest_assembled)
    waves: list[list[tuple[int, FlatChunk]]] = [[] for _ in range(-(-plan.assembled_bytes // window))]
    for tagged in plan.straddling:
        waves[tagged[1].at // window].append(tagged)
    return [tuple(w) for w in waves]


@dataclass(frozen=True)
class RankReadPlan:
    """What one rank reads in a load, and what it exchanges (indices are into its own
    list of requested ShardedTensors, then into ``forwards``).

    Attributes:
        rank: the group rank it is for.
        reads: the tensors it reads from storage.
        copies: ``(index, source)``: a block it asked for twice, filled from the copy it read.
        sends: ``(peer, indices)``: tensors it read that ``peer`` asked for too, in order.
        receives: ``(peer, indices)``: its tensors that ``peer`` reads and sends, in order.
        forwards: blocks it reads only for other ranks (a shard read once for all that
            ask for it: ``plan_reads``' ``shards``), as their requests' records; number
            ``k`` has index ``requested + k``.
        requested: the length of its own list with its pieces, as planned (set where it
            has forwards or pieces).
        pieces: ``(index, box)``: its requests split at the edges of the chunks they
            touch along their leading axis, where each chunk is read once
            (``plan_reads``' ``shards``): piece
            ``k`` of the rank's ``n`` requests is request ``n + k``, the part ``box``
            (``(start, stop)`` per axis of the block, prepended axes included) of
            request ``index``, which is then read only through its pieces.

    ``sends``, ``receives`` and ``forwards`` are tuples, or where planned in bulk
    sequences of the same entries held as numpy columns (``planning.columns``), equal
    to those tuples but no tuples themselves (``tuple(plan.sends)`` makes one); such a
    plan is not hashable.
    """

    rank: int
    reads: tuple[int, ...]
    copies: tuple[tuple[int, int], ...] = ()
    sends: Sequence[tuple[int, tuple[int, ...]]] = ()
    receives: Sequence[tuple[int, tuple[int, ...]]] = ()
    forwards: Sequence[ShardRecord] = ()
    requested: int = 0
    pieces: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()


@dataclass(frozen=True)
class RankLoadPlan:
    """One rank's part of a load: its key mismatches and its read plan.

    Attributes:
        missing: checkpoint keys that no rank requested (StrictHandling ``*_ALL`` only).
        unexpected: keys this rank requested that the checkpoint lacks; dropped from its
            request before reading when the strict mode says to skip them.
        reads: the sharded strategy's plan for this rank (``RankReadPlan`` for ours).
    """

    rank: int
    missing: frozenset[str]
    unexpected: frozenset[str]
    reads: object


# A block's part: ``(start, stop)`` per axis of the block; and each rank's pieces, as
# ``RankReadPlan.pieces`` lists them (the index of the request split, and the part).
_Box = tuple[tuple[int, int], ...]
_PiecesByRank = list[list[tuple[int, _Box]]]


# The most bytes one rank reads for other ranks alone where shards are read once
# (``plan_reads``' ``shards``): the blocks it did not ask for itself, held until the
# exchange (the ones it asked for land in its own tensors). A shard that would take a
# rank past it is read by each rank that asks, as without.
MAX_FORWARDED_BYTES = 2 << 30


def plan_reads(
    layout: GlobalLayout, fully_parallel: bool, shards: Mapping[str, tuple[int, ...]] | None = None,
) -> list[RankReadPlan]:
    """Every rank's reads of a load (index = group rank).

    Without ``fully_parallel`` each rank reads everything it asked for. With it, a block
    that several ranks ask for (same region, flat range and dtype: replicas) is read
    from storage by one of them, chosen to balance the bytes each rank reads
    (``planning.layout.pick_balanced``), and sent to the others; a rank that asked twice for one
    block reads it once.

    ``shards`` (with ``fully_parallel``): the chunk shapes (a sharded array's shards) of
    arrays (key -> the record's ``chunk_shape``) whose chunks are each read by one rank:
    a block asked for whose leading axis runs over a chunk's edge is split there
    (``RankReadPlan.pieces``), and every block (or piece) asked for is read by one rank
    that asks for part of its chunk, balanced by bytes, and sent to the others, so a
    chunk is fetched once (one or two requests) instead of once per rank (at 4,096
    ranks, FSDP2's thousands of arrays each touch most ranks; a whole-tensor chunk
    loaded by FSDP2 or TP ranks, each asking for part of it). A reader holds at most
    ``MAX_FORWARDED_BYTES`` of blocks it did not ask for itself
    (``RankReadPlan.forwards``).
    """
    world = layout.world_size
    shards = shards or {}
    once = fully_parallel and layout.holds_each_block_once()  # no block asked for twice
    if not fully_parallel or (not shards and once):
        mine: list[list[int]] = [[] for _ in range(world)]  # each rank reads all it asked for
        for records in layout.tensors.values():
            for s in records:
                mine[s.rank].append(s.index)
        return [RankReadPlan(rank, tuple(sorted(mine[rank]))) for rank in range(world)]
    own = [0] * world
    for records in layout.tensors.values():
        for s in records:
            own[s.rank] += 1
    pieces: _PiecesByRank = [[] for _ in range(world)]
    if once:  # each block asked for once (FSDP2: millions at 4,096 ranks)
        plans = _single_asker_plans(layout, own, shards, pieces)
    else:
        layout = _split_at_chunk_edges(layout, shards, own, pieces)
        requests: dict[tuple, list[ShardRecord]] = defaultdict(list)  # a block asked for twice (in one dtype or two)
        for records in layout.tensors.values():
            for s in records:  # ``ShardRecord.block_id`` and the dtype, as one tuple (millions at 4,096 ranks)
                requests[(s.key, s.offset, s.block_shape, s.flat_range, s.dtype)].append(s)
        plans = _plan_shared_reads(list(requests.values()), own, shards)  # in the order of the gathered requests
    return [replace(plan, pieces=tuple(pieces[plan.rank]), requested=own[plan.rank]) if pieces[plan.rank] else plan
            for plan in plans]


def _split_at_chunk_edges(
    layout: GlobalLayout, shards: Mapping[str, tuple[int, ...]], own: list[int],
    pieces: _PiecesByRank,
) -> GlobalLayout:
    """``layout`` with each block of the arrays in ``shards`` whose leading axis runs over
    a chunk's edge replaced by its pieces (``_split_records``)."""
    tensors: dict[str, list[ShardRecord]] = {}
    for key, records in layout.tensors.items():
        chunk = shards.get(key)
        usable = chunk is not None and len(chunk) > 0 and all(len(s.offset) == len(chunk) for s in records)
        crossing = _crossing(record_rows(records, len(chunk)), chunk) if usable else None
        tensors[key] = _split_records(records, crossing, chunk, own, pieces)[0] if crossing is not None else records
    return GlobalLayout(tensors, layout.objects, layout.world_size)


def _split_records(
    records: list[ShardRecord], crossing: np.ndarray, chunk: tuple[int, ...], own: list[int],
    pieces: _PiecesByRank,
) -> tuple[list[ShardRecord], np.ndarray, list[int]]:
    """``records`` with each block ``crossing`` marks (and that may not differ from the
    stored shape) replaced by its pieces, split at the edges of ``chunk``
    (``_chunk_boxes``), each a request of its rank numbered after its own (``own``, the
    count per rank, grows by them; ``pieces``, per rank, gets ``RankReadPlan.pieces``);
    also, per record out, the position of the record it came from, and the positions
    of the pieces."""
    out: list[ShardRecord] = []
    source: list[int] = []
    made: list[int] = []
    at = 0
    for i in np.flatnonzero(crossing).tolist():
        s = records[i]
        if s.allow_shape_mismatch:
            continue
        out += records[at:i]
        source += range(at, i)
        at = i + 1
        for box in _chunk_boxes(s, chunk):
            pieces[s.rank].append((s.index, box))
            made.append(len(out))
            out.append(_piece(s, box, own[s.rank]))
            source.append(i)
            own[s.rank] += 1
    out += records[at:]
    source += range(at, len(records))
    return out, np.asarray(source, np.int64), made


def _piece(block: ShardRecord, box: _Box, index: int) -> ShardRecord:
    """The part ``box`` of ``block`` as the request ``index`` of its rank."""
    return replace(block, index=index, offset=tuple(o + a for o, (a, _) in zip(block.offset, box)),
                   block_shape=tuple(b - a for a, b in box))


def planned_requests(plan: RankReadPlan, own: Sequence[ShardRecord]) -> list[ShardRecord]:
    """Every request ``plan`` numbers, as records, by index: the rank's own (``own``, in
    the order of its list), its pieces, then its forwards."""
    pieces = [_piece(own[i], box, len(own) + k) for k, (i, box) in enumerate(plan.pieces)]
    return [*own, *pieces, *plan.forwards]


def _crossing(rows: np.ndarray, chunk: tuple[int, ...]) -> np.ndarray | None:
    """Per block (``planning.columns.record_rows`` of every axis of the array), whether
    it is one to split: its leading axis (its first of more than one element:
    ``_chunk_boxes``) runs over an edge of ``chunk``, and it has elements and no
    flattened range; None where none is."""
    ndim = len(chunk)
    offset, extent, flat = rows[:, :ndim], rows[:, ndim : 2 * ndim], rows[:, 2 * ndim]
    if not len(rows):
        return None
    leading = np.argmax(extent > 1, axis=1)  # 0 where no axis has more than one element (nothing crosses)
    start, size = offset[np.arange(len(rows)), leading], extent[np.arange(len(rows)), leading]
    step = np.asarray(chunk, np.int64)[leading]
    crossing = (start // step != (start + size - 1) // step) & (flat < 0) & (extent > 0).all(axis=1)
    return crossing if crossing.any() else None


def _chunk_boxes(block: ShardRecord, chunk: tuple[int, ...]) -> list[_Box]:
    """The parts of ``block`` at the edges of ``chunk`` along its leading axis, the
    first with more than one element (``(start, stop)`` per axis of the block), in
    order. Only there: a part of the leading axis is a contiguous run of the block's
    tensor, read and received in place; a part along a later axis would be strided,
    each landing in a buffer of its own first (the block's size again at once)."""
    axis = next(a for a, size in enumerate(block.block_shape) if size > 1)
    start, size, step = block.offset[axis], block.block_shape[axis], chunk[axis]
    edges = [start, *range((start // step + 1) * step, start + size, step), start + size]
    whole = [(0, n) for n in block.block_shape]
    return [(*whole[:axis], (a - start, b - start), *whole[axis + 1 :]) for a, b in zip(edges[:-1], edges[1:])]


class _Bucket(NamedTuple):
    """One shard's blocks as ``_BlockTable.shard_buckets`` gives them: a position and
    asker per block (per block and asker where several ranks ask for one), in the order
    the blocks were gathered.

    Attributes:
        nbytes: the bytes of its blocks.
        first: the position of its first block.
        positions: its blocks' positions (among the groups, or the records).
        askers: the rank asking for each.
        sizes: the bytes of each.
    """

    nbytes: int
    first: int
    positions: np.ndarray
    askers: np.ndarray
    sizes: np.ndarray


def _plan_shared_reads(
    groups: list[list[ShardRecord]], own: list[int], shards: Mapping[str, tuple[int, ...]],
) -> list[RankReadPlan]:
    """``plan_reads`` of ``groups`` of requests for one block each, some asked for by
    several ranks (``own``: how many requests each rank made): one rank reads each
    block, a member of its group or, for a block of a shard read once, the shard's
    reader (``_shard_readers``), and sends it to the members."""
    world = len(own)
    load = [0] * world
    readers: list[int | None] = [None] * len(groups)
    for rank, positions in _shard_readers(_group_buckets(groups, shards), load):
        for i in positions.tolist():
            readers[i] = rank
    rest = [i for i, r in enumerate(readers) if r is None]
    for i, member in zip(rest, pick_balanced([groups[i] for i in rest], load)):
        readers[i] = member.rank
    reads: list[list[int]] = [[] for _ in range(world)]
    copies: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    sends: list[dict[int, list[int]]] = [defaultdict(list) for _ in range(world)]
    receives: list[dict[int, list[int]]] = [defaultdict(list) for _ in range(world)]
    forwards: list[list[ShardRecord]] = [[] for _ in range(world)]
    for group, rank in zip(groups, readers):
        reader = next((s for s in group if s.rank == rank), None)
        if reader is None:  # a block of a shard this rank reads for others only
            index = own[rank] + len(forwards[rank])
            forwards[rank].append(group[0])
        else:
            index = reader.index
        reads[rank].append(index)
        for s in group:
            if s is reader:
                continue
            if s.rank == rank:
                copies[rank].append((s.index, index))
            else:  # the same order on both sides: the groups' order
                sends[rank][s.rank].append(index)
                receives[s.rank][rank].append(s.index)
    return [
        RankReadPlan(
            rank,
            tuple(sorted(reads[rank])),
            tuple(copies[rank]),
            tuple((peer, tuple(ix)) for peer, ix in sorted(sends[rank].items())),
            tuple((peer, tuple(ix)) for peer, ix in sorted(receives[rank].items())),
            tuple(forwards[rank]),
            own[rank] if forwards[rank] else 0,
        )
        for rank in range(world)
    ]


def _group_buckets(groups: list[list[ShardRecord]], shards: Mapping[str, tuple[int, ...]]) -> list[_Bucket]:
    """The shards of ``groups``' blocks (positions: the groups'), each group's members
    its askers (a rank that asks twice, once)."""
    by_key: dict[str, list[int]] = defaultdict(list)
    for i, group in enumerate(groups):
        if group[0].key in shards:
            by_key[group[0].key].append(i)
    buckets: list[_Bucket] = []
    for key, positions in by_key.items():
        table = _BlockTable.of([groups[i][0] for i in positions], shards[key])
        for bucket in table.shard_buckets(positions) if table is not None else []:
            members = bucket.positions.tolist()
            if any(len(groups[i]) > 1 for i in members):  # replicas: every asker counts
                asking = sorted({(s.rank, i) for i in members for s in groups[i]})
                bucket = bucket._replace(askers=np.fromiter((r for r, _ in asking), np.int64, len(asking)),
                                         sizes=np.fromiter((groups[i][0].nbytes for _, i in asking), np.int64,
                                                           len(asking)))
            buckets.append(bucket)
    return buckets


def _shard_readers(buckets: list[_Bucket], load: list[int]) -> list[tuple[int, np.ndarray]]:
    """``(reader, positions)`` of each shard read once: among its askers that it takes
    to at most ``MAX_FORWARDED_BYTES`` of blocks they did not ask for, the one with the
    fewest bytes so far (``load``, updated; ties: lowest rank), largest shard first
    (ties: the order gathered). A shard one rank asks for alone, or that no asker can
    take, is left out (each asker reads its own blocks)."""
    chosen: list[tuple[int, np.ndarray]] = []
    loads = np.asarray(load, dtype=np.int64)
    forwarded = np.zeros(len(load), dtype=np.int64)
    for bucket in sorted(buckets, key=lambda b: (-b.nbytes, b.first)):
        candidates, which = np.unique(bucket.askers, return_inverse=True)
        if len(candidates) == 1:
            continue  # one rank asks: it reads, as it would
        own = np.bincount(which, weights=bucket.sizes, minlength=len(candidates)).astype(np.int64)
        extra = bucket.nbytes - own
        fits = np.flatnonzero(forwarded[candidates] + extra <= MAX_FORWARDED_BYTES)
        if not len(fits):
            continue
        best = fits[np.lexsort((candidates[fits], loads[candidates[fits]]))[0]]
        rank = int(candidates[best])
        forwarded[rank] += extra[best]
        loads[rank] += bucket.nbytes
        chosen.append((rank, bucket.positions))
    load[:] = loads.tolist()
    return chosen


def _single_asker_plans(
    layout: GlobalLayout, own: list[int], shards: Mapping[str, tuple[int, ...]],
    pieces: _PiecesByRank,
) -> list[RankReadPlan]:
    """``plan_reads`` where every block has one asker (FSDP2: millions of blocks at 4,096
    ranks), in bulk: each block is read by its asker, or by the reader of its shard
    (``_shard_readers``), who reads it as a forward (numbered in the order gathered)
    and sends it; a block over a shard's edge is split first (``_split_records``, from
    the table's rows: no second pass over the records). The exchanges and forwards are
    numpy columns (``planning.columns``): no Python object per block on the
    coordinator."""
    world = len(own)
    ranks, indices, buckets = [], [], []
    tables: list[tuple[int, _BlockTable]] = []  # (position of its first block, table)
    base = 0
    for key, records in layout.tensors.items():
        table = _BlockTable.of(records, shards[key]) if key in shards else None
        crossing = _crossing(table.rows, table.shard) if table is not None else None
        if crossing is not None:
            records, table = table.split(records, crossing, own, pieces)
        if table is not None:
            buckets += table.shard_buckets(range(base, base + len(records)))
            ranks.append(table.ranks)
            indices.append(table.indices)
            tables.append((base, table))
        else:
            ranks.append(np.fromiter((s.rank for s in records), np.int64, len(records)))
            indices.append(np.fromiter((s.index for s in records), np.int64, len(records)))
        base += len(records)
    rank = np.concatenate(ranks) if ranks else np.zeros(0, np.int64)
    index = np.concatenate(indices) if indices else np.zeros(0, np.int64)
    reader = rank.copy()
    for r, positions in _shard_readers(buckets, [0] * world):
        reader[positions] = r
    local = np.flatnonzero(reader == rank)
    reads = _split_by(rank[local], index[local], world, sort=True)
    moved = np.flatnonzero(reader != rank)  # in the order gathered
    by_reader = moved[np.argsort(reader[moved], kind="stable")]
    sender = reader[by_reader]
    starts = np.searchsorted(sender, np.arange(world + 1))
    number = np.arange(len(by_reader)) - starts[sender]  # each reader's forwards: 0, 1, ...
    forward_index = np.asarray(own, np.int64)[sender] + number
    mine = _split_by(sender, forward_index, world)
    sends = split_by_peer(sender, rank[by_reader], forward_index, world)
    receives = split_by_peer(rank[by_reader], sender, index[by_reader], world)
    forwards = _forwarded_blocks(tables, by_reader, starts)
    return [
        RankReadPlan(r, tuple(reads[r]) + tuple(mine[r]), (), sends[r], receives[r], forwards[r],
                     own[r] if forwards[r] else 0)
        for r in range(world)
    ]


def _forwarded_blocks(
    tables: list[tuple[int, _BlockTable]], positions: np.ndarray, bounds: np.ndarray,
) -> list[ForwardedBlocks | tuple[()]]:
    """Each reader's ``forwards``: the blocks at ``positions`` (in the order gathered,
    all in ``tables``' arrays), reader ``r``'s from ``bounds[r]`` to ``bounds[r + 1]``."""
    if not len(positions):
        return [()] * (len(bounds) - 1)
    axes = max(len(table.shard) for _, table in tables)
    arrays = [a for _, table in tables for a in table.arrays]  # every table's, numbered in turn
    numbered = np.cumsum([0] + [len(table.arrays) for _, table in tables])
    firsts = np.asarray([first for first, _ in tables], np.int64)
    table_of = np.searchsorted(firsts, positions, side="right") - 1
    within = positions - firsts[table_of]
    rows = np.empty((len(positions), row_width(axes)), np.int64)
    array = np.empty(len(positions), np.int64)  # each block's position in ``arrays``
    order = np.argsort(table_of, kind="stable")
    edges = np.searchsorted(table_of[order], np.arange(len(tables) + 1))
    for t, (lo, hi) in enumerate(zip(edges[:-1].tolist(), edges[1:].tolist())):
        if lo < hi:
            picked, table = order[lo:hi], tables[t][1]
            rows[picked] = widened(table.rows[within[picked]], axes)
            array[picked] = numbered[t] + table.kinds[within[picked]]
    out: list[ForwardedBlocks | tuple[()]] = []
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        if lo == hi:
            out.append(())
            continue
        named, array_of = np.unique(array[lo:hi], return_inverse=True)
        out.append(ForwardedBlocks(tuple(arrays[a] for a in named.tolist()), array_of.reshape(-1), rows[lo:hi].copy()))
    return out


def _split_by(owner: np.ndarray, values: np.ndarray, world: int, sort: bool = False) -> list[list[int]]:
    """``values`` split by ``owner`` (a rank each), in their order or sorted."""
    order = np.lexsort((values, owner)) if sort else np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(world + 1))
    ordered = values[order].tolist()
    return [ordered[bounds[r] : bounds[r + 1]] for r in range(world)]


@dataclass(frozen=True)
class _BlockTable:
    """The blocks of one array that a load asks for, as columns (one row per block), and
    the shape of its shards: which shard holds each block's first element.

    Attributes:
        arrays: the ``(key, dtype, global_shape)`` its blocks name (one, unless a layout
            that was not checked names several).
        kinds: each block's position in ``arrays``.
        rows: each block's ``planning.columns.record_rows`` row.
        first: each block's first element (of its flattened range, if any).
        nbytes: its bytes.
        shard: the array's shard shape.
    """

    arrays: tuple[tuple[str, str, tuple[int, ...]], ...]
    kinds: np.ndarray
    rows: np.ndarray
    first: np.ndarray
    nbytes: np.ndarray
    shard: tuple[int, ...]

    @property
    def ranks(self) -> np.ndarray:
        """Each block's asker."""
        return self.rows[:, -3]

    @property
    def indices(self) -> np.ndarray:
        """Each block's index among its asker's requests."""
        return self.rows[:, -2]

    @classmethod
    def of(cls, records: list[ShardRecord], shard: tuple[int, ...]) -> _BlockTable | None:
        """The table of ``records``, or None where a block or its global shape has
        another number of axes than the shard (or the array none): those blocks are read
        by their askers."""
        ndim, n = len(shard), len(records)
        if not ndim or any(len(s.offset) != ndim for s in records):
            return None
        if len({s.dtype for s in records}) == 1 and len({s.global_shape for s in records}) == 1:  # checked layouts
            named = [(records[0].dtype, records[0].global_shape)]
        else:
            named = list(dict.fromkeys((s.dtype, s.global_shape) for s in records))
        if any(len(shape) != ndim for _, shape in named):  # blocks with other axes than the array
            return None
        arrays = tuple((records[0].key, dtype, shape) for dtype, shape in named)
        if len(named) == 1:
            kinds = np.zeros(n, np.int64)
        else:
            position = {pair: i for i, pair in enumerate(named)}
            kinds = np.fromiter((position[(s.dtype, s.global_shape)] for s in records), np.int64, n)
        return cls._of_rows(arrays, kinds, record_rows(records, ndim), shard)

    @classmethod
    def _of_rows(cls, arrays: tuple, kinds: np.ndarray, rows: np.ndarray, shard: tuple[int, ...]) -> _BlockTable:
        """The table of blocks given as ``record_rows``, each of ``arrays[kinds[i]]``."""
        ndim = len(shard)
        itemsizes = np.asarray([ITEMSIZE_BY_ZARR_NAME.get(d) or from_zarr_name(d).itemsize for _, d, _ in arrays],
                               np.int64)
        offset, extent, flat = rows[:, :ndim], rows[:, ndim : 2 * ndim], rows[:, 2 * ndim : 2 * ndim + 2]
        is_flat = flat[:, 0] >= 0
        first = offset.copy()
        if is_flat.any():  # a flattened range's first element: its start unraveled in its block
            rest = np.where(is_flat, flat[:, 0], 0)
            for axis in range(ndim - 1, -1, -1):
                rest, within = np.divmod(rest, np.maximum(extent[:, axis], 1))
                first[:, axis] += within
        nbytes = np.where(is_flat, flat[:, 1] - flat[:, 0], extent.prod(axis=1)) * itemsizes[kinds]
        return cls(arrays, kinds, rows, first, nbytes, shard)

    def split(
        self, records: list[ShardRecord], crossing: np.ndarray, own: list[int],
        pieces: _PiecesByRank,
    ) -> tuple[list[ShardRecord], _BlockTable]:
        """``records`` (this table's) with the blocks ``crossing`` marks split at the
        shards' edges (``_split_records``), and their table: the rows of the blocks kept,
        the pieces' made anew."""
        out, source, made = _split_records(records, crossing, self.shard, own, pieces)
        rows = self.rows[source]
        if made:
            rows[made] = record_rows([out[j] for j in made], len(self.shard))
        return out, self._of_rows(self.arrays, self.kinds[source], rows, self.shard)

    def shard_buckets(self, positions: Sequence[int]) -> list[_Bucket]:
        """The shards holding the first element of some of its blocks (``positions``:
        the blocks' positions in the order gathered), blocks of no bytes left out."""
        held = np.flatnonzero(self.nbytes > 0)
        if not len(held):
            return []
        cells = self.first[held] // np.asarray(self.shard, np.int64)
        ids, at, inverse = np.unique(cells, axis=0, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        sizes = np.bincount(inverse, weights=self.nbytes[held], minlength=len(ids))
        order = np.argsort(inverse, kind="stable")
        bounds = np.searchsorted(inverse[order], np.arange(len(ids) + 1))
        members = np.asarray(positions, np.int64)[held]
        ranks, nbytes = self.ranks[held], self.nbytes[held]
        return [_Bucket(int(sizes[b]), int(members[at[b]]), members[run], ranks[run], nbytes[run])
                for b in range(len(ids)) for run in (order[bounds[b] : bounds[b + 1]],)]
