"""The storage core: ShardedTensors as Zarr v3 arrays (one GLOBAL array per key).

Save, in stages (``ZarrSaveShardedStrategy``)::

    all ranks    stage     tensors -> host numpy views; CUDA tensors (and, for an async
                           save, every tensor) copied into host buffers, in waves under
                           a byte bound, each wave written while the next is copied
                           (``shardstore.staging``); the chunks of flattened tensors that
                           straddle ranks are assembled by exchanging only the
                           straddling pieces (collective)
    all ranks    write     array zarr.json files (owner of each array's first chunk) in
                           one batch, then every chunk write in flight at once; then
                           the written data is made durable
    all ranks    agree     every rank reports success or its error (collective)
    coordinator  commit    root zarr.json = commit record (with file checksums),
                           written atomically, last

``stage`` is the blocking part of an async save; ``write`` is the ``AsyncRequest``'s
I/O; ``agree`` + ``commit`` are its finalization. With ``fully_parallel`` (default),
replicated blocks are written by their replicas in turn (``layout.balance_writers``).

Load (``ZarrLoadShardedStrategy``): one read of the commit record gives every array's
metadata; the coordinator plans who reads what (``plan_load``, ``planner.plan_reads``)
and each rank runs its part (``run_read_plan``): its regions are read (only the chunks
that overlap them), all reads in flight at once, then agreed, then exchanged. On a local
disk chunks go straight into the result's memory (``shardstore.chunk_io``); elsewhere
(S3) TensorStore reads them, opened from the record without reading any ``zarr.json``.
With ``fully_parallel`` (default), a block that several ranks request is read by one
and sent to the others.

The module functions named after Megatron-Core's zarr strategy (``_create_zarr_array``,
``_load_from_array``, ...) work on single tensors, for callers of that API.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts
import torch
import torch.distributed as dist

from shardstore.chunk_io import (
    DEFAULT_IO_THREADS,
    ArrayChunks,
    ReadJob,
    WrittenChunk,
    chunk_store_for,
    is_chunk_aligned,
    read_region,
    run_reads,
    run_writes,
    write_region,
)
from shardstore.commit import PendingCheckpoint, new_save_id
from shardstore.core import CheckpointingException
from shardstore.dict_utils import dict_list_map_inplace
from shardstore.distributed import Group, RankFailure, raise_failures
from shardstore.dtypes import (
    from_torch,
    from_zarr_name,
    numpy_to_tensor,
    numpy_to_torch_dtype_dict,  # noqa: F401  (seed API)
    tensor_to_numpy,
    torch_to_numpy_dtype_dict,  # noqa: F401  (seed API)
)
from shardstore.format import (
    ZARR_JSON,
    ArrayRecord,
    CommitRecord,
    group_metadata,
    read_commit_record,
    write_commit_record,
)
from shardstore.integrity import file_checksums
from shardstore.layout import (
    FlatChunk,
    GlobalLayout,
    Region,
    ShardRecord,
    block_shape,
    chunk_shape_for,
    region_at,
)
from shardstore.loaded import (  # flatten_range, pad_to_expected_shape: Megatron-Core's names here
    flatten_range,  # noqa: F401
    pad_to_expected_shape,  # noqa: F401
    place_loaded,
    postprocess_loaded,
)
from shardstore.locations import open_location
from shardstore.mapping import ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from shardstore.planner import RankReadPlan, RankSavePlan, plan_reads, plan_save
from shardstore.progress import stage
from shardstore.protocol import gather_and_plan
from shardstore.staging import (
    DEFAULT_LOAD_STAGING_BYTES,
    DeviceUploader,
    HostBufferPool,
    HostSnapshot,
    to_host,
)
from shardstore.storage import Location
from shardstore.strategies.async_utils import AsyncRequest
from shardstore.strategies.base import (
    AsyncSaveShardedStrategy,
    CheckpointDir,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from shardstore.utils import local_sharded_items

logger = logging.getLogger(__name__)

# What metadata.json names as the sharded backend. Megatron-Core's own zarr backend is
# ("zarr", 1): a shardstore checkpoint must not claim it, or Megatron would open ours
# with its reader and get nothing. "zarr" stays registered as an alias, so code asking
# for the default "zarr" strategy gets shardstore's.
SHARDSTORE_BACKEND = "shardstore"
ZARR_BACKEND = "zarr"
READABLE_BACKENDS = (SHARDSTORE_BACKEND, ZARR_BACKEND)  # "zarr": checkpoints of shardstore <= 0.1
ZARR_VERSION = 1
# Bound on one stored object: small enough for fine-grained resharded reads and far
# below S3's 5 GiB single-PUT limit.
DEFAULT_MAX_CHUNK_BYTES = 64 * 2**20
# TensorStore I/O operations in flight at once.
DEFAULT_IO_CONCURRENCY = 64
# Host memory a sync save of CUDA tensors copies through at once (pinned buffers).
DEFAULT_SYNC_STAGING_BYTES = 2 * 2**30


# --------------------------------------------------------------------------- specs


def tensorstore_context(location: Location, io_concurrency: int = DEFAULT_IO_CONCURRENCY) -> ts.Context:
    """One context per save or load: no chunk cache (data passes through once)."""
    return ts.Context(
        {
            "cache_pool": {"total_bytes_limit": 0},
            "data_copy_concurrency": {"limit": max(1, os.cpu_count() or 1)},
            "file_io_concurrency": {"limit": io_concurrency},
            **location.tensorstore_context(),
        }
    )


def array_spec(location: Location, record: ArrayRecord, for_write: bool) -> dict[str, Any]:
    """TensorStore spec that opens ``record``'s array without reading its ``zarr.json``.

    Writes store chunks even when they equal the fill value, and reads refuse missing
    chunks, so a lost chunk is an error instead of silent zeros.
    """
    spec: dict[str, Any] = {
        "driver": "zarr3",
        "kvstore": location.kvstore_spec(record.key),
        "metadata": record.zarr_metadata(),
    }
    if for_write:
        spec["store_data_equal_to_fill_value"] = True
    else:
        spec["fill_missing_data_reads"] = False
    return spec


def open_arrays(
    location: Location, records: list[ArrayRecord], context: ts.Context, for_write: bool
) -> dict[str, ts.TensorStore]:
    """Opens many arrays concurrently (no I/O: the metadata is assumed, not read)."""
    futures = {
        r.key: ts.open(
            array_spec(location, r, for_write), open=True, assume_metadata=True, context=context
        )
        for r in records
    }
    handles = {}
    for key, future in futures.items():
        try:
            handles[key] = future.result()
        except Exception as exc:
            raise CheckpointingException(
                f"Cannot open array {key!r} of checkpoint {location.describe()}: {exc}"
            ) from exc
    return handles


def _region_shape(region: Region) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in region)


def _ts_index(region: Region) -> tuple[slice, ...]:
    return tuple(slice(s.start, s.stop) for s in region)


# --------------------------------------------------------------------------- save


@dataclass
class WriteOp:
    """One region of one array and the host bytes that go there."""

    key: str
    region: Region
    value: np.ndarray


@dataclass
class StagedSave:
    """A rank's part of a save, ready for I/O: nothing refers to the caller's tensors
    except through ``ops`` (host views, or CUDA data already copied to host)."""

    location: Location
    records: dict[str, ArrayRecord]
    metadata_files: dict[str, bytes]
    ops: list[WriteOp]
    commit_record: CommitRecord | None  # the coordinator's
    group: Group
    snapshot: HostSnapshot | None = None
    written: list[WrittenChunk] = field(default_factory=list)


@dataclass
class Staging:
    """How a save makes its host copies.

    Attributes:
        snapshot: copy even CPU tensors, so the caller may change them once ``save``
            returns (async saves). Without it (sync saves) CPU tensors are written from
            the caller's memory and only CUDA tensors are copied. CUDA tensors go through
            ``pool``'s pinned buffers.
        max_bytes: the most copied bytes held at once; above it the blocks are written
            in waves, in the caller, each wave's writes overlapping the copies of the
            next (two waves of at most half of it; flattened tensors are staged at once:
            their chunks are assembled across ranks). None: no bound.
        io_concurrency: for the writes of those waves.
        io_threads: threads for the direct local writes of this save.
    """

    snapshot: bool = False
    max_bytes: int | None = None
    pool: HostBufferPool | None = None
    io_concurrency: int = DEFAULT_IO_CONCURRENCY
    io_threads: int = DEFAULT_IO_THREADS


def _block_op(s: ShardRecord, host: list[torch.Tensor | None]) -> WriteOp:
    return WriteOp(s.key, s.region, tensor_to_numpy(host[s.index]).reshape(s.block_shape))


def stage_save(
    tensors: list[ShardedTensor],
    location: Location,
    plan: RankSavePlan,
    group: Group,
    staging: Staging | None = None,
) -> StagedSave:
    """Collective: prepares this rank's writes of its ``plan`` (host copies,
    straddling-chunk exchange)."""
    staging = staging or Staging()
    records = plan.records
    host: list[torch.Tensor | None] = [None] * len(tensors)
    written: set[int] = set()  # blocks already written in an earlier wave
    early_chunks: list[WrittenChunk] = []  # what those waves wrote
    snapshot = HostSnapshot(staging.pool)
    error = None

    def write_wave(wave: list[ShardRecord], copied: Any) -> None:
        """Writes a wave once its copies landed; its buffers go back to the pool."""
        copied.synchronize()
        early_chunks.extend(write_ops(location, records, [_block_op(h, host) for h in wave], staging.io_concurrency))
        snapshot.release([host[h.index] for h in wave])
        for h in wave:
            host[h.index] = None
            written.add(h.index)

    try:
        waves: list[tuple[list[ShardRecord], Any, int]] = []  # closed waves, copies in flight
        held: list[ShardRecord] = []  # the wave being copied
        held_bytes = in_flight = 0
        for s in sorted(plan.shards, key=lambda s: s.flat_range is not None):
            data = tensors[s.index].data
            if data is None:
                raise CheckpointingException(f"ShardedTensor {s.key!r} has no data to save")
            copy = staging.snapshot or data.device.type != "cpu"
            if staging.max_bytes and copy and s.flat_range is None:
                if held and held_bytes + s.nbytes > staging.max_bytes // 2:
                    waves.append((held, snapshot.mark(), held_bytes))
                    in_flight += held_bytes
                    held, held_bytes = [], 0
                # the newest waves' copies run while the oldest is written, within the bound
                while waves and in_flight + held_bytes + s.nbytes > staging.max_bytes:
                    wave, copied, nbytes = waves.pop(0)
                    write_wave(wave, copied)
                    in_flight -= nbytes
            host[s.index] = snapshot.copy(data) if copy else to_host(data)
            if copy:
                held.append(s)
                held_bytes += s.nbytes
        snapshot.wait()
    except Exception as exc:  # reported on every rank by agree()
        error = exc
    group.agree(error, f"Staging tensors for checkpoint {location.describe()}")

    mine = plan.shards
    ops = [_block_op(s, host) for s in mine if s.flat_range is None and s.index not in written]
    for w in plan.flat_direct:
        flat = tensor_to_numpy(host[w.index])[w.local_start : w.local_stop]
        ops.append(WriteOp(w.key, w.region, flat.reshape(_region_shape(w.region))))
    ops += exchange_straddling_chunks(plan.straddling, host, records, group)
    metadata_files = {f"{key}/{ZARR_JSON}": json.dumps(records[key].zarr_metadata()).encode()
                      for key in plan.array_metadata}
    metadata_files.update({f"{g}/{ZARR_JSON}": json.dumps(group_metadata()).encode() for g in plan.group_metadata})
    return StagedSave(location, records, metadata_files, ops, plan.commit, group, snapshot, early_chunks)


def exchange_straddling_chunks(
    straddling: tuple[tuple[int, FlatChunk], ...], host: list[torch.Tensor | None],
    records: dict[str, ArrayRecord], group: Group,
) -> list[WriteOp]:
    """Among the ranks concerned: assembles the flat chunks this rank writes from its
    neighbours' pieces.

    Only the straddling pieces travel, as raw bytes, point to point; each chunk's tag
    (from the plan, unique within the save) pairs its sends with its receives.
    """
    if not straddling:
        return []
    device = group.device
    assembled: dict[int, tuple[FlatChunk, torch.Tensor]] = {}
    ops: list[dist.P2POp] = []
    received: list[tuple[torch.Tensor, torch.Tensor]] = []
    for tag, chunk in straddling:
        itemsize = from_zarr_name(records[chunk.key].dtype).itemsize
        if chunk.writer == group.rank:
            buffer = torch.empty(chunk.volume * itemsize, dtype=torch.uint8)
            assembled[tag] = (chunk, buffer)
        for rank, index, lo, hi, at in chunk.pieces:
            if chunk.writer == group.rank:
                target = buffer[at * itemsize : (at + (hi - lo)) * itemsize]
                if rank == group.rank:
                    target.copy_(host[index][lo:hi].view(torch.uint8))
                else:
                    landing = target if device.type == "cpu" else torch.empty_like(target, device=device)
                    ops.append(dist.P2POp(dist.irecv, landing, group.global_rank(rank), group.process_group, tag))
                    if landing is not target:
                        received.append((landing, target))
            elif rank == group.rank:
                piece = host[index][lo:hi].view(torch.uint8).to(device)
                ops.append(dist.P2POp(dist.isend, piece, group.global_rank(chunk.writer), group.process_group, tag))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for landing, target in received:
        target.copy_(landing)
    result = []
    for chunk, buffer in assembled.values():
        dtype = from_zarr_name(records[chunk.key].dtype)
        value = buffer.numpy().view(dtype.numpy_dtype).reshape(_region_shape(chunk.region))
        result.append(WriteOp(chunk.key, chunk.region, value))
    return result


def write_staged(
    staged: StagedSave, io_concurrency: int = DEFAULT_IO_CONCURRENCY, io_threads: int = DEFAULT_IO_THREADS
) -> None:
    """This rank's I/O: metadata files, then every chunk write in flight, then durability.

    What the writers report (each chunk's crc32c) is kept for the commit record.
    """
    where = staged.location.describe()
    with stage("save: write", where) as timing:
        staged.location.write_many(staged.metadata_files)
        staged.written += write_ops(staged.location, staged.records, staged.ops, io_concurrency, io_threads)
        timing.nbytes = sum(op.value.nbytes for op in staged.ops)
    with stage("save: durable", where):
        staged.location.make_durable()


def write_ops(
    location: Location, records: dict[str, ArrayRecord], ops: list[WriteOp], io_concurrency: int,
    io_threads: int = DEFAULT_IO_THREADS,
) -> list[WrittenChunk]:
    """Writes whole chunks of arrays (the plan gives every chunk one writer and one
    write), all in flight at once; returns each chunk's crc32c."""
    store = chunk_store_for(location, io_concurrency, io_threads)
    jobs: list = []
    for op in ops:
        if not op.value.size:
            continue
        record = records[op.key]
        if not is_chunk_aligned(op.region, record.shape, record.chunk_shape):
            raise CheckpointingException(
                f"Internal error: the write of {op.key!r} region {_describe_region(op.region)} is not aligned "
                f"with its chunks {record.chunk_shape}; please report it"
            )
        jobs += write_region(ArrayChunks.of(store, record), op.region, op.value)
    return run_writes(jobs, store.threads)


def _describe_region(region: Region) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in region) + "]"


