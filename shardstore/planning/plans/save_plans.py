"""The coordinator's save plan (``plan_save``): a loop that places each array by its
kind and hands its writes to the ranks' parts (``RankPart``, one per rank):

    blocks       unsharded chunks, or shards inside blocks (``array_storage``): written
                 by their holders, as the main shards say
    packed       a small array split over ranks, gathered whole to one writer, who
                 packs it (``plan_packed_whole``): as one chunk, or, where each block is
                 a chunk of the array's grid and at least ``MIN_PACKED_BLOCK_BYTES``,
                 as those chunks, so that a rank loading its block again reads only
                 that member of the pack
    gathered     each shard of a sharded array (``array_storage.sharded_record``)
                 assembled by exchange on one writer from the blocks it covers
                 (``plan_gathered_writes``)
    flattened    flattened ranges (the distributed optimizer's fragments): each chunk
                 written directly by the holder of the range it lies in, or assembled by
                 exchange where it straddles ranges (``plan_flat_writes``)

What is assembled by exchange goes to its writer and to each contributor, numbered with
a tag unique within the save, at its place in the writer's assembly (``FlatChunk.at``,
which ``rank_plans.exchange_waves`` cuts into waves).
"""

from __future__ import annotations

__all__ = [
    "MIN_PACKED_BLOCK_BYTES",
    "RankPart",
    "ShardRuns",
    "plan_flat_writes",
    "plan_gathered_writes",
    "plan_packed_whole",
    "plan_save",
]

import bisect
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np

from shardstore.errors import CheckpointingException
from shardstore.format.codecs import BYTES_CRC32C
from shardstore.format.records import ArrayRecord, CommitRecord, ObjectRecord, parent_groups
from shardstore.format.sharding import InnerGrid
from shardstore.planning.layout import (
    DirectFlatWrite,
    FlatChunk,
    GatheredShards,
    ShardRecord,
    balance_writers,
    block_chunks,
)
from shardstore.planning.plans.array_storage import array_records
from shardstore.planning.plans.block_grid import BlockGrid, Piece
from shardstore.planning.plans.rank_plans import RankSavePlan


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


# A packed array's blocks stay chunks of their own from this size on: below it a load
# reads the whole array in the one ranged read it makes anyway (``format.packs``' runs
# join members less than a few KiB apart), and fewer members keep the zip small.
MIN_PACKED_BLOCK_BYTES = 64 * 1024


def plan_packed_whole(
    record: ArrayRecord, main: list[ShardRecord], pack_up_to: int, load: list[int],
) -> tuple[ArrayRecord, list[FlatChunk]] | None:
    """An array of at most ``pack_up_to`` bytes (``SaveOptions.pack_arrays_up_to``) whose
    whole blocks several ranks hold (FSDP2's ``Shard(0)``), each block a contiguous run
    of the array's C order: gathered by exchange to the holder of one of them with the
    fewest bytes to write so far (``load``, updated: the shard writers' balance), which
    packs it (``execution.save.packed_keys``), so such arrays cost a pack per rank
    instead of a chunk or shard each and a document. Stored as ``[bytes, crc32c]``
    chunks: a chunk per block where the blocks are the record's chunks
    (``_block_chunks``), else ONE chunk, the whole array. Its record and the chunks;
    None where this does not apply (no packing, larger arrays, one holder, flattened
    ranges)."""
    shape = record.shape
    nbytes = math.prod(shape) * record.itemsize
    held = [s for s in main if math.prod(s.block_shape)]
    if (
        not pack_up_to or not shape or not 0 < nbytes <= pack_up_to or len({s.rank for s in held}) < 2
        or any(s.flat_range is not None or s.allow_shape_mismatch or not _runs_in_c_order(s.block_shape, shape)
               for s in main)
    ):
        return None
    writer = min({s.rank for s in held}, key=lambda r: (load[r], r))
    load[writer] += nbytes
    blocks = _block_chunks(record, held, writer)
    if blocks is not None:
        return replace(record, codec=BYTES_CRC32C), blocks
    strides = [math.prod(shape[a + 1 :]) for a in range(len(shape))]
    pieces = tuple(
        (s.rank, s.index, 0, math.prod(s.block_shape), sum(o * st for o, st in zip(s.offset, strides)))
        for s in held
    )
    whole = replace(record, chunk_shape=shape, codec=BYTES_CRC32C)
    return whole, [FlatChunk(record.key, tuple(slice(0, n) for n in shape), writer, pieces)]


