"""How each array of a save is stored: its record (``array_records``), in chunks aligned
with its blocks, or in shards: gathered across blocks (``sharded_record``, flattened ranges
included) or inside them (``in_block_sharded_record``: an array whose large blocks split
a later axis, Megatron's row-parallel weights, is stored one shard per chunk, each
written by its block's holder, no gather).
"""

from __future__ import annotations

__all__ = [
    "IN_BLOCK_PARTS",
    "MAX_INNER_BYTES",
    "SHARDED_FILES_SHARE",
    "array_records",
    "flattened_block",
    "in_block_sharded_record",
    "sharded_record",
]

import math
from dataclasses import replace

from shardstore.format.dtypes import from_zarr_name
from shardstore.format.records import ArrayRecord
from shardstore.format.sharding import MAX_FLAT_INNER_CHUNKS, ShardingIndexed
from shardstore.planning.layout import (
    GatheredShards,
    ShardRecord,
    bound_chunk,
    chunk_shape_for,
    largest_divisor_at_most,
    read_grained_record,
)
from shardstore.planning.plans.block_grid import BlockGrid
from shardstore.planning.plans.shard_sizes import (
    FRAGMENT_PARTS,
    INNER_PARTS,
    MIN_INNER_BYTES,
    SMALL_FRAGMENT_SHARE,
    count_chunks,
    inner_rows,
    shard_shape,
    split_axis,
    whole_inner_chunks,
)

# Shards inside blocks (``in_block_sharded_record``): chunks of at least an
# IN_BLOCK_PARTS-th of ``shard_bytes`` (a gathered shard would hold at most that many:
# files multiply little), inner chunks of at most MAX_INNER_BYTES.
IN_BLOCK_PARTS = 8
MAX_INNER_BYTES = 1 << 20


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
    split = split_axis(chunk)
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
    if count_chunks(chunk, inner) > MAX_FLAT_INNER_CHUNKS:
        return None
    return replace(record, codec=ShardingIndexed(inner, itemsize))


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


def array_records(
    layout: GatheredShards, max_chunk_bytes: int, shard_bytes: int | None = None, read_grain: int | None = None,
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
    (``shard_shape``), so the files of the array no longer multiply with the ranks.
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
    if not whole_inner_chunks(grid, chunk) or shard_bytes < chunk_bytes or count_chunks(shape, chunk) < 2:
        return record
    inner = list(chunk)
    split = split_axis(chunk)
    if chunk[1:] == shape[1:]:  # whole rows (FSDP2's Shard(0), one row each included): rows, as ever
        split = 0
    if split < len(chunk):
        inner[split] = inner_rows(chunk[split], math.prod(chunk[split + 1 :]) * record.itemsize)
    codec = ShardingIndexed(tuple(inner), record.itemsize)
    sharded = replace(record, chunk_shape=shard_shape(shape, codec.chunk_shape, shard_bytes / codec.inner_nbytes),
                      codec=codec)
    if sharded.chunk_count > loose.chunk_count * SHARDED_FILES_SHARE:
        return record
    return sharded


def _flat_sharded_record(record: ArrayRecord, main: list[ShardRecord], shard_bytes: int, grid: BlockGrid) -> ArrayRecord:
    """``record`` of an array saved from flattened ranges (the distributed optimizer's
    fragments; ``grid``: one block per distinct block, ``FlatBlockGrid``) stored in
    shards: inner chunks contiguous in their block (``record``'s chunks, split further
    by ``bound_chunk``) of at most an eighth of the array's smallest non-empty fragment
    but the few smallest (``FRAGMENT_PARTS``, ``_sizing_fragment``: a load at the save's
    layout reads at most two inner chunks more than a fragment, 1.25x), at least
    ``MIN_INNER_BYTES`` and a ``MAX_FLAT_INNER_CHUNKS``-th of ``shard_bytes``; shards of
    about ``shard_bytes`` (``shard_shape``) and at most that many inner chunks, grown in
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
        or not whole_inner_chunks(grid, inner) or count < 2 or count_chunks(record.shape, inner) < 2
    ):
        return record
    split = min(split_axis(inner), len(inner) - 1)
    order = [*range(split, -1, -1), *range(split + 1, len(inner))]
    shard = shard_shape(record.shape, inner, count, order, cap=MAX_FLAT_INNER_CHUNKS)
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


def flattened_block(main_shards: list[ShardRecord]) -> tuple[int, ...] | None:
    """The block shape that the caller's flattened ranges were cut from, when every main
    shard is such a range of a block of that one shape (what the commit record keeps
    for ``strategies.resharding``); else None (whole blocks, irregular cuts)."""
    shapes = {s.block_shape for s in main_shards if s.flat_range is not None and not s.irregular}
    if len(shapes) != 1 or any(s.flat_range is None or s.irregular for s in main_shards):
        return None
    return shapes.pop()
