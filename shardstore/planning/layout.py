"""The global layout of a save or load and the chunk grid derived from it. Pure functions.

Every rank contributes the metadata (never the data) of its shards; the coordinator
alone holds the ``GatheredShards`` and plans from it (``shardstore.protocol.plan_stage``,
``shardstore.planning.plans``):

* the chunk grid of every array is aligned with the sharding grid (the chunk shape
  divides every shard boundary), so every chunk lies inside one main-replica shard and
  has exactly ONE writer; chunks are further split to stay under ``max_chunk_bytes``;
* flattened ranges (distributed optimizer) use chunks that are contiguous in the
  flattened block, so a rank writes the chunks inside its range directly, and the few
  chunks that straddle a range boundary are assembled by the rank holding their first
  element from pieces its neighbours send (``FlatChunk``).

Arrays stored at a read grain (``read_grained_record``): a chunk cut into inner chunks a
loader reads alone.

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

__all__ = [
    "DirectFlatWrite",
    "FlatChunk",
    "GatheredShards",
    "ObjectShardRecord",
    "READ_PARTS",
    "ShardRecord",
    "balance_writers",
    "block_chunks",
    "block_shape",
    "bound_chunk",
    "chunk_shape_for",
    "largest_divisor_at_most",
    "pick_balanced",
    "read_grained_record",
    "region_at",
    "region_shape",
]

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from itertools import product
from operator import attrgetter

from shardstore.format.chunks import Region
from shardstore.format.codecs import BYTES_CRC32C
from shardstore.format.dtypes import ITEMSIZE_BY_ZARR_NAME, from_torch, from_zarr_name
from shardstore.format.records import ArrayRecord
from shardstore.format.sharding import ShardingIndexed
from shardstore.mapping import (
    MeshReplicaId,
    ShardedObject,
    ShardedTensor,
    as_integers,
    is_main_replica,
)


def block_shape(tensor: ShardedTensor) -> tuple[int, ...]:
    """The extent of a ShardedTensor's block in the global tensor: its (non-flat) local
    shape with a unit axis for every prepended axis."""
    return (1,) * tensor.prepend_axis_num + tuple(tensor.local_shape)


def region_at(offset: tuple[int, ...], extent: tuple[int, ...]) -> Region:
    """The box of ``extent`` elements starting at ``offset``."""
    return tuple(slice(o, o + e) for o, e in zip(offset, extent))


def region_shape(region: Region) -> tuple[int, ...]:
    """The extent of ``region`` along each axis."""
    return tuple(s.stop - s.start for s in region)


@dataclass(frozen=True)
class ShardRecord:
    """Metadata of one ShardedTensor of one rank, as all ranks see it after the gather.

    Attributes:
        key: the global tensor's key.
        rank: the rank holding it (in the save's process group).
        index: its position in that rank's list of ShardedTensors.
        dtype: Zarr v3 data type name (``"bfloat16"``, ``"float32"``, ...).
        global_shape: shape of the global tensor.
        offset: offset of the block in the global tensor, every axis.
        block_shape: extent of the block, every axis (1 on prepended axes).
        flat_range: ``(start, stop)`` within the flattened block, or None.
        main: True for the main replica (the one that writes).
        allow_shape_mismatch: see ShardedTensor.
        irregular: on no regular grid (``axis_fragmentations=None``): an uneven DTensor
            block, or an irregular shard given to the storage core as a flattened range
            of the whole tensor (``shardstore.inputs.irregular``), which is no flattened
            range the caller cut from a block.
        mesh_replica: a DTensor's block (``mapping.MeshReplicaId``): an equal block of
            the same key on another rank is its replica.
    """

    key: str
    rank: int
    index: int
    dtype: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    block_shape: tuple[int, ...]
    flat_range: tuple[int, int] | None
    main: bool
    allow_shape_mismatch: bool = False
    irregular: bool = False
    mesh_replica: bool = False

    @classmethod
    def from_sharded_tensor(cls, tensor: ShardedTensor, rank: int, index: int) -> ShardRecord:
        """The record of ``tensor`` as it holds its data now (``ShardedTensor.held_dtype``):
        the record's dtype is the one the save writes.

        Raises:
            CheckpointingException: its data's shape is no longer the declared one, or its
                global shape or offset holds a value that is no integer.
        """
        tensor.check_held_shape()
        flat = tensor.flattened_range
        return cls(
            key=tensor.key,
            rank=rank,
            index=index,
            dtype=from_torch(tensor.held_dtype).zarr_name,
            global_shape=as_integers(tensor.global_shape, f"ShardedTensor {tensor.key!r}: its global shape"),
            offset=as_integers(tensor.global_offset, f"ShardedTensor {tensor.key!r}: its global offset"),
            block_shape=block_shape(tensor),
            flat_range=None if flat is None else (flat.start, flat.stop),
            main=is_main_replica(tensor.replica_id),
            allow_shape_mismatch=tensor.allow_shape_mismatch,
            irregular=tensor.axis_fragmentations is None,
            mesh_replica=isinstance(tensor.replica_id, MeshReplicaId),
        )

    @classmethod
    def of_request(cls, tensor: ShardedTensor, rank: int, index: int) -> ShardRecord:
        """The record of a load's request: ``from_sharded_tensor``'s, in the dtype the load
        returns (the declared ``dtype``, whatever ``data`` holds now), which is the dtype
        in which a block that another rank reads for it travels (``planning.plans.plan_reads``)."""
        record = cls.from_sharded_tensor(tensor, rank, index)
        dtype = from_torch(tensor.dtype).zarr_name
        return record if record.dtype == dtype else replace(record, dtype=dtype)

    def __reduce__(self) -> tuple[Callable[[tuple], ShardRecord], tuple[tuple]]:
        """Pickled as one tuple of its fields, not pickle's dict naming every field:
        every rank's records travel to the coordinator (7.4 million at 4,096 ranks for
        FSDP2 Llama-70B, 1 GB), and this is 22% fewer bytes."""
        return _shard_record_of, (_shard_record_fields(self),)

    @property
    def region(self) -> Region:
        return region_at(self.offset, self.block_shape)

    @property
    def block_volume(self) -> int:
        return math.prod(self.block_shape)

    @property
    def block_id(self) -> tuple:
        """What replicas of one block have in common."""
        return (self.key, self.offset, self.block_shape, self.flat_range)

    @property
    def nbytes(self) -> int:
        """Bytes this shard holds (its flat range, or its whole block)."""
        flat = self.flat_range
        volume = math.prod(self.block_shape) if flat is None else flat[1] - flat[0]
        itemsize = ITEMSIZE_BY_ZARR_NAME.get(self.dtype) or from_zarr_name(self.dtype).itemsize  # raises if unknown
        return volume * itemsize


_SHARD_RECORD_FIELDS = tuple(f.name for f in fields(ShardRecord))
_shard_record_fields = attrgetter(*_SHARD_RECORD_FIELDS)


def _shard_record_of(values: tuple) -> ShardRecord:
    """``ShardRecord.__reduce__``'s inverse: the record of those field values, as
    pickle restores a frozen dataclass (its fields set, ``__init__`` not run)."""
    record = object.__new__(ShardRecord)
    record.__dict__.update(zip(_SHARD_RECORD_FIELDS, values))
    return record


@dataclass(frozen=True)
class ObjectShardRecord:
    """Metadata of one ShardedObject of one rank."""

    key: str
    unique_key: str
    rank: int
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    main: bool

    @classmethod
    def from_sharded_object(cls, obj: ShardedObject, rank: int) -> ObjectShardRecord:
        return cls(
            obj.key, obj.unique_key, rank, tuple(obj.global_shape), tuple(obj.global_offset),
            is_main_replica(obj.replica_id),
        )


@dataclass(frozen=True)
class GatheredShards:
    """Every rank's shards, grouped by key. Identical on every rank after the gather."""

    tensors: dict[str, list[ShardRecord]]
    objects: dict[str, list[ObjectShardRecord]]
    world_size: int

    @classmethod
    def from_gathered(
        cls, per_rank: list[tuple[list[ShardRecord], list[ObjectShardRecord]]]
    ) -> GatheredShards:
        tensors: dict[str, list[ShardRecord]] = defaultdict(list)
        objects: dict[str, list[ObjectShardRecord]] = defaultdict(list)
        main_mesh_blocks: set[tuple] = set()
        for rank_tensors, rank_objects in per_rank:
            for t in rank_tensors:
                tensors[t.key].append(_deduplicated(t, main_mesh_blocks))
            for o in rank_objects:
                objects[o.key].append(o)
        return cls(dict(tensors), dict(objects), len(per_rank))

    def main_shards(self, key: str) -> list[ShardRecord]:
        return [r for r in self.tensors[key] if r.main]

    def holds_each_block_once(self) -> bool:
        """Whether no two records name one block (``ShardRecord.block_id``): no replicas
        to choose a writer among, no request to share. A set of block ids per key, not
        one dict of every record: millions at 4,096 ranks."""
        return all(len({(s.offset, s.block_shape, s.flat_range) for s in shards}) == len(shards)
                   for shards in self.tensors.values())