def _block_chunks(record: ArrayRecord, held: list[ShardRecord], writer: int) -> list[FlatChunk] | None:
    """A chunk per block, each assembled from that block alone, where every block is
    exactly one chunk of ``record``'s grid (its offset on the grid, its extent the
    chunk's, cut at the array's edge) of at least ``MIN_PACKED_BLOCK_BYTES``; else None."""
    grid, shape = record.chunk_shape, record.shape
    if math.prod(grid) * record.itemsize < MIN_PACKED_BLOCK_BYTES:
        return None
    chunks = []
    for s in held:
        if any(o % n for o, n in zip(s.offset, grid)) or tuple(s.block_shape) != tuple(
                min(n, g - o) for n, g, o in zip(grid, shape, s.offset)):
            return None
        region = tuple(slice(o, o + b) for o, b in zip(s.offset, s.block_shape))
        chunks.append(FlatChunk(record.key, region, writer, ((s.rank, s.index, 0, math.prod(s.block_shape), 0),)))
    return chunks


def _runs_in_c_order(block: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether a block of shape ``block`` is one contiguous run of an array of ``shape``
    in C order: single elements along the axes before its first longer one, whole
    along those after it."""
    lead = next((a for a, b in enumerate(block) if b != 1), len(block))
    return tuple(block[lead + 1 :]) == tuple(shape[lead + 1 :])


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


@dataclass
class RankPart:
    """One rank's part of a save while ``plan_save`` places the arrays: the lists its
    ``RankSavePlan`` freezes, each grown by its ``add_*`` (``shards``, by ``plan_save``).

    Attributes:
        shards: its main shards.
        direct: chunks inside one of its flattened ranges, written directly.
        straddling: ``(tag, chunk)`` it assembles or sends a piece of.
        metadata: arrays whose ``zarr.json`` it writes.
        touched: arrays it writes chunks or metadata of, or sends pieces of.
        gathered: arrays whose blocks are gathered to a writer, that it takes part in.
        assembling: the bytes it assembles by exchange so far (``FlatChunk.at``).
    """

    shards: list[ShardRecord] = field(default_factory=list)
    direct: list[DirectFlatWrite] = field(default_factory=list)
    straddling: list[tuple[int, FlatChunk]] = field(default_factory=list)
    metadata: list[str] = field(default_factory=list)
    touched: set[str] = field(default_factory=set)
    gathered: set[str] = field(default_factory=set)
    assembling: int = 0

    def add_metadata(self, key: str) -> None:
        """``key``'s ``zarr.json``, which it writes."""
        self.metadata.append(key)

    def add_direct(self, write: DirectFlatWrite) -> None:
        """A chunk inside one of its flattened ranges."""
        self.direct.append(write)

    def add_gathered(self, key: str) -> None:
        """``key``, gathered to a writer, which it holds a block of or writes."""
        self.gathered.add(key)

    def add_assembled(self, key: str, tag: int, chunk: FlatChunk, nbytes: int) -> FlatChunk:
        """``chunk`` of ``nbytes``, which it assembles: placed after what it assembles
        so far; the chunk, so placed."""
        # FlatChunk's own constructor, not ``replace``: a 4,096-rank save makes a copy
        # per contributor, hundreds of thousands
        placed = FlatChunk(key, chunk.region, chunk.writer, chunk.pieces, self.assembling)
        self.assembling += nbytes
        self.straddling.append((tag, placed))
        self.touched.add(key)
        return placed

    def add_contribution(self, key: str, tag: int, chunk: FlatChunk) -> None:
        """``chunk`` as far as it sends pieces of it (``chunk.pieces``: its own)."""
        self.straddling.append((tag, chunk))
        self.touched.add(key)

    def plan(
        self, rank: int, records: dict[str, ArrayRecord], checkpoint_nbytes: int, commit: CommitRecord | None,
        assembled_bytes: int, largest_assembled: int,
    ) -> RankSavePlan:
        """Its frozen plan as rank ``rank``; the coordinator's (``commit``) writes the groups."""
        return RankSavePlan(
            rank=rank,
            records={k: records[k] for k in sorted(self.touched)},
            shards=tuple(self.shards),
            flat_direct=tuple(self.direct),
            straddling=tuple(self.straddling),
            array_metadata=tuple(self.metadata),
            group_metadata=tuple(parent_groups(list(records))) if commit is not None else (),
            checkpoint_nbytes=checkpoint_nbytes,
            commit=commit,
            gathered=frozenset(self.gathered),
            assembled_bytes=assembled_bytes,
            largest_assembled=largest_assembled,
        )


class _Exchanges:
    """The chunks a save assembles by exchange, handed to the ranks' parts (``parts``),
    each with its tag (``tag``: the next); and the bytes of the largest (``largest``)."""

    def __init__(self, parts: list[RankPart]) -> None:
        self.parts = parts
        self.tag = 0
        self.largest = 0

    def add(self, key: str, chunks: Iterable[FlatChunk], itemsize: int) -> None:
        """``chunks`` of ``key``: each to its writer, and to each contributor its own
        pieces (grouped once, not per rank: a small tensor's one chunk, or a shard, may
        gather pieces from every rank)."""
        for chunk in chunks:
            writer, nbytes = chunk.writer, chunk.volume * itemsize
            chunk = self.parts[writer].add_assembled(key, self.tag, chunk, nbytes)
            self.largest = max(self.largest, nbytes)
            by_rank: dict[int, list] = defaultdict(list)
            for piece in chunk.pieces:
                if piece[0] != writer:
                    by_rank[piece[0]].append(piece)
            for rank in sorted(by_rank):
                self.parts[rank].add_contribution(
                    key, self.tag, FlatChunk(key, chunk.region, writer, tuple(by_rank[rank]), chunk.at))
            self.tag += 1

    def gather(self, key: str, main: list[ShardRecord], chunks: list[FlatChunk], itemsize: int) -> None:
        """``key``'s ``chunks``, gathered from its ``main`` blocks to their writers: every
        holder and writer takes part (``RankSavePlan.gathered``)."""
        for rank in {s.rank for s in main} | {c.writer for c in chunks}:
            self.parts[rank].add_gathered(key)
        self.add(key, chunks, itemsize)


def plan_save(
    layout: GatheredShards, max_chunk_bytes: int, fully_parallel: bool, shard_bytes: int | None = None,
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
    load = [0] * world  # bytes each rank writes of gathered shards and packed arrays
    parts = [RankPart() for _ in range(world)]
    exchanges = _Exchanges(parts)
    for ordinal, (key, key_shards) in enumerate(sorted(layout.tensors.items())):
        main = [s for s in key_shards if s.main]
        if not main:
            continue
        for s in main:  # its blocks: inline, not a call each (a million at 512 FSDP2 ranks)
            part = parts[s.rank]
            part.shards.append(s)
            part.touched.add(key)
        whole = plan_packed_whole(records[key], main, pack_arrays_up_to, load)
        if whole is not None:  # packed: its writer packs it, document included
            records[key], chunks = whole
            parts[chunks[0].writer].add_metadata(key)
            exchanges.gather(key, main, chunks, records[key].itemsize)
            continue
        parts[main[ordinal % len(main)].rank].add_metadata(key)
        if key in grids:  # gathered into shards (shards inside blocks are not in ``grids``)
            chunks = plan_gathered_writes(key, records[key], grids[key], load)
            exchanges.gather(key, main, chunks, records[key].itemsize)
        elif main[0].flat_range is not None:  # flattened ranges
            direct, straddling = plan_flat_writes(key, main, records[key].chunk_shape)
            for write in direct:
                parts[write.rank].add_direct(write)
            exchanges.add(key, straddling, records[key].itemsize)
        # else blocks: written by their holders, as their main shards say
    commit = CommitRecord(
        arrays=records,
        objects={
            key: ObjectRecord(key, tuple(sorted({o.unique_key for o in shards_ if o.main})))
            for key, shards_ in layout.objects.items()
        },
        world_size=world,
    )
    # the arrays' bytes: what the main shards of a valid layout cover, each element once
    nbytes, assembled_bytes = sum(r.nbytes for r in records.values()), max(p.assembling for p in parts)
    return [part.plan(rank, records, nbytes, commit if rank == 0 else None, assembled_bytes, exchanges.largest)
            for rank, part in enumerate(parts)]
