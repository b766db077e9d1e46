"""A load's requests split at the edges of the chunks they touch along their leading
axis, so each chunk is read once (``RankReadPlan.pieces``): a block into blocks, a
flattened range (the distributed optimizer's fragment) into flattened ranges.
"""

from __future__ import annotations

__all__ = [
    "Box", "PiecesByRank", "chunk_boxes", "crossing_blocks", "leading_rows", "request_piece",
    "split_at_chunk_edges", "split_records",
]

import math
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from shardstore.planning.columns import record_rows
from shardstore.planning.layout import (
    GatheredShards,
    ShardRecord,
)

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
