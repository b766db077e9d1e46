"""PyTorch DCP's own API on shardstore's format: a ``StorageWriter`` and ``StorageReader``.

``dcp.save(state_dict, storage_writer=ShardstoreWriter(path))``, ``dcp.async_save(...)``
and ``dcp.load(state_dict, storage_reader=ShardstoreReader(path))`` read and write the
same Zarr v3 hierarchy as ``shardstore.save`` (local paths and ``s3://``): DCP's planners
decide what each rank writes and reads (deduplication of replicas, resharding), and
this module stores it as shardstore does. A checkpoint written either way loads the
other way and is checked by ``shardstore verify``.

What goes where (the same as ``shardstore.save`` of the same state dict, see
``shardstore.inputs.dtensors``):

* every sharded item (a DTensor: DCP's ``WriteItemType.SHARD``) is a chunk of one
  global array named by its fully qualified name (``model.layers.0.weight``), written by
  the rank DCP's plan gives it, with each chunk's crc32c bound into the commit record;
  where the save's layout shards (``ShardstoreWriter(layout=...)``), an array of small
  blocks on a grid is stored in Zarr v3 shards instead, each block sent to its shard's
  writer in ``write_data`` (``compat.dcp.exchange`` says on which group);
* every plain tensor (DCP's replicated ``WriteItemType.TENSOR``: a DDP or one-process
  model's parameters, Adam's moments) of at least ``min_array_bytes`` is an array of its
  own, its one block written by one of the ranks that hold it, balanced by bytes
  (``shardstore.inputs.plain_tensors``);
* everything else (smaller tensors such as the optimizer's ``step``, Python values such
  as param groups) is the common state, ``common.pt``, nested as the caller's dict was
  (DCP's flattening mappings; a list keeps its length, ``None`` where an array is),
  loaded with ``weights_only`` like every common state.

``ShardstoreWriter`` (here) lists the calls DCP makes in a save and what each does, and
what a failure leaves; ``ShardstoreReader`` (``compat.dcp.reader``) those of a load. What
the save's stages hand each other is ``compat.dcp.parts``; the common state's way to
``common.pt``, ``compat.dcp.common_state``.
"""

from __future__ import annotations

__all__ = ["ShardstoreReader", "ShardstoreWriter"]

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from shardstore.compat.dcp.common_state import (
    common_value,
    given_paths,
    nested_common,
    refuse_unwritten,
    with_dropped_slots,
    write_result,
)
from shardstore.compat.dcp.exchange import (
    exchange_members_match,
    on_another_thread,
    own_group,
    refuse_other_group,
)
from shardstore.compat.dcp.parts import (
    COORDINATOR_PLAN_ITEMS,
    COORDINATOR_PLANS,
    COORDINATOR_PLANS_KEPT,
    DELIVERED_LOCK,
    RECENT_PLANS,
    RECENT_PLANS_KEPT,
    CheckpointId,
    CommonValue,
    CoordinatorPlan,
    HeldPlainTensors,
    PlanAtWrite,
    PlannedPart,
    RankPart,
    Refused,
    WrittenChunks,
    first_delivery,
    gathered_shards,
    id_text,
    is_plain,
    is_sharded,
    new_id,
    plain_kind,
    shard_description,
)
from shardstore.compat.dcp.reader import ShardstoreReader
from shardstore.engine.common_state import COMMON_BACKEND, COMMON_VERSION
from shardstore.engine.zarr_strategies import (
    DEFAULT_SYNC_STAGING_BYTES,
    SHARDSTORE_BACKEND,
    ZARR_VERSION,
    ShardBytes,
    ZarrSaveShardedStrategy,
    checked_staging_bytes,
)
from shardstore.errors import CheckpointingException
from shardstore.execution import RankSave, SavePipeline, fail_before_staging
from shardstore.format import (
    BY_TORCH,
    COMMON_FILE,
    DEFAULT_IO_CONCURRENCY,
    CheckpointingConfig,
    CommitRecord,
    DcpMetadata,
    LayoutSite,
    SaveIntent,
    SaveOptions,
    StorageLayout,
    WrittenChunk,
    serialize,
)
from shardstore.inputs.plain_tensors import (
    DEFAULT_MIN_ARRAY_BYTES,
    HeldTensor,
    assign_writers,
    stored_as_array,
)
from shardstore.mapping import ShardedTensor
from shardstore.opened import bare_location
from shardstore.protocol import Deliver, Group, run_stage
from shardstore.stores import NameLimits

logger = logging.getLogger(__name__)

