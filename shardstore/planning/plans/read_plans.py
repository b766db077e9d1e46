"""The coordinator's read plan of a load (``plan_reads``): which rank reads each
requested block and who sends it to whom; and the requests a rank's plan numbers
(``planned_requests``).

A load's requests are split at the edges of the chunks they touch along their leading
axis, so each chunk is read once (``RankReadPlan.pieces``): a block into blocks, a
flattened range (the distributed optimizer's fragment) into flattened ranges
(``split_at_chunk_edges``). A block several ranks ask for, or a shard read once for all
that ask for part of it, is read by one rank and sent to the others
(``plan_shared_reads``; ``single_asker_plans`` in bulk where each block has one asker).
"""

from __future__ import annotations

__all__ = [
    "Box",
    "MAX_FORWARDED_BYTES",
    "PiecesByRank",
    "chunk_boxes",
    "crossing_blocks",
    "leading_rows",
    "plan_reads",
    "plan_shared_reads",
    "planned_requests",
    "request_piece",
    "single_asker_plans",
    "split_at_chunk_edges",
    "split_records",
]

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from shardstore.format.dtypes import ITEMSIZE_BY_ZARR_NAME, from_zarr_name
from shardstore.planning.columns import (
    ForwardedBlocks,
    record_rows,
    row_width,
    split_by_peer,
    widened,
)
from shardstore.planning.layout import (
    GatheredShards,
    ShardRecord,
    pick_balanced,
)
from shardstore.planning.plans.rank_plans import RankReadPlan

# A request's part: ``(start, stop)`` per axis of its block, or for a flattened range one
# ``(start, stop)`` within the range; and each rank's pieces, as ``RankReadPlan.pieces``
# lists them (the index of the request split, and the part).
Box = tuple[tuple[int, int], ...]
PiecesByRank = list[list[tuple[int, Box]]]


def split_at_chunk_edges(
    layout: GatheredShards, shards: Mapping[str, tuple[int, ...]], own: list[int],
    pieces: PiecesByRank,
) -> GatheredShards:
    """``layout`` with each block of the arrays in ``shards`` whose leading axis runs over
    a chunk's edge replaced by its pieces (``split_records``)."""
    tensors: dict[str, list[ShardRecord]] = {}
    for key, records in layout.tensors.items():
        chunk = shards.get(key)
        usable = chunk is not None and len(chunk) > 0 and all(len(s.offset) == len(chunk) for s in records)
        crossing = crossing_blocks(record_rows(records, len(chunk)), chunk) if usable else None
        tensors[key] = split_records(records, crossing, chunk, own, pieces)[0] if crossing is not None else records
    return GatheredShards(tensors, layout.objects, layout.world_size)


