"""The storage core's strategies: ShardedTensors as Zarr v3 arrays (one GLOBAL array per key).

``ZarrSaveShardedStrategy`` and ``ZarrLoadShardedStrategy`` plan once on the coordinator
(``shardstore.protocol.plan_stage``, ``shardstore.planning.plans``) and run each rank's part: a save's
stages in ``shardstore.execution.save`` (stage, write) and ``execution.save_commit`` (agree, commit), a load's in
``shardstore.execution.load`` (read, agree, exchange). Load: one read of the commit
record gives every array's metadata; the coordinator plans who reads what
(``plan_load``, ``planning.plans.plan_reads``). With ``fully_parallel`` (default), replicated
blocks are written by their replicas in turn (``planning.layout.balance_writers``), and a block
that several ranks request is read by one and sent to the others.

The module functions named after Megatron-Core's zarr strategy (``_create_zarr_array``,
``_load_from_array``, ...) work on single tensors, for callers of that API, through
TensorStore (``array_spec``: arrays opened from the record without reading any
``zarr.json``); they live in ``strategies.zarr_arrays`` and are offered here by those
names.
"""

from __future__ import annotations

__all__ = [
    "AUTO_SHARD_MIN_RANKS", "DEFAULT_MAX_CHUNK_BYTES", "DEFAULT_SHARD_BYTES", "DEFAULT_SYNC_STAGING_BYTES",
    "SHARDSTORE_BACKEND", "ShardBytes",
    "ZARR_VERSION", "ZarrLoadShardedStrategy", "ZarrSaveShardedStrategy", "checked_max_chunk_bytes",
    "checked_shard_bytes", "checked_staging_bytes",
    "_create_or_open_zarr_arrays", "_create_zarr_array",
    "_load_from_array", "_open_zarr_array_verbose", "_save_to_existing_array",
    "_should_create_array", "array_spec", "consolidated_document", "flatten_range", "load_zarr_based_sharded_metadata",
    "numpy_to_torch_dtype_dict", "pad_to_expected_shape", "postprocess_numpy_array",
    "register_default_zarr_strategies", "single_tensor_record", "tensorstore_context",
    "torch_to_numpy_dtype_dict",
]

import functools
import logging
import math
import numbers
from dataclasses import replace
from typing import Literal

import torch.distributed as dist

