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
  writer in ``write_data`` (``tools.dcp_exchange`` says on which group);
* every plain tensor (DCP's replicated ``WriteItemType.TENSOR``: a DDP or one-process
  model's parameters, Adam's moments) of at least ``min_array_bytes`` is an array of its
  own, its one block written by one of the ranks that hold it, balanced by bytes
  (``shardstore.inputs.plain_tensors``);
* everything else (smaller tensors such as the optimizer's ``step``, Python values such
  as param groups) is the common state, ``common.pt``, nested as the caller's dict was
  (DCP's flattening mappings; a list keeps its length, ``None`` where an array is),
  loaded with ``weights_only`` like every common state.

``ShardstoreWriter`` lists the calls DCP makes in a save and what each does, and what a
failure leaves; ``ShardstoreReader`` those of a load.
"""

from __future__ import annotations

__all__ = ["ShardstoreReader", "ShardstoreWriter"]

import io
import logging
import math
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from shardstore.dict_utils import flatten
from shardstore.errors import CheckpointingException
from shardstore.execution import RankSave, SavePipeline, fail_before_staging
from shardstore.format import (
    BY_TORCH,
    COMMON_FILE,
    DEFAULT_IO_CONCURRENCY,
    ArrayChunks,
    CheckpointingConfig,
    CommitRecord,
    DcpMetadata,
    LayoutSite,
    SaveIntent,
    SaveOptions,
    StatePath,
    StorageLayout,
    WrittenChunk,
    cast_checked,
    chunk_store_for,
    from_zarr_name,
    holds_its_values,
    load_torch,
    numpy_to_tensor,
    read_region,
    run_reads,
    serialize,
    state_paths,
    tensor_to_numpy,
)
from shardstore.inputs.dtensors import fqn
from shardstore.inputs.plain_tensors import (
    DEFAULT_MIN_ARRAY_BYTES,
    HeldTensor,
    assign_writers,
    stored_as_array,
)
from shardstore.mapping import ShardedTensor
from shardstore.opened import bare_location, open_read
from shardstore.protocol import Deliver, Group, run_stage
from shardstore.serialization import verify_checkpoint_and_load_strategy
from shardstore.stores import Location, NameLimits
from shardstore.strategies.common import COMMON_BACKEND, COMMON_VERSION
from shardstore.strategies.zarr import (
    DEFAULT_SYNC_STAGING_BYTES,
    SHARDSTORE_BACKEND,
    ZARR_VERSION,
    ShardBytes,
    ZarrLoadShardedStrategy,
    ZarrSaveShardedStrategy,
    checked_staging_bytes,
)
from shardstore.tools.dcp_exchange import (
    exchange_members_match,
    on_another_thread,
    own_group,
    refuse_other_group,
)

logger = logging.getLogger(__name__)

CheckpointId = str | os.PathLike | Location
# What a DCP save writes as ``metadata.json``: shardstore's arrays, torch's common state.
CONFIG = CheckpointingConfig(SHARDSTORE_BACKEND, ZARR_VERSION, COMMON_BACKEND, COMMON_VERSION)


# --------------------------------------------------------------------------- save


@dataclass(frozen=True)
class RankPart:
    """What the coordinator's plan gives one rank (``SavePlan.storage_data``).

    Attributes:
        save: the save this rank joins and its part of shardstore's save plan.
        items: the sharded write items it writes, in the order ``save.plan`` numbers them.
        exchange: the ranks exchange blocks in ``write_data`` (a layout that shards, in
            a save of several ranks; ``tools.dcp_exchange``).
        ranks: how many ranks the save has (DCP's plans): the group a later save plans
            on where DCP's plan cache hands this part back (``PlanAtWrite``).
        plan_id: the planning that made it (the same in every rank's part): a later save
            whose every rank holds a part of it, for the same inputs, reuses it
            (``ShardstoreWriter._reused_at_write``).
    """

    save: RankSave
    items: tuple[WriteItem, ...]
    exchange: bool = False
    ranks: int = 1
    plan_id: str = ""
    layout: StorageLayout = StorageLayout()

    @property
    def part_id(self) -> str:
        """Unique to the save it was planned for (``_first_delivery``)."""
        return self.save.intent.save_id


@dataclass(frozen=True)
class Refused:
    """The coordinator's refusal of a save, given to every rank in place of its part
    where DCP had already cached the save's plans (a raise in ``prepare_global_plan``
    would leave DCP's plan cache half made: no rank's ``finish_plan`` would run, and
    the next save would be planned from two different saves' plans). Every rank raises
    it in ``write_data``; handed back by DCP's cache at a later save, it is an earlier
    save's plan like any other (``PlanAtWrite``).

    Attributes:
        part_id: unique to this refusal.
        message: what every rank raises.
        ranks: how many ranks the save has.
    """

    part_id: str
    message: str
    ranks: int


@dataclass(frozen=True)
class PlanAtWrite:
    """The coordinator's word to a rank where it did not plan the save: the save is
    planned in ``write_data``, every rank together (``ShardstoreWriter._planned_at_write``).
    Given where DCP's plan cache sent some ranks their previous plan (they then hold an
    earlier save's part, or another writer's), or where a rank's plan carries what it
    held under other writer settings (``HeldPlainTensors.settings``: DCP's cached local
    plan of an earlier save).

    Attributes:
        ranks: how many ranks the save has.
    """

    ranks: int


# The ids of the parts (``RankPart``, ``Refused``) that reached ``write_data`` in this
# process: a part DCP's plan cache hands back is one of them. One short string per
# save, kept for the process's life: DCP may hand back its first save's part at any
# later save.
_DELIVERED: set[str] = set()
_DELIVERED_LOCK = threading.Lock()


@dataclass(frozen=True)
class _Planned:
    """A part this process wrote a save by, and what it was planned from.

    Attributes:
        inputs: ``ShardstoreWriter._plan_inputs`` of the rank's plan: its rank, the
            number of ranks, the writer's settings and its items (what it holds,
            ``HeldPlainTensors``, follows from them).
        part: the rank's part.
        names_needed: on the coordinator, the longest names the plan's files have
            (``SavePipeline.begin_planned``); None elsewhere.
    """

    inputs: tuple
    part: RankPart
    names_needed: NameLimits | None = None


# The parts this process most recently wrote saves by where the planner caches plans
# (``_caches_plans``), newest first: a save whose every rank holds a part of the same
# plan, for the inputs it has now, reuses that plan (``ShardstoreWriter._reused_at_write``).
# A few, for a process that saves several state dicts in turn; DCP's plan cache holds
# the same parts.
_RECENT_PLANS: list[_Planned] = []
_RECENT_PLANS_KEPT = 4


def _first_delivery(part: RankPart | Refused) -> bool:
    """Whether ``part`` reaches ``write_data`` for the first time in this process
    (marks it delivered): False for an earlier save's part, which DCP's plan cache
    (``DefaultSavePlanner(enable_plan_caching=True)``) hands back in place of a new one
    where a rank's plan did not change."""
    with _DELIVERED_LOCK:
        if part.part_id in _DELIVERED:
            return False
        _DELIVERED.add(part.part_id)
        return True


@dataclass(frozen=True)
class CommonValue:
    """A value of the common state, on its way to the coordinator (on its WriteResult):
    the ``torch.save`` bytes of a tensor (``_saved_bytes``), or those DCP's planner
    serialized a Python value to. Never a tensor itself: DCP pickles the results, and
    torch's pickling of some dtypes (complex32, float8_e8m0fnu, the fnuz float8s,
    float4) does not load back."""

    fqn: str
    value: bytes


@dataclass(frozen=True)
class HeldPlainTensors:
    """What a rank's local plan tells the coordinator (``SavePlan.storage_data``): the
    plain tensors it holds that become arrays, each of which it could write (DCP's
    deduplication keeps a replicated item in one plan only), the name, shape and
    dtype of every plain tensor it holds (``_refuse_divergent_replicas``), and its rank
    and the size of the group it exchanges blocks on (``refuse_other_group``). DCP's
    plan cache may hand the coordinator one made by an earlier save's writer:
    ``settings`` tells."""

    items: tuple[WriteItem, ...]
    plain: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = ()
    member: tuple[int, int] | None = None
    settings: tuple = ()  # the writer's settings it was made under (``ShardstoreWriter._held_settings``)


@dataclass(frozen=True)
class WrittenChunks:
    """A rank's report to the coordinator (on its first WriteResult): every chunk it
    wrote, and the common value that result carries (DCP gives one storage_data per
    result: neither may replace the other)."""

    chunks: tuple[WrittenChunk, ...]
    common: CommonValue | None = None


def _is_sharded(item: WriteItem) -> bool:
    return item.type == WriteItemType.SHARD


def _is_plain(item: WriteItem) -> bool:
    return item.type == WriteItemType.TENSOR


def _plain_kind(item: WriteItem) -> tuple[str, tuple[int, ...], torch.dtype]:
    """A plain tensor's name, shape and dtype."""
    return item.index.fqn, tuple(item.tensor_data.size), item.tensor_data.properties.dtype


def shard_description(item: WriteItem) -> ShardedTensor:
    """A sharded write item as shardstore's description of a shard, without its data
    (as ``inputs.dtensors`` describes a DTensor's block): on no regular grid (DCP's
    blocks may be uneven), a main replica (DCP's plan already gave each replicated block
    to one rank)."""
    data = item.tensor_data
    return ShardedTensor(
        item.index.fqn, None, data.properties.dtype, tuple(data.chunk.sizes), tuple(data.size),
        tuple(data.chunk.offsets), None,
    )


def gathered_shards(
    plans: list[SavePlan], plain_arrays: list[list[WriteItem]] | None = None,
) -> tuple[list[list[ShardedTensor]], list[tuple[WriteItem, ...]]]:
    """Every rank's sharded items and the plain tensors it writes as arrays
    (``plain_arrays``, per rank: each a block that is the whole array) as shardstore's
    shard descriptions (``SavePipeline.plan_gathered`` plans them), and each rank's items
    in the same order. Empty shards (uneven sharding) hold nothing and are left out; an
    array with no elements at all keeps one empty block, so it is still recorded."""
    per_rank: list[list[ShardedTensor]] = []
    orders: list[tuple[WriteItem, ...]] = []
    empty_arrays: set[str] = set()
    for rank, plan in enumerate(plans):
        shards: list[ShardedTensor] = []
        order: list[WriteItem] = []
        for item in [*filter(_is_sharded, plan.items), *(plain_arrays[rank] if plain_arrays else ())]:
            shard = shard_description(item)
            if math.prod(shard.local_shape) == 0:
                if math.prod(shard.global_shape) != 0 or shard.key in empty_arrays:
                    continue
                empty_arrays.add(shard.key)
                shard = replace(shard, global_offset=(0,) * len(shard.global_shape), local_shape=shard.global_shape)
            shards.append(shard)
            order.append(item)
        per_rank.append(shards)
        orders.append(tuple(order))
    return per_rank, orders


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
            group, or under ``dcp.async_save`` the writers' own: ``tools.dcp_exchange``).
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
        self.save_id = _new_id()
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
        self.save_id = _new_id()

    def storage_meta(self) -> StorageMeta:
        """DCP's ids of this save, as ``FileSystemWriter`` gives them (a save id of its
        own per ``reset``, not shardstore's record's): handed to the planner, and
        recorded at the commit for ``ShardstoreReader.read_metadata``."""
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def _open_save(self, layout: StorageLayout, exchange: bool) -> SavePipeline:
        """This rank's view of the save (``execution.pipeline``): the one place the
        target and the checkpoint reused from are opened. DCP's ranks talk through its
        plans and results; they exchange blocks themselves only where ``exchange``
        (``RankPart.exchange``), on ``process_group``; otherwise the pipeline's group is
        this process alone. The target is a shared directory, as ``FileSystemWriter``
        takes one: the checkpoint is published beside the files other programs keep
        there (``format.commit.SaveOptions``)."""
        options = SaveOptions(overwrite=self.overwrite, reuse_from=self.reuse_from, shared_directory=True,
                              layout=layout)
        group = Group(self.process_group) if exchange else None
        return SavePipeline.open(self._target(), group, options=options, config=CONFIG)

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
        the ranks can exchange blocks (``tools.dcp_exchange``), and whether they do: where
        it shards or packs (small split arrays are gathered whole into a rank's pack: a
        file per rank instead of a chunk file per block and a directory per array).

        Raises:
            CheckpointingException: an explicit ``shard_bytes`` where they cannot."""
        ranks = len(plans)
        can = ranks > 1 and exchange_members_match(plans)
        site = LayoutSite.of(bare_location(self._target()).capabilities, ranks, can)
        layout = self.layout.chosen_for(site)
        if ranks > 1 and not can and layout.shard_bytes is not None:
            refuse_other_group(plans, _id_text(self.checkpoint_id) or "")
        return layout, can and (layout.shard_bytes is not None or layout.pack_arrays_up_to > 0)

    def _as_array(self, item: WriteItem) -> bool:
        """A plain tensor's item that is written as an array (the same answer on every
        rank: it depends on the item alone)."""
        return (
            _is_plain(item) and item.tensor_data.properties.dtype in BY_TORCH
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
                f"Saving {_id_text(self.checkpoint_id)}: dcp.save(use_collectives=False) saves each of the {ranks} "
                "ranks on its own, and a ShardstoreWriter checkpoint is one commit of every rank's part; nothing "
                "was written. Save with use_collectives=True (the default)"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """All ranks: names the plain tensors this rank holds that become arrays and,
        with ``shard_bytes``, its place in the group it would exchange blocks on."""
        return replace(plan, storage_data=self._held(plan.items))

    def _held(self, items: list[WriteItem]) -> HeldPlainTensors:
        """What a rank holding ``items`` tells the coordinator."""
        plain = tuple(map(_plain_kind, filter(_is_plain, items)))
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
        made the writer (``dcp.async_save``'s), the writers' own (``tools.dcp_exchange``)."""
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
                logger.exception("Planning checkpoint %s failed", _id_text(self.checkpoint_id))
            parts = [Refused(_new_id(), _refusal(exc, self.checkpoint_id), len(plans))] * len(plans)
        return [replace(plan, storage_data=part) for plan, part in zip(plans, parts)]

    def _planned(self, plans: list[SavePlan]) -> list[RankPart]:
        """Coordinator: every rank's part of a save planned from DCP's plans (each
        carrying its rank's ``HeldPlainTensors``); begins the save."""
        layout, exchange = self._chosen(plans)
        save = self._open_save(layout, exchange)
        save.refuse_oversized_objects(self._strategy(layout).object_bounds(len(plans)))
        _refuse_divergent_replicas(plans, save.describe())
        shards, orders = gathered_shards(plans, _plain_array_writers(plans, self._as_array))
        parts, self._names_needed = save.plan_gathered(shards, self._strategy(layout).plan_save)
        self._save, self._commit = save, parts[0].plan.commit
        plan_id = _new_id()
        return [RankPart(part, order, exchange, len(plans), plan_id, layout) for part, order in zip(parts, orders)]

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
                f"Saving {_id_text(self.checkpoint_id)}: with DCP's plan caching, ShardstoreWriter plans the save in "
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
            results = [_result(item, planner, self._as_array(item)) for item in plan.items]
            in_plan = {item.index for item in plan.items}
            # a plain array DCP's deduplication gave another rank: its result travels from here
            results += [_result(item, planner, True) for item in part.items if item.index not in in_plan]
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
        if isinstance(data, (RankPart, Refused)) and _first_delivery(data):
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
        (``_plan_inputs``), among the recent plans (``_RECENT_PLANS``), with the
        coordinator's ``names_needed``."""
        entry = _Planned(inputs, part, self._names_needed if self.is_coordinator else None)
        with _DELIVERED_LOCK:
            kept = [e for e in _RECENT_PLANS if e.part.plan_id != part.plan_id]
            _RECENT_PLANS[:] = [entry, *kept][:_RECENT_PLANS_KEPT]

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
        with _DELIVERED_LOCK:
            recent = [e for e in _RECENT_PLANS if e.inputs == inputs]
        mine = {e.part.plan_id: e for e in recent if _still_holds(e.part, plan, planner)}

        def decide(held: list[tuple[str, ...]]) -> list[tuple[str, SaveIntent] | None]:
            common = set(held[0]).intersection(*held[1:])
            newest = next((mine[i] for i in held[0] if i in common and mine[i].names_needed is not None), None)
            intent = self._begin_reused(newest, len(held)) if newest is not None else None
            return [(newest.part.plan_id, intent) if newest is not None and intent is not None else None] * len(held)

        where = _id_text(self.checkpoint_id)
        reused = run_stage(group, f"Checking the cached plans of checkpoint {where} (DCP's plan cache is on)",
                           lambda: tuple(mine), reduce=decide, deliver=Deliver.SCATTER)
        if reused is None:
            return None
        plan_id, intent = reused
        part = replace(mine[plan_id].part, save=RankSave(intent, mine[plan_id].part.save.plan))
        _first_delivery(part)
        return part

    def _begin_reused(self, planned: _Planned, ranks: int) -> SaveIntent | None:
        """Coordinator: begins a save by ``planned``'s plan, into this writer's
        checkpoint (None, nothing begun: its target stores shorter names than the
        plan's files have)."""
        save = self._open_save(planned.part.layout, planned.part.exchange)
        save.refuse_oversized_objects(self._strategy(planned.part.layout).object_bounds(ranks))
        intent = save.begin_planned(ranks, cast(NameLimits, planned.names_needed))
        if intent is not None:
            self._save, self._commit = save, planned.part.save.plan.commit
            self._names_needed = planned.names_needed
        return intent

    def _planned_at_write(self, plan: SavePlan, group: Group) -> RankPart:
        """Collective on the writer's process group (one stage: every rank's items and
        holdings, ``_held``, gathered to the coordinator, which plans as
        ``prepare_global_plan`` does and begins the save; each rank's part scattered):
        the plan of a save where DCP's plan cache sent some ranks their previous plan.
        Their items are the same as then (that is what the cache decided); what else
        they hold is taken from their items; the save, its staging area and its intent
        are new."""
        where = _id_text(self.checkpoint_id)
        part = run_stage(group, f"Planning checkpoint {where} (DCP's plan cache is on)",
                         lambda: replace(plan, storage_data=self._held(plan.items)),
                         reduce=self._planned, deliver=Deliver.SCATTER)
        _first_delivery(part)
        return part

    def _joined(self, part: RankPart) -> SavePipeline:
        """This rank's pipeline of the save, joined. Where the ranks exchange blocks, a
        failure here is told to the peers, which wait in the exchange's agreement
        (``SavePipeline.write_plan``): every rank raises it, none waits for a timeout."""
        group = self._collective_group() if part.exchange else None
        try:
            save = self._save if self.is_coordinator else self._open_save(part.layout, part.exchange)
            if save is None:
                raise CheckpointingException("ShardstoreWriter.write_data on the coordinator without a save in progress")
            if group is not None:
                save.group = group  # the coordinator opened it before every rank could make the writers' own
            save.join(part.save.intent)
            return save
        except Exception as exc:
            if group is not None:
                fail_before_staging(group, _id_text(self.checkpoint_id), exc)
            raise

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
                        common[data.fqn] = _common_value(data, where)
                reports.append(chunks)
            _refuse_unwritten(metadata, commit, common, where)
            given = _given_paths(metadata)
            recorded = self._dcp_metadata(given, where)
            if recorded.paths is not None:
                # a fresh dict per slot: one object pickled at two places loads as one, shared
                common.update({name: {} for name in recorded.paths.keys() - given.keys()})
            mappings = given if recorded.paths is None else recorded.paths
            # durable by itself (an fsync of the file, not a second syncfs of the file system)
            save.location.write_atomic(COMMON_FILE, serialize(_nested(common, mappings)))
            save.commit(replace(commit, dcp=recorded), reports)
            _complete(metadata, self.storage_meta())
        except BaseException as exc:
            save.abandon()
            if isinstance(exc, Exception) and not isinstance(exc, CheckpointingException):
                raise CheckpointingException(f"Committing checkpoint {where} failed: {exc}") from exc
            raise

    def _dcp_metadata(self, given: Any, where: str) -> DcpMetadata:
        """What the commit record keeps of DCP's metadata: the paths it was given
        (``given``: ``_given_paths``) with the list slots its flattening dropped
        (``_with_dropped_slots``), and this save's ``storage_meta``."""
        paths = _with_dropped_slots(given)
        if paths is None:
            # a custom planner's own data: DCP's writer pickles it; a JSON record cannot
            logger.warning(
                "Saving %s: the planner's planner_data is not DCP's flattening mapping of a state dict, so it is not "
                "kept; a load without a state dict (dcp_to_torch_save's planner) gives the saved names flat", where,
            )
        ids = self.storage_meta()
        return DcpMetadata(paths, _id_text(ids.checkpoint_id), ids.save_id, tuple(ids.modules))

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