def _deduplicated(record: ShardRecord, main_mesh_blocks: set[tuple]) -> ShardRecord:
    """``record``, no longer main where it is a DTensor's block (``mesh_replica``) whose
    equal block an earlier rank holds as main (``main_mesh_blocks``, their block ids:
    updated): DCP's deduplication of the copies of a DTensor on a mesh that other ranks
    repeat (TP + DDP), which its replica id cannot tell."""
    if not (record.mesh_replica and record.main):
        return record
    block = record.block_id
    if block in main_mesh_blocks:
        return replace(record, main=False)
    main_mesh_blocks.add(block)
    return record


def balance_writers(layout: GatheredShards) -> GatheredShards:
    """Fully-parallel save: each replicated block is written by one of its replicas,
    chosen so that every rank writes about the same number of bytes.

    Without this, every replicated tensor is written by its main replica (replica_id 0),
    which in a TP x DP job is the same few ranks. Blocks with one holder count first;
    then ``pick_balanced``. Replicas must hold equal data, as replication means.
    """
    if layout.holds_each_block_once():
        return layout  # every block has one holder: nothing to choose
    replicas: dict[tuple, list[ShardRecord]] = defaultdict(list)
    for shards in layout.tensors.values():
        for s in shards:  # ``block_id``, inlined: millions of records at 4,096 ranks
            replicas[(s.key, s.offset, s.block_shape, s.flat_range)].append(s)
    replicated = [g for g in replicas.values() if len(g) > 1 and any(s.main for s in g)]
    if not replicated:  # every block has one holder: nothing to choose
        return layout
    load = [0] * layout.world_size
    for s in (s for group in replicas.values() if len(group) == 1 for s in group if s.main):
        load[s.rank] += s.nbytes
    writers = {w.block_id: w for w in pick_balanced(replicated, load)}
    tensors = {  # a record changes only where its role does: ``replace`` costs 13 us a record
        key: [replace(s, main=not s.main) if (b := s.block_id) in writers and (writers[b] is s) != s.main else s
              for s in shards]
        for key, shards in layout.tensors.items()
    }
    return GatheredShards(tensors, layout.objects, layout.world_size)


