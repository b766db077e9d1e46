"""The storage core's strategies: ShardedTensors as Zarr v3 arrays (one GLOBAL array per key).

``ZarrSaveShardedStrategy`` and ``ZarrLoadShardedStrategy`` plan once on the coordinator
(``shardstore.protocol.plan_stage``, ``shardstore.planning.plans``) and run each rank's part: a save's
stages in ``shardstore.execution.save`` (stage, write, agree, commit), a load's in
``shardstore.execution.load`` (read, agree, exchange). Load: one read of the commit
record gives every array's metadata; the coordinator plans who reads what
(``plan_load``, ``planning.plans.plan_reads``). With ``fully_parallel`` (default), replicated
blocks are written by their replicas in turn (``planning.layout.balance_writers``), and a block
that several ranks request is read by one and sent to the others.

The module functions named after Megatron-Core's zarr strategy (``_create_zarr_array``,
``_load_from_array``, ...) work on single tensors, for callers of that API, through
TensorStore (``array_spec``: arrays opened from the record without reading any
``zarr.json``).
"""

from __future__ import annotations

__all__ = [
    "AUTO_SHARD_MIN_RANKS", "DEFAULT_MAX_CHUNK_BYTES", "DEFAULT_SHARD_BYTES", "DEFAULT_SYNC_STAGING_BYTES",
    "SHARDSTORE_BACKEND", "ShardBytes",
    "ZARR_VERSION", "ZarrLoadShardedStrategy", "ZarrSaveShardedStrategy", "checked_max_chunk_bytes",
    "checked_shard_bytes", "checked_staging_bytes",
    "resolve_shard_bytes", "_create_or_open_zarr_arrays", "_create_zarr_array",
    "_load_from_array", "_open_zarr_array_verbose", "_save_to_existing_array",
    "_should_create_array", "array_spec", "consolidated_document", "flatten_range", "load_zarr_based_sharded_metadata",
    "numpy_to_torch_dtype_dict", "pad_to_expected_shape", "postprocess_numpy_array",
    "register_default_zarr_strategies", "single_tensor_record", "tensorstore_context",
    "torch_to_numpy_dtype_dict", "whole_tensor_metadata",
]

import functools
import json
import logging
import math
import numbers
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import tensorstore as ts
import torch
import torch.distributed as dist

