"""One save, composed once: ``SavePipeline`` owns its target, group, publisher and steps.

Every door that writes a shardstore checkpoint (``shardstore.save``, the array writer
of conversions, the DCP writer, the Megatron-Core plug-in) opens ONE pipeline at its API
boundary and calls its steps in this order: ``open`` (all ranks; the one place a save's
target is opened), ``plan`` (collective: the coordinator validates, plans and ``begin``s,
every rank ``join``s), the writes (all ranks), then ``commit`` (coordinator), which goes
through ``execution.save_commit.commit_save``, the ONLY place that binds the chunks' digests into
the commit record and publishes. On failure, ``abandon`` (coordinator, once every rank
knows) or ``release``. ``SavePipeline``'s docstring lists each step and who calls it, and
how each door maps onto them.

Reads open once with ``shardstore.opened.open_read`` (its ``require_record()`` replaces
asking a location for ``record``).
"""

from __future__ import annotations

__all__ = ["RankSave", "SaveFinalization", "SavePipeline", "SaveProgress"]

import functools
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from shardstore.errors import CheckpointingException

# The rank-level steps are called through their modules (``rank_save.write_ops``,
# ``rank_commit.commit_save``, ...), so a test that replaces one there (a crash before the
# writes, a lost report) reaches this pipeline too.
from shardstore.execution import save as rank_save
from shardstore.execution import save_commit as rank_commit
from shardstore.execution.changes import SourceVersions, in_place_ops
from shardstore.execution.save import (
    StagedWrites,
    Staging,
    WriteOp,
)
from shardstore.format.chunks import DEFAULT_IO_CONCURRENCY, DEFAULT_IO_THREADS, WrittenChunk
from shardstore.format.commit import (
    PendingCheckpoint,
    Publisher,
    SaveIntent,
    SaveOptions,
    adopt_save,
    adopted,
    begin_save,
    check_shared,
    join_save,
    publisher_for,
)
from shardstore.format.config import CheckpointingConfig, write_config
from shardstore.format.features import PACKS_DIR
from shardstore.format.packs import Packing
from shardstore.format.records import ArrayRecord, CommitRecord
from shardstore.format.storage_layout import LayoutSite, StorageLayout
from shardstore.mapping import ShardedObject, ShardedTensor
from shardstore.planning.checks import (
    admits_names,
    check_layout,
    check_storable_data,
    local_records,
    name_lengths_needed,
)
from shardstore.planning.layout import GatheredShards
from shardstore.planning.plans import RankSavePlan, object_bounds
from shardstore.progress import stage
from shardstore.protocol.collectives import Group
from shardstore.protocol.plan_cache import PlanCache, gather_and_plan_cached
from shardstore.protocol.stage import every_rank_stopped, raise_stage_failure
from shardstore.protocol.stopped_writers import StoppedWriters
from shardstore.stores.base import Location, NameLimits
from shardstore.stores.locations import open_location

# How long a coordinator unwinding an interrupted save waits for every rank to say it
# stopped writing (``protocol.stopped_writers``) before it leaves the staged files to the
# next save into the same place instead of deleting them (seconds).
UNWIND_WAIT_S = 10.0


@dataclass
class SaveProgress:
    """This rank's progress in one save, held by its pending checkpoint
    (``PendingCheckpoint.shared``) and so shared by every pipeline that holds the save
    (a strategy handed ``location`` adopts it in a pipeline of its own).

    Attributes:
        writers: the count of the save's ranks that stopped writing into it; a rank
            counts itself once however many pipelines hold the save.
        finalized: whether the save's finalization returned on this rank (committed).
    """

    writers: StoppedWriters
    finalized: bool = False


@dataclass(frozen=True)
class RankSave:
    """One rank's part of a save planned by ``SavePipeline.plan_gathered``, which a door
    whose framework carries the plans (DCP's ``SavePlan``) hands to that rank.

    Attributes:
        intent: the save the rank joins (``SavePipeline.join``).
        plan: what the rank writes (``SavePipeline.write_plan``); on the coordinator,
            also the commit record it commits (``plan.commit``).
    """

    intent: SaveIntent
    plan: RankSavePlan