def pick_balanced(groups: list[list[ShardRecord]], load: list[int]) -> list[ShardRecord]:
    """One member of each group (in the groups' order), so that the ranks' byte counts
    stay even: greedy, largest group first, to the member whose rank has the fewest
    bytes so far (ties: lowest rank). ``load``: bytes each rank already has; updated.
    A pure function of its input (the groups' order included)."""
    sizes = [group[0].nbytes for group in groups]
    chosen: list[ShardRecord] = [group[0] for group in groups]  # a group of one has no choice
    for i in sorted(range(len(groups)), key=sizes.__getitem__, reverse=True):  # stable: ties in the groups' order
        group = groups[i]
        if len(group) == 1:
            load[group[0].rank] += sizes[i]
            continue
        member = chosen[i] = min(group, key=lambda s: (load[s.rank], s.rank))
        load[member.rank] += member.nbytes
    return chosen


@dataclass(frozen=True)
class FlatChunk:
    """A chunk of a flattened tensor that straddles the ranges of several ranks.

    Attributes:
        key: array key.
        region: the chunk's region in the global array.
        writer: rank that assembles and writes it (holder of its first element).
        pieces: ``(rank, index, local_start, local_stop, chunk_start)``: rank ``rank``
            contributes ``data[local_start:local_stop]`` of its ShardedTensor number
            ``index`` at flat position ``chunk_start`` of the chunk.
        at: the bytes its writer assembles before it in the save
            (``planning.plans.plan_save``), which place it in an exchange wave
            (``planning.plans.exchange_waves``).
    """

    key: str
    region: Region
    writer: int
    pieces: tuple[tuple[int, int, int, int, int], ...]
    at: int = 0

    @property
    def volume(self) -> int:
        return math.prod(s.stop - s.start for s in self.region)