def finalize_save(staged: StagedSave, error: BaseException | None) -> None:
    """Collective: the coordinator gathers every rank's outcome (its error, or the
    crc32c of each chunk it wrote), binds the chunks into the commit record and commits
    (``shardstore.commit``: a save that lost a race with another save fails here).

    On any failure every rank raises the same error, no commit record is written, and
    the coordinator deletes what the save wrote.
    """
    group, location = staged.group, staged.location
    staged.ops = []  # the host copies are no longer needed
    if staged.snapshot is not None:
        staged.snapshot.release()
    local = RankFailure.from_exception(group.rank, error) if error is not None else staged.written
    gathered = group.gather_object(local)
    what, failures = "Writing", []
    if group.is_coordinator:
        failures = [g for g in gathered if isinstance(g, RankFailure)]
        if not failures:
            try:
                record = bind_chunks(staged.commit_record, gathered, location.describe())
                publish(location, replace(record, files=file_checksums(location, record)))
            except Exception as exc:  # told to every rank below
                what, failures = "Committing", [RankFailure.from_exception(group.rank, exc)]
    what, failures = group.broadcast_object((what, failures))
    if isinstance(location, PendingCheckpoint):
        if failures and group.is_coordinator:
            location.abandon()
        else:
            location.release()
    raise_failures(failures, f"{what} checkpoint {location.describe()}", cause=error)