from shardstore.engine.async_requests import AsyncRequest
from shardstore.engine.load import LoadSettings, read_planned
from shardstore.engine.save import SaveSettings, sharded_writes
from shardstore.engine.strategies import (
    AsyncSaveShardedStrategy,
    CheckpointDir,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from shardstore.engine.walk import open_dir, tensor_metadata
from shardstore.engine.zarr_arrays import (  # Megatron-Core's names for them are this module's
    READABLE_BACKENDS,
    SHARDSTORE_BACKEND,
    ZARR_VERSION,
    _create_or_open_zarr_arrays,
    _create_zarr_array,
    _load_from_array,
    _open_zarr_array_verbose,
    _save_to_existing_array,
    _should_create_array,
    array_spec,
    consolidated_document,
    load_zarr_based_sharded_metadata,
    postprocess_numpy_array,
    single_tensor_record,
    tensorstore_context,
)
from shardstore.errors import CheckpointingException
from shardstore.execution.loaded import (  # flatten_range, pad_to_expected_shape: Megatron-Core's names here
    flatten_range,  # noqa: F401
    pad_to_expected_shape,  # noqa: F401
)
from shardstore.execution.pipeline import SavePipeline
from shardstore.execution.staging import (
    DEFAULT_LOAD_STAGING_BYTES,
    DeviceUploader,
    HostBufferPool,
)
from shardstore.format.chunks import DEFAULT_IO_CONCURRENCY
from shardstore.format.dtypes import (
    numpy_to_torch_dtype_dict,  # noqa: F401  (seed API)
    torch_to_numpy_dtype_dict,  # noqa: F401  (seed API)
)
from shardstore.format.records import (
    CommitRecord,
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
from shardstore.mapping import ShardedStateDict, StateDict
from shardstore.opened import bare_location
from shardstore.planning.layout import (
    GatheredShards,
)
from shardstore.planning.plans import (
    RankReadPlan,
    RankSavePlan,
    plan_reads,
    plan_save,
)
from shardstore.protocol.collectives import Group
from shardstore.protocol.plan_cache import PlanCache
from shardstore.protocol.plan_stage import gather_and_plan
from shardstore.stores.base import Location
from shardstore.utils import local_sharded_items

logger = logging.getLogger(__name__)

# Host memory a sync save of CUDA tensors copies through at once (pinned buffers).
DEFAULT_SYNC_STAGING_BYTES = 2 * 2**30
# What ``shard_bytes`` takes: "auto" (the default), None (never shard) or a size in bytes.
ShardBytes = int | Literal["auto"] | None


# --------------------------------------------------------------------------- specs


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
        """The cached plan (None without ``cache_plan``)."""
        return self._plan_cache

    @property
    def save_settings(self) -> SaveSettings:
        """This strategy's options as a save reads them, once, when it starts."""
        return SaveSettings(self.io_concurrency, self.max_staging_bytes, self.sync_staging_bytes,
                            self.background_io_threads, self._buffers, self._sync_buffers)

    @property
    def plan_settings(self) -> tuple[bool, StorageLayout]:
        """What this strategy's plans depend on besides the save's layout, as they are
        now: part of the cached plan's key (``SavePipeline.plan``)."""
        return (self.fully_parallel, self.layout)

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
        return SavePipeline.into_callers_directory(bare_location(checkpoint_dir), self._group(process_group), self.layout)

    def plan_into(self, sharded_state_dict: ShardedStateDict, pipeline: SavePipeline) -> RankSavePlan:
        """Collective: this rank's part of the plan of saving ``sharded_state_dict``
        through ``pipeline`` (``SavePipeline.plan`` with ``plan_save`` and this strategy's
        plan cache), the save begun and joined."""
        tensors, objects = local_sharded_items(sharded_state_dict)
        return pipeline.plan(tensors, objects, self.plan_save, plan_cache=self.plan_cache,
                             plan_settings=self.plan_settings)

    def plan_save(self, layout: GatheredShards, storage: StorageLayout | None = None) -> list[RankSavePlan]:
        """Coordinator: every rank's part of the save (``shardstore.planning.plans``) by
        ``storage``, the save's chosen layout as planned at its site (``SavePipeline``
        passes it: ``StorageLayout.planned_at``; its ``pack_arrays_up_to`` gathers small
        arrays split over ranks whole, for packing); without it, by this strategy's
        layout chosen for the world size, gathering none."""
        if storage is None:  # the seed's API: no pipeline, so no array gathered for a pack
            storage = self.layout.chosen_for(LayoutSite(layout.world_size)).planned_at(LayoutSite(can_exchange=False))
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
        agreed in the staging stage (``execution.save.stage_save``). The save's run,
        ``engine.save.sharded_writes``, by this strategy's ``save_settings``."""
        return self._request(sharded_state_dict, pipeline, plan, local_error, snapshot=True)

    def save_into(
        self, sharded_state_dict: ShardedStateDict, pipeline: SavePipeline, plan: RankSavePlan,
        local_error: BaseException | None = None,
    ) -> None:
        """Synchronous: writes CPU tensors straight from their memory; CUDA tensors
        stream through pinned buffers, at most ``sync_staging_bytes`` at once, their
        copies overlapping the writes (``engine.save.sharded_writes``)."""
        self._request(sharded_state_dict, pipeline, plan, local_error, snapshot=False).execute_sync()

    def _group(self, process_group: dist.ProcessGroup | None) -> Group:
        return Group(process_group if process_group is not None else self.process_group)

    def _request(
        self, sharded_state_dict: ShardedStateDict, pipeline: SavePipeline, plan: RankSavePlan,
        local_error: BaseException | None, snapshot: bool,
    ) -> AsyncRequest:
        tensors = pipeline.planned_tensors
        if tensors is None:  # a plan made elsewhere (the seed's save_with_plan): its tensors, in its order
            tensors, _ = local_sharded_items(sharded_state_dict)
        return sharded_writes(pipeline, tensors, plan, self.save_settings, local_error, snapshot)


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
        opened = open_dir(checkpoint_dir)
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

    def plan_load(self, layout: GatheredShards, record: CommitRecord | None = None) -> list[RankReadPlan]:
        """Coordinator: who reads which requested block (``planning.plans.plan_reads``);
        given the checkpoint's ``record``, each chunk (or shard) of its arrays once where
        ``read_shards_once`` says so."""
        shards = None
        if record is not None and self.reads_shards_once(layout.world_size):
            shards = {k: a.chunk_shape for k, a in record.arrays.items() if k in layout.tensors}
        return plan_reads(layout, self.fully_parallel, shards)

    @property
    def load_settings(self) -> LoadSettings:
        """This strategy's read options as a load reads them, once, when it starts."""
        return LoadSettings(self.io_concurrency, self.allow_lossy_casts, self._uploader)

    def load_with_plan(
        self, sharded_state_dict: ShardedStateDict, location: Location, record: CommitRecord, plan: RankReadPlan,
        group: Group, local_error: BaseException | None = None,
    ) -> StateDict:
        """Collective: ``engine.load.read_planned`` by this strategy's ``load_settings``."""
        return read_planned(sharded_state_dict, location, record, plan, group, self.load_settings, local_error)

    def load_tensors_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        record = open_dir(checkpoint_dir).require_record()
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
        opened = open_dir(checkpoint_dir)
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


def register_default_zarr_strategies() -> None:
    """Registers the strategies as defaults for backends ``shardstore`` and ``zarr``
    (an alias), version 1."""
    for backend in READABLE_BACKENDS:
        register_default_strategy(StrategyAction.LOAD_SHARDED, backend, ZARR_VERSION, ZarrLoadShardedStrategy())
        register_default_strategy(StrategyAction.SAVE_SHARDED, backend, ZARR_VERSION, ZarrSaveShardedStrategy())


# ------------------------------------------------- Megatron-Core zarr module API
# Single-tensor building blocks with the seed's names, on the same format and specs.