@dataclass(frozen=True)
class DirectFlatWrite:
    """A chunk lying wholly in one rank's flat range: ``data[local_start:local_stop]`` of
    that rank's ShardedTensor number ``index``."""

    key: str
    index: int
    region: Region
    local_start: int
    local_stop: int
    rank: int


def chunk_shape_for(
    main_shards: list[ShardRecord], global_shape: tuple[int, ...], itemsize: int, max_chunk_bytes: int,
    contiguous: bool = False,
) -> tuple[int, ...]:
    """The chunk shape of an array: aligned with every shard boundary, bounded in bytes.

    Along each axis the chunk size divides every shard start (their gcd), so no chunk
    crosses a shard boundary. For flattened shards the chunk is also contiguous in the
    flattened block. Then axes are split (by divisors, keeping alignment) until a chunk
    holds at most ``max_chunk_bytes`` (``bound_chunk``; contiguous in the block where
    the shards are flattened, or where ``contiguous`` asks it: chunks that shards of
    ``shard_bytes`` gather, ``planning.plans.array_records``).
    """
    ndim = len(global_shape)
    chunk = []
    columns = list(zip(*[r.offset for r in main_shards])) or [()] * ndim  # the offsets by axis
    for axis in range(ndim):
        starts = {o for o in columns[axis] if o > 0}
        size = math.gcd(*starts) if starts else global_shape[axis]
        chunk.append(max(1, size))
    flattened = any(r.flat_range is not None for r in main_shards)
    if flattened:
        chunk = _contiguous_in_blocks(chunk, {r.block_shape for r in main_shards})
    return bound_chunk(tuple(chunk), itemsize, max_chunk_bytes, contiguous=contiguous or flattened)


def _contiguous_in_blocks(chunk: list[int], blocks: set[tuple[int, ...]]) -> list[int]:
    """``chunk`` cut so that it tiles every one of ``blocks`` (the shapes of an array's
    flattened blocks) in one contiguous range of its flattened order: along each axis a
    divisor of every block's non-zero extent, and one element along the axes before the
    last one where it is shorter than some block. Blocks of several shapes (a shorter
    last block along an axis) all count, not only the first."""
    for block in blocks:
        chunk = [math.gcd(c, b) for c, b in zip(chunk, block)]  # gcd(c, 0) is c: empty blocks cut nothing
    partial = [a for a in range(len(chunk)) if any(chunk[a] < block[a] for block in blocks)]
    if partial:
        chunk[: partial[-1]] = [1] * partial[-1]
    return chunk


# A chunk more than this many times smaller than its bound, where the bound is met by
# splitting one axis alone, is a length without a divisor near the bound (FSDP2's
# blocks of 4,138 = 2 x 2,069 rows of 32 KiB, the bound 2,048 rows: chunks of 2 rows,
# 2,069 files per rank and array): ``bound_chunk`` then also splits a later axis.
SMALL_CHUNK_SHARE = 4


