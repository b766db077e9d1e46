"""Arrays stored at a read grain: a chunk cut into inner chunks a loader reads alone.

A block split along its first axis (FSDP2's ``Shard(0)``, Megatron's column-parallel
weights, layer-stacked blocks ``[1, out/TP, in]``) is stored, by default, as chunks of up
to ``max_chunk_bytes`` that each hold whole rows of the block. A load at another layout
(2 -> 4 ranks) needs part of each chunk; read whole, it reads 2x what it loads. With a
read grain (``StorageLayout.read_grain``) each such chunk of at least twice the grain
becomes one Zarr v3 shard (``sharding_indexed``, ``format.sharding``) with the same key,
written by the block's holder as the chunk was (no exchange between ranks, no more
files, the inner chunks are the shard's C order: no copy), whose inner chunks cut the
first axis the chunk does not hold whole into ``k`` parts: ``k`` the largest divisor of
its length up to ``READ_PARTS`` (8) that keeps an inner chunk at least the grain. A
loader reads the shard's index and the inner chunks it needs, by range
(``format.sharding.read_inner``): 2 -> 4 reads 1.0x where ``k`` is even, at most one
inner chunk more per end otherwise.

Not cut: flattened arrays (their chunks are assembled from fragments), arrays already
in shards (``shard_bytes``), chunks that split an axis after their first longer one
(last-axis tensor-parallel blocks ``[out, in/TP]``: the columns a TP 4 reader needs are
strided in the block's C order, so inner chunks of them cost the save a transposing
copy of every byte; ``in_block_sharded_record`` does that where ``shard_bytes`` is set),
and chunks under twice the grain or whose length has no divisor that fits.
"""

from __future__ import annotations

__all__ = ["READ_PARTS", "read_grained_record"]

import math
from dataclasses import replace

from shardstore.format.codecs import BYTES_CRC32C
from shardstore.format.records import ArrayRecord
from shardstore.format.sharding import ShardingIndexed

READ_PARTS = 8
"""The most inner chunks a chunk is cut into for reads: a loader of any part of a block
reads at most an eighth of a chunk more per end of its part."""


def read_grained_record(record: ArrayRecord, read_grain: int | None) -> ArrayRecord:
    """``record`` with each chunk stored as one shard of inner chunks of at least
    ``read_grain`` bytes (module docstring), where its chunks hold whole rows of the
    axes after their first longer one; else ``record`` as it is (None: never)."""
    if read_grain is None:
        return record
    shape, chunk, itemsize = record.shape, record.chunk_shape, record.itemsize
    # the size first, the test most arrays fail: with it last, a save of 10,000 arrays
    # of 1-64 KiB spent 57 ms of its 1.7 s here
    if math.prod(chunk) * itemsize < 2 * read_grain or record.codec != BYTES_CRC32C or record.flattened_block is not None:
        return record
    axis = next((a for a, n in enumerate(chunk) if n > 1), len(chunk))
    if axis == len(chunk) or chunk[axis + 1 :] != shape[axis + 1 :]:
        return record
    row_bytes = math.prod(chunk[axis + 1 :]) * itemsize
    rows = chunk[axis]
    parts = next((k for k in range(min(READ_PARTS, rows), 1, -1)
                  if rows % k == 0 and rows // k * row_bytes >= read_grain), None)
    if parts is None:
        return record
    inner = (*chunk[:axis], rows // parts, *chunk[axis + 1 :])
    return replace(record, codec=ShardingIndexed(inner, itemsize))