def split_records(
    records: list[ShardRecord], crossing: np.ndarray, chunk: tuple[int, ...], own: list[int],
    pieces: PiecesByRank,
) -> tuple[list[ShardRecord], np.ndarray, list[int]]:
    """``records`` with each block ``crossing`` marks (and that may not differ from the
    stored shape) replaced by its pieces, split at the edges of ``chunk``
    (``chunk_boxes``), each a request of its rank numbered after its own (``own``, the
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
        for box in chunk_boxes(s, chunk):
            pieces[s.rank].append((s.index, box))
            made.append(len(out))
            out.append(request_piece(s, box, own[s.rank]))
            source.append(i)
            own[s.rank] += 1
    out += records[at:]
    source += range(at, len(records))
    return out, np.asarray(source, np.int64), made


def request_piece(block: ShardRecord, box: Box, index: int) -> ShardRecord:
    """The part ``box`` of ``block`` as the request ``index`` of its rank (of a
    flattened range: the range's part, in the same block)."""
    if block.flat_range is not None:
        ((a, b),) = box
        start = block.flat_range[0]
        return replace(block, index=index, flat_range=(start + a, start + b))
    return replace(block, index=index, offset=tuple(o + a for o, (a, _) in zip(block.offset, box)),
                   block_shape=tuple(b - a for a, b in box))


def crossing_blocks(rows: np.ndarray, chunk: tuple[int, ...]) -> np.ndarray | None:
    """Per request (``planning.columns.record_rows`` of every axis of the array),
    whether it is one to split: its leading axis (its block's first of more than one
    element: ``chunk_boxes``) runs over an edge of ``chunk``, and it has elements; for a
    flattened range, the rows of its block it covers do, and its block lies in one chunk
    along every later axis (so its parts are contiguous runs). None where none is."""
    ndim = len(chunk)
    offset, extent = rows[:, :ndim], rows[:, ndim : 2 * ndim]
    lo, hi = rows[:, 2 * ndim], rows[:, 2 * ndim + 1]
    if not len(rows):
        return None
    leading = np.argmax(extent > 1, axis=1)  # 0 where no axis has more than one element (nothing crosses)
    at = np.arange(len(rows))
    start, size = offset[at, leading], extent[at, leading]
    steps = np.asarray(chunk, np.int64)
    step = steps[leading]
    flat = lo >= 0
    crossing = (start // step != (start + size - 1) // step) & ~flat & (extent > 0).all(axis=1)
    if flat.any():
        later = np.arange(ndim)[None, :] > leading[:, None]
        one_cell = (~later | (offset // steps == (offset + np.maximum(extent, 1) - 1) // steps)).all(axis=1)
        row = np.maximum(np.where(later, extent, 1).prod(axis=1), 1)  # elements per step of the leading axis
        first, last = start + lo // row, start + (hi - 1) // row
        crossing |= flat & (hi > lo) & one_cell & (first // step != last // step)
    return crossing if crossing.any() else None


def leading_rows(block: ShardRecord) -> tuple[int, int, int, int]:
    """``(axis, first, last, row)``: the block's leading axis (its first of more than
    one element; 0 where none is), the first and last index along it that the block,
    or its flattened range, covers, and the elements per step of that axis. A
    flattened range must have elements."""
    axis = next((a for a, size in enumerate(block.block_shape) if size > 1), 0)
    start, row = block.offset[axis], math.prod(block.block_shape[axis + 1 :])
    if block.flat_range is None:
        return axis, start, start + block.block_shape[axis] - 1, row
    lo, hi = block.flat_range
    return axis, start + lo // row, start + (hi - 1) // row, row


def chunk_boxes(block: ShardRecord, chunk: tuple[int, ...]) -> list[Box]:
    """The parts of ``block`` at the edges of ``chunk`` along its leading axis, the
    first with more than one element (``(start, stop)`` per axis of the block; of a
    flattened range, ``(start, stop)`` within it, cut where the rows it covers cross an
    edge), in order. Only there: a part of the leading axis is a contiguous run of the
    block's tensor, read and received in place; a part along a later axis would be
    strided, each landing in a buffer of its own first (the block's size again at once)."""
    axis, first, last, row = leading_rows(block)
    start, step = block.offset[axis], chunk[axis]
    if block.flat_range is not None:
        lo, hi = block.flat_range
        cuts = [lo, *((edge - start) * row for edge in range((first // step + 1) * step, last + 1, step)), hi]
        return [((a - lo, b - lo),) for a, b in zip(cuts[:-1], cuts[1:])]
    edges = [start, *range((start // step + 1) * step, last + 1, step), last + 1]
    whole = [(0, n) for n in block.block_shape]
    return [(*whole[:axis], (a - start, b - start), *whole[axis + 1 :]) for a, b in zip(edges[:-1], edges[1:])]


# The most bytes one rank reads for other ranks alone where shards are read once
# (``plan_reads``' ``shards``): the blocks it did not ask for itself, held until the
# exchange (the ones it asked for land in its own tensors). A shard that would take a
# rank past it is read by each rank that asks, as without.
MAX_FORWARDED_BYTES = 2 << 30


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


def plan_shared_reads(
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


def single_asker_plans(
    layout: GatheredShards, own: list[int], shards: Mapping[str, tuple[int, ...]],
    pieces: PiecesByRank,
) -> list[RankReadPlan]:
    """``plan_reads`` where every block has one asker (FSDP2: millions of blocks at 4,096
    ranks), in bulk: each block is read by its asker, or by the reader of its shard
    (``_shard_readers``), who reads it as a forward (numbered in the order gathered)
    and sends it; a block over a shard's edge is split first (``split_records``, from
    the table's rows: no second pass over the records). The exchanges and forwards are
    numpy columns (``planning.columns``): no Python object per block on the
    coordinator."""
    world = len(own)
    ranks, indices, buckets = [], [], []
    tables: list[tuple[int, _BlockTable]] = []  # (position of its first block, table)
    base = 0
    for key, records in layout.tensors.items():
        table = _BlockTable.of(records, shards[key]) if key in shards else None
        crossing = crossing_blocks(table.rows, table.shard) if table is not None else None
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
        pieces: PiecesByRank,
    ) -> tuple[list[ShardRecord], _BlockTable]:
        """``records`` (this table's) with the blocks ``crossing`` marks split at the
        shards' edges (``split_records``), and their table: the rows of the blocks kept,
        the pieces' made anew."""
        out, source, made = split_records(records, crossing, self.shard, own, pieces)
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


def plan_reads(
    layout: GatheredShards, fully_parallel: bool, shards: Mapping[str, tuple[int, ...]] | None = None,
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
    pieces: PiecesByRank = [[] for _ in range(world)]
    if once:  # each block asked for once (FSDP2: millions at 4,096 ranks)
        plans = single_asker_plans(layout, own, shards, pieces)
    else:
        layout = split_at_chunk_edges(layout, shards, own, pieces)
        requests: dict[tuple, list[ShardRecord]] = defaultdict(list)  # a block asked for twice (in one dtype or two)
        for records in layout.tensors.values():
            for s in records:  # ``ShardRecord.block_id`` and the dtype, as one tuple (millions at 4,096 ranks)
                requests[(s.key, s.offset, s.block_shape, s.flat_range, s.dtype)].append(s)
        plans = plan_shared_reads(list(requests.values()), own, shards)  # in the order of the gathered requests
    return [replace(plan, pieces=tuple(pieces[plan.rank]), requested=own[plan.rank]) if pieces[plan.rank] else plan
            for plan in plans]


def planned_requests(plan: RankReadPlan, own: Sequence[ShardRecord]) -> list[ShardRecord]:
    """Every request ``plan`` numbers, as records, by index: the rank's own (``own``, in
    the order of its list), its pieces, then its forwards."""
    pieces = [request_piece(own[i], box, len(own) + k) for k, (i, box) in enumerate(plan.pieces)]
    return [*own, *pieces, *plan.forwards]