def bound_chunk(
    chunk: tuple[int, ...], itemsize: int, max_chunk_bytes: int, contiguous: bool = True
) -> tuple[int, ...]:
    """A chunk dividing ``chunk`` along every axis, of at most ``max_chunk_bytes``
    (where one element fits), found by splitting the leading axes: the largest such
    split of one axis, not of every combination of axes.

    ``contiguous``: split only the leading non-unit axis (the axes before it go to 1),
    so a chunk contiguous in its block stays so (flattened ranges, inner chunks of a
    shard). Otherwise, where that gives a chunk more than ``SMALL_CHUNK_SHARE`` times
    under the bound, the axis keeps its smallest divisor above the bound's share and
    the axes after it are split in turn, whichever chunk is larger (a box of the block,
    copied out with a stride).
    """
    out = list(chunk)
    for axis in range(len(out)):
        rest = math.prod(out[axis + 1 :]) * itemsize
        if out[axis] * rest <= max_chunk_bytes:
            break
        limit = max(1, max_chunk_bytes // max(rest, 1))
        out[axis] = largest_divisor_at_most(out[axis], limit)
        if rest <= max_chunk_bytes:
            if not contiguous and out[axis] * rest * SMALL_CHUNK_SHARE < max_chunk_bytes:
                return _split_later(tuple(out), chunk, axis, limit, itemsize, max_chunk_bytes)
            break
    return tuple(out)


def _split_later(
    found: tuple[int, ...], chunk: tuple[int, ...], axis: int, limit: int, itemsize: int, max_chunk_bytes: int
) -> tuple[int, ...]:
    """``found`` (``chunk`` split along ``axis`` to a divisor far under the bound), or,
    where larger, ``chunk`` with ``axis`` at its smallest divisor above ``limit`` (the
    most elements along it the bound allows, ``chunk[axis]`` being more) and the axes
    after it bounded in what is left (``bound_chunk``)."""
    n = chunk[axis]
    if len(chunk) == axis + 1:
        return found
    kept = n // largest_divisor_at_most(n, (n - 1) // limit)  # the smallest divisor of n above limit
    later = bound_chunk(chunk[axis + 1 :], itemsize * kept, max_chunk_bytes, contiguous=False)
    candidate = (*found[:axis], kept, *later)
    if math.prod(candidate) * itemsize > max_chunk_bytes or math.prod(candidate) <= math.prod(found):
        return found
    return candidate


# Candidates each search of ``largest_divisor_at_most`` tries before it settles: a
# length with no divisor nearby (a crafted 2**62 elements, a large prime) must cost
# milliseconds, not the minutes a scan up to its square root takes.
MAX_DIVISOR_TRIALS = 1 << 16


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is at most ``limit``; when ``MAX_DIVISOR_TRIALS``
    candidates on each side find none (only for lengths of about 2**32 and more), the
    largest power of two that divides it within the limit.

    A divisor above sqrt(n) is ``n // d`` for the smallest ``d >= n / limit`` dividing
    ``n``, and beats any below; else one below is found scanning down from
    ``min(limit, sqrt(n))``."""
    if n <= limit:
        return n
    root = math.isqrt(n)
    first = -(-n // limit)
    for d in range(first, min(root, first + MAX_DIVISOR_TRIALS) + 1):
        if n % d == 0:
            return n // d
    top = min(limit, root)
    for d in range(top, max(1, top - MAX_DIVISOR_TRIALS), -1):
        if n % d == 0:
            return d
    return _largest_power_of_two_dividing(n, limit)


def _largest_power_of_two_dividing(n: int, limit: int) -> int:
    """The largest power of two that divides ``n`` and is at most ``limit`` (1 for odd
    ``n``): what ``largest_divisor_at_most`` settles for when its trials find nothing."""
    power = n & -n
    while power > limit:
        power >>= 1
    return power


def block_chunks(record: ShardRecord, chunk_shape: tuple[int, ...], global_shape: tuple[int, ...]):
    """Yields ``(region, flat_start, flat_stop)`` of every chunk in a shard's block, in
    flattened order. Requires a chunk shape that is contiguous within the block."""
    ends = [min(o + b, g) for o, b, g in zip(record.offset, record.block_shape, global_shape)]
    counts = [-(-(e - o) // c) for o, e, c in zip(record.offset, ends, chunk_shape)]
    strides = [math.prod(record.block_shape[a + 1 :]) for a in range(len(chunk_shape))]
    for idx in product(*(range(n) for n in counts)):
        starts = [o + i * c for o, i, c in zip(record.offset, idx, chunk_shape)]
        stops = [min(s + c, e) for s, c, e in zip(starts, chunk_shape, ends)]
        flat_start = sum((s - o) * st for s, o, st in zip(starts, record.offset, strides))
        volume = math.prod(e - s for s, e in zip(starts, stops))
        yield tuple(slice(s, e) for s, e in zip(starts, stops)), flat_start, flat_start + volume


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
