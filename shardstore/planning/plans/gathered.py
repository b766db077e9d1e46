"""Gathered shards: each shard of a sharded array (``array_storage.sharded_record``)
assembled by exchange on one writer from the blocks it covers (``plan_gathered_writes``).
"""

from __future__ import annotations

__all__ = ["ShardRuns", "plan_gathered_writes"]

import itertools
import math
from dataclasses import dataclass

import numpy as np

from shardstore.errors import CheckpointingException
from shardstore.format.records import ArrayRecord
from shardstore.format.sharding import InnerGrid
from shardstore.planning.layout import (
    FlatChunk,
)
from shardstore.planning.plans.block_grid import BlockGrid, Piece


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
