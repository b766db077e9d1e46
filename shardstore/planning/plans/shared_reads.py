"""Reads shared between ranks: a block several ranks ask for, or a shard read once for
all that ask for part of it, is read by one rank and sent to the others
(``plan_shared_reads``; ``single_asker_plans`` in bulk where each block has one asker).
"""

from __future__ import annotations

__all__ = ["MAX_FORWARDED_BYTES", "plan_shared_reads", "single_asker_plans"]

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
from shardstore.planning.plans.chunk_pieces import PiecesByRank, crossing_blocks, split_records
from shardstore.planning.plans.rank_plans import RankReadPlan

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
