"""Flattened ranges (the distributed optimizer's fragments): each chunk written directly
by the holder of the range it lies in, or assembled by exchange where it straddles ranges
(``plan_flat_writes``).
"""

from __future__ import annotations

__all__ = ["plan_flat_writes"]

import bisect
from collections import defaultdict

from shardstore.planning.layout import (
    DirectFlatWrite,
    FlatChunk,
    ShardRecord,
    block_chunks,
)


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
