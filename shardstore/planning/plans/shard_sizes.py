"""How large shards and their inner chunks are: the bounds on a shard's bytes
(``largest_shard_bytes``, ``stored_at_most``), a shard's shape in inner chunks
(``shard_shape``), and the small grid helpers every kind of sharded record uses.
"""

from __future__ import annotations

__all__ = [
    "FRAGMENT_PARTS", "INNER_PARTS", "MIN_INNER_BYTES", "SMALL_FRAGMENT_SHARE", "count_chunks",
    "inner_rows", "largest_shard_bytes", "largest_shard_data_bytes", "object_bounds", "shard_shape", "split_axis",
    "stored_at_most", "whole_inner_chunks",
]

import math

import numpy as np

from shardstore.format.codecs import CRC_BYTES
from shardstore.format.sharding import ShardIndex
from shardstore.format.storage_layout import SHARD_SLACK, StorageLayout
from shardstore.planning.plans.block_grid import BlockGrid

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

# ``SHARD_SLACK`` (``format.storage_layout``): how far a shard may exceed ``shard_bytes``
# (``shard_shape``): shards of 1-1.25 times the size where fewer, evenly cut, are closer
# to it than more, smaller ones. Megatron GPT-175B's attention projection's optimizer
# blocks are 72 MiB: one shard each, not two of 36 MiB.


def largest_shard_data_bytes(shard_bytes: int) -> int:
    """The most data bytes one shard of a save with ``shard_bytes`` holds: ``SHARD_SLACK``
    times it (``shard_shape``)."""
    return math.floor(shard_bytes * SHARD_SLACK)


def largest_shard_bytes(shard_bytes: int) -> int:
    """The most bytes one stored shard of a save with ``shard_bytes`` takes: its data
    (``largest_shard_data_bytes``) and index (``stored_at_most``). S3's object limit is
    checked against it (``object_bounds``)."""
    return stored_at_most(largest_shard_data_bytes(shard_bytes))


def object_bounds(layout: StorageLayout) -> dict[str, tuple[int | None, int | None]]:
    """By option name, its value in a save's chosen ``layout`` and the largest stored
    object it allows (a chunk and its crc32c, or a shard inside a block and its index:
    ``stored_at_most``; a gathered shard: ``largest_shard_bytes``; None: no shards), as
    a save checks them against the store's limit when it is opened (``SavePipeline``)."""
    chunk, shard = int(layout.max_chunk_bytes), layout.shard_bytes
    return {"max_chunk_bytes": (chunk, stored_at_most(chunk)),
            "shard_bytes": (shard, None if shard is None else largest_shard_bytes(int(shard)))}


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


def split_axis(chunk: tuple[int, ...]) -> int:
    """A chunk's first axis longer than one element (its number of axes if none)."""
    return next((a for a, n in enumerate(chunk) if n > 1), len(chunk))


def count_chunks(shape: tuple[int, ...], chunk: tuple[int, ...]) -> int:
    """Chunks of ``chunk`` in an array of ``shape``."""
    return math.prod(-(-n // c) for n, c in zip(shape, chunk))


def whole_inner_chunks(grid: BlockGrid, chunk: tuple[int, ...]) -> bool:
    """Whether every block of ``grid`` is whole chunks of ``chunk``, each contiguous in
    its block: the blocks start on the chunk grid and are no longer than the chunk
    along the axes after its first longer one."""
    split = split_axis(chunk)
    return all(o % c == 0 for axis, c in zip(grid.starts, chunk) for o in axis.tolist()) and not (
        grid.shapes[:, split + 1 :] > np.asarray(chunk[split + 1 :], dtype=np.int64)).any()


def shard_shape(
    shape: tuple[int, ...], inner: tuple[int, ...], count: float, order: list[int] | None = None,
    cap: float | None = None,
) -> tuple[int, ...]:
    """A shard of about ``count`` inner chunks (``shard_bytes`` over an inner chunk's):
    as many as the array has along the first axis of ``order`` (default: the array's
    axes in order), then, where all of it fits, along the next, and so on. Along an axis
    the shards are as many as ``count`` gives, rounded to the nearest (halves down), each
    of at most ``SHARD_SLACK`` times ``count`` (and ``cap``, where less:
    ``MAX_FLAT_INNER_CHUNKS``), as even as their number allows; later axes take what is
    left of ``count``, rounded down."""
    # 192 inner chunks at 42.7 per shard are four shards of 48, not five of 39; 33 at 32
    # per shard are one of 33, at 20 per shard 17 + 16, not 20 + 13 (an edge shard is
    # stored padded to the full shape). Rounding, not rounding up, keeps the shards' mean
    # size near ``count``, so an array's files follow its bytes (a block of 1.125 shards
    # is one shard, not two of half the size). Later axes rounded down keep 2-D grids of
    # blocks of most of a shard one block per shard.
    out = list(inner)
    cap = count * SHARD_SLACK if cap is None else min(cap, count * SHARD_SLACK)
    for axis in range(len(shape)) if order is None else order:
        total = -(-shape[axis] // inner[axis])
        shards = max(-(-total // max(1, math.floor(cap))), math.ceil(total / max(count, 1) - 0.5), 1)
        along = -(-total // shards)
        out[axis] = along * inner[axis]
        count, cap = count / along, cap / along
    return tuple(out)


def inner_rows(rows: int, row_bytes: int) -> int:
    """The rows of an inner chunk of a chunk of ``rows`` rows: a divisor of ``rows``
    (so blocks stay whole inner chunks), as small as ``INNER_PARTS`` and
    ``MIN_INNER_BYTES`` allow."""
    for parts in range(min(INNER_PARTS, rows), 1, -1):
        if rows % parts == 0 and rows // parts * row_bytes >= MIN_INNER_BYTES:
            return rows // parts
    return rows