def _given_paths(metadata: Metadata) -> Any:
    """Where each saved name was in the state dict DCP was given: its planner's paths;
    where it did not flatten the state dict (``DefaultSavePlanner(flatten_state_dict=
    False)``: no planner data), each name is a key of its top level, as saved."""
    if metadata.planner_data is None:
        return {name: (name,) for name in metadata.state_dict_metadata}
    return metadata.planner_data


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
        left = map(_plain_kind, filter(_is_plain, plan.items))
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
        [sum(item.tensor_storage_size() or 0 for item in plan.items if _is_sharded(item)) for plan in plans],
    )
    return [[item for item in items if writers[item.index.fqn] == rank] for rank, items in enumerate(held)]


def _refuse_unwritten(metadata: Metadata, commit: CommitRecord, common: dict[str, Any], where: str) -> None:
    """Refuses to commit a save whose DCP metadata names a value no rank wrote, neither
    an array of the plan nor a common value of the results (DCP's plan cache and the
    plan the ranks wrote by disagreeing): the checkpoint would load as damaged."""
    missing = sorted(metadata.state_dict_metadata.keys() - commit.arrays.keys() - common.keys())
    if missing:
        raise CheckpointingException(
            f"Saving {where}: DCP's metadata names {missing[:8]} ({len(missing)} in all), which no rank wrote; nothing "
            "is committed. If DCP's plan caching is on (enable_plan_caching=True), save with it off"
        )