# What a DCP save writes as ``metadata.json``: shardstore's arrays, torch's common state.
CONFIG = CheckpointingConfig(SHARDSTORE_BACKEND, ZARR_VERSION, COMMON_BACKEND, COMMON_VERSION)

class ShardstoreWriter(StorageWriter):
    """DCP ``StorageWriter`` that writes a shardstore checkpoint: ``dcp.save(state,
    storage_writer=ShardstoreWriter(path))``. What it does at each of DCP's calls, and
    its options at length: docs/guide/dcp-fsdp2.md ("What the writer does at each
    call"). A failure on any rank fails ``dcp.save`` on every rank and commits nothing.

    Args:
        checkpoint_id: where to save (a local path, ``s3://bucket/prefix`` or a
            Location); DCP's ``checkpoint_id=`` replaces it. Other programs' files in a
            local directory are kept beside the checkpoint; another tool's checkpoint
            there is refused.
        overwrite: replace a committed shardstore checkpoint there (on by default, as
            DCP's ``FileSystemWriter`` has it).
        layout: where the bytes go (``StorageLayout``; fields left ``"auto"`` are chosen
            per save from DCP's ranks, the store and whether the ranks can exchange).
            ``max_chunk_bytes``, ``shard_bytes``, ``zarr_metadata`` and
            ``pack_arrays_up_to`` are spellings of its fields (``StorageLayout.of``).
        io_concurrency: chunk writes in flight at once per rank.
        min_array_bytes: a plain tensor of at least this many bytes becomes an array
            of its own; smaller ones stay in ``common.pt``.
        reuse_from: an earlier checkpoint whose unchanged chunks are shared, not
            written again (``shardstore.save``'s ``reuse_from``).
        process_group: the group the ranks exchange blocks on (default: the default
            group, or under ``dcp.async_save`` the writers' own: ``compat.dcp.exchange``).
        sync_staging_bytes: the most host memory a rank's staging copies hold at once.
    """

    def __init__(
        self, checkpoint_id: CheckpointId | None = None, *, overwrite: bool = True,
        max_chunk_bytes: int | Literal["auto"] = "auto", io_concurrency: int = DEFAULT_IO_CONCURRENCY,
        min_array_bytes: int = DEFAULT_MIN_ARRAY_BYTES, reuse_from: CheckpointId | None = None,
        shard_bytes: ShardBytes = "auto", process_group: dist.ProcessGroup | None = None,
        zarr_metadata: str | None = None, sync_staging_bytes: int = DEFAULT_SYNC_STAGING_BYTES,
        pack_arrays_up_to: int | None = None, layout: StorageLayout | None = None,
    ) -> None:
        super().__init__()
        self.checkpoint_id = checkpoint_id
        self.overwrite = overwrite
        self.io_concurrency = io_concurrency
        self.min_array_bytes = min_array_bytes
        self.reuse_from = reuse_from
        # refused now if unknown, out of range or contradicting layout
        self.layout = StorageLayout.of(layout, max_chunk_bytes=max_chunk_bytes, shard_bytes=shard_bytes,
                                       zarr_metadata=zarr_metadata, pack_arrays_up_to=pack_arrays_up_to)
        self.process_group = process_group
        self.sync_staging_bytes = checked_staging_bytes("sync_staging_bytes", sync_staging_bytes)
        self._strategy(self.layout)  # refuses a bound out of range now, not at the save
        # the thread the caller made the writer on: a save on another one is dcp.async_save's
        self._caller_thread: int | None = threading.get_ident()
        self.is_coordinator = False
        self.save_id = new_id()
        self._save: SavePipeline | None = None  # the coordinator's, from plan to finish
        self._commit: CommitRecord | None = None
        self._names_needed: NameLimits | None = None  # the coordinator's, of the plan of _save

    def __getstate__(self) -> dict:
        """What ``dcp.async_save(async_checkpointer_type=PROCESS)`` sends its save
        process: everything but a save in progress; a process group cannot travel."""
        if self.process_group is not None:
            raise CheckpointingException(
                f"ShardstoreWriter({self.checkpoint_id!r}) holds a process group, which cannot travel to another "
                "process (dcp.async_save with AsyncCheckpointerType.PROCESS): leave process_group=None there, the "
                "save process's default group is DCP's"
            )
        # the save process runs the save as a save of its own, on its own default group
        return {**self.__dict__, "_save": None, "_commit": None, "_names_needed": None, "_caller_thread": None}

    def reset(self, checkpoint_id: CheckpointId | None = None) -> None:
        """A new save: its checkpoint id (when given) and a new DCP save id."""
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id
        self.save_id = new_id()

    def storage_meta(self) -> StorageMeta:
        """DCP's ids of this save, as ``FileSystemWriter`` gives them (a save id of its
        own per ``reset``, not shardstore's record's): handed to the planner, and
        recorded at the commit for ``ShardstoreReader.read_metadata``."""
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def _open_save(self, layout: StorageLayout, group: Group | None) -> SavePipeline:
        """This rank's view of the save (``execution.pipeline``): the one place the
        target and the checkpoint reused from are opened. DCP's ranks talk through its
        plans and results; they exchange blocks themselves only where
        ``RankPart.exchange``, on ``group`` (the coordinator's planning: ``process_group``;
        the writes: ``_collective_group``); otherwise (None) the pipeline's group is this
        process alone. The target is a shared directory, as ``FileSystemWriter``
        takes one: the checkpoint is published beside the files other programs keep
        there (``format.commit.SaveOptions``)."""
        options = SaveOptions(overwrite=self.overwrite, reuse_from=self.reuse_from, shared_directory=True,
                              layout=layout)
        return SavePipeline.open(bare_location(self._target()), group, options=options, config=CONFIG)

    def _target(self) -> CheckpointId:
        """Where this save goes (``checkpoint_id``), refused where none was given."""
        if self.checkpoint_id is None:
            raise CheckpointingException("ShardstoreWriter has no checkpoint path: pass one, or checkpoint_id= to dcp.save")
        return self.checkpoint_id

    @staticmethod
    def _strategy(layout: StorageLayout) -> ZarrSaveShardedStrategy:
        """How the coordinator plans the chunks by ``layout`` (DCP's plan already chose
        each block's writer among its replicas)."""
        return ZarrSaveShardedStrategy(fully_parallel=False, layout=layout)

    def _chosen(self, plans: list[SavePlan]) -> tuple[StorageLayout, bool]:
        """Coordinator: this save's layout, chosen for DCP's ranks, the store and whether
        the ranks can exchange blocks (``compat.dcp.exchange``), and whether they do: where
        it shards or packs (small split arrays are gathered whole into a rank's pack: a
        file per rank instead of a chunk file per block and a directory per array).

        Raises:
            CheckpointingException: an explicit ``shard_bytes`` where they cannot."""
        ranks = len(plans)
        can = ranks > 1 and exchange_members_match(plans)
        site = LayoutSite.of(bare_location(self._target()).capabilities, ranks, can)
        layout = self.layout.chosen_for(site)
        if ranks > 1 and not can and layout.shard_bytes is not None:
            refuse_other_group(plans, id_text(self.checkpoint_id) or "")
        return layout, can and (layout.shard_bytes is not None or layout.pack_arrays_up_to > 0)

    def _as_array(self, item: WriteItem) -> bool:
        """A plain tensor's item that is written as an array (the same answer on every
        rank: it depends on the item alone). A sparse tensor is none: it goes to the
        common state as it is."""
        if not is_plain(item):
            return False
        properties = item.tensor_data.properties
        return (
            properties.dtype in BY_TORCH and properties.layout == torch.strided
            and stored_as_array(tuple(item.tensor_data.size), item.tensor_storage_size() or 0, self.min_array_bytes)
        )

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """All ranks. The coordinator abandons a save of this writer that DCP never
        finished (a rank failed in an earlier ``dcp.save``): every rank is past it now.
        A save of several ranks without DCP's collectives is refused
        (``_refuse_uncoordinated``)."""
        self._refuse_uncoordinated(kwargs.get("use_collectives", True))
        self.is_coordinator = is_coordinator
        if self._save is not None:
            logger.warning("Abandoning the unfinished save into %s", self._save.describe())
            self._save.abandon()
            self._save = None

    def _refuse_uncoordinated(self, use_collectives: bool) -> None:
        """Refuses ``dcp.save(use_collectives=False)`` where there are several ranks: DCP
        then plans and finishes every rank's save alone, and each would commit a
        checkpoint of its own part into the same place, one replacing another."""
        if use_collectives is False and (ranks := Group(self.process_group).world_size) > 1:
            raise CheckpointingException(
                f"Saving {id_text(self.checkpoint_id)}: dcp.save(use_collectives=False) saves each of the {ranks} "
                "ranks on its own, and a ShardstoreWriter checkpoint is one commit of every rank's part; nothing "
                "was written. Save with use_collectives=True (the default)"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """All ranks: names the plain tensors this rank holds that become arrays and,
        with ``shard_bytes``, its place in the group it would exchange blocks on."""
        return replace(plan, storage_data=self._held(plan.items))

    def _held(self, items: list[WriteItem]) -> HeldPlainTensors:
        """What a rank holding ``items`` tells the coordinator."""
        plain = tuple(map(plain_kind, filter(is_plain, items)))
        group = Group(self.process_group)  # checked where the ranks would exchange (``_chosen``)
        member = (group.rank, group.world_size)
        return HeldPlainTensors(tuple(filter(self._as_array, items)), plain, member, self._held_settings())

    def _held_settings(self) -> tuple:
        """The settings ``_held``'s answer depends on."""
        return self.min_array_bytes, self.layout

    def _holds_as_now(self, plan: SavePlan) -> bool:
        """Whether a plan's ``HeldPlainTensors``, where it has one, was made under this
        writer's settings (else DCP's plan cache gave the coordinator an earlier save's
        local plan, made by a writer with other settings)."""
        held = plan.storage_data
        return not isinstance(held, HeldPlainTensors) or held.settings == self._held_settings()

    def _collective_group(self) -> Group:
        """Every rank, in ``write_data``: the group the writer's own collectives run on:
        ``process_group``, or the default group, or on a thread other than the one that
        made the writer (``dcp.async_save``'s), the writers' own (``compat.dcp.exchange``)."""
        if on_another_thread(self.process_group, self._caller_thread) and Group().world_size > 1:
            return Group(own_group())
        return Group(self.process_group)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: validates and plans the global layout, then begins the save
        (``SavePipeline.begin``: the staging area and ``metadata.json``); each rank's plan
        carries the save's intent, which it joins in ``write_data``.

        With DCP's plan caching: where DCP sent some ranks' plans as unchanged
        (``SavePlan(usable=False)``), or a plan's holdings are an earlier writer's, the
        plan is made in ``write_data`` instead (``PlanAtWrite``). DCP has cached the
        plans by now wherever one is usable, so a refusal then reaches the ranks as
        their part (``Refused``), not as an exception here."""
        if not any(plan.usable for plan in plans):  # DCP changed no cache: refusing here is safe
            self._refuse_planning_size(len(plans))
            return plans
        if not all(plan.usable and self._holds_as_now(plan) for plan in plans):
            return [replace(plan, storage_data=PlanAtWrite(len(plans))) if plan.usable else plan for plan in plans]
        try:
            parts: list[RankPart | Refused] = list(self._planned(plans))
        except Exception as exc:
            if not isinstance(exc, CheckpointingException):
                logger.exception("Planning checkpoint %s failed", id_text(self.checkpoint_id))
            parts = [Refused(new_id(), _refusal(exc, id_text(self.checkpoint_id)), len(plans))] * len(plans)
        return [replace(plan, storage_data=part) for plan, part in zip(plans, parts)]

    def _planned(self, plans: list[SavePlan]) -> list[RankPart]:
        """Coordinator: every rank's part of a save planned from DCP's plans (each
        carrying its rank's ``HeldPlainTensors``); begins the save. Where every rank
        holds what it held at a recent save (``COORDINATOR_PLANS``), that plan is taken
        again with this save's intent: planning 192 tensors of 2 ranks took 15 ms."""
        layout, exchange = self._chosen(plans)
        inputs = self._coordinator_inputs(plans, layout, exchange)
        with DELIVERED_LOCK:
            recent = next((p for p in COORDINATOR_PLANS if p.inputs == inputs), None)
        if recent is not None and (parts := self._begun_again(recent)) is not None:
            return parts
        save = self._open_save(layout, Group(self.process_group) if exchange else None)
        _refuse_divergent_replicas(plans, save.describe())
        shards, orders = gathered_shards(plans, _plain_array_writers(plans, self._as_array))
        parts, self._names_needed = save.plan_gathered(shards, self._strategy(layout).plan_save)
        self._save, self._commit = save, parts[0].plan.commit
        plan_id = new_id()
        rank_parts = [RankPart(part, order, exchange, len(plans), plan_id, layout) for part, order in zip(parts, orders)]
        if sum(len(plan.items) for plan in plans) <= COORDINATOR_PLAN_ITEMS:
            with DELIVERED_LOCK:
                kept = [p for p in COORDINATOR_PLANS if p.inputs != inputs]
                COORDINATOR_PLANS[:] = [CoordinatorPlan(inputs, tuple(rank_parts), self._names_needed), *kept][
                    :COORDINATOR_PLANS_KEPT]
        return rank_parts

    def _coordinator_inputs(self, plans: list[SavePlan], layout: StorageLayout, exchange: bool) -> tuple:
        """What the coordinator's plan of a save depends on (``CoordinatorPlan.inputs``)."""
        return tuple((tuple(plan.items), plan.storage_data) for plan in plans), self._held_settings(), layout, exchange

    def _begun_again(self, recent: CoordinatorPlan) -> list[RankPart] | None:
        """Coordinator: the parts of ``recent``'s plan for a new save into this writer's
        checkpoint, begun (``_begin_reused``; None, nothing begun: its store takes
        shorter names than the plan's files have, and the save is planned anew)."""
        intent = self._begin_reused(recent.parts[0], recent.names_needed, len(recent.parts))
        if intent is None:
            return None
        return [replace(part, save=RankSave(intent, part.save.plan)) for part in recent.parts]

    def _planning_group(self, ranks: int) -> Group:
        """The group the ranks plan a save on in ``write_data`` (``_planned_at_write``):
        this process alone for one rank, else the writer's (``_collective_group``).
        Refused, before any rank writes: one whose size is not DCP's."""
        if ranks == 1:
            return Group.local()
        self._refuse_planning_size(ranks)
        return self._collective_group()

    def _refuse_planning_size(self, ranks: int) -> None:
        """Refuses to plan at write on a group whose size is not DCP's ``ranks`` (the
        writers' own has the default group's); makes no group."""
        if ranks > 1 and (size := Group(self.process_group).world_size) != ranks:
            raise CheckpointingException(
                f"Saving {id_text(self.checkpoint_id)}: with DCP's plan caching, ShardstoreWriter plans the save in "
                f"write_data on its process group, which has {size} ranks where dcp.save has {ranks}. "
                "Pass the group given to dcp.save(process_group=...) as ShardstoreWriter(process_group=...)"
            )

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """All ranks: this rank's arrays' metadata and chunks, durable; the results
        carry the chunks' checksums and this rank's common values to the coordinator."""
        part = self._this_saves_part(plan, planner)
        save = self._joined(part)
        try:
            written = self._write_shards(part, planner, save)
            results = [write_result(item, planner, self._as_array(item)) for item in plan.items]
            in_plan = {item.index for item in plan.items}
            # a plain array DCP's deduplication gave another rank: its result travels from here
            results += [write_result(item, planner, True) for item in part.items if item.index not in in_plan]
        except CheckpointingException:
            raise
        except Exception as exc:
            raise CheckpointingException(f"Writing checkpoint {save.describe()} failed: {exc}") from exc
        finally:
            if not self.is_coordinator:
                save.release()
        if results and written.chunks:  # the chunks travel on the first result, beside its own value
            results[0] = replace(results[0], storage_data=replace(written, common=results[0].storage_data))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _this_saves_part(self, plan: SavePlan, planner: SavePlanner) -> RankPart:
        """This rank's part of this save: the one its plan carries (or the coordinator's
        refusal, raised), or, where the plan is an earlier save's that DCP's plan cache
        handed back (an earlier part or refusal, or another writer's) or a
        ``PlanAtWrite``, one planned now by every rank together. Every rank takes the
        same way: DCP hands back a cached plan exactly where the coordinator saw an
        unusable one, and then gave every usable one a ``PlanAtWrite``. Where ``planner``
        caches plans, the part is kept among the recent plans."""
        caching = _caches_plans(planner)
        data = plan.storage_data
        if isinstance(data, (RankPart, Refused)) and first_delivery(data):
            if isinstance(data, Refused):
                raise CheckpointingException(data.message)
            if caching:
                self._remember(self._plan_inputs(plan, data.ranks), data)
            return data
        if isinstance(data, (RankPart, Refused, PlanAtWrite)):
            ranks = data.ranks
        else:  # another writer's plan, cached by DCP under the same planner class
            ranks = Group(self.process_group).world_size
        group = self._planning_group(ranks)
        inputs = self._plan_inputs(plan, ranks)
        part = self._reused_at_write(inputs, plan, planner, group) or self._planned_at_write(plan, group)
        if caching:
            self._remember(inputs, part)
        return part

    def _plan_inputs(self, plan: SavePlan, ranks: int) -> tuple:
        """What this rank's part of a save's plan depends on, besides the other ranks'
        (which they compare): its rank and the number of ranks, the writer's settings
        that shape a plan and its items. What it holds (``_held``) follows from them:
        the items by the settings, its place in the exchange group (``process_group``,
        the planning group) by the rank."""
        rank = Group(self.process_group).rank if ranks > 1 else 0
        return rank, ranks, self._held_settings(), tuple(plan.items)

    def _remember(self, inputs: tuple, part: RankPart) -> None:
        """Keeps ``part``, delivered to this rank for a plan with ``inputs``
        (``_plan_inputs``), among the recent plans (``RECENT_PLANS``), with the
        coordinator's ``names_needed``."""
        entry = PlannedPart(inputs, part, self._names_needed if self.is_coordinator else None)
        with DELIVERED_LOCK:
            kept = [e for e in RECENT_PLANS if e.part.plan_id != part.plan_id]
            RECENT_PLANS[:] = [entry, *kept][:RECENT_PLANS_KEPT]

    def _reused_at_write(
        self, inputs: tuple, plan: SavePlan, planner: SavePlanner, group: Group,
    ) -> RankPart | None:
        """Collective on ``group`` (one small stage): where every rank holds a part of
        the same recent plan made for the ``inputs`` it has now (``_plan_inputs`` of
        ``plan``: DCP's plan cache handed it back its items), that plan with a new save: the
        coordinator begins it (``SavePipeline.begin_planned``) and every rank joins it
        with its own part. None on every rank otherwise (the ranks then plan in full).
        A rank whose inputs did not change between two recent plans holds a part of
        each: every rank names all of its own, the newest plan they all hold is taken."""
        with DELIVERED_LOCK:
            recent = [e for e in RECENT_PLANS if e.inputs == inputs]
        mine = {e.part.plan_id: e for e in recent if _still_holds(e.part, plan, planner)}

        def decide(held: list[tuple[str, ...]]) -> list[tuple[str, SaveIntent] | None]:
            common = set(held[0]).intersection(*held[1:])
            newest = next((mine[i] for i in held[0] if i in common and mine[i].names_needed is not None), None)
            intent = (self._begin_reused(newest.part, cast(NameLimits, newest.names_needed), len(held))
                      if newest is not None else None)
            return [(newest.part.plan_id, intent) if newest is not None and intent is not None else None] * len(held)

        where = id_text(self.checkpoint_id)
        reused = run_stage(group, f"Checking the cached plans of checkpoint {where} (DCP's plan cache is on)",
                           lambda: tuple(mine), reduce=decide, deliver=Deliver.SCATTER)
        if reused is None:
            return None
        plan_id, intent = reused
        part = replace(mine[plan_id].part, save=RankSave(intent, mine[plan_id].part.save.plan))
        first_delivery(part)
        return part

    def _begin_reused(self, part: RankPart, names_needed: NameLimits, ranks: int) -> SaveIntent | None:
        """Coordinator: begins a save by the plan ``part`` is one rank's part of (made
        for ``ranks`` ranks, whose files have names up to ``names_needed``), into this
        writer's checkpoint (None, nothing begun: its target stores shorter names than
        the plan's files have)."""
        save = self._open_save(part.layout, Group(self.process_group) if part.exchange else None)
        intent = save.begin_planned(ranks, names_needed)
        if intent is not None:
            self._save, self._commit, self._names_needed = save, part.save.plan.commit, names_needed
        return intent

    def _planned_at_write(self, plan: SavePlan, group: Group) -> RankPart:
        """Collective on the writer's process group (one stage: every rank's items and
        holdings, ``_held``, gathered to the coordinator, which plans as
        ``prepare_global_plan`` does and begins the save; each rank's part scattered):
        the plan of a save where DCP's plan cache sent some ranks their previous plan.
        Their items are the same as then (that is what the cache decided); what else
        they hold is taken from their items; the save, its staging area and its intent
        are new."""
        where = id_text(self.checkpoint_id)
        part = run_stage(group, f"Planning checkpoint {where} (DCP's plan cache is on)",
                         lambda: replace(plan, storage_data=self._held(plan.items)),
                         reduce=self._planned, deliver=Deliver.SCATTER)
        first_delivery(part)
        return part

    def _joined(self, part: RankPart) -> SavePipeline:
        """This rank's pipeline of the save, joined. Where the ranks exchange blocks, a
        failure here is told to the peers, which wait in the exchange's agreement
        (``SavePipeline.write_plan``): every rank raises it, none waits for a timeout."""
        group = self._collective_group() if part.exchange else None
        try:
            if self.is_coordinator:
                save = self._coordinators_writes(group)
            else:
                save = self._open_save(part.layout, group)
                save.join(part.save.intent)
            return save
        except Exception as exc:
            if group is not None:
                fail_before_staging(group, id_text(self.checkpoint_id), exc)
            raise

    def _coordinators_writes(self, group: Group | None) -> SavePipeline:
        """Coordinator: the pipeline it writes its part through, the save it began
        (``prepare_global_plan``) on ``group``, the writers' own (made only once every
        rank reached ``write_data``, after the save was opened), or on this process
        alone (None). The planning pipeline stays as it was opened; both hold the one
        pending checkpoint, which ``finish`` commits."""
        if self._save is None:
            raise CheckpointingException("ShardstoreWriter.write_data on the coordinator without a save in progress")
        if group is None:
            return self._save
        return SavePipeline(self._save.target, group, config=CONFIG, pending=self._save.pending)

    def _write_shards(self, part: RankPart, planner: SavePlanner, save: SavePipeline) -> WrittenChunks:
        """This rank's arrays' ``zarr.json`` files and chunks (the blocks of sharded
        arrays exchanged first, ``RankPart.exchange``), durable before it reports."""
        tensors: list[ShardedTensor] = []
        error = None
        try:
            tensors = [replace(shard_description(item), data=_resolved(item, planner, save.describe()))
                       for item in part.items]
        except Exception as exc:  # told to every rank by the staging stage's agreement
            error = exc
        return WrittenChunks(tuple(save.write_plan(part.save.plan, tensors, self.io_concurrency, error,
                                                   self.sync_staging_bytes)))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: writes common.pt and commits, DCP's metadata (its planner's
        paths, the storage ids) sealed in the commit record, then completes the
        ``metadata`` ``dcp.save`` returns (``_complete``); on failure nothing is
        committed and the save's files are deleted."""
        save, commit = self._save, self._commit
        self._save = self._commit = None
        if save is None or commit is None:
            raise CheckpointingException("ShardstoreWriter.finish without a save in progress (is this the coordinator?)")
        where = save.describe()
        try:
            reports, common = [], {}
            for rank_results in results:
                chunks: list[WrittenChunk] = []
                for result in rank_results:
                    data = result.storage_data
                    if isinstance(data, WrittenChunks):
                        chunks += data.chunks
                        data = data.common
                    if isinstance(data, CommonValue):
                        common[data.fqn] = common_value(data, where)
                reports.append(chunks)
            refuse_unwritten(metadata, commit, common, where)
            given = given_paths(metadata)
            recorded = self._dcp_metadata(given, where)
            if recorded.paths is not None:
                # a fresh dict per slot: one object pickled at two places loads as one, shared
                common.update({name: {} for name in recorded.paths.keys() - given.keys()})
            mappings = given if recorded.paths is None else recorded.paths
            # durable by itself (an fsync of the file, not a second syncfs of the file system)
            save.location.write_atomic(COMMON_FILE, serialize(nested_common(common, mappings)))
            save.commit(replace(commit, dcp=recorded), reports)
            _complete(metadata, self.storage_meta())
        except BaseException as exc:
            save.abandon()
            if isinstance(exc, Exception) and not isinstance(exc, CheckpointingException):
                raise CheckpointingException(f"Committing checkpoint {where} failed: {exc}") from exc
            raise

    def _dcp_metadata(self, given: Any, where: str) -> DcpMetadata:
        """What the commit record keeps of DCP's metadata: the paths it was given
        (``given``: ``given_paths``) with the list slots its flattening dropped
        (``with_dropped_slots``), and this save's ``storage_meta``."""
        paths = with_dropped_slots(given)
        if paths is None:
            # a custom planner's own data: DCP's writer pickles it; a JSON record cannot
            logger.warning(
                "Saving %s: the planner's planner_data is not DCP's flattening mapping of a state dict, so it is not "
                "kept; a load without a state dict (dcp_to_torch_save's planner) gives the saved names flat", where,
            )
        ids = self.storage_meta()
        return DcpMetadata(paths, id_text(ids.checkpoint_id), ids.save_id, tuple(ids.modules))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: CheckpointId) -> bool:
        try:
            bare_location(checkpoint_id)
        except Exception:  # noqa: BLE001  (any reason: not a place we can write)
            return False
        return True

