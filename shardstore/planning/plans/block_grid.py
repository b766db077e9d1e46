"""An array's main blocks as a grid (``BlockGrid``), or the blocks its flattened ranges
were cut from (``FlatBlockGrid``): what a gathered shard's pieces are found in.
"""

from __future__ import annotations

__all__ = ["BlockGrid", "FlatBlockGrid", "Piece"]

import bisect
import itertools
import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from shardstore.errors import CheckpointingException
from shardstore.planning.layout import (
    ShardRecord,
)


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