def bind_chunks(record: CommitRecord, reports: list[list[WrittenChunk]], where: str) -> CommitRecord:
    """The commit record with every chunk's crc32c as its writer reported it.

    Raises:
        CheckpointingException: a chunk nobody wrote, or one written twice.
    """
    crcs: dict[str, dict[tuple[int, ...], int]] = {key: {} for key in record.arrays}
    for rank, chunks in enumerate(reports):
        for key, index, crc in chunks:
            if index in crcs[key]:
                raise CheckpointingException(
                    f"{where}: chunk {record.arrays[key].chunk_key(index)} of array {key!r} was written twice "
                    f"(rank {rank} and another)"
                )
            crcs[key][index] = crc
    arrays = {key: a.with_chunk_crcs(crcs[key], where) for key, a in record.arrays.items()}
    return replace(record, arrays=arrays)


def publish(location: Location, record: CommitRecord) -> None:
    """Writes the commit record: through the save's ``PendingCheckpoint`` (staging
    published by rename, races refused), or in place for a bare location (the seed's
    strategy API called directly)."""
    if isinstance(location, PendingCheckpoint):
        location.commit(replace(record, save_id=location.intent.save_id))
    else:
        write_commit_record(location, replace(record, save_id=new_save_id()))


class ZarrSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Saves ShardedTensors as Zarr v3 arrays (one global array per key).

    Args:
        backend: the name ``metadata.json`` records, ``"shardstore"``.
        version: format version, 1.
        max_chunk_bytes: upper bound on one stored chunk, in bytes.
        io_concurrency: I/O operations in flight at once (TensorStore), capped at
            ``chunk_io.DEFAULT_IO_THREADS`` threads on the direct local path.
        process_group: group of the ranks that save together (default: the world).
        fully_parallel: spread the writing of replicated tensors over their replicas,
            balanced by bytes (``layout.balance_writers``), instead of leaving it all to
            replica 0. Replicas must then hold equal data. Costs nothing without
            replicas; on by default.
        max_staging_bytes: async saves only: the most host memory one rank's snapshot
            may hold; above it the save writes in waves and blocks longer (None: no cap).
        sync_staging_bytes: sync saves of CUDA tensors: the most host memory their
            copies hold at once (CPU tensors are written from their own memory). Pinned
            buffers returned after a save stay for the next one, up to this many bytes.
        background_io_threads: async saves only: threads writing local chunks in the
            background. Few on purpose: every runnable I/O thread takes an equal share of
            a core from the training loop. Measured on 2 cores, each busy with a rank's
            matmul loop, 1 GiB per rank, A/B in one run: 8 threads left the loop 14-54%
            of its rate, 1 thread 51-62%, and the save took about as long.
    """

    def __init__(
        self,
        backend: str = SHARDSTORE_BACKEND,
        version: int = ZARR_VERSION,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        io_concurrency: int = DEFAULT_IO_CONCURRENCY,
        process_group: dist.ProcessGroup | None = None,
        fully_parallel: bool = True,
        max_staging_bytes: int | None = None,
        background_io_threads: int = 1,
        sync_staging_bytes: int = DEFAULT_SYNC_STAGING_BYTES,
    ) -> None:
        super().__init__(backend, version)
        if max_chunk_bytes < 1:
            raise ValueError(f"max_chunk_bytes must be positive, got {max_chunk_bytes}")
        self.max_chunk_bytes = max_chunk_bytes
        self.io_concurrency = io_concurrency
        self.process_group = process_group
        self.fully_parallel = fully_parallel
        self.max_staging_bytes = max_staging_bytes
        self.background_io_threads = background_io_threads
        self.sync_staging_bytes = sync_staging_bytes
        self._buffers = HostBufferPool()  # async snapshots: every buffer kept for the next save
        self._sync_buffers = HostBufferPool(max_free_bytes=sync_staging_bytes)

    def release_buffers(self) -> None:
        """Frees the pinned host buffers kept for the next save's copies."""
        self._buffers.clear()
        self._sync_buffers.clear()

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> AsyncRequest:
        tensors, objects = local_sharded_items(sharded_state_dict)
        plan = gather_and_plan(tensors, objects, Group(self.process_group), self.plan_save)
        return self.async_save_with_plan(sharded_state_dict, checkpoint_dir, plan)

    def plan_save(self, layout: GlobalLayout) -> list[RankSavePlan]:
        """Coordinator: every rank's part of the save (``shardstore.planner``)."""
        return plan_save(layout, self.max_chunk_bytes, self.fully_parallel)

    def async_save_with_plan(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir, plan: RankSavePlan,
        process_group: dist.ProcessGroup | None = None,
    ) -> AsyncRequest:
        """Snapshots the tensors to host memory (the blocking part) and returns the
        request whose ``async_fn`` writes them and whose finalization commits."""
        staging = Staging(True, self.max_staging_bytes, self._buffers, self.io_concurrency, self.background_io_threads)
        return self._request(sharded_state_dict, checkpoint_dir, plan, staging, process_group)

    def save_with_plan(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir, plan: RankSavePlan,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        """Synchronous: writes CPU tensors straight from their memory; CUDA tensors
        stream through pinned buffers, at most ``sync_staging_bytes`` at once, their
        copies overlapping the writes."""
        staging = Staging(False, self.sync_staging_bytes, self._sync_buffers, self.io_concurrency)
        self._request(sharded_state_dict, checkpoint_dir, plan, staging, process_group).execute_sync()

    def _request(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir, plan: RankSavePlan,
        staging: Staging, process_group: dist.ProcessGroup | None,
    ) -> AsyncRequest:
        tensors, _ = local_sharded_items(sharded_state_dict)
        group = Group(process_group if process_group is not None else self.process_group)
        location = open_location(checkpoint_dir)
        limit = location.max_object_bytes
        if limit is not None and self.max_chunk_bytes > limit:
            raise CheckpointingException(
                f"max_chunk_bytes={self.max_chunk_bytes} exceeds the {limit}-byte object limit of "
                f"{location.describe()}; use a smaller bound"
            )
        with stage("save: stage", location.describe()):
            staged = stage_save(tensors, location, plan, group, staging)
        return AsyncRequest(
            async_fn=write_staged,
            async_fn_args=(staged, self.io_concurrency, staging.io_threads),
            finalize_fns=[_finalizer(staged)],
        )


def _finalizer(staged: StagedSave) -> Callable[[BaseException | None], None]:
    def finalize(error: BaseException | None = None) -> None:
        with stage("save: commit", staged.location.describe()):
            finalize_save(staged, error)

    def abort() -> None:
        """Local, no agreement: releases the save's descriptors and lock, so the next
        save into the same place sees a dead save and removes its files (deleting them
        here could race with other ranks still writing)."""
        if isinstance(staged.location, PendingCheckpoint):
            staged.location.release()

    finalize.accepts_async_error = True  # type: ignore[attr-defined]
    finalize.checkpoint = staged.location.describe()  # type: ignore[attr-defined]
    finalize.abort = abort  # type: ignore[attr-defined]
    return finalize


# --------------------------------------------------------------------------- load


@dataclass
class ReadOp:
    """A region to read for one ShardedTensor and how to turn it into its tensor."""

    tensor: ShardedTensor
    region: Region
    finish: Callable[[torch.Tensor], torch.Tensor]


def plan_read(t: ShardedTensor, record: ArrayRecord, where: str) -> ReadOp:
    """Which region of the stored array ``t`` needs, and the post-processing after it.

    A flattened range reads only the rows of its block that it touches.
    """
    if record.shape != t.global_shape and not t.allow_shape_mismatch:
        raise CheckpointingException(
            f"{where}: tensor {t.key!r} is stored with global shape {record.shape}, the state "
            f"dict expects {t.global_shape}; set allow_shape_mismatch=True to load it padded or truncated"
        )
    if len(record.shape) != len(t.global_shape):
        raise CheckpointingException(
            f"{where}: tensor {t.key!r} is stored with {len(record.shape)} dims, expected {len(t.global_shape)}"
        )
    extent = block_shape(t)
    block = region_at(t.global_offset, extent)
    fr = t.flattened_range
    if fr is not None and record.shape == t.global_shape and len(extent) > 0:
        axis = next((a for a, b in enumerate(extent) if b > 1), len(extent) - 1)
        row = math.prod(extent[axis + 1 :])
        first, last = fr.start // row, -(-fr.stop // row)
        region = block[:axis] + (slice(block[axis].start + first, block[axis].start + last),) + block[axis + 1 :]
        skip = fr.start - first * row

        def finish_flat(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(-1)[skip : skip + fr.stop - fr.start]

        return ReadOp(t, region, finish_flat)
    region = tuple(slice(min(s.start, n), min(s.stop, n)) for s, n in zip(block, record.shape))

    def finish(x: torch.Tensor) -> torch.Tensor:
        return postprocess_loaded(x.reshape(_region_shape(region)[t.prepend_axis_num :]), t)

    return ReadOp(t, region, finish)


def load_tensors(
    tensors: list[ShardedTensor], location: Location, record: CommitRecord,
    io_concurrency: int = DEFAULT_IO_CONCURRENCY, allow_lossy_casts: bool = False,
    uploader: DeviceUploader | None = None,
) -> list[torch.Tensor]:
    """Reads every tensor's region, all reads in flight at once; returns them in order.

    Chunks land straight in the result's memory where they can (``chunk_io``); each
    is checked against its own crc32c and the one the commit record binds. A request
    whose ``data`` is a contiguous tensor of the stored dtype and the region's shape
    is filled in place and returned (as DCP loads): no second copy of the rank's state.
    On the CPU the chunks are read into it; on a device they go through ``uploader``'s
    pinned slabs, copied to the device while the next wave is read. On a failed load
    such a tensor may hold part of the checkpoint.
    """
    where = f"checkpoint {location.describe()}"
    missing = sorted({t.key for t in tensors if t.key not in record.arrays})
    if missing:
        raise CheckpointingException(
            f"{where} has no tensor(s) {missing}; pass strict='log_unexpected' (or another "
            "StrictHandling) to skip keys that are not in the checkpoint"
        )
    reads = [plan_read(t, record.arrays[t.key], where) for t in tensors]
    store = chunk_store_for(location, io_concurrency)
    arrays: list[np.ndarray | None] = []  # None: filled in place (the request's tensor is the result)
    jobs: list[ReadJob] = []
    uploads: list[int] = []  # reads into device targets
    targets_seen: set[int] = set()  # tied tensors (one memory, two keys) get their own results
    for n, r in enumerate(reads):
        stored = record.arrays[r.tensor.key]
        dtype, shape = from_zarr_name(stored.dtype), _region_shape(r.region)
        target = _in_place_target(r, dtype.torch_dtype, targets_seen)
        if target is None:
            out = np.empty(shape, dtype.numpy_dtype)
            arrays.append(out)
        else:
            arrays.append(None)
            if _through_host(target):
                uploads.append(n)
                continue
            out = tensor_to_numpy(target).reshape(shape)
        jobs += read_region(ArrayChunks.of(store, stored), r.region, out)
    run_reads(jobs, store.threads)

    def read_wave(pairs: list[tuple[int, torch.Tensor]]) -> None:
        wave_jobs: list[ReadJob] = []
        for i, host in pairs:
            r = reads[uploads[i]]
            out = tensor_to_numpy(host).reshape(_region_shape(r.region))
            wave_jobs += read_region(ArrayChunks.of(store, record.arrays[r.tensor.key]), r.region, out)
        run_reads(wave_jobs, store.threads)

    (uploader or DeviceUploader()).fill([reads[n].tensor.data for n in uploads], read_wave)
    results = []
    for r, array in zip(reads, arrays):
        if array is None:
            results.append(r.tensor.data)
            continue
        stored = record.arrays[r.tensor.key]
        x = numpy_to_tensor(array, from_zarr_name(stored.dtype).torch_dtype)
        results.append(place_loaded(r.finish(x), r.tensor, where, allow_lossy_casts))
    return results


def _through_host(target: torch.Tensor) -> bool:
    """Whether chunks reach ``target`` through host staging (device memory) rather
    than being read into it."""
    return target.device.type != "cpu"


def _claim(data: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...], taken: set[int]) -> bool:
    """Whether a request's ``data`` can be filled in place with a result of ``dtype``
    and ``shape``: a contiguous CPU or CUDA tensor (other devices, meta..., get the
    result moved to them) of exactly that dtype and shape, whose memory no other request
    of this load took (``taken``: data pointers; updated when claimed). Tied tensors
    (one memory, two keys) so get their own results."""
    if (
        data is None or data.device.type not in ("cpu", "cuda") or data.dtype != dtype
        or not data.is_contiguous() or tuple(data.shape) != shape or data.data_ptr() in taken
    ):
        return False
    taken.add(data.data_ptr())
    return True


def _in_place_target(read: ReadOp, stored_dtype: torch.dtype, taken: set[int]) -> torch.Tensor | None:
    """The request's own tensor as the destination of its region, when the read needs
    no conversion (no flattened range, padding or prepended-axis change) and ``_claim``
    gives it."""
    t = read.tensor
    shape = tuple(_region_shape(read.region)[t.prepend_axis_num :])
    if t.flattened_range is not None or not _claim(t.data, stored_dtype, shape, taken):
        return None
    return t.data.detach()


def run_read_plan(
    tensors: list[ShardedTensor], location: Location, record: CommitRecord, plan: RankReadPlan, group: Group,
    io_concurrency: int = DEFAULT_IO_CONCURRENCY, allow_lossy_casts: bool = False,
    local_error: BaseException | None = None, uploader: DeviceUploader | None = None,
) -> list[torch.Tensor]:
    """Collective: this rank's part of a load (``planner.plan_reads``): its reads, an
    agreement (a failed read, or ``local_error``, raises on every rank before any
    exchange), then the exchange of blocks that other ranks read for it."""
    out: dict[int, torch.Tensor] = {}
    error = local_error
    if error is None:
        try:
            loaded = load_tensors(
                [tensors[i] for i in plan.reads], location, record, io_concurrency, allow_lossy_casts, uploader
            )
            out = dict(zip(plan.reads, loaded))
        except Exception as exc:  # reported on every rank by agree(), before any exchange
            error = exc
    group.agree(error, f"Reading checkpoint {location.describe()}")
    taken = {x.data_ptr() for i, x in out.items() if x is tensors[i].data}  # filled in place already
    for index, source in plan.copies:  # one block asked for twice: read once, copied
        out[index] = _receive_target(tensors[index], taken)
        out[index].copy_(out[source].reshape(out[index].shape))
    sends = {peer: [out[i] for i in indices] for peer, indices in plan.sends}
    receives: dict[int, list[torch.Tensor]] = {}
    for peer, indices in plan.receives:
        for i in indices:
            out[i] = _receive_target(tensors[i], taken)
        receives[peer] = [out[i].detach() for i in indices]
    group.exchange(sends, receives)
    return [out[i] for i in range(len(tensors))]


def _receive_target(t: ShardedTensor, taken: set[int]) -> torch.Tensor:
    """Where a block read for another request lands for ``t`` (by another rank, or by
    this one for the same block asked for twice): the request's own tensor when
    ``_claim`` gives it, as reads fill it; else a new tensor on its device."""
    shape = _result_shape(t)
    if _claim(t.data, t.dtype, shape, taken):
        return t.data
    return torch.empty(shape, dtype=t.dtype, device=t.data.device if t.data is not None else "cpu")


def _result_shape(t: ShardedTensor) -> tuple[int, ...]:
    """The shape of the tensor a load returns for ``t``."""
    if t.flattened_range is not None:
        return (t.flattened_range.stop - t.flattened_range.start,)
    return tuple(t.local_shape)


class ZarrLoadShardedStrategy(LoadShardedStrategy):
    """Loads ShardedTensors from a shardstore Zarr v3 checkpoint, under any layout.

    Args:
        io_concurrency: TensorStore I/O operations in flight at once.
        fully_parallel: blocks requested by several ranks (replicas) are read once and
            exchanged over the process group (``planner.plan_reads``, ``run_read_plan``).
            Collective: every rank of the group must call ``load``. On by default; the
            plan is made once either way (one gather and one scatter of the request
            metadata).
        process_group: the ranks that load together (default: the world).
        allow_lossy_casts: convert to the requested dtype even where that can change
            values (float32 -> int64, -> float16, -> bool). Off: such a load raises,
            naming the key; exact conversions (float16 -> float32, ...) always pass.
        load_staging_bytes: the most pinned host memory a load into CUDA tensors holds
            (two slabs of half of it, freed when the load returns).
    """

    def __init__(
        self, io_concurrency: int = DEFAULT_IO_CONCURRENCY, fully_parallel: bool = True,
        process_group: dist.ProcessGroup | None = None, allow_lossy_casts: bool = False,
        load_staging_bytes: int = DEFAULT_LOAD_STAGING_BYTES,
    ) -> None:
        self.io_concurrency = io_concurrency
        self.fully_parallel = fully_parallel
        self.allow_lossy_casts = allow_lossy_casts
        self.process_group = process_group
        self._uploader = DeviceUploader(load_staging_bytes)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> StateDict:
        location = open_location(checkpoint_dir)
        record = read_commit_record(location)
        return self.load_with_record(sharded_state_dict, location, record)

    def load_with_record(
        self, sharded_state_dict: ShardedStateDict, location: Location, record: CommitRecord,
        process_group: dist.ProcessGroup | Group | None = None,
    ) -> StateDict:
        """Like ``load`` with a commit record the caller already read (and on the
        caller's process group or ``Group`` when given): plans once (``plan_load``,
        without the strict-handling and integrity checks of ``serialization.load``),
        then ``load_with_plan``."""
        if isinstance(process_group, Group):
            group = process_group
        else:
            group = Group(process_group if process_group is not None else self.process_group)
        tensors, _ = local_sharded_items(sharded_state_dict)
        plan = gather_and_plan(tensors, [], group, self.plan_load, place=location.describe(), validate=False)
        return self.load_with_plan(sharded_state_dict, location, record, plan, group)

    def plan_load(self, layout: GlobalLayout) -> list[RankReadPlan]:
        """Coordinator: who reads which requested block (``planner.plan_reads``)."""
        return plan_reads(layout, self.fully_parallel)

    def load_with_plan(
        self, sharded_state_dict: ShardedStateDict, location: Location, record: CommitRecord, plan: RankReadPlan,
        group: Group, local_error: BaseException | None = None,
    ) -> StateDict:
        """Collective: reads this rank's part (``run_read_plan``) and puts the tensors in
        place of the request's ShardedTensors. A read that fails on one rank raises the
        same error, naming the checkpoint, key and chunk, on every rank."""
        tensors, _ = local_sharded_items(sharded_state_dict)
        results = iter(run_read_plan(
            tensors, location, record, plan, group, self.io_concurrency, self.allow_lossy_casts, local_error,
            self._uploader,
        ))
        return dict_list_map_inplace(
            lambda x: next(results) if isinstance(x, ShardedTensor) else x, sharded_state_dict
        )

    def load_tensors_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        record = read_commit_record(open_location(checkpoint_dir))
        return {key: tensor_metadata(a) for key, a in record.arrays.items()}

    def load_sharded_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        return self.load_tensors_metadata(checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: CheckpointDir, key_prefix: str) -> None:
        """Removes the arrays whose key starts with ``key_prefix`` (call on one process).

        The commit record is rewritten first, so a crash midway leaves a consistent
        checkpoint with some unreferenced files, never a record naming missing arrays.
        """
        location = open_location(checkpoint_dir)
        record = read_commit_record(location)
        removed = [k for k in record.arrays if k.startswith(key_prefix)]
        kept = {k: a for k, a in record.arrays.items() if k not in removed}
        write_commit_record(location, replace(record, arrays=kept))
        for key in removed:
            location.remove_tree(key)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend not in READABLE_BACKENDS:
            raise CheckpointingException(
                f"{self.__class__.__name__} reads backends {list(READABLE_BACKENDS)}, the checkpoint has "
                f"{loaded_backend!r}"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != ZARR_VERSION:
            raise CheckpointingException(
                f"{self.__class__.__name__} reads format version {ZARR_VERSION}, the checkpoint has "
                f"{loaded_version}; upgrade shardstore"
            )

    def __str__(self) -> str:
        return self.__class__.__name__


def tensor_metadata(record: ArrayRecord) -> ShardedTensor:
    """A data-less ShardedTensor covering the whole stored array (one shard)."""
    dtype = from_zarr_name(record.dtype).torch_dtype
    meta = torch.empty(record.shape, dtype=dtype, device="meta")
    return ShardedTensor.from_rank_offsets(record.key, meta).without_data()


def register_default_zarr_strategies() -> None:
    """Registers the strategies as defaults for backends ``shardstore`` and ``zarr``
    (an alias), version 1."""
    for backend in READABLE_BACKENDS:
        register_default_strategy(StrategyAction.LOAD_SHARDED, backend, ZARR_VERSION, ZarrLoadShardedStrategy())
        register_default_strategy(StrategyAction.SAVE_SHARDED, backend, ZARR_VERSION, ZarrSaveShardedStrategy())


# ------------------------------------------------- Megatron-Core zarr module API
# Single-tensor building blocks with the seed's names, on the same format and specs.


def single_tensor_record(t: ShardedTensor, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> ArrayRecord:
    """Array metadata derived from one tensor: chunks follow its own block shape."""
    shard = ShardRecord.from_sharded_tensor(t, 0, 0)
    chunk = chunk_shape_for([shard], tuple(t.global_shape), from_torch(t.dtype).itemsize, max_chunk_bytes)
    return ArrayRecord(t.key, tuple(t.global_shape), from_torch(t.dtype).zarr_name, chunk)


def _should_create_array(ten: ShardedTensor) -> bool:
    """The main replica holding the first element creates the array."""
    return (
        is_main_replica(ten.replica_id)
        and not any(ten.global_offset)
        and (ten.flattened_range is None or ten.flattened_range.start == 0)
    )


def _create_zarr_array(sharded_tensor: ShardedTensor, checkpoint_dir: CheckpointDir | Location) -> ts.TensorStore:
    """Creates the array of ``sharded_tensor``'s key (writes its ``zarr.json``)."""
    location = open_location(checkpoint_dir)
    record = single_tensor_record(sharded_tensor)
    location.write_bytes(f"{record.key}/{ZARR_JSON}", json.dumps(record.zarr_metadata()).encode())
    return open_arrays(location, [record], tensorstore_context(location), for_write=True)[record.key]


def _create_or_open_zarr_arrays(
    sharded_tensors: list[ShardedTensor], checkpoint_dir: CheckpointDir | Location
) -> list[ts.TensorStore | None]:
    """Arrays for the given tensors: created by the first chunk's main replica, opened
    (from storage) by other main replicas, None for non-main replicas.

    The arrays created here must exist before others open them (a barrier in between
    when several ranks take part).
    """
    arrays: list[ts.TensorStore | None] = [
        _create_zarr_array(t, checkpoint_dir) if _should_create_array(t) else None for t in sharded_tensors
    ]
    location = open_location(checkpoint_dir)
    for i, t in enumerate(sharded_tensors):
        if arrays[i] is None and is_main_replica(t.replica_id):
            arrays[i] = _open_zarr_array_verbose(location.describe(t.key), "r+")
    return arrays


def _save_to_existing_array(sharded_tensor: ShardedTensor, arr: ts.TensorStore | None) -> None:
    """Writes a non-flat tensor's data into its region of ``arr`` (no-op for None)."""
    if arr is None:
        return
    if sharded_tensor.flattened_range is not None:
        raise CheckpointingException(
            f"{sharded_tensor.key!r}: flattened ranges need the cross-rank chunk exchange; "
            "save them with ZarrSaveShardedStrategy"
        )
    extent = block_shape(sharded_tensor)
    value = tensor_to_numpy(to_host(sharded_tensor.data)).reshape(extent)
    arr[_ts_index(region_at(sharded_tensor.global_offset, extent))].write(value).result()


def _open_zarr_array_verbose(path: str | Path, mode: str, **open_kwargs: Any) -> ts.TensorStore:
    """Opens the array stored at ``path`` (reads its ``zarr.json``), with a clear error."""
    location = open_location(Path(path).parent)
    spec = {"driver": "zarr3", "kvstore": location.kvstore_spec(Path(path).name)}
    options = {"read": True, "write": mode != "r", **open_kwargs}
    try:
        return ts.open(spec, open=True, **options).result()
    except Exception as exc:
        raise CheckpointingException(f"Cannot open Zarr array at {path} (mode {mode!r}): {exc}") from exc


def _load_from_array(sharded_tensor: ShardedTensor, checkpoint_dir: CheckpointDir | Location) -> torch.Tensor:
    """Loads one tensor from its array (reads the array's own ``zarr.json``)."""
    location = open_location(checkpoint_dir)
    arr = _open_zarr_array_verbose(location.describe(sharded_tensor.key), "r")
    stored = ArrayRecord(
        sharded_tensor.key, tuple(arr.shape), str(arr.dtype.name), tuple(arr.chunk_layout.read_chunk.shape)
    )
    op = plan_read(sharded_tensor, stored, f"checkpoint {location.describe()}")
    array = arr[_ts_index(op.region)].read().result()
    return place_loaded(op.finish(numpy_to_tensor(array, from_zarr_name(stored.dtype).torch_dtype)), sharded_tensor,
                        f"checkpoint {location.describe()}")


def postprocess_numpy_array(
    loaded_array: np.ndarray, sharded_tensor: ShardedTensor, apply_flattened_range: bool = True
) -> torch.Tensor:
    """Turns a loaded numpy array into the tensor ``sharded_tensor`` asks for (no copy
    when no padding or cast is needed)."""
    x = numpy_to_tensor(np.ascontiguousarray(loaded_array), _torch_dtype_of(loaded_array.dtype))
    x = x.reshape(x.shape[sharded_tensor.prepend_axis_num :]) if x.ndim > len(sharded_tensor.local_shape) else x
    return postprocess_loaded(x, sharded_tensor, apply_flattened_range)


def _torch_dtype_of(dtype: np.dtype) -> torch.dtype:
    for known_numpy, known_torch in numpy_to_torch_dtype_dict.items():
        if known_numpy == dtype:
            return known_torch
    raise CheckpointingException(f"numpy dtype {dtype} has no torch equivalent")


def load_zarr_based_sharded_metadata(
    checkpoint_dir: CheckpointDir | Location,
    get_shape_dtype_fn: Callable[[str], tuple[tuple[int, ...], np.dtype]],
) -> ShardedStateDict:
    """Data-less ShardedTensors for every array of the checkpoint.

    Args:
        checkpoint_dir: checkpoint root
        get_shape_dtype_fn: returns ``(shape, numpy dtype)`` for an array's path
    """
    location = open_location(checkpoint_dir)
    record = read_commit_record(location)
    sharded = {}
    for key in record.arrays:
        shape, dtype = get_shape_dtype_fn(location.describe(key))
        meta = torch.empty(tuple(shape), dtype=_torch_dtype_of(np.dtype(dtype)), device="meta")
        sharded[key] = ShardedTensor.from_rank_offsets(key, meta).without_data()
    return sharded