def _complete(metadata: Metadata, storage_meta: StorageMeta) -> None:
    """Completes the Metadata ``dcp.save`` returns (and ``dcp.async_save``'s future) as
    DCP's ``FileSystemWriter.finish`` does: this save's ids and DCP's metadata version."""
    metadata.storage_meta = storage_meta
    metadata.version = CURRENT_DCP_VERSION

def _still_holds(part: RankPart, plan: SavePlan, planner: SavePlanner) -> bool:
    """Whether this rank still holds, as planned, every item ``part`` has it write: its
    plan's own, and each plain array the writer gave it that DCP's deduplication gave
    another rank (``_plain_array_writers`` chose among the ranks that held it then; its
    items alone do not say it still does)."""
    in_plan = {item.index for item in plan.items}
    for item in part.items:
        if item.index in in_plan:
            continue
        try:
            data = planner.resolve_data(item)
        except ValueError:  # DCP's "Could not find FQN": the rank no longer holds it, a re-plan decides
            return False
        if not isinstance(data, torch.Tensor) or tuple(data.shape) != tuple(item.tensor_data.size):
            return False
    return True

def _caches_plans(planner: SavePlanner) -> bool:
    """Whether ``planner`` caches its plans (``DefaultSavePlanner(enable_plan_caching=
    True)`` and its subclasses): only then may a later save hand this one's parts back."""
    return bool(getattr(planner, "_enable_plan_caching", False))