from shardstore._zarr_autoload import EXTENSION_METADATA
from shardstore.errors import CheckpointingException
from shardstore.execution.load import load_tensors, plan_read, run_read_plan
from shardstore.execution.loaded import (  # flatten_range, pad_to_expected_shape: Megatron-Core's names here
    flatten_range,  # noqa: F401
    pad_to_expected_shape,  # noqa: F401
    place_loaded,
    postprocess_loaded,
)
from shardstore.execution.pipeline import SavePipeline
from shardstore.execution.save import Staging
from shardstore.execution.staging import (
    DEFAULT_LOAD_STAGING_BYTES,
    DeviceUploader,
    HostBufferPool,
    to_host,
)
from shardstore.format.chunks import DEFAULT_IO_CONCURRENCY
from shardstore.format.consolidated import ZarrMetadata
from shardstore.format.dtypes import (
    from_torch,
    from_zarr_name,
    numpy_to_tensor,
    numpy_to_torch_dtype_dict,  # noqa: F401  (seed API)
    tensor_to_numpy,
    torch_to_numpy_dtype_dict,  # noqa: F401  (seed API)
)
from shardstore.format.pack_listing import PACKED_ARRAYS_ATTRIBUTE
from shardstore.format.records import (
    MAX_RECORD_BYTES,
    ZARR_JSON,
    ArrayRecord,
    CommitRecord,
    is_committed,
    sharded_backend,
)
from shardstore.format.removal import remove_entries
from shardstore.format.storage_layout import (
    AUTO,
    AUTO_SHARD_MIN_RANKS,
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_SHARD_BYTES,
    LayoutSite,
    StorageLayout,
)
from shardstore.mapping import ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from shardstore.opened import bare_location, open_read, write_location
from shardstore.planning.layout import (
    GlobalLayout,
    Region,
    ShardRecord,
    block_shape,
    chunk_shape_for,
    region_at,
)
from shardstore.planning.plans import (
    RankReadPlan,
    RankSavePlan,
    largest_shard_bytes,
    plan_reads,
    plan_save,
    stored_at_most,
)
from shardstore.protocol.collectives import Group
from shardstore.protocol.plan_cache import PlanCache
from shardstore.protocol.plan_stage import gather_and_plan
from shardstore.stores.base import Location, kvstore_spec, usable_cpus
from shardstore.strategies.async_utils import AsyncRequest
from shardstore.strategies.base import (
    AsyncSaveShardedStrategy,
    CheckpointDir,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from shardstore.utils import local_sharded_items, sharded_tensor_slots

logger = logging.getLogger(__name__)

# What metadata.json names as the sharded backend. Megatron-Core's own zarr backend is
# ("zarr", 1): a shardstore checkpoint must not claim it, or Megatron would open ours
# with its reader and get nothing. "zarr" stays registered as an alias, so code asking
# for the default "zarr" strategy gets shardstore's.
SHARDSTORE_BACKEND = "shardstore"
ZARR_BACKEND = "zarr"
READABLE_BACKENDS = (SHARDSTORE_BACKEND, ZARR_BACKEND)  # "zarr": checkpoints of shardstore <= 0.1
ZARR_VERSION = 1
# Host memory a sync save of CUDA tensors copies through at once (pinned buffers).
DEFAULT_SYNC_STAGING_BYTES = 2 * 2**30
# What ``shard_bytes`` takes: "auto" (the default), None (never shard) or a size in bytes.
ShardBytes = int | Literal["auto"] | None


# --------------------------------------------------------------------------- specs


def tensorstore_context(location: Location, io_concurrency: int = DEFAULT_IO_CONCURRENCY) -> ts.Context:
    """One context per save or load: no chunk cache (data passes through once)."""
    return ts.Context(
        {
            "cache_pool": {"total_bytes_limit": 0},
            "data_copy_concurrency": {"limit": usable_cpus()},
            "file_io_concurrency": {"limit": io_concurrency},
            **location.store.chunk_access().context,
        }
    )


def array_spec(location: Location, record: ArrayRecord, for_write: bool) -> dict[str, Any]:
    """TensorStore spec that opens ``record``'s array without reading its ``zarr.json``.

    Writes store chunks even when they equal the fill value, and reads refuse missing
    chunks, so a lost chunk is an error instead of silent zeros.
    """
    spec: dict[str, Any] = {
        "driver": "zarr3",
        "kvstore": kvstore_spec(location, record.key),
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


def _ts_index(region: Region) -> tuple[slice, ...]:
    return tuple(slice(s.start, s.stop) for s in region)


# --------------------------------------------------------------------------- shard size


def checked_shard_bytes(shard_bytes: object) -> ShardBytes:
    """``shard_bytes`` as ``ZarrSaveShardedStrategy`` takes it: ``"auto"``, None or a
    positive integer (bytes), as ``StorageLayout`` checks it.

    Raises:
        ValueError: anything else, naming the value and what is accepted.
    """
    return StorageLayout(shard_bytes=shard_bytes).shard_bytes  # type: ignore[arg-type]


def checked_max_chunk_bytes(max_chunk_bytes: object) -> int:
    """``max_chunk_bytes`` as a save takes it: a positive number of bytes of at most
    ``MAX_CHUNK_BYTES`` (``StorageLayout``'s check).

    Raises:
        ValueError: anything else, naming the option, the value and what is accepted.
    """
    value = checked_staging_bytes("max_chunk_bytes", max_chunk_bytes)
    return int(StorageLayout(max_chunk_bytes=value).max_chunk_bytes)


def checked_staging_bytes(name: str, value: object, optional: bool = False) -> int | None:
    """A host memory bound (``max_staging_bytes``, ``sync_staging_bytes``,
    ``load_staging_bytes``) or another size option (``max_chunk_bytes``): a positive,
    finite number of bytes, as an int (None where ``optional``).
    Checked when the strategy or writer is made: every rank's bound cuts the save's
    exchange into waves, so a value that fails only later fails one rank alone (and a
    load's ``load_staging_bytes`` would fail only in a load into device tensors).

    Raises:
        ValueError: anything else, naming the option and the value.
    """
    if value is None and optional:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 1:
        return int(value)
    accepted = "None (no bound) or " if optional else ""
    raise ValueError(f"{name} must be {accepted}a positive, finite number of bytes, got {value!r}")


def resolve_shard_bytes(shard_bytes: ShardBytes, world_size: int) -> int | None:
    """The shard size a save from ``world_size`` ranks uses (None: no array sharded), as
    ``StorageLayout.chosen_for`` chooses it."""
    return StorageLayout(shard_bytes=shard_bytes).chosen_for(LayoutSite(world_size)).shard_bytes  # type: ignore[return-value]


class ZarrSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Saves ShardedTensors as Zarr v3 arrays (one global array per key). Each option at
    length: docs/guide/saving-and-loading.md ("Options of a save", "Many ranks: plan
    once", "Fewer files: sharded arrays") and docs/guide/async.md.

    Args:
        backend: the name ``metadata.json`` records, ``"shardstore"``.
        version: its version, 1.
        max_chunk_bytes: upper bound on one stored chunk, in bytes.
        io_concurrency: I/O operations in flight at once per rank.
        process_group: group of the ranks that save together (default: the world).
        fully_parallel: spread the writing of replicated tensors over their replicas,
            balanced by bytes (replicas must hold equal data); on by default.
        max_staging_bytes: async saves: the most host memory a rank's snapshot holds
            (above it the save writes in waves); every rank passes the same.
        sync_staging_bytes: sync saves: the most host memory copies of CUDA tensors
            (and of tensors whose memory is out of order) hold at once.
        background_io_threads: async saves: threads writing local chunks in the
            background (few on purpose: each takes a share of a core from training).
        cache_plan: reuse the last save's plan while every rank's structure is
            unchanged (``protocol.plan_cache``).
        shard_bytes: store arrays of small blocks in Zarr v3 shards of about this many
            bytes, gathered to one writer each; ``"auto"`` (default): 64 MiB from 32
            ranks, else never; None: never; a number: always (feature
            ``sharding_indexed``).

    Raises:
        ValueError: ``max_chunk_bytes`` not positive; ``shard_bytes`` neither
            ``"auto"``, None nor a positive integer; either allowing chunks or shards
            larger than readers accept (``MAX_CHUNK_BYTES``, 16 GiB of data).
    """

    def __init__(
        self,
        backend: str = SHARDSTORE_BACKEND,
        version: int = ZARR_VERSION,
        max_chunk_bytes: int | Literal["auto"] = AUTO,
        io_concurrency: int = DEFAULT_IO_CONCURRENCY,
        process_group: dist.ProcessGroup | None = None,
        fully_parallel: bool = True,
        max_staging_bytes: int | None = None,
        background_io_threads: int = 1,
        sync_staging_bytes: int = DEFAULT_SYNC_STAGING_BYTES,
        cache_plan: bool = False,
        shard_bytes: ShardBytes = AUTO,
        layout: StorageLayout | None = None,
    ) -> None:
        super().__init__(backend, version)
        if max_chunk_bytes != AUTO:
            max_chunk_bytes = checked_max_chunk_bytes(max_chunk_bytes)
        self.layout = StorageLayout.of(layout, max_chunk_bytes=max_chunk_bytes, shard_bytes=shard_bytes)
        self.io_concurrency = io_concurrency
        self.process_group = process_group
        self.fully_parallel = fully_parallel
        self.max_staging_bytes = checked_staging_bytes("max_staging_bytes", max_staging_bytes, optional=True)
        self.background_io_threads = background_io_threads
        self.sync_staging_bytes = checked_staging_bytes("sync_staging_bytes", sync_staging_bytes)
        # async snapshots: buffers kept for the next save, within the cap when there is one
        self._buffers = HostBufferPool(max_free_bytes=self.max_staging_bytes)
        self._sync_buffers = HostBufferPool(max_free_bytes=self.sync_staging_bytes)
        self._plan_cache: PlanCache | None = None
        self.cache_plan = cache_plan

    @property
    def shard_bytes(self) -> ShardBytes:
        """``layout.shard_bytes`` as given (``"auto"``, None or bytes)."""
        return self.layout.shard_bytes

    @shard_bytes.setter
    def shard_bytes(self, value: ShardBytes) -> None:
        self.layout = replace(self.layout, shard_bytes=value)

    @property
    def max_chunk_bytes(self) -> int:
        """``layout.max_chunk_bytes``, ``DEFAULT_MAX_CHUNK_BYTES`` where left to choose."""
        chosen = self.layout.max_chunk_bytes
        return DEFAULT_MAX_CHUNK_BYTES if chosen == AUTO else int(chosen)

    @max_chunk_bytes.setter
    def max_chunk_bytes(self, value: int) -> None:
        self.layout = replace(self.layout, max_chunk_bytes=checked_max_chunk_bytes(value))

    @property
    def cache_plan(self) -> bool:
        """Whether saves reuse the last plan while the structure is unchanged."""
        return self._plan_cache is not None

    @cache_plan.setter
    def cache_plan(self, enabled: bool) -> None:
        if not enabled:
            self._plan_cache = None
        elif self._plan_cache is None:
            self._plan_cache = PlanCache()

    @property
    def plan_cache(self) -> PlanCache | None:
        """The cached plan (None without ``cache_plan``), keyed also by the settings
        the plan depends on, as they are now."""
        if self._plan_cache is not None:  # "auto" as given: the cache's key holds the world size it resolves by
            self._plan_cache.settings = (self.fully_parallel, self.layout)
        return self._plan_cache

    def release_buffers(self) -> None:
        """Frees the pinned host buffers kept for the next save's copies."""
        self._buffers.clear()
        self._sync_buffers.clear()

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> AsyncRequest:
        """Collective: plans once (``protocol.plan_stage.gather_and_plan``: the global sharding, and
        every key against the target's name limits, are checked before anything is
        written), then ``async_save_into`` the directory as the caller made it
        (``into_callers_directory``)."""
        pipeline = self.into_callers_directory(checkpoint_dir)
        return self.async_save_into(sharded_state_dict, pipeline, self.plan_into(sharded_state_dict, pipeline))

    def into_callers_directory(
        self, checkpoint_dir: CheckpointDir, process_group: dist.ProcessGroup | None = None
    ) -> SavePipeline:
        """The save into a directory the caller made and wrote into (the seed's
        signatures; Megatron-Core's ``save``), on ``process_group`` or else this
        strategy's (``SavePipeline.into_callers_directory``)."""
        return SavePipeline.into_callers_directory(checkpoint_dir, self._group(process_group), self.layout)

    def plan_into(self, sharded_state_dict: ShardedStateDict, pipeline: SavePipeline) -> RankSavePlan:
        """Collective: this rank's part of the plan of saving ``sharded_state_dict``
        through ``pipeline`` (``SavePipeline.plan`` with ``plan_save`` and this strategy's
        plan cache), the save begun and joined."""
        tensors, objects = local_sharded_items(sharded_state_dict)
        return pipeline.plan(tensors, objects, self.plan_save, plan_cache=self.plan_cache)

    def plan_save(self, layout: GlobalLayout, storage: StorageLayout | None = None) -> list[RankSavePlan]:
        """Coordinator: every rank's part of the save (``shardstore.planning.plans``) by
        ``storage``, the save's chosen layout (``SavePipeline`` passes it; its
        ``pack_arrays_up_to`` gathers small arrays split over ranks whole, for packing);
        without it, by this strategy's layout chosen for the world size, packing none."""
        if storage is None:
            unpacked = self.layout.combined(StorageLayout(pack_arrays_up_to=0)) if self.layout.pack_arrays_up_to == AUTO \
                else self.layout
            storage = unpacked.chosen_for(LayoutSite(layout.world_size))
        return plan_save(layout, int(storage.max_chunk_bytes), self.fully_parallel, storage.shard_bytes,  # type: ignore[arg-type]
                         int(storage.pack_arrays_up_to), storage.read_grain)  # type: ignore[arg-type]

    def async_save_with_plan(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir, plan: RankSavePlan,
        process_group: dist.ProcessGroup | None = None, local_error: BaseException | None = None,
    ) -> AsyncRequest:
        """``async_save_into`` a directory the caller made (the seed's signature, as
        Megatron-Core's ``save`` calls it): ``into_callers_directory``."""
        pipeline = self.into_callers_directory(checkpoint_dir, process_group)
        return self.async_save_into(sharded_state_dict, pipeline, plan, local_error)

    def save_with_plan(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir, plan: RankSavePlan,
        process_group: dist.ProcessGroup | None = None, local_error: BaseException | None = None,
    ) -> None:
        """``save_into`` a directory the caller made (as ``async_save_with_plan``)."""
        self.save_into(sharded_state_dict, self.into_callers_directory(checkpoint_dir, process_group), plan, local_error)

    def async_save_into(
        self, sharded_state_dict: ShardedStateDict, pipeline: SavePipeline, plan: RankSavePlan,
        local_error: BaseException | None = None,
    ) -> AsyncRequest:
        """Snapshots the tensors to host memory (the blocking part) and returns the
        request whose ``async_fn`` writes them into ``pipeline``'s save and whose
        finalization commits. ``local_error``: this rank's failure in the step before,
        agreed in the staging stage (``execution.save.stage_save``)."""
        staging = Staging(True, self.max_staging_bytes, self._buffers, self.io_concurrency, self.background_io_threads)
        return self._request(sharded_state_dict, pipeline, plan, staging, local_error)

    def save_into(
        self, sharded_state_dict: ShardedStateDict, pipeline: SavePipeline, plan: RankSavePlan,
        local_error: BaseException | None = None,
    ) -> None:
        """Synchronous: writes CPU tensors straight from their memory; CUDA tensors
        stream through pinned buffers, at most ``sync_staging_bytes`` at once, their
        copies overlapping the writes."""
        staging = Staging(False, self.sync_staging_bytes, self._sync_buffers, self.io_concurrency)
        self._request(sharded_state_dict, pipeline, plan, staging, local_error).execute_sync()

    def object_bounds(self, world_size: int) -> dict[str, tuple[int | None, int | None]]:
        """By option name, its value in a save from ``world_size`` ranks and the largest
        stored object it allows (a chunk and its crc32c, or a shard inside a block and its
        index: ``stored_at_most``; a gathered shard: ``largest_shard_bytes``), as
        ``SavePipeline.refuse_oversized_objects`` takes them."""
        shard_bytes = resolve_shard_bytes(self.shard_bytes, world_size)  # the strategy's, as chosen for the world
        return {"max_chunk_bytes": (self.max_chunk_bytes, stored_at_most(self.max_chunk_bytes)),
                "shard_bytes": (shard_bytes, None if shard_bytes is None else largest_shard_bytes(shard_bytes))}

    def _group(self, process_group: dist.ProcessGroup | None) -> Group:
        return Group(process_group if process_group is not None else self.process_group)

    def _request(
        self, sharded_state_dict: ShardedStateDict, pipeline: SavePipeline, plan: RankSavePlan, staging: Staging,
        local_error: BaseException | None = None,
    ) -> AsyncRequest:
        tensors = pipeline.planned_tensors
        if tensors is None:  # a plan made elsewhere (the seed's save_with_plan): its tensors, in its order
            tensors, _ = local_sharded_items(sharded_state_dict)
        pipeline.refuse_oversized_objects(self.object_bounds(pipeline.group.world_size))
        pipeline.stage(tensors, plan, staging, local_error)
        return AsyncRequest(
            async_fn=SavePipeline.write_staged,
            async_fn_args=(pipeline, self.io_concurrency, staging.io_threads),
            finalize_fns=[pipeline.finalization()],
        )


class ZarrLoadShardedStrategy(LoadShardedStrategy):
    """Loads ShardedTensors from a shardstore Zarr v3 checkpoint, under any layout.

    Args:
        io_concurrency: TensorStore I/O operations in flight at once.
        fully_parallel: blocks requested by several ranks (replicas) are read once and
            exchanged over the process group (``planning.plans.plan_reads``, ``run_read_plan``).
            Collective: every rank of the group must call ``load``. On by default; the
            plan is made once either way (one gather and one scatter of the request
            metadata).
        process_group: the ranks that load together (default: the world).
        allow_lossy_casts: convert to the requested dtype even where that can change
            values (float32 -> int64, -> float16, -> bool). Off: such a load raises,
            naming the key; exact conversions (float16 -> float32, ...) always pass.
        load_staging_bytes: the most pinned host memory a load into CUDA tensors holds
            (two slabs of half of it, freed when the load returns): a positive, finite
            number of bytes.
        read_shards_once: with ``fully_parallel``, each shard of a sharded array, and
            each chunk of an unsharded one, is read by one of the ranks that ask for
            part of it, which sends the others their blocks
            (``planning.plans.plan_reads``), so it is fetched once, not once per rank
            (a whole-tensor checkpoint of a data-parallel or TP 1 job, loaded with
            FSDP2 or TP 8: each chunk once, not by every rank that needs some of its
            rows or columns): ``True``, ``False``, or ``"auto"`` (default): from
            ``AUTO_SHARD_MIN_RANKS`` (32) ranks on, where sharded saves start. A reader
            holds at most ``planning.plans.MAX_FORWARDED_BYTES`` of blocks for others.

    Raises:
        ValueError: ``load_staging_bytes`` not a positive, finite number of bytes;
            ``read_shards_once`` neither True, False nor ``"auto"``.
    """

    def __init__(
        self, io_concurrency: int = DEFAULT_IO_CONCURRENCY, fully_parallel: bool = True,
        process_group: dist.ProcessGroup | None = None, allow_lossy_casts: bool = False,
        load_staging_bytes: int = DEFAULT_LOAD_STAGING_BYTES, read_shards_once: bool | Literal["auto"] = "auto",
    ) -> None:
        if read_shards_once not in (True, False, "auto"):
            raise ValueError(f"read_shards_once must be True, False or 'auto', got {read_shards_once!r}")
        self.io_concurrency = io_concurrency
        self.fully_parallel = fully_parallel
        self.allow_lossy_casts = allow_lossy_casts
        self.process_group = process_group
        self.read_shards_once = read_shards_once
        self._uploader = DeviceUploader(checked_staging_bytes("load_staging_bytes", load_staging_bytes))

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> StateDict:
        opened = open_read(checkpoint_dir)
        return self.load_with_record(sharded_state_dict, opened.location, opened.require_record())

    def load_with_record(
        self, sharded_state_dict: ShardedStateDict, location: Location, record: CommitRecord,
        process_group: dist.ProcessGroup | Group | None = None, local_error: BaseException | None = None,
    ) -> StateDict:
        """Like ``load`` with a commit record the caller already read (and on the
        caller's process group or ``Group`` when given): plans once (``plan_load``,
        without the strict-handling and integrity checks of ``serialization.load``),
        then ``load_with_plan``. ``local_error``: this rank's failure in preparing its
        request, raised on every rank by the plan's gather (a collective: every rank
        still calls)."""
        if isinstance(process_group, Group):
            group = process_group
        else:
            group = Group(process_group if process_group is not None else self.process_group)
        tensors, _ = local_sharded_items(sharded_state_dict)
        plan = gather_and_plan(tensors, [], group, functools.partial(self.plan_load, record=record),
                               local_error=local_error, place=location.describe())
        return self.load_with_plan(sharded_state_dict, location, record, plan, group)

    def reads_shards_once(self, ranks: int) -> bool:
        """Whether a load by ``ranks`` ranks reads each chunk once (``read_shards_once``:
        ``"auto"`` from ``AUTO_SHARD_MIN_RANKS`` ranks)."""
        return self.read_shards_once is True or (self.read_shards_once == "auto" and ranks >= AUTO_SHARD_MIN_RANKS)

    def plan_load(self, layout: GlobalLayout, record: CommitRecord | None = None) -> list[RankReadPlan]:
        """Coordinator: who reads which requested block (``planning.plans.plan_reads``);
        given the checkpoint's ``record``, each chunk (or shard) of its arrays once where
        ``read_shards_once`` says so."""
        shards = None
        if record is not None and self.reads_shards_once(layout.world_size):
            shards = {k: a.chunk_shape for k, a in record.arrays.items() if k in layout.tensors}
        return plan_reads(layout, self.fully_parallel, shards)

    def load_with_plan(
        self, sharded_state_dict: ShardedStateDict, location: Location, record: CommitRecord, plan: RankReadPlan,
        group: Group, local_error: BaseException | None = None,
    ) -> StateDict:
        """Collective: reads this rank's part (``run_read_plan``) and puts the tensors in
        place of the request's ShardedTensors. A read that fails on one rank raises the
        same error, naming the checkpoint, key and chunk, on every rank."""
        tensors, slots = sharded_tensor_slots(sharded_state_dict)
        results = run_read_plan(
            tensors, location, record, plan, group, self.io_concurrency, self.allow_lossy_casts, local_error,
            self._uploader,
        )
        for (container, key), tensor in zip(slots, results):
            container[key] = tensor
        return sharded_state_dict

    def load_tensors_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        record = open_read(checkpoint_dir).require_record()
        return {key: tensor_metadata(a) for key, a in record.arrays.items()}

    def load_sharded_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        return self.load_tensors_metadata(checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: CheckpointDir, key_prefix: str) -> None:
        """Removes the arrays and the ShardedObject shards whose key starts with
        ``key_prefix`` (call on one process), as Megatron-Core 0.16's torch_dist drops
        every entry of its metadata with that prefix: an array by its key, an object's
        shard by its unique key (``key/shard_<offset>_<shape>``), so a prefix may take
        some shards of an object and leave the others.

        Crash-safe (``format.removal``): a marker naming what goes is written first, then
        the commit record without them, then their files; so the record never names a
        missing file, and the next removal (this one again, or another) finishes one that
        a killed process began.
        Groups left without arrays go too (their ``zarr.json`` where the save wrote one,
        which the new record no longer vouches for, and their directories once empty),
        innermost first; a document the record never listed (a consolidated-only save's
        group, where another program wrote one) stays. So do the object folders left empty.
        Packed arrays (feature `packs`) go with their packs, whole: a pack that also holds
        arrays that stay is refused (its zip would still show plain readers the removed ones).
        """
        opened = open_read(checkpoint_dir)
        remove_entries(opened.location, opened.require_record(), key_prefix)

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
    """A data-less ShardedTensor covering the whole stored array (one shard); for an
    array saved from flattened ranges, a flattened one (its whole range), as Megatron-Core
    describes a flattened tensor: a load of it gives the 1-D tensor."""
    dtype = from_zarr_name(record.dtype).torch_dtype
    return whole_tensor_metadata(record.key, record.shape, dtype, flattened=record.flattened_block is not None)


def whole_tensor_metadata(
    key: str, shape: tuple[int, ...], dtype: torch.dtype, flattened: bool = False
) -> ShardedTensor:
    """A data-less ShardedTensor covering a whole global tensor of ``shape``; with
    ``flattened`` (and at least one axis), as the flattened range of all its elements."""
    meta = torch.empty(shape, dtype=dtype, device="meta")
    if flattened and meta.ndim > 0:
        return ShardedTensor.from_rank_offsets_flat(
            key, meta.flatten(), tuple(shape), flattened_range=slice(0, meta.numel())
        ).without_data()
    return ShardedTensor.from_rank_offsets(key, meta).without_data()


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
    return _create_array_in(write_location(checkpoint_dir), sharded_tensor)


def _create_array_in(location: Location, sharded_tensor: ShardedTensor) -> ts.TensorStore:
    """``_create_zarr_array`` into a location ``write_location`` gave."""
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
    location = write_location(checkpoint_dir)
    arrays: list[ts.TensorStore | None] = [
        _create_array_in(location, t) if _should_create_array(t) else None for t in sharded_tensors
    ]
    for i, t in enumerate(sharded_tensors):
        if arrays[i] is None and is_main_replica(t.replica_id):
            arrays[i] = _open_array(location, t.key, "r+")
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
    """Opens the array stored at ``path`` (a local path or a URL such as
    ``s3://bucket/ckpt/key``; reads its ``zarr.json``), with a clear error."""
    parent, _, name = os.fspath(path).rstrip("/").rpartition("/")
    return _open_array(bare_location(parent or "."), name, mode, **open_kwargs)


def _open_array(location: Location, key: str, mode: str, **open_kwargs: Any) -> ts.TensorStore:
    """Opens the array ``key`` of ``location`` (reads its ``zarr.json``, or, where it has
    none, takes its document from the consolidated metadata of ``location``'s root
    ``zarr.json``: a checkpoint saved with ``zarr_metadata="consolidated_only"``; a packed
    array, feature ``packs``, read-only from its pack), with a clear error. Internal
    callers hold the location already: no path is split again (which ``Path`` would do
    wrongly for a URL: ``s3://`` becomes ``s3:/``)."""
    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": kvstore_spec(location, key)}
    options = {"read": True, "write": mode != "r", **open_kwargs}
    try:
        return ts.open(spec, open=True, **options).result()
    except Exception as exc:
        root = _root_document(location) if "NOT_FOUND" in str(exc) else None
        if (pack := _packed_array_pack(root, key)) is not None:
            return _open_packed_array(location, key, pack, mode, **open_kwargs)
        document = _consolidated_document(root, key)
        if document is None:
            raise CheckpointingException(
                f"Cannot open Zarr array at {location.describe(key)} (mode {mode!r}): {exc}. A checkpoint saved "
                "with zarr_metadata='consolidated_only' keeps no zarr.json per array: open it from the "
                "checkpoint's root directory and the array's full key"
            ) from exc
    try:
        return ts.open({**spec, "metadata": document}, open=True, assume_metadata=True, **options).result()
    except Exception as exc:
        raise CheckpointingException(
            f"Cannot open Zarr array at {location.describe(key)} (mode {mode!r}) with its document from the "
            f"root's consolidated metadata: {exc}"
        ) from exc


def _open_packed_array(location: Location, key: str, pack: str, mode: str, **open_kwargs: Any) -> ts.TensorStore:
    """Opens the packed array ``key`` (feature ``packs``) from ``pack``, a Zarr v3
    hierarchy in a stored zip, through TensorStore's ``zip`` kvstore: read-only.

    Raises:
        CheckpointingException: a mode that writes, or the pack unreadable."""
    if mode != "r":
        raise CheckpointingException(
            f"Cannot open Zarr array {key!r} of {location.describe()} in mode {mode!r}: it is packed into {pack} "
            "(SaveOptions.pack_arrays_up_to), which is read-only; open it with mode 'r', or save the checkpoint "
            "again without packing"
        )
    base = kvstore_spec(location)
    spec = {"driver": "zarr3", "kvstore": {"driver": "zip", "base": {**base, "path": f"{base['path']}{pack}"},
                                           "path": f"{key}/"}}
    try:
        return ts.open(spec, open=True, read=True, **open_kwargs).result()
    except Exception as exc:
        raise CheckpointingException(
            f"Cannot open Zarr array {key!r} from its pack {location.describe(pack)}: {exc}; `shardstore verify "
            f"{location.describe()}` checks the pack"
        ) from exc


def _root_document(location: Location) -> dict[str, Any] | None:
    """``location``'s root ``zarr.json``, parsed, or None where it has none.

    Raises:
        CheckpointingException: a root that is no JSON object."""
    data = location.read_bytes_or_none(ZARR_JSON, max_bytes=MAX_RECORD_BYTES)
    try:
        root = json.loads(data) if data is not None else None
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser's depth
        raise CheckpointingException(f"{location.describe(ZARR_JSON)} is not a Zarr group's document: {exc}") from exc
    if root is not None and not isinstance(root, dict):
        raise CheckpointingException(f"{location.describe(ZARR_JSON)} is not a Zarr group's document: not an object")
    return root


def _packed_array_pack(root: dict[str, Any] | None, key: str) -> str | None:
    """The pack the root document's ``packed_arrays`` attribute names for ``key`` (format
    version 8), or None."""
    attributes = root.get("attributes") if root is not None else None
    packed = attributes.get(PACKED_ARRAYS_ATTRIBUTE) if isinstance(attributes, dict) else None
    pack = packed.get(key) if isinstance(packed, dict) else None
    return pack if isinstance(pack, str) else None


def consolidated_document(location: Location, key: str) -> dict[str, Any] | None:
    """The array ``key``'s metadata document as the consolidated metadata of
    ``location``'s root ``zarr.json`` lists it (extension data types beside Zarr's own
    listing, ``EXTENSION_METADATA``), or None where there is none, and where the root
    is no shardstore record of a consolidated-only save (a per-array ``zarr.json``
    missing from any other checkpoint is damage, not a layout)."""
    return _consolidated_document(_root_document(location), key)


def _consolidated_document(root: dict[str, Any] | None, key: str) -> dict[str, Any] | None:
    """``consolidated_document`` of a parsed root document."""
    try:
        consolidated = root.get("consolidated_metadata") if root is not None else None
        layout = root.get("attributes", {}).get("shardstore", {}).get("zarr_metadata") if root is not None else None
    except AttributeError as exc:
        raise CheckpointingException(f"the root {ZARR_JSON} is not a Zarr group's document: {exc}") from exc
    if not isinstance(consolidated, dict) or layout != ZarrMetadata.CONSOLIDATED_ONLY.value:
        return None
    for listing in (consolidated.get("metadata"), consolidated.get(EXTENSION_METADATA)):
        if isinstance(listing, dict) and isinstance(listing.get(key), dict):
            return listing[key]
    return None


def _load_from_array(sharded_tensor: ShardedTensor, checkpoint_dir: CheckpointDir | Location) -> torch.Tensor:
    """Loads one tensor from its array. A committed shardstore checkpoint is read as
    ``load`` reads it (``load_tensors``: every chunk bound by the commit record, a
    missing one an error, never the fill value). Megatron's zarr functions write arrays
    into a bare directory, with no commit record: read as it is (the array's own
    ``zarr.json``, or its document in the root's consolidated metadata, ``_open_array``;
    each chunk's crc32c, a codec of the array, is checked by TensorStore)."""
    location = bare_location(checkpoint_dir)
    if _holds_shardstore_checkpoint(location):
        opened = open_read(checkpoint_dir)
        return load_tensors([sharded_tensor], opened.location, opened.require_record())[0]
    arr = _open_array(location, sharded_tensor.key, "r")
    stored = ArrayRecord(
        sharded_tensor.key, tuple(arr.shape), str(arr.dtype.name), tuple(arr.chunk_layout.read_chunk.shape)
    )
    op = plan_read(sharded_tensor, stored, f"checkpoint {location.describe()}")
    try:
        array = arr[_ts_index(op.region)].read().result()
    except Exception as exc:  # TensorStore's DATA_LOSS (a chunk's crc32c), a missing chunk file, I/O
        raise CheckpointingException(
            f"Reading {sharded_tensor.key!r} from checkpoint {location.describe()} failed: {exc}; "
            f"`shardstore verify {location.describe()}` lists every damaged chunk"
        ) from exc
    return place_loaded(op.finish(numpy_to_tensor(array, from_zarr_name(stored.dtype).torch_dtype)), sharded_tensor,
                        f"checkpoint {location.describe()}")


def _holds_shardstore_checkpoint(location: Location) -> bool:
    """Whether ``location`` holds a committed shardstore checkpoint (its commit record,
    and a ``metadata.json`` naming our backend), rather than the bare arrays of
    Megatron's zarr functions or another tool's Zarr group."""
    return is_committed(location) and sharded_backend(location) in READABLE_BACKENDS


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
    opened = open_read(checkpoint_dir)
    sharded = {}
    for key in opened.require_record().arrays:
        shape, dtype = get_shape_dtype_fn(opened.describe(key))
        meta = torch.empty(tuple(shape), dtype=_torch_dtype_of(np.dtype(dtype)), device="meta")
        sharded[key] = ShardedTensor.from_rank_offsets(key, meta).without_data()
    return sharded
