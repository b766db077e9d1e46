"""A rank's part of a save, as its ``planning.plans.RankSavePlan`` says: stage, write, commit.

The stages (``engine.zarr_strategies.ZarrSaveShardedStrategy`` runs them):

    all ranks    stage     tensors -> host numpy views; CUDA tensors (and, for an async
                           save, every tensor) copied into host buffers, in waves under
                           a byte bound, each wave written while the next is copied
                           (``shardstore.execution.staging``); the chunks of flattened tensors that
                           straddle ranks, and the shards gathered from several
                           ranks, are assembled by exchanging only their pieces, in
                           exchange waves under the same bound, each a stage that
                           writes the wave before (collective)            ``stage_save``
    all ranks    write     array zarr.json files (a holder of each array's blocks; none
                           with ``SaveOptions.zarr_metadata="consolidated_only"``) in
                           one batch, then every chunk write in flight at once; then
                           the written data is made durable     ``SavePipeline.write_staged``
    all ranks    agree     every rank reports success or its error (collective)
    coordinator  commit    root zarr.json = commit record (with file checksums),
                           written atomically, last                     ``finalize_save``,
                                                                        ``commit_save``

``stage`` is the blocking part of an async save; ``write`` is the ``AsyncRequest``'s
I/O; ``agree`` + ``commit`` (``execution.save_commit``) are its finalization. ``execution.pipeline.SavePipeline``
runs them in that order and holds what they stage and write. Chunks are written by
``shardstore.format.chunks`` (local files, or a TensorStore kvstore elsewhere).
"""

from __future__ import annotations

__all__ = [
    "ASSEMBLY_SHARE", "StagedWrites", "Staging", "WriteOp", "assembly_wave_bytes", "fail_before_staging",
    "metadata_files", "node_document_files", "packed_keys", "stage_save", "write_ops",
]

import json
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NoReturn, cast

import numpy as np
import torch

from shardstore.errors import CheckpointingException
from shardstore.execution.staging import HostBufferPool, HostSnapshot, to_host
from shardstore.format.chunks import (
    DEFAULT_IO_CONCURRENCY,
    DEFAULT_IO_THREADS,
    ArrayChunks,
    ChunkFile,
    WrittenChunk,
    chunk_store_for,
    is_chunk_aligned,
    run_writes,
    write_region,
)
from shardstore.format.codecs import BYTES_CRC32C
from shardstore.format.commit import PendingCheckpoint
from shardstore.format.dtypes import byte_view, from_zarr_name, holds_its_values, tensor_to_numpy
from shardstore.format.features import ZarrMetadata
from shardstore.format.packs import PackCollector, Packing, fits_one_pack, write_packs
from shardstore.format.records import (
    ZARR_JSON,
    ArrayRecord,
    group_metadata,
)
from shardstore.format.sharding import ShardingIndexed
from shardstore.mapping import ShardedTensor
from shardstore.planning.layout import (
    DirectFlatWrite,
    FlatChunk,
    Region,
    ShardRecord,
    block_chunks,
    region_shape,
)
from shardstore.planning.plans import RankSavePlan, exchange_waves
from shardstore.protocol.collectives import Group, travels_packed
from shardstore.protocol.stage import Transfers, run_stage
from shardstore.stores.base import usable_cpus

logger = logging.getLogger(__name__)


@dataclass
class WriteOp:
    """One region of one array and the host bytes that go there."""

    key: str
    region: Region
    value: np.ndarray
    # its jobs hold a copy of ``value`` (``PackedShardsOp``): bounded by ``MAX_COPIED_BYTES``
    copies: ClassVar[bool] = False

    def jobs(self, array: ArrayChunks) -> list[tuple[ChunkFile, np.ndarray]]:
        """The chunk writes that store it: its region must be whole chunks."""
        if not is_chunk_aligned(self.region, array.shape, array.chunk_shape):
            raise CheckpointingException(
                f"Internal error: the write of {self.key!r} region {_describe_region(self.region)} is not aligned "
                f"with its chunks {array.chunk_shape}; please report it"
            )
        return write_region(array, self.region, self.value)


@dataclass
class ShardOp(WriteOp):
    """A whole shard gathered from several ranks: ``value`` is its decoded bytes
    (``format.sharding.ShardingIndexed.decoded``), written as they are at ``index``."""

    index: tuple[int, ...] = ()

    def jobs(self, array: ArrayChunks) -> list[tuple[ChunkFile, np.ndarray]]:
        return [(array.file(self.index), self.value)]