def _refuse_divergent_replicas(plans: list[SavePlan], where: str) -> None:
    """Refuses a plain tensor that ranks hold under one name with different shapes or
    dtypes. DCP keeps one rank's copy of a replicated value; here one rank's copy could
    become an array while another's, below the threshold, went to the common state, and
    the checkpoint committed would then fail every load, or which copy is kept would
    depend on the order of the ranks. Each rank's plain tensors before DCP's
    deduplication are in its ``HeldPlainTensors``; where a planner dropped that, what
    deduplication left in its items."""
    seen: dict[str, dict[tuple, list[int]]] = {}
    for rank, plan in enumerate(plans):
        held = plan.storage_data.plain if isinstance(plan.storage_data, HeldPlainTensors) else ()
        left = map(plain_kind, filter(is_plain, plan.items))
        for name, size, dtype in {*held, *left}:
            seen.setdefault(name, {}).setdefault((size, dtype), []).append(rank)
    for name, kinds in seen.items():
        if len(kinds) > 1:
            holders = "; ".join(f"rank(s) {ranks}: {dtype} {list(size)}" for (size, dtype), ranks in kinds.items())
            raise CheckpointingException(
                f"Saving {where}: ranks hold {name!r} with different shapes or dtypes ({holders}). DCP keeps one copy "
                "of a replicated tensor: save each rank's own tensor under a name of its own"
            )