def _refusal(exc: Exception, checkpoint_id: CheckpointId | None) -> str:
    """What every rank raises for the coordinator's failure to plan a save."""
    if isinstance(exc, CheckpointingException):
        return str(exc)
    return f"Planning checkpoint {_id_text(checkpoint_id)} failed on the coordinator: {type(exc).__name__}: {exc}"


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


def _result(item: WriteItem, planner: SavePlanner, as_array: bool) -> WriteResult:
    """The WriteResult of one item: a sharded item's or a plain array's bytes were
    written (by this rank or the one the plan chose); a common value travels in it."""
    if _is_sharded(item) or as_array:
        return WriteResult(index=item.index, size_in_bytes=item.tensor_storage_size() or 0, storage_data=None)
    data = planner.resolve_data(item)
    if isinstance(data, torch.Tensor):
        value, size = _saved_bytes(data), data.nbytes
    else:
        value = data.getvalue()
        size = len(value)
    return WriteResult(index=item.index, size_in_bytes=size, storage_data=CommonValue(item.index.fqn, value))


def _saved_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor of the common state as ``torch.save`` bytes of a copy in host memory (a
    view would carry its whole storage)."""
    buffer = io.BytesIO()
    torch.save(tensor.detach().cpu().clone(memory_format=torch.contiguous_format), buffer)
    return buffer.getvalue()


def _common_value(value: CommonValue, where: str) -> Any:
    """A common value as common.pt stores it: a tensor, or a Python value DCP serialized
    with ``torch.save``, read back as every common state is (``weights_only``)."""
    try:
        return load_torch(value.value, f"{where} ({value.fqn})")
    except CheckpointingException as exc:
        raise CheckpointingException(
            f"Cannot store {value.fqn!r} in the common state: every load reads it with weights_only=True, "
            f"which this value does not pass. Store plain Python values, tensors and numpy arrays, or keep it "
            f"out of the checkpoint. {exc}"
        ) from exc


def _nested(common: dict[str, Any], mappings: Any) -> dict[str, Any]:
    """The common values nested as the caller's state dict was (DCP's flattening
    mappings: fully qualified name -> path), or flat when DCP did not flatten. A list
    keeps every element in its place and its length: ``None`` where an array is (so a
    load puts the array back at its index, ``dict_utils.nest``)."""
    from torch.distributed.checkpoint._traverse import set_element

    if not isinstance(mappings, dict):
        return dict(common)
    order = {name: i for i, name in enumerate(mappings)}  # the caller's order, not the ranks'
    nested: dict[str, Any] = {}
    for name in sorted(common, key=lambda name: order.get(name, len(order))):
        set_element(nested, mappings.get(name, (name,)), common[name])
    for name, path in mappings.items():
        if name not in common:
            _hold_place(nested, path)
    return nested


def _hold_place(nested: dict[str, Any], path: tuple) -> None:
    """Extends the list of ``nested`` on ``path`` with ``None`` up to the element on
    ``path`` where it is shorter (an array at the end of a list keeps the list's length)."""
    node: Any = nested
    for key in path:
        if isinstance(node, list):
            if key >= len(node):
                node.extend([None] * (key + 1 - len(node)))
                return
        elif not isinstance(node, dict) or key not in node:
            return
        node = node[key]


def _new_id() -> str:
    """A DCP save or load id, as DCP's own storage layer makes them."""
    return str(uuid.uuid4())


def _id_text(checkpoint_id: CheckpointId | None) -> str | None:
    """A checkpoint id as the commit record keeps it (text): a path as given, a
    Location by its address."""
    if checkpoint_id is None:
        return None
    if isinstance(checkpoint_id, (str, os.PathLike)):
        return os.fsdecode(checkpoint_id)
    return checkpoint_id.describe()


def _with_dropped_slots(planner_data: Any) -> dict[str, StatePath] | None:
    """DCP's planner paths (each saved name -> its dict keys and list indices) with a
    path for every list slot below a saved index that holds no saved path, named as DCP
    names paths; None where ``planner_data`` is no such mapping. DCP's flattening walks
    every element of a list it does not save whole and drops only dicts that hold
    nothing but empty dicts, so each such slot held one: it is saved as ``{}``, and a
    load that asks for the slot (DCP's load planner turns the caller's ``{}`` there into
    ``None`` and asks for it) gets ``{}`` back. None also where such a slot's name is a
    saved name already (``{"l": [{}, t], "l.0": 1}``: DCP cannot load that state either)."""
    if not isinstance(planner_data, dict) or not all(isinstance(path, tuple) for path in planner_data.values()):
        return None
    held: dict[tuple, set[int]] = {}
    for path in planner_data.values():
        for depth, part in enumerate(path):
            if type(part) is int:
                held.setdefault(path[:depth], set()).add(part)
    paths = dict(planner_data)
    for prefix, indices in held.items():
        for slot in set(range(max(indices))) - indices:
            paths.setdefault(".".join(map(str, (*prefix, slot))), (*prefix, slot))
    return state_paths(paths, len(paths))


# --------------------------------------------------------------------------- load


@dataclass
class _OpenCheckpoint:
    """What ``read_metadata`` found: the checkpoint, its commit record and its common
    values by fully qualified name."""

    location: Location
    record: CommitRecord
    common: dict[str, Any]


class ShardstoreReader(StorageReader):
    """DCP ``StorageReader`` that reads a shardstore checkpoint: ``dcp.load(state,
    storage_reader=ShardstoreReader(path))``. Every region is read from the chunks it
    touches and checked against their crc32c, straight into the destination tensor
    where it can be; what it does at each of DCP's calls: docs/guide/dcp-fsdp2.md ("What
    the reader does at each call").

    Args:
        checkpoint_id: the checkpoint (local path, ``s3://bucket/prefix`` or a Location);
            DCP's ``checkpoint_id=`` replaces it.
        io_concurrency: chunk reads in flight at once per rank.
        allow_lossy_casts: convert to the requested dtype even where that changes values
            (0.1 into bfloat16, ...), as DCP's own ``FileSystemReader`` does (on by
            default, as there); off, such a load raises, naming the key.
            ``shardstore.load`` refuses such casts unless asked.
        process_group: the ranks that load together: the group given to
            ``dcp.load(process_group=...)`` (default: the world).
        read_shards_once: the ranks plan their reads together and a chunk several
            need is read by one and sent (``"auto"``: from ``AUTO_SHARD_MIN_RANKS``,
            32, ranks); ``False``: each rank reads every chunk its regions touch.
    """

    def __init__(
        self, checkpoint_id: CheckpointId | None = None, *, io_concurrency: int = DEFAULT_IO_CONCURRENCY,
        allow_lossy_casts: bool = True, process_group: dist.ProcessGroup | None = None,
        read_shards_once: bool | Literal["auto"] = "auto",
    ) -> None:
        super().__init__()
        self.checkpoint_id = checkpoint_id
        self.io_concurrency = io_concurrency
        self.allow_lossy_casts = allow_lossy_casts
        self.process_group = process_group
        self.load_id = _new_id()
        self._open: _OpenCheckpoint | None = None
        # reads in the stored dtype (``_copy`` converts, as ``allow_lossy_casts`` says)
        self._strategy = ZarrLoadShardedStrategy(io_concurrency, process_group=process_group,
                                                 read_shards_once=read_shards_once)

    def reset(self, checkpoint_id: CheckpointId | None = None) -> None:
        """A new load: its checkpoint id (when given) and a new DCP load id."""
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id
        self.load_id = _new_id()
        self._open = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """All ranks: the commit record and common.pt as DCP's Metadata. A save through
        ``ShardstoreWriter`` gives DCP's names, planner data and storage ids back, as
        DCP's own writer recorded them (``DcpMetadata``); any other checkpoint, and one
        saved through ``ShardstoreWriter`` before they were recorded, gives its arrays'
        keys and its common values by every name a request may give them
        (``_flat_common``), no planner data, and only this load's id."""
        if self.checkpoint_id is None:
            raise CheckpointingException("ShardstoreReader has no checkpoint path: pass one, or checkpoint_id= to dcp.load")
        opened = open_read(self.checkpoint_id)
        location = opened.location
        if not opened.is_shardstore:
            raise CheckpointingException(
                f"{location.describe()} is not a shardstore checkpoint (another tool's format); read it with that "
                "tool's reader (DCP's FileSystemReader), or convert it (`shardstore convert`)"
            )
        record = opened.require_record()
        _, common_strategy = verify_checkpoint_and_load_strategy(opened)
        stored = common_strategy.load_common(location)
        paths = record.dcp.paths if record.dcp is not None else None
        if paths is None:
            common = {
                key: value for key, value in _flat_common(stored).items()
                if not (value is None and key in record.arrays)  # an array's place in a list (``_nested``)
            }
        else:
            common = _values_at_paths(stored, paths, record, location.describe())
        self._open = _OpenCheckpoint(location, record, common)
        described: dict[str, Any] = {key: _array_metadata(array.shape, array.dtype) for key, array in record.arrays.items()}
        for key, value in common.items():
            if key in described:
                raise CheckpointingException(
                    f"{location.describe()}: {key!r} names both an array and a value of the common state"
                )
            described[key] = (
                _tensor_metadata(tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor)
                else BytesStorageMetadata()
            )
        return Metadata(
            state_dict_metadata=described, planner_data=None if paths is None else dict(paths),
            storage_meta=self._storage_meta(record.dcp), version=CURRENT_DCP_VERSION,
        )

    def _storage_meta(self, recorded: DcpMetadata | None) -> StorageMeta:
        """DCP's ids: the save's as recorded, and this load's (``FileSystemReader``'s)."""
        if recorded is None:
            return StorageMeta(load_id=self.load_id)
        return StorageMeta(recorded.checkpoint_id, recorded.save_id, self.load_id, list(recorded.modules))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: decides for every rank whether the ranks plan their reads
        together (``read_shards_once``) and tells them (``LoadPlan.storage_data``). Where
        this reader's process group is not the size of ``dcp.load``'s, they do not:
        refused under ``read_shards_once=True``, a warning under ``"auto"``."""
        ranks = len(plans)
        together = ranks > 1 and self._strategy.reads_shards_once(ranks)
        if together and (size := Group(self.process_group).world_size) != ranks:
            where = self._open.location.describe() if self._open is not None else _id_text(self.checkpoint_id)
            problem = (f"Loading checkpoint {where}: dcp.load runs on {ranks} ranks and ShardstoreReader's process "
                       f"group has {size}; pass the group given to dcp.load as ShardstoreReader(process_group=...)")
            if self._strategy.read_shards_once is True:
                raise CheckpointingException(problem)
            logger.warning("%s to read each chunk once; each rank reads what it needs instead", problem)
            together = False
        return [replace(plan, storage_data=_ReadTogether(together)) for plan in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """All ranks: the common values of this rank's plan, then its array regions: by
        this rank alone, or planned with the other ranks' and read (a collective:
        ``prepare_global_plan`` decided for every rank)."""
        opened = self._open
        if opened is None:
            raise CheckpointingException("ShardstoreReader.read_data before read_metadata")
        where = f"checkpoint {opened.location.describe()}"
        together = isinstance(plan.storage_data, _ReadTogether) and plan.storage_data.together
        requests: list[tuple[ReadItem, torch.Tensor, ShardedTensor]] = []
        error = None
        for item in plan.items:
            try:  # a failure here is raised on every rank by the plan's gather, when together
                request = self._read_common_or_request(item, planner, opened, where)
            except CheckpointingException as exc:
                error = exc
                break
            except Exception as exc:
                error = CheckpointingException(f"{where}: reading {item.storage_index.fqn!r} failed: {exc}")
                error.__cause__ = exc
                break
            if request is not None:
                requests.append(request)
        if together:
            self._read_together(requests, opened, error, where)
        elif error is not None:
            raise error
        else:
            self._read_alone(requests, opened, where)
        for item, target, _ in requests:
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_common_or_request(
        self, item: ReadItem, planner: LoadPlanner, opened: _OpenCheckpoint, where: str,
    ) -> tuple[ReadItem, torch.Tensor, ShardedTensor] | None:
        """A common value ``item`` names, given to the planner (None); or the request for
        the region of an array it names: the target, and a ShardedTensor of the stored
        dtype that reads into it (its ``data``) where it is a contiguous CPU tensor of
        that dtype, else has no data (the read makes its result)."""
        key = item.storage_index.fqn
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, _as_bytes(opened.common[key]))
            return None
        target = planner.resolve_tensor(item).detach()
        if key in opened.common:
            self._copy(item, target, _narrow(opened.common[key], _box(item)), where)
            planner.commit_tensor(item, target)
            return None
        array = opened.record.arrays[key]
        stored = from_zarr_name(array.dtype).torch_dtype
        direct = target.device.type == "cpu" and target.dtype == stored and holds_its_values(target)
        box = _box(item)
        request = ShardedTensor(key, target.reshape(tuple(item.lengths)) if direct else None, stored,
                                tuple(item.lengths), tuple(array.shape), tuple(s.start for s in box), None)
        return item, target, request

    def _read_alone(
        self, requests: list[tuple[ReadItem, torch.Tensor, ShardedTensor]], opened: _OpenCheckpoint, where: str,
    ) -> None:
        """Every request's region read by this rank, all at once, into its target where
        the request reads in place, else through a buffer of the stored dtype."""
        store = chunk_store_for(opened.location, self.io_concurrency)
        arrays: dict[str, ArrayChunks] = {}
        jobs, buffered = [], []
        for item, target, request in requests:
            key = request.key
            try:
                if key not in arrays:
                    arrays[key] = ArrayChunks.of(store, opened.record.arrays[key])
                stored = from_zarr_name(opened.record.arrays[key].dtype)
                out = tensor_to_numpy(request.data) if request.data is not None else np.empty(
                    tuple(item.lengths), stored.numpy_dtype)
                jobs += read_region(arrays[key], _box(item), out.reshape(tuple(item.lengths)))
                if request.data is None:
                    buffered.append((item, target, out, stored.torch_dtype))
            except CheckpointingException:
                raise
            except Exception as exc:
                raise CheckpointingException(f"{where}: reading {key!r} failed: {exc}") from exc
        run_reads(jobs, store.threads)
        for item, target, out, dtype in buffered:
            self._copy(item, target, numpy_to_tensor(out, dtype), where)

    def _read_together(
        self, requests: list[tuple[ReadItem, torch.Tensor, ShardedTensor]], opened: _OpenCheckpoint,
        error: BaseException | None, where: str,
    ) -> None:
        """Collective: the requests planned with every rank's and read
        (``ZarrLoadShardedStrategy.load_with_record``); ``error``, this rank's failure
        in making them, raised on every rank. A rank that fails before ``read_data``
        (a planner's ``finish_plan``) leaves the others waiting here for the process
        group's timeout."""
        asked = {i: request for i, (_, _, request) in enumerate(requests)}
        loaded = self._strategy.load_with_record(asked, opened.location, opened.record,
                                                 Group(self.process_group), local_error=error)
        for i, (item, target, request) in enumerate(requests):
            if loaded[i] is not request.data:  # else read in place
                self._copy(item, target, loaded[i], where)

    def _copy(self, item: ReadItem, target: torch.Tensor, source: torch.Tensor, where: str) -> None:
        """``source`` into ``target``; another dtype only where every value converts
        exactly, unless lossy casts are allowed (as ``shardstore.load``)."""
        if source.dtype != target.dtype and not self.allow_lossy_casts:
            source, changed = cast_checked(source, target.dtype)
            if changed is not None:
                raise CheckpointingException(
                    f"{where}: tensor {item.storage_index.fqn!r} is stored in another dtype than the state dict's "
                    f"{target.dtype}, which would change its value at index {list(changed)} of the requested part. "
                    "Request the stored dtype, or pass ShardstoreReader(allow_lossy_casts=True)"
                )
        target.copy_(source.reshape(target.shape))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: CheckpointId) -> bool:
        try:
            return open_read(checkpoint_id).is_shardstore
        except Exception:  # noqa: BLE001  (any reason: not a checkpoint we can read)
            return False