@dataclass
class PackedShardsOp(WriteOp):
    """A block of an array stored in shards inside its blocks
    (``planning.plans.in_block_sharded_record``): each shard's values packed into its
    decoded bytes (``format.sharding.ShardingIndexed.pack``: one copy, inner-chunk-major)
    before its codec encodes them."""

    copies: ClassVar[bool] = True

    def jobs(self, array: ArrayChunks) -> list[tuple[ChunkFile, np.ndarray]]:
        codec = cast(ShardingIndexed, array.codec)
        return [(file, codec.pack(values)) for file, values in super().jobs(array)]


@dataclass(frozen=True)
class StagedWrites:
    """A rank's part of a save, ready for I/O (``stage_save``): nothing refers to the
    caller's tensors except through ``ops`` (host views, or CUDA data already copied
    to host). ``SavePipeline`` holds it from its ``stage`` to its ``finalize``.

    Attributes:
        records: the arrays this rank writes chunks of.
        metadata_files: the ``zarr.json`` files this rank writes.
        ops: the whole-chunk writes left to do.
        snapshot: the host copies ``ops`` point into, released after the writes.
        written_early: chunks already written while staging (waves under a byte bound).
        packing: the arrays of ``ops`` this rank packs (``packed_keys``), or None.
    """

    records: dict[str, ArrayRecord]
    metadata_files: dict[str, bytes]
    ops: list[WriteOp]
    snapshot: HostSnapshot | None = None
    written_early: tuple[WrittenChunk, ...] = ()
    packing: Packing | None = None


@dataclass
class Staging:
    """How a save makes its host copies.

    Attributes:
        snapshot: copy even CPU tensors, so the caller may change them once ``save``
            returns (async saves). Without it (sync saves) CPU tensors are written from
            the caller's memory and only CUDA tensors, and CPU tensors whose memory does
            not hold their values in order (``holds_its_values``), are copied. CUDA
            tensors go through ``pool``'s pinned buffers.
        max_bytes: the most copied bytes held at once; above it the blocks are written
            in waves, in the caller, each wave's writes overlapping the copies of the
            next (two waves of at most half of it; a flattened range mostly written as
            its own chunks is written with its wave, and copies of the pieces of it
            that the stage's exchange reads, at most a chunk at each end, kept; a range
            mostly made of such pieces, and a block of a gathered array, is copied for
            the exchange waves that read it (a snapshot copies no gathered CPU block:
            the exchange reads it before the save returns)). The chunks a rank
            assembles from several ranks' pieces (gathered shards, flattened tensors'
            straddling chunks) are exchanged in waves of a quarter of it each
            (``stage_save``), after the copies still unwritten are written down to
            the room the busiest wave leaves (``_RangeWaves.exchange_holds``); every
            rank must pass the same bound then. None: no bound.
        io_concurrency: for the writes of those waves.
        io_threads: threads for the direct local writes of this save.
    """

    snapshot: bool = False
    max_bytes: int | None = None
    pool: HostBufferPool | None = None
    io_concurrency: int = DEFAULT_IO_CONCURRENCY
    io_threads: int = DEFAULT_IO_THREADS


def _block_ops(s: ShardRecord, host: list[torch.Tensor | None], records: dict[str, ArrayRecord]) -> list[WriteOp]:
    """The write of a block as its own chunks, or as the shards inside it: one op per
    shard, so ``MAX_COPIED_BYTES`` bounds the packed copies, not the block."""
    value = tensor_to_numpy(host[s.index]).reshape(s.block_shape)
    record = records[s.key]
    if not isinstance(record.codec, ShardingIndexed):
        return [WriteOp(s.key, s.region, value)]
    return [
        PackedShardsOp(s.key, region, value[tuple(slice(r.start - o, r.stop - o) for r, o in zip(region, s.offset))])
        for region, _, _ in block_chunks(s, record.chunk_shape, record.shape)
    ]


def _planned_tensor(tensors: list[ShardedTensor], s: ShardRecord, where: str) -> torch.Tensor:
    """The data of the tensor the plan's shard ``s`` numbers, checked to be the one the
    plan was made from (same key): a plan is bound to the list it was made from."""
    tensor = tensors[s.index] if s.index < len(tensors) else None
    if tensor is None or tensor.key != s.key:
        found = "nothing" if tensor is None else repr(tensor.key)
        raise CheckpointingException(
            f"Internal error: the save plan of {where} numbers {s.key!r} as tensor {s.index}, which is {found}: "
            "the plan was made from another state dict; please report it"
        )
    if tensor.data is None:
        raise CheckpointingException(f"ShardedTensor {s.key!r} has no data to save")
    return tensor.data