def _plain_array_writers(plans: list[SavePlan], as_array: Callable[[WriteItem], bool]) -> list[list[WriteItem]]:
    """Per rank, the plain tensors it writes as arrays: each by one of the ranks that
    hold it, balanced by bytes (``plain_tensors.assign_writers``). A rank holds those its
    local plan named and those left in its plan (also where a planner dropped what
    ``prepare_local_plan`` named: every array item of every plan is written)."""
    held = []
    for plan in plans:
        named = plan.storage_data.items if isinstance(plan.storage_data, HeldPlainTensors) else ()
        by_index = {item.index: item for item in (*named, *filter(as_array, plan.items))}
        held.append(tuple(by_index.values()))
    writers = assign_writers(
        [[HeldTensor(item.index.fqn, item.tensor_storage_size() or 0) for item in items] for items in held],
        [sum(item.tensor_storage_size() or 0 for item in plan.items if is_sharded(item)) for plan in plans],
    )
    return [[item for item in items if writers[item.index.fqn] == rank] for rank, items in enumerate(held)]

def _refusal(exc: Exception, where: str | None) -> str:
    """What every rank raises for the coordinator's failure to plan a save of the
    checkpoint ``where`` names (``id_text``)."""
    if isinstance(exc, CheckpointingException):
        return str(exc)
    return f"Planning checkpoint {where} failed on the coordinator: {type(exc).__name__}: {exc}"

def _resolved(item: WriteItem, planner: SavePlanner, where: str) -> Any:
    """An item's data from the planner, refused where its dtype is not the plan's: DCP's
    plan cache (``enable_plan_caching=True``) compares names, shapes and offsets, not
    dtypes, so a tensor whose dtype changed since the plan was cached arrives with the
    old one."""
    data = planner.resolve_data(item)
    planned = item.tensor_data.properties.dtype if item.tensor_data is not None else None
    if isinstance(data, torch.Tensor) and planned is not None and data.dtype != planned:
        raise CheckpointingException(
            f"Saving {where}: {item.index.fqn!r} is {data.dtype} and DCP's plan has it as {planned}. DCP's plan cache "
            "(enable_plan_caching=True) does not see a tensor's dtype change: save with enable_plan_caching=False "
            "from now on"
        )
    return data