class SavePipeline:
    """One save of one checkpoint: the one object that holds a save's state on a rank.
    What the save may do is fixed when it is opened (``options``); what it decided when
    it began is its ``pending`` checkpoint's; what this rank staged and wrote is kept here
    until the commit.

    Its steps, in order (who calls each):

        all ranks    SavePipeline.open(location, group, options, config=)
                     a save into a Location the door made of its caller's target (and
                     ``options.reuse_from``, the checkpoint it reuses from, opened here); ``options`` (``SaveOptions``:
                     overwrite, reuse, shared directory, where the arrays' Zarr metadata
                     goes) come whole from the door; the
                     publisher follows from the target's capabilities
                     (``format.commit.publisher_for``: rename locally, in place on S3)
                 or  SavePipeline.into_callers_directory(location, group)
                     a directory the caller created and wrote into (Megatron-Core's own
                     ``save``): no staging, no begin; published in place, the caller's
                     files listed as external (``format.commit.IntoCallersDirectory``)
        collective   plan(tensors, objects, planner, ...) -> this rank's plan
                     gathers the shard records, validates and plans on the coordinator
                     (``protocol.plan_stage``/``plan_cache``), which then ``begin``s; every
                     rank ``join``s with the intent it receives with its part of the plan
        coordinator  begin() -> SaveIntent   (called by ``plan``; a door that plans
                     itself, as DCP's ``prepare_global_plan``, calls it directly)
                     refuses what is not ours to replace, clears dead saves, creates the
                     staging area and its marker, writes ``metadata.json``
        all ranks    join(intent) -> PendingCheckpoint   (the coordinator's own pending)
        all ranks    stage(tensors, plan, staging) then
                     write_staged() (the strategies; an async save's I/O) and finalize(error)
                     (its collective commit); or write_plan(plan, tensors): a rank's part of
                     a plan it was handed
        coordinator  commit(record, reports) -> CommitRecord
                     ``execution.save_commit.commit_save``: the ONLY place that binds the chunks'
                     crc32c and XXH3-128 digests and the reused chunks into the commit record
                     and publishes (by the pending checkpoint's ``Publisher``)
        on failure   abandon() (coordinator, once every rank knows) or release() (a rank
                     that lets go without deleting anything)

    A save that runs its commit as a collective stage (``finalize``, through
    ``execution.save_commit.finalize_save``: every rank's written chunks gathered to the
    coordinator) reaches ``commit_save`` too;
    ``SavePipeline.commit`` is for doors that gathered the reports themselves (DCP's
    ``finish``) or write from one process (``tools.array_writer``).

    The doors, as adapters over it:

        shardstore.save          SavePipeline.open -> plan (begins, joins) -> the strategy's
                                 save_into / async_save_into (engine.strategies; ours stages
                                 the tensors ``plan`` was given, writes into
                                 ``pipeline.location``; finalize -> commit_save)
        ZarrSaveShardedStrategy  save_with_plan / async_save_with_plan / async_save (the seed's
          seed signatures        signatures, a path): its into_callers_directory (this class's
                                 on its process group), plan_into (plan with its plan_save and
                                 plan cache), then save_into / async_save_into
        CheckpointWriter         open -> begin -> ArrayWrites(pipeline): check_storable, write_array ... -> commit
        DCP ShardstoreWriter     prepare_global_plan (coordinator): open, plan_gathered (the
                                 shards DCP gathered, as ShardedTensors without data: the checks,
                                 the plan, begin); each rank's RankSave (intent and plan) travels
                                 in its SavePlan. write_data (all ranks): open + join(intent)
                                 off the coordinator, write_plan (on the process group, with
                                 shard_bytes), release() off the coordinator.
                                 finish (coordinator): common.pt into ``location``, then
                                 commit(commit_record, reports); abandon() on failure.
        Megatron plug-in         _plan: base_strategy.into_callers_directory(checkpoint_dir)
                                 and base_strategy.plan_into(sd, pipeline), as the seed
                                 signatures; save: base_strategy.save_into(sd, pipeline,
                                 plan); async_save:
                                 base_strategy.async_save_into(...) as Megatron's request
                                 (``strategies.forked_writes``: its finalization commits
                                 through finalize -> commit_save)
        shardstore.megatron      Megatron-Core's module functions: shardstore.save / load

    Attributes:
        target: where the checkpoint is published (opened once, here).
        group: the ranks that save together.
        options: how the save may treat its target (``format.commit.SaveOptions``,
            ``reuse_from`` opened).
        publisher: how it is published, chosen from the target's capabilities.
        written: the chunks this rank wrote (what its writers reported).
    """

    def __init__(
        self, target: Location, group: Group, options: SaveOptions | None = None,
        config: CheckpointingConfig | None = None, pending: PendingCheckpoint | None = None,
    ) -> None:
        self.target, self.group, self.config = target, group, config
        self.site = _site(target, group)
        self.options = pending.options if pending is not None else (options or SaveOptions()).chosen_for(self.site)
        self._pending = pending
        self.publisher: Publisher = pending.publisher if pending is not None else publisher_for(target.capabilities)
        self.written: list[WrittenChunk] = []
        self._planned: list[ShardedTensor] | None = None  # the tensors ``plan`` was given, in its order
        self._staged: StagedWrites | None = None
        self._commit_record: CommitRecord | None = None  # the coordinator's, from its plan
        # the caller's tensors' version counters while the save reads them, then what a change cost
        self._versions: SourceVersions | None = None
        self._changed: CheckpointingException | None = None
        self._in_place: list[WriteOp] = []  # the writes of a sync save from the caller's memory
        self._refuse_oversized_objects()

    def __getstate__(self) -> dict:
        """What a writer in another process needs (Megatron's persistent worker pickles
        the request): the staged host copies, not the caller's tensors, nor the commit
        record (the finalization, in this process, commits), nor the host snapshot (its
        CUDA copy streams do not pickle, its pool holds buffers of earlier saves; the
        writes point into the copies themselves, and this process lets them go)."""
        staged = None if self._staged is None else replace(self._staged, snapshot=None)
        return {**self.__dict__, "_planned": None, "_commit_record": None, "_staged": staged, "_versions": None,
                "_in_place": []}

    @classmethod
    def open(
        cls, location: Location, group: Group | None = None, options: SaveOptions | None = None, *,
        config: CheckpointingConfig | None = None,
    ) -> SavePipeline:
        """A save into ``location`` (a door's ``opened.bare_location`` of its caller's
        target), staged and published by the rules of ``format.commit``, as ``options`` allow (``options.reuse_from``, an
        earlier committed checkpoint whose unchanged chunks it shares, is opened here);
        ``config``: written as ``metadata.json``; ``group``: default, this process alone
        (no collectives)."""
        opened = (options or SaveOptions()).opened(open_location)
        return cls(location, group or Group.local(), opened, config)

    @classmethod
    def into_callers_directory(
        cls, location: Location, group: Group | None = None, layout: StorageLayout | None = None,
    ) -> SavePipeline:
        """A save into a directory the caller created and already wrote into
        (Megatron-Core's ``save``, the seed's strategy API called directly): joined at
        once, published in place, nothing there ever deleted. Handed the location of a
        save this process began or joined (the strategies' API passes
        ``SavePipeline.location`` down as a checkpoint directory), it is that save's
        (``format.commit.adopt_save``)."""
        group = group or Group.local()
        chosen = None
        if adopted(location) is None:  # a caller's directory: this save's layout, chosen here
            chosen = (layout or StorageLayout()).chosen_for(_site(location, group, callers_directory=True))
        pending = adopt_save(location, chosen)
        return cls(pending.target, group, pending.options, pending=pending)

    def describe(self, rel: str = "") -> str:
        return self.target.describe(rel)

    @property
    def pending(self) -> PendingCheckpoint:
        """Where this rank writes (after ``begin`` or ``join``)."""
        if self._pending is None:
            raise CheckpointingException(f"Internal error: the save into {self.describe()} was not begun or joined")
        return self._pending

    @property
    def location(self) -> Location:
        """Where this rank writes (``PendingCheckpoint.location``; after ``begin`` or ``join``)."""
        return self.pending.location

    @property
    def committed(self) -> bool:
        """Whether the save's finalization returned on this rank (and so on every rank):
        the checkpoint is published, through this pipeline or another that adopted its
        save (a strategy handed ``location``)."""
        return self._pending is not None and self._progress().finalized

    @property
    def planned_tensors(self) -> list[ShardedTensor] | None:
        """The ShardedTensors ``plan`` was given, which this rank's part of the plan
        numbers (``ShardRecord.index``); None when this pipeline did not plan (a plan
        handed in from elsewhere, the seed's ``save_with_plan``)."""
        return self._planned

    # ------------------------------------------------------------------ steps

    def begin(self) -> SaveIntent:
        """Coordinator: begins the save (``format.commit.begin_save``: refuses what is not
        ours to replace, creates the staging area) and writes its ``metadata.json``; on
        failure deletes what it created and raises."""
        with stage("save: begin", self.describe()):
            pending = begin_save(self.target, self.options)
            try:
                if self.config is not None:
                    write_config(self.config, pending.location)
            except BaseException:
                pending.abandon()
                raise
        self._pending = pending
        return pending.intent

    def _begin_for_every_rank(self) -> SaveIntent:
        """``begin`` inside the plan stage: a failure becomes a ``StageFailed`` that the
        plan's scatter tells every rank."""
        try:
            return self.begin()
        except Exception as exc:  # told to every rank by the plan's scatter
            raise_stage_failure(self.group, f"Preparing checkpoint directory {self.describe()}", exc)

    def join(self, intent: SaveIntent) -> PendingCheckpoint:
        """Every rank: the pending checkpoint of the save the coordinator began (its own
        on the coordinator)."""
        if self._pending is None:
            self._pending = join_save(self.target, intent, self.options)
        return self._pending

    def plan(
        self, tensors: list[ShardedTensor], objects: list[ShardedObject], planner: Callable[[Any], list[Any]], *,
        plan_cache: PlanCache | None = None, plan_settings: Hashable = (), local_error: BaseException | None = None,
        common_digests: dict[str, str] | None = None, common_state: dict[str, Any] | None = None,
    ) -> Any:
        """Collective: this rank's part of ``planner``'s plan (``protocol.plan_cache``),
        the save begun on the coordinator once the plan is made and joined on every rank.
        Keys the target cannot store, an invalid global sharding and any rank's
        ``local_error`` fail every rank before anything is written, and so do a store
        the ranks cannot share (``format.commit.check_shared``: ``memory://``) and data
        no array can be written from (``planning.checks.check_storable_data``: sparse,
        nested, meta or fake tensors, dtypes the format does not store); a rank that
        cannot join fails every rank in the staging stage's agreement
        (``execution.save.fail_before_staging``). The
        pipeline keeps ``tensors`` (``planned_tensors``): the state dict is not walked
        again to write them. ``plan_cache`` reuses a plan made under the same
        ``plan_settings`` (the planner's) and this save's layout."""
        self._planned = tensors
        storage = self._planned_layout()
        planner = functools.partial(planner, storage=storage)
        settings = (plan_settings, storage)  # a cached plan for this layout only
        if local_error is None:
            try:
                check_shared(self.target, self.group.world_size)
                for tensor in tensors:
                    check_storable_data(tensor, self.describe())
            except CheckpointingException as exc:  # reported on every rank by the plan stage
                local_error = exc
        if self._pending is not None:  # a caller's directory: nothing to begin
            return gather_and_plan_cached(
                plan_cache, tensors, objects, self.group, planner, local_error=local_error,
                common_digests=common_digests, save_to=self.target, common_state=common_state, settings=settings,
            )
        try:
            intent, plan = gather_and_plan_cached(
                plan_cache, tensors, objects, self.group, planner, anew=self._begin_for_every_rank,
                local_error=local_error, common_digests=common_digests, save_to=self.target,
                common_state=common_state, settings=settings,
            )
        except BaseException:  # no rank joined the save: nothing of it can be in use
            if self._pending is not None:
                self._pending.abandon()
            raise
        try:
            self.join(intent)
        except Exception as exc:  # the peers wait in the staging stage: told there, not left to time out
            rank_save.fail_before_staging(self.group, self.describe(), exc)
        return plan

    def _planned_layout(self) -> StorageLayout:
        """What a planner (a strategy's ``plan_save``, as its ``storage``) plans this save
        by: its chosen layout (the coordinator's plan decides it for every rank) as
        planned at its site (``StorageLayout.planned_at``: no small array split over ranks
        gathered whole for packing where the save's group cannot exchange them, as DCP's
        writer's, whose plan's ranks are each a process alone here)."""
        return self.options.layout.planned_at(self.site)

    def _refuse_oversized_objects(self) -> None:
        """Refuses, before anything is written, a layout whose stored objects may be
        larger than the target's object size limit (``Capabilities.max_object_bytes``:
        S3's 5 GiB for one PUT), by the save's chosen layout (``planning.plans.
        object_bounds``).

        Raises:
            CheckpointingException: naming the option, the limit and the checkpoint."""
        limit = self.target.capabilities.max_object_bytes
        for name, (value, largest) in object_bounds(self.options.layout).items():
            if limit is not None and largest is not None and largest > limit:
                raise CheckpointingException(
                    f"{name}={value} exceeds the {limit}-byte object limit of {self.describe()} (objects of up "
                    f"to {largest} bytes); use a smaller {name}"
                )

    def plan_gathered(
        self, tensors: list[list[ShardedTensor]], planner: Callable[..., list[RankSavePlan]],
    ) -> tuple[list[RankSave], NameLimits]:
        """Coordinator of a door whose framework gathers the ranks' shards itself (DCP's
        ``prepare_global_plan``), given every rank's ``tensors`` (``tensors[rank]``, data
        not needed): the checks ``plan`` makes (a store the ranks cannot share, keys the
        target cannot store, dtypes the format does not store, the global sharding),
        ``planner``'s plan of their layout,
        then ``begin``. Returns each rank's part (the save's intent, which every rank
        ``join``s, and its plan) and the longest names the plan's files have (what
        ``begin_planned`` checks a later target against); raises before anything is
        written."""
        where = self.describe()
        check_shared(self.target, len(tensors))
        for tensor in (tensor for rank_tensors in tensors for tensor in rank_tensors):
            check_storable_data(tensor, where)  # no data here: its dtype, named by its key
        layout = GatheredShards.from_gathered([local_records(ts, [], rank, where) for rank, ts in enumerate(tensors)])
        check_layout(layout, self.target.name_limits, where)
        plans = planner(layout, storage=self._planned_layout())
        intent = self.begin()
        return [RankSave(intent, plan) for plan in plans], name_lengths_needed(layout)

    def begin_planned(self, world_size: int, names_needed: NameLimits) -> SaveIntent | None:
        """Coordinator of a save that reuses the parts ``plan_gathered`` made for an
        earlier one (each rank holds its own, as under DCP's plan caching): the checks of
        ``plan_gathered`` that depend on the target (a store the ranks cannot share; names
        as long as ``names_needed``), then ``begin``. None, with nothing begun, where the
        target stores shorter names than the plan's (plan again: the full check names the
        key)."""
        check_shared(self.target, world_size)
        if not admits_names(self.target.name_limits, names_needed):
            return None
        return self.begin()

    def write_plan(
        self, plan: RankSavePlan, tensors: list[ShardedTensor], io_concurrency: int = DEFAULT_IO_CONCURRENCY,
        local_error: BaseException | None = None, staging_bytes: int | None = None,
    ) -> list[WrittenChunk]:
        """This rank's part of a save plan from its ``tensors`` (the ones the plan's
        shards number, data on any device): the staging stage (``execution.save.
        stage_save``: host copies of CUDA data; on a group of several ranks, collective,
        every rank calls it, and the blocks gathered into other ranks' shards travel;
        ``local_error``, this rank's failure before, fails every rank), then the arrays'
        ``zarr.json`` files, every chunk, then durability, before the rank reports what
        it wrote (and what it wrote while staging). ``staging_bytes``: the host memory
        bound of the copies and of the chunks assembled by exchange (``Staging.max_bytes``,
        the same on every rank; None: no bound)."""
        staging = Staging(max_bytes=staging_bytes, io_concurrency=io_concurrency)
        versions = SourceVersions.of(tensors)
        staged = rank_save.stage_save(tensors, self.pending, plan, self.group, staging, local_error)
        written = [*staged.written_early, *self._write(
            staged.metadata_files, staged.records, staged.ops, io_concurrency, packing=staged.packing)]
        in_place = in_place_ops(staged.ops, tensors)
        if changed := versions.error_after_writes(self.describe(), in_place, staged.records, written):
            raise changed
        return written

    def stage(
        self, tensors: list[ShardedTensor], plan: RankSavePlan, staging: Staging,
        local_error: BaseException | None = None,
    ) -> None:
        """Collective: this rank's host copies of ``tensors`` for its part of ``plan``
        (``execution.save.stage_save``), kept for ``write_staged``; an async save's
        blocking part."""
        versions = SourceVersions.of(tensors)
        with stage("save: stage", self.describe()):
            staged = rank_save.stage_save(tensors, self.pending, plan, self.group, staging, local_error)
        self._staged, self._commit_record = staged, plan.commit
        if staging.snapshot:  # an async save reads the caller's tensors no more
            self._changed = versions.error(self.describe(), "its host copies were made")
        else:  # a sync save reads them until its writes end (``finalize``)
            self._versions, self._in_place = versions, in_place_ops(staged.ops, tensors)
        self.written += staged.written_early

    def write_staged(self, io_concurrency: int = DEFAULT_IO_CONCURRENCY, io_threads: int = DEFAULT_IO_THREADS) -> None:
        """This rank's I/O of what ``stage`` staged (an async save's ``async_fn``):
        metadata files, every chunk write in flight, then durability."""
        staged = self._require_staged()
        try:
            self._write(staged.metadata_files, staged.records, staged.ops, io_concurrency, io_threads, staged.packing)
        finally:
            self._writers().mark()

    def _write(
        self, files: dict[str, bytes], records: dict[str, ArrayRecord], ops: list[WriteOp], io_concurrency: int,
        io_threads: int = DEFAULT_IO_THREADS, packing: Packing | None = None,
    ) -> list[WrittenChunk]:
        where = self.describe()
        with stage("save: write", where) as timing:
            self.location.write_many(files)
            # the arrays without a document here get their directories in one pass too; packed ones get none
            packed = packing.keys if packing is not None else frozenset()
            directories = {op.key for op in ops if op.key not in packed} | ({PACKS_DIR} if packed else set())
            self.location.make_directories(directories - {rel.rpartition("/")[0] for rel in files})
            written = self._write_arrays(records, ops, io_concurrency, io_threads, packing)
            timing.nbytes = sum(op.value.nbytes for op in ops)
        with stage("save: durable", where):
            self._make_durable()
        return written

    def _make_durable(self) -> None:
        """``make_durable``; on the coordinator (in its own process, not a writer process
        the save was handed to), the commit record's arrays are encoded meanwhile on
        another thread (``CommitRecord.encode_ahead``; a ``syncfs`` holds no
        lock Python needs), so the commit encodes little more than the chunks'
        checksums. Only CPU work overlaps: the record is written after the data is
        durable."""
        record = self._commit_record
        if record is None or not self.group.in_its_process:  # a writer process: the commit is not its
            self.location.make_durable()
            return
        with ThreadPoolExecutor(1, thread_name_prefix="shardstore-encode") as pool:
            encoded = pool.submit(record.encode_ahead)
            self.location.make_durable()
            encoded.result()

    def finalize(self, error: BaseException | None, written: list[WrittenChunk] | None = None) -> None:
        """Collective: the commit of a staged save (``execution.save_commit.finalize_save``),
        given this rank's ``error`` from the writes; the host copies are let go first.
        ``written``: what a writer in another process wrote for this rank
        (``compat.megatron.strategies.forked_writes``), in place of what this process
        wrote itself."""
        if written is not None:
            self.written = list(written)
        staged, self._staged = self._require_staged(), None
        if staged.snapshot is not None:
            staged.snapshot.release()
        versions, self._versions = self._versions, None
        in_place, self._in_place = self._in_place, []
        if error is None and versions is not None:
            error = versions.error_after_writes(self.describe(), in_place, staged.records, self.written)
        error = error or self._changed
        try:
            rank_commit.finalize_save(self.pending, self.group, self._commit_record, self.written, error)
            self._progress().finalized = True
        finally:
            if self.group.is_coordinator:
                self._writers().forget()

    def _require_staged(self) -> StagedWrites:
        if self._staged is None:
            raise CheckpointingException(f"Internal error: the save into {self.describe()} was not staged")
        return self._staged

    def _write_arrays(
        self, records: dict[str, ArrayRecord], ops: list[WriteOp], io_concurrency: int = DEFAULT_IO_CONCURRENCY,
        io_threads: int = DEFAULT_IO_THREADS, packing: Packing | None = None,
    ) -> list[WrittenChunk]:
        """This rank's whole-chunk writes into the save (``execution.save.write_ops``;
        ``packing``: the arrays it packs); what the writers report is kept in
        ``written`` for the commit."""
        chunks = rank_save.write_ops(self.pending, records, ops, io_concurrency, io_threads, packing)
        self.written += chunks
        return chunks

    def commit(self, record: CommitRecord, reports: list[list[WrittenChunk]] | None = None) -> CommitRecord:
        """Coordinator: ``execution.save_commit.commit_save`` with every rank's reports (default:
        this rank's ``written``, a save from one process); returns the committed record."""
        return rank_commit.commit_save(self.pending, record, [self.written] if reports is None else reports)

    def abandon(self) -> None:
        """Coordinator, after a failure every rank knows of: deletes what the save wrote
        (nothing in a caller's directory)."""
        if self._pending is not None:
            self._pending.abandon()

    def release(self) -> None:
        """Lets go of what the save holds, deleting nothing (safe to call again)."""
        if self._pending is not None:
            self._pending.release()

    def unwind(self, error: BaseException) -> None:
        """Every rank, when ``error`` (any exception, an interrupt included) unwinds the
        save. The coordinator deletes what the save staged when no rank can still be
        writing into it: every rank raised the same failure
        (``protocol.stage.every_rank_stopped``), or, before the commit stage began, every
        rank said it stopped writing within ``UNWIND_WAIT_S`` seconds
        (``protocol.stopped_writers``: a Ctrl-C that reached every rank, or one rank
        interrupted while the others had written their part). Otherwise every rank only
        lets go, deleting nothing, and the next save into the same place removes the
        staging directory once its lock is free. The caller re-raises ``error``."""
        if self._pending is None:  # not begun or joined: nothing staged
            return
        writers = self._writers()
        try:
            writers.mark()
            if self.group.is_coordinator and self._no_rank_writes(error, writers):
                self.abandon()
        finally:  # also when a second interrupt ends the wait: nothing stays held
            self.release()
            if self.group.is_coordinator:
                writers.forget()

    def _no_rank_writes(self, error: BaseException, writers: StoppedWriters) -> bool:
        """Coordinator: whether no rank can still write into the save ``error`` unwinds
        (the commit stage not begun: once it has, the checkpoint may be published)."""
        if every_rank_stopped(self.group, error):
            return True
        return self._staged is not None and writers.everyone(UNWIND_WAIT_S)

    def _writers(self) -> StoppedWriters:
        """The count of this save's ranks that stopped writing into it (``SaveProgress``)."""
        return self._progress().writers

    def _progress(self) -> SaveProgress:
        """This rank's progress in the save, one per pending checkpoint."""
        pending = self.pending
        return pending.shared(SaveProgress, lambda: SaveProgress(
            StoppedWriters(self.group, pending.intent.save_id, shared_id=pending.intent.agreed)
        ))


def _site(target: Location, group: Group, callers_directory: bool = False) -> LayoutSite:
    """What a save into ``target`` by ``group`` chooses its layout for (the one place a
    save's site is made): its ranks exchange blocks only where there are several."""
    return LayoutSite.of(target.capabilities, group.world_size, can_exchange=group.world_size > 1,
                         callers_directory=callers_directory)


@dataclass(frozen=True)
class SaveFinalization:
    """The ``AsyncRequest`` finalization of a staged save (``engine.async_requests.
    Finalization``): ``finalize(error)`` commits under the ``save: commit`` stage, given
    the background writer's error; ``abort()`` only releases what the save holds."""

    pipeline: SavePipeline

    @property
    def checkpoint(self) -> str:
        return self.pipeline.describe()

    def finalize(self, error: BaseException | None, written: list[WrittenChunk] | None = None) -> None:
        """Collective: ``SavePipeline.finalize``."""
        with stage("save: commit", self.checkpoint):
            self.pipeline.finalize(error, written)

    def abort(self) -> None:
        """Local, no agreement: releases the save's descriptors and lock, so the next
        save into the same place sees a dead save and removes its files (deleting them
        here could race with other ranks still writing)."""
        self.pipeline.release()