# What the ranks must pass alike when a save assembles chunks in several exchange waves
# (``stage_save``), as its error names it.
_WAVE_SETTING = ("host memory bounds (max_staging_bytes of an async save, sync_staging_bytes of a sync one or "
                 "of DCP's ShardstoreWriter)")
# The share of a save's host memory bound (``Staging.max_bytes``) one exchange wave
# assembles (``stage_save``): a wave of blocks under 1 MiB also holds their packed
# copies, one on each side of the exchange (``protocol.collectives.Group.exchange``), so
# a quarter of the bound is assembled and about three quarters held.
ASSEMBLY_SHARE = 4


def assembly_wave_bytes(max_bytes: int | None) -> int | None:
    """The bytes one exchange wave assembles under the host memory bound ``max_bytes``
    (``Staging.max_bytes``; None: no bound, one wave): ``planning.plans.exchange_waves``'
    ``wave_bytes``."""
    return max(1, int(max_bytes) // ASSEMBLY_SHARE) if max_bytes else None


@dataclass(frozen=True)
class _RangeWaves:
    """Which of a rank's blocks follow the exchange waves and which the copy waves
    (``stage_save``, ``copy_to_host``).

    Attributes:
        read_in: by tensor index, the first and last exchange wave that reads the block
            (``_waves_reading``).
        pieces: the flattened ranges that join the copy waves although the exchange
            reads pieces of them, and those pieces (``_edge_pieces``).
        edges: where such a range written early keeps copies of its pieces (filled by
            ``copy_to_host``, read by ``straddling_transfers``, emptied after the range's
            last exchange wave).
        direct: each flattened range's chunks that lie wholly in it (``plan.flat_direct``).
        waves: the exchange waves (``planning.plans.exchange_waves``).
    """

    read_in: dict[int, tuple[int, int]]
    pieces: dict[int, list[tuple[int, int]]]
    edges: dict[int, dict[tuple[int, int], torch.Tensor]]
    direct: dict[int, list[DirectFlatWrite]]
    waves: list[tuple[tuple[int, FlatChunk], ...]]

    @property
    def later(self) -> frozenset[int]:
        """The blocks copied for a later exchange wave than the first, not in staging."""
        return frozenset(i for i, (first, _) in self.read_in.items() if first > 0 and i not in self.pieces)

    def exchange_holds(self, plan: RankSavePlan, copies: dict[int, int]) -> int:
        """The most host bytes one exchange wave holds on this rank: the chunks it
        assembles, the pieces that travel packed (``travels_packed``: a message
        built on the sending side, received whole on the other), and the copies the
        waves read (``copies``: bytes by tensor index, each alive from the first wave
        that reads its block to the last; the kept pieces of a range written in the
        copy waves (``pieces``) from the first wave on)."""
        starts = [0] * (len(self.waves) + 1)  # copies coming alive at each wave, less those let go
        for i, n in copies.items():
            if i in self.read_in:
                first, last = self.read_in[i]
                starts[0 if i in self.pieces else first] += n
                starts[last + 1] -= n
        most = alive = 0
        for number, wave in enumerate(self.waves):
            alive += starts[number]
            held = alive
            for _, chunk in wave:
                itemsize = plan.records[chunk.key].itemsize
                writes = chunk.writer == plan.rank
                held += chunk.volume * itemsize if writes else 0
                held += sum((hi - lo) * itemsize for r, _, lo, hi, _ in chunk.pieces
                            if (r == plan.rank) != writes and travels_packed((hi - lo) * itemsize))
            most = max(most, held)
        return most

    def follows_exchange(self, index: int) -> bool:
        """Whether the block is copied for and let go after the exchange waves that read
        it, not in the copy waves."""
        return index in self.read_in and index not in self.pieces


@dataclass(frozen=True)
class _ExchangeWaves:
    """How a rank cuts its save's exchange (``stage_save``), as the ranks agree on it:
    ``count`` waves of ``cut_by`` bytes (``exchange_waves``' ``wave_bytes``; None: one
    wave, whatever the bound); ``bound``, the rank's bound, is shown, not compared, so
    bounds that cut the same waves agree."""

    count: int
    cut_by: int | None
    bound: int | None = field(compare=False, default=None)

    def __repr__(self) -> str:
        waves = "one wave" if self.count == 1 else f"{self.count} waves"
        return f"{waves} (bound {self.bound} bytes)" if self.bound is not None else f"{waves} (no bound)"


def stage_save(
    tensors: list[ShardedTensor],
    location: PendingCheckpoint,
    plan: RankSavePlan,
    group: Group,
    staging: Staging | None = None,
    local_error: BaseException | None = None,
) -> StagedWrites:
    """Collective (``protocol.stage.run_stage``): this rank's host copies, agreed by
    every rank (``local_error``: an earlier local failure, e.g. of the common state,
    reported here too), then the exchange of the chunks that straddle ranks (flattened
    tensors' chunks, gathered shards). Under a byte bound (``Staging.max_bytes``) a rank
    assembling more than a quarter of it (``ASSEMBLY_SHARE``) does so in waves
    (``planning.plans.exchange_waves``), each a stage of its own that writes the wave
    before and then exchanges the next: a wave assembles at most a quarter of the bound
    plus one chunk (or its largest chunk, plus one). The last wave's chunks are written
    with the other writes."""
    staging = staging or Staging()
    host: list[torch.Tensor | None] = [None] * len(tensors)
    written: set[int] = set()  # blocks already written in an earlier wave
    early_chunks: list[WrittenChunk] = []  # what those waves wrote
    where = location.describe()
    snapshot = HostSnapshot(staging.pool, where)
    assembled: list[tuple[FlatChunk, torch.Tensor]] = []  # this exchange wave's chunks
    wave_bytes = assembly_wave_bytes(staging.max_bytes)
    waves = exchange_waves(plan, wave_bytes)
    by_index = {s.index: s for s in plan.shards}
    direct: dict[int, list[DirectFlatWrite]] = {}
    for w in plan.flat_direct:
        direct.setdefault(w.index, []).append(w)
    book = _RangeWaves(_waves_reading(waves, group.rank), _edge_pieces(plan, by_index), {}, direct, waves)
    read_in, edges, later = book.read_in, book.edges, book.later

    def straddles(wave: tuple[tuple[int, FlatChunk], ...]) -> Callable[[Any], Transfers]:
        def transfers(_: Any) -> Transfers:
            planned, chunks = straddling_transfers(wave, host, plan.records, group.rank, edges)
            assembled.extend(chunks)
            return planned

        return transfers

    def next_wave(number: int) -> Callable[[], None]:
        def work() -> None:
            """Writes the last wave's assembled chunks, and the own chunks of the
            flattened ranges no later wave reads, and lets go of those buffers and of
            the copies of every block no later wave reads; copies the blocks this
            wave reads first."""
            done = [i for i, (_, last) in read_in.items() if last == number - 1]
            for i in done:
                edges.pop(i, None)
            ops = [_assembled_op(chunk, buffer, plan.records, plan.gathered) for chunk, buffer in assembled]
            ops += [_flat_direct_op(w, host) for i in done if i not in written for w in direct.get(i, [])]
            assembled.clear()
            early_chunks.extend(_write_early(location, plan.records, ops, staging.io_concurrency))
            snapshot.release([host[i] for i in done])
            for i in done:
                host[i] = None
                written.add(i)
            for i in sorted(i for i in later if read_in[i][0] == number and host[i] is None):
                host[i] = snapshot.copy(_planned_tensor(tensors, by_index[i], where), by_index[i].key)
            snapshot.wait()

        return work

    run_stage(
        group, _staging_stage(where),
        lambda: copy_to_host(tensors, location, plan, staging, host, snapshot, written, early_chunks, book),
        transfers=straddles(waves[0]), local_error=local_error,
        same_setting=(_WAVE_SETTING, _ExchangeWaves(len(waves), wave_bytes if len(waves) > 1 else None,
                                                    staging.max_bytes)),
    )
    for number, wave in enumerate(waves[1:], 1):
        run_stage(group, f"Assembling chunks for checkpoint {where} (exchange wave {number + 1} of {len(waves)})",
                  next_wave(number), transfers=straddles(wave))
    sent = [s.index for s in plan.shards if s.key in plan.gathered and host[s.index] is not None]
    snapshot.release([host[i] for i in sent])  # exchanged: their pinned copies go back to the pool
    for i in sent:
        host[i] = None
    ops = [op for s in plan.shards if _written_whole(s, plan) and s.index not in written
           for op in _block_ops(s, host, plan.records)]
    ops += [_flat_direct_op(w, host) for w in plan.flat_direct if w.index not in written]
    ops += [_assembled_op(chunk, buffer, plan.records, plan.gathered) for chunk, buffer in assembled]
    packing = packed_keys(plan, ops, location.options.pack_arrays_up_to)
    files = metadata_files(plan, location.options.zarr_metadata, packing.keys if packing else frozenset())
    return StagedWrites(plan.records, files, ops, snapshot, tuple(early_chunks), packing)


def packed_keys(plan: RankSavePlan, ops: list[WriteOp], up_to: int) -> Packing | None:
    """The arrays this rank packs (``SaveOptions.pack_arrays_up_to``, ``format.packs``):
    those of at most ``up_to`` bytes (none when 0) stored as ``[bytes, crc32c]`` whose
    document this rank writes (``RankSavePlan.array_metadata``) and whose every element
    ``ops`` write (its own blocks, or, for one split over ranks, the one chunk it
    assembled: ``planning.plans.plan_packed_whole``): the plan gives each chunk one
    writer, so no other rank writes any chunk of theirs, and none was written early
    (in a wave under a byte bound); and
    that fit one pack (``format.packs.fits_one_pack``: no more chunks than a zip
    without zip64 holds). Each rank decides for its own arrays alone; the commit record says what was packed."""
    if not up_to:
        return None
    covered: dict[str, int] = {}
    for op in ops:
        if type(op) is WriteOp:
            covered[op.key] = covered.get(op.key, 0) + op.value.size
    keys = []
    for key in plan.array_metadata:
        record = plan.records.get(key)
        if (
            record is not None and record.codec == BYTES_CRC32C
            and 0 < record.nbytes <= up_to and covered.get(key) == math.prod(record.shape)
            and fits_one_pack(record)
        ):
            keys.append(key)
    return Packing(frozenset(keys), plan.rank) if keys else None


def _staging_stage(where: str) -> str:
    """The staging stage of a save into ``where`` (``stage_save``), as errors name it."""
    return f"Staging tensors for checkpoint {where}"


def fail_before_staging(group: Group, where: str, error: BaseException) -> NoReturn:
    """Collective: this rank's ``error`` between the plan stage and the staging stage of
    a save into ``where`` (joining it: opening the coordinator's staging directory),
    told to the peers that wait in the staging stage's agreement (``stage_save``), so
    that every rank raises the same ``StageFailed`` instead of waiting for this one."""
    run_stage(group, _staging_stage(where), lambda: None, local_error=error)
    raise error  # not reached: the stage raised it, as every rank's failure


def _waves_reading(waves: list[tuple[tuple[int, FlatChunk], ...]], rank: int) -> dict[int, tuple[int, int]]:
    """The first and last exchange wave that reads each of this rank's blocks (by
    tensor index: blocks of gathered arrays, flattened ranges with pieces of chunks
    that straddle ranges): a copy of one (a CUDA block's) is made for its first wave
    and let go after its last (``stage_save``), a flattened range's own chunks written
    then."""
    read: dict[int, tuple[int, int]] = {}
    for number, wave in enumerate(waves):
        for _, chunk in wave:
            for piece in chunk.pieces:
                if piece[0] == rank:
                    first, _ = read.get(piece[1], (number, number))
                    read[piece[1]] = (first, number)
    return read


def _edge_pieces(plan: RankSavePlan, by_index: dict[int, ShardRecord]) -> dict[int, list[tuple[int, int]]]:
    """By tensor index, the ``[lo, hi)`` pieces of this rank's flattened ranges that
    the stage's exchange reads (of chunks straddling ranges), for the ranges whose
    pieces are at most half of them: such a range is copied in the copy waves, its own
    chunks written, and only copies of its pieces kept for the exchange (a chunk at
    each end at most). A range mostly made of pieces (one smaller than the chunks,
    as the distributed optimizer's are at the default chunk size) is copied for the
    exchange waves that read it instead (``stage_save``)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for _, chunk in plan.straddling:
        if chunk.key in plan.gathered:
            continue
        for rank, index, lo, hi, _ in chunk.pieces:
            if rank == plan.rank:
                spans.setdefault(index, []).append((lo, hi))
    itemsize = {i: plan.records[by_index[i].key].itemsize for i in spans}
    return {i: s for i, s in spans.items() if 2 * sum(hi - lo for lo, hi in s) * itemsize[i] <= by_index[i].nbytes}


def _flat_direct_op(w: DirectFlatWrite, host: list[torch.Tensor | None]) -> WriteOp:
    """The write of a chunk lying wholly in one of this rank's flattened ranges."""
    flat = tensor_to_numpy(host[w.index])[w.local_start : w.local_stop]
    return WriteOp(w.key, w.region, flat.reshape(region_shape(w.region)))


def _needs_copy(s: ShardRecord, data: torch.Tensor, staging: Staging, plan: RankSavePlan) -> bool:
    """Whether ``data`` of the block ``s`` goes to host memory as a copy: every CUDA
    block, every block whose memory does not hold its values in order
    (``holds_its_values``: a column slice, a transpose; ``to_host`` would copy it, all
    of them at once and outside the bound), and under an async snapshot every block but
    the gathered ones (read only by the stage's exchange, before the save returns: a
    snapshot would protect nothing)."""
    return (
        (staging.snapshot and s.key not in plan.gathered) or data.device.type != "cpu" or not holds_its_values(data)
    )


def _written_whole(s: ShardRecord, plan: RankSavePlan) -> bool:
    """The block ``s`` is written as its own chunks (not a flattened range, not gathered
    into a shard with other ranks' blocks: ``RankSavePlan.gathered``)."""
    return s.flat_range is None and s.key not in plan.gathered


def copy_to_host(
    tensors: list[ShardedTensor], location: PendingCheckpoint, plan: RankSavePlan, staging: Staging,
    host: list[torch.Tensor | None], snapshot: HostSnapshot, written: set[int], early_chunks: list[WrittenChunk],
    book: _RangeWaves,
) -> None:
    """Fills ``host`` with each planned shard's host tensor (a copy where ``staging``
    says so; none yet of the blocks ``book.later`` names, copied for a later exchange
    wave); above ``staging.max_bytes`` whole waves are written early (``written``,
    ``early_chunks``), each while the next is copied: the blocks written whole, and the
    flattened ranges that do not follow the exchange waves (``book``), a range written
    early keeping copies of the pieces the exchange reads in ``book.edges``. Where this
    rank takes part in an exchange, the copies still unwritten at the end are written
    down to the room its busiest exchange wave leaves under the bound."""
    later = book.later

    def ops_of(h: ShardRecord) -> list[WriteOp]:
        if h.flat_range is None:
            return _block_ops(h, host, plan.records)
        return [_flat_direct_op(w, host) for w in book.direct.get(h.index, [])]

    def write_wave(wave: list[ShardRecord], copied: Any) -> None:
        """Writes a wave once its copies landed (and match their sources); its buffers go back to the pool."""
        snapshot.landed(copied, [host[h.index] for h in wave])
        ops = [op for h in wave for op in ops_of(h)]
        early_chunks.extend(_write_early(location, plan.records, ops, staging.io_concurrency))
        for h in wave:
            if h.index in book.pieces:
                flat = host[h.index].reshape(-1)
                book.edges[h.index] = {(lo, hi): snapshot.copy(flat[lo:hi]) for lo, hi in book.pieces[h.index]}
        snapshot.release([host[h.index] for h in wave])
        for h in wave:
            host[h.index] = None
            written.add(h.index)

    waves: list[tuple[list[ShardRecord], Any, int]] = []  # closed waves, copies in flight
    held: list[ShardRecord] = []  # the wave being copied
    for_exchange: dict[int, int] = {}  # bytes of the copies the exchange waves read, by tensor index
    held_bytes = in_flight = 0

    def close_wave() -> None:
        """The wave being copied joins the waves in flight, its copies marked now."""
        nonlocal held, held_bytes, in_flight
        waves.append((held, snapshot.mark(), held_bytes))
        in_flight += held_bytes
        held, held_bytes = [], 0

    def write_down_to(limit: int) -> None:
        """Writes the oldest waves in flight until at most ``limit`` bytes of them are left."""
        nonlocal in_flight
        while waves and in_flight > limit:
            wave, copied, nbytes = waves.pop(0)
            write_wave(wave, copied)
            in_flight -= nbytes

    where = location.describe()
    for s in sorted(plan.shards, key=lambda s: not _written_whole(s, plan)):
        data = _planned_tensor(tensors, s, where)
        copy = _needs_copy(s, data, staging, plan)
        in_waves = _written_whole(s, plan) or (s.key not in plan.gathered and not book.follows_exchange(s.index))
        if copy and not in_waves:
            for_exchange[s.index] = s.nbytes
        elif copy and s.index in book.pieces:  # a range written early keeps copies of these pieces
            for_exchange[s.index] = sum(hi - lo for lo, hi in book.pieces[s.index]) * plan.records[s.key].itemsize
        if copy and s.index in later:
            continue
        if staging.max_bytes and copy and in_waves:
            if held and held_bytes + s.nbytes > staging.max_bytes // 2:
                close_wave()
            # the newest waves' copies run while the oldest is written, within the bound
            write_down_to(staging.max_bytes - held_bytes - s.nbytes)
        host[s.index] = snapshot.copy(data, s.key) if copy else to_host(data)
        if copy and in_waves:  # a gathered block's copy is let go once exchanged, never written as a block
            held.append(s)
            held_bytes += s.nbytes
    if staging.max_bytes and plan.straddling:  # this rank takes part in an exchange
        # The copies still unwritten stay beside every exchange wave: written first down
        # to the room the busiest wave leaves under the bound.
        if held:
            close_wave()
        write_down_to(staging.max_bytes - book.exchange_holds(plan, for_exchange))
    snapshot.wait()


def metadata_files(
    plan: RankSavePlan, where: ZarrMetadata = ZarrMetadata.PER_NODE, packed: frozenset[str] = frozenset(),
) -> dict[str, bytes]:
    """The ``zarr.json`` files a rank writes: its arrays' (``RankSavePlan.array_metadata``;
    not those it packs, ``packed``, whose documents go into their packs) and, on the
    coordinator, the groups' that keys with ``/`` make (``node_document_files``)."""
    arrays = [plan.records[key] for key in plan.array_metadata if key not in packed]
    return node_document_files(arrays, plan.group_metadata, where)


def node_document_files(
    arrays: Iterable[ArrayRecord], groups: Iterable[str], where: ZarrMetadata
) -> dict[str, bytes]:
    """The ``zarr.json`` files of ``arrays`` and ``groups`` by relative path; none where
    their documents go into the root's consolidated metadata only (``where``, the save's
    ``SaveOptions.zarr_metadata``: the commit record then says so)."""
    if where is ZarrMetadata.CONSOLIDATED_ONLY:
        return {}
    files = {f"{a.key}/{ZARR_JSON}": json.dumps(a.zarr_metadata()).encode() for a in arrays}
    files.update({f"{g}/{ZARR_JSON}": json.dumps(group_metadata()).encode() for g in groups})
    return files


def straddling_transfers(
    straddling: tuple[tuple[int, FlatChunk], ...], host: list[torch.Tensor | None],
    records: dict[str, ArrayRecord], rank: int, edges: dict[int, dict[tuple[int, int], torch.Tensor]] | None = None,
) -> tuple[Transfers, list[tuple[FlatChunk, torch.Tensor]]]:
    """The transfers that assemble the flat chunks this rank writes from its
    neighbours' pieces, and those chunks' byte buffers (filled once the transfers ran).

    Only the straddling pieces travel, as raw bytes. Both sides list a pair's pieces in
    the same order: chunks by their tag (from the plan, unique within the save), then
    each chunk's pieces in order. ``edges``: the pieces kept of flattened ranges
    written early (``copy_to_host``), whose ``host`` entry is gone.
    """
    transfers = Transfers()
    assembled: list[tuple[FlatChunk, torch.Tensor]] = []

    def piece(index: int, lo: int, hi: int) -> torch.Tensor:
        data = host[index]
        kept = data.reshape(-1)[lo:hi] if data is not None else (edges or {})[index][(lo, hi)]
        return byte_view(kept)

    for _, chunk in sorted(straddling, key=lambda tagged: tagged[0]):
        itemsize = from_zarr_name(records[chunk.key].dtype).itemsize
        buffer = None
        if chunk.writer == rank:
            buffer = torch.empty(chunk.volume * itemsize, dtype=torch.uint8)
            assembled.append((chunk, buffer))
        for piece_rank, index, lo, hi, at in chunk.pieces:
            if buffer is not None:
                target = buffer[at * itemsize : (at + (hi - lo)) * itemsize]
                if piece_rank == rank:
                    target.copy_(piece(index, lo, hi))
                else:
                    transfers.receives.setdefault(piece_rank, []).append(target)
            elif piece_rank == rank:
                transfers.sends.setdefault(chunk.writer, []).append(piece(index, lo, hi))
    return transfers, assembled


def _assembled_op(
    chunk: FlatChunk, buffer: torch.Tensor, records: dict[str, ArrayRecord], gathered: frozenset[str]
) -> WriteOp:
    record = records[chunk.key]
    # a shard, its inner chunks packed (``planning.plans.plan_gathered_writes``); not an
    # array gathered whole into one plain chunk (``planning.plans.plan_packed_whole``)
    if chunk.key in gathered and isinstance(record.codec, ShardingIndexed):
        codec = cast(ShardingIndexed, record.codec)
        index = tuple(s.start // c for s, c in zip(chunk.region, record.chunk_shape))
        data = codec.decoded(buffer.numpy(), record.chunk_shape, region_shape(chunk.region))
        return ShardOp(chunk.key, chunk.region, data, index)
    dtype = from_zarr_name(record.dtype)
    return WriteOp(chunk.key, chunk.region, buffer.numpy().view(dtype.numpy_dtype).reshape(region_shape(chunk.region)))


def _write_early(
    pending: PendingCheckpoint, records: dict[str, ArrayRecord], ops: list[WriteOp], io_concurrency: int,
) -> list[WrittenChunk]:
    """``write_ops`` of chunks written while staging (waves under a byte bound), their
    arrays' directories made first (one pass, as ``SavePipeline`` does for the rest): a
    chunk shared by a hard link needs its directory to exist."""
    pending.location.make_directories({op.key for op in ops})
    return write_ops(pending, records, ops, io_concurrency)


def write_ops(
    pending: PendingCheckpoint, records: dict[str, ArrayRecord], ops: list[WriteOp], io_concurrency: int,
    io_threads: int = DEFAULT_IO_THREADS, packing: Packing | None = None,
) -> list[WrittenChunk]:
    """Writes whole chunks of arrays (the plan gives every chunk one writer and one
    write), all in flight at once, or shares those unchanged since the checkpoint the
    save reuses from (``format.reuse``); the arrays of ``packing`` go into this rank's
    packs (``write_packs``), never shared; returns what each writer reports."""
    store = chunk_store_for(pending.location, io_concurrency, io_threads)
    packed = packing.keys if packing is not None else frozenset()
    unpacked = {k: r for k, r in records.items() if k not in packed} if packed else records
    reuse = pending.chunk_reuse(store, unpacked)
    share = None if reuse is None else reuse.sharer(store)
    written: list[WrittenChunk] = []
    for batch in _batches([op for op in ops if op.value.size and op.key not in packed]):
        jobs = [job for op in batch for job in op.jobs(ArrayChunks.of(store, records[op.key]))]
        written += run_writes(jobs, store.threads, share)
    if reuse is not None:
        reuse.log_tally()
    if packing is not None:
        written += _write_packed(store, records, [op for op in ops if op.key in packed], packing)
    return written


def _write_packed(store: Any, records: dict[str, ArrayRecord], ops: list[WriteOp], packing: Packing) -> list[WrittenChunk]:
    """The packed arrays' chunks encoded on the writer threads (crc32c, digest and the
    zip's CRC-32 of each), then laid out in this rank's packs and each pack written as
    one object (``format.packs.write_packs``); the reports name pack and offset."""
    collector = PackCollector(store.threads)
    jobs = [job for op in ops for job in op.jobs(ArrayChunks.of(collector, records[op.key]))]
    reports = run_writes(jobs, _encoding_threads(jobs, store.threads))
    placed, sizes = write_packs(store, packing.rank, {key: records[key] for key in packing.keys}, collector)
    out = []
    for report in reports:
        pack, offsets = placed[report.key]
        offset = offsets[records[report.key].chunk_ordinal(report.index)]
        out.append(report._replace(packed=(pack, offset, sizes[pack])))
    return out


# Packed chunks of at most this many bytes on average are encoded on one thread: their
# encoding does no I/O, and its Python steps hold the GIL about as long as the chunk's
# three checksums take, so threads only contend for it (issue 44.6: 10,000 chunks of
# 1-64 KiB took 0.36 s on 8 threads, 0.23 s on 2 and 0.20 s on one, on 2 cores).
ONE_THREAD_CHUNK_BYTES = 256 << 10


def _encoding_threads(jobs: list[tuple[ChunkFile, np.ndarray]], threads: int) -> int:
    """How many threads encode packed chunks ``jobs`` (``_write_packed``): one where
    they are small (``ONE_THREAD_CHUNK_BYTES``), else no more than the cores."""
    if not jobs or sum(data.nbytes for _, data in jobs) <= ONE_THREAD_CHUNK_BYTES * len(jobs):
        return 1
    return min(threads, usable_cpus())


# The most bytes of copies made for writing (``WriteOp.copies``: packed shards) held at
# once: above it such ops are written in batches, one after another (a rank's
# row-parallel weights, a third of its model's, would otherwise be copied whole).
MAX_COPIED_BYTES = 256 << 20


def _batches(ops: list[WriteOp]) -> list[list[WriteOp]]:
    """``ops`` in batches written one after another: the first holds every op that
    copies nothing and copying ones up to ``MAX_COPIED_BYTES``, each next one more."""
    batches: list[list[WriteOp]] = [[op for op in ops if not op.copies]]
    held = 0
    for op in (op for op in ops if op.copies):
        if held and held + op.value.nbytes > MAX_COPIED_BYTES:
            batches.append([])
            held = 0
        batches[-1].append(op)
        held += op.value.nbytes
    return batches


def _describe_region(region: Region) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in region) + "]"