def _flat_common(common: dict[str, Any]) -> dict[str, Any]:
    """The common values by every name a request may give them: DCP's flattening (a
    list of plain values is one value, a list holding a tensor or a container is
    walked) and every leaf's own name (a list that held a DTensor when saved is walked
    by the request's flattening, whatever the common state holds of it now)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(common)
    for leaf in flatten(common):
        flat.setdefault(fqn(leaf.path), leaf.value)
    return flat


def _values_at_paths(
    common: dict[str, Any], paths: dict[str, StatePath], record: CommitRecord, where: str,
) -> dict[str, Any]:
    """The common values by the names DCP saved them under: each at its path in
    common.pt (``_nested`` put it there); a name that is an array has none.

    Raises:
        CheckpointingException: a name that is neither (the checkpoint is damaged).
    """
    values: dict[str, Any] = {}
    for name, path in paths.items():
        if name in record.arrays:
            continue
        node: Any = common
        for part in path:
            held = part in node if isinstance(node, dict) else isinstance(node, list) and type(part) is int and part < len(node)
            if not held:
                raise CheckpointingException(
                    f"{where}: {name!r}, saved through DCP, is neither an array nor in the common state at "
                    f"{list(path)}; the checkpoint is damaged: load an earlier one"
                )
            node = node[part]
        values[name] = node
    return values


def _tensor_metadata(shape: tuple[int, ...], dtype: torch.dtype) -> TensorStorageMetadata:
    """One chunk covering the whole tensor: DCP then asks for each requested region
    once, and shardstore reads the chunks it touches."""
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype),
        size=torch.Size(shape),
        chunks=[ChunkStorageMetadata(offsets=torch.Size((0,) * len(shape)), sizes=torch.Size(shape))],
    )


def _array_metadata(shape: tuple[int, ...], zarr_dtype: str) -> TensorStorageMetadata:
    return _tensor_metadata(shape, from_zarr_name(zarr_dtype).torch_dtype)


@dataclass(frozen=True)
class _ReadTogether:
    """What ``ShardstoreReader.prepare_global_plan`` gives each rank
    (``LoadPlan.storage_data``): whether the ranks plan their reads together (one
    decision for all, so that every rank or none enters the collective)."""

    together: bool


def _box(item: ReadItem) -> tuple[slice, ...]:
    """A read item's box in the stored tensor: from its chunk's offset plus the offset
    inside it, its lengths along every axis."""
    chunk = item.storage_index.offset or (0,) * len(item.storage_offsets)
    return tuple(slice(c + o, c + o + n) for c, o, n in zip(chunk, item.storage_offsets, item.lengths))


def _narrow(tensor: torch.Tensor, box: tuple[slice, ...]) -> torch.Tensor:
    return tensor if tensor.ndim == 0 else tensor[box]


def _as_bytes(value: Any) -> io.BytesIO:
    """A common value as DCP's ``load_bytes`` takes it (a ``torch.save`` stream)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer
