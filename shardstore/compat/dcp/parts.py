"""What the stages of a save through DCP's API hand each other (``compat.dcp.writer``).

DCP carries a writer's data between its calls in ``SavePlan.storage_data`` and
``WriteResult.storage_data``: a rank's local plan (``HeldPlainTensors``), the
coordinator's part for each rank (``RankPart``, a ``Refused`` save, a ``PlanAtWrite``),
each rank's report (``WrittenChunks``, ``CommonValue``). DCP's plan cache may hand a
writer an earlier save's part: ``first_delivery`` and ``RECENT_PLANS`` tell it so.
Also how a write item becomes shardstore's description of a shard.
"""

from __future__ import annotations

__all__ = [
    "COORDINATOR_PLAN_ITEMS", "COORDINATOR_PLANS", "COORDINATOR_PLANS_KEPT", "CheckpointId", "CommonValue", "CoordinatorPlan",
    "DELIVERED", "DELIVERED_LOCK", "HeldPlainTensors",
    "PlanAtWrite", "PlannedPart", "RECENT_PLANS", "RECENT_PLANS_KEPT", "RankPart", "Refused", "TensorBytes",
    "WrittenChunks", "first_delivery", "gathered_shards", "id_text", "is_plain", "is_sharded",
    "new_id", "plain_kind", "shard_description",
]

import math
import os
import threading
import uuid
from dataclasses import dataclass, replace

import torch
from torch.distributed.checkpoint.planner import (
    SavePlan,
    WriteItem,
    WriteItemType,
)

from shardstore.execution import RankSave
from shardstore.format import (
    StorageLayout,
    WrittenChunk,
)
from shardstore.mapping import ShardedTensor
from shardstore.stores import Location, NameLimits

CheckpointId = str | os.PathLike | Location

@dataclass(frozen=True)
class RankPart:
    """What the coordinator's plan gives one rank (``SavePlan.storage_data``).

    Attributes:
        save: the save this rank joins and its part of shardstore's save plan.
        items: the sharded write items it writes, in the order ``save.plan`` numbers them.
        exchange: the ranks exchange blocks in ``write_data`` (a layout that shards, in
            a save of several ranks; ``compat.dcp.exchange``).
        ranks: how many ranks the save has (DCP's plans): the group a later save plans
            on where DCP's plan cache hands this part back (``PlanAtWrite``).
        plan_id: the planning that made it (the same in every rank's part, and in the
            parts of later saves that took the plan again, ``COORDINATOR_PLANS``): a
            later save whose every rank holds a part of it, for the same inputs, reuses
            it (``ShardstoreWriter._reused_at_write``).
    """

    save: RankSave
    items: tuple[WriteItem, ...]
    exchange: bool = False
    ranks: int = 1
    plan_id: str = ""
    layout: StorageLayout = StorageLayout()

    @property
    def part_id(self) -> str:
        """Unique to the save it was planned for (``first_delivery``)."""
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
DELIVERED: set[str] = set()

DELIVERED_LOCK = threading.Lock()

@dataclass(frozen=True)
class PlannedPart:
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
RECENT_PLANS: list[PlannedPart] = []

RECENT_PLANS_KEPT = 4

@dataclass(frozen=True)
class CoordinatorPlan:
    """Every rank's part of a save as the coordinator planned it, and what from.

    Attributes:
        inputs: ``ShardstoreWriter._coordinator_inputs``: every rank's items and
            holdings, the writer's settings, the layout chosen and whether the ranks
            exchange. Equal inputs plan equal parts.
        parts: each rank's part (its save's intent is that save's: a later save takes
            the plans, with an intent of its own).
        names_needed: the longest names the plan's files have.
    """

    inputs: tuple
    parts: tuple[RankPart, ...]
    names_needed: NameLimits

# The plans this process most recently made as a coordinator, newest first: a save
# whose ranks hold what they held then is not planned again (``ShardstoreWriter.
# _planned``): a training loop saves the same structure at every step, and DCP's own
# plan caching is off by default. Two, for a process that saves two state dicts in turn.
COORDINATOR_PLANS: list[CoordinatorPlan] = []

COORDINATOR_PLANS_KEPT = 2

# The most write items, over all ranks, of a plan kept there: each costs about 1.3 KB
# with its part, so two plans of this many hold about 130 MB; a larger save (1,024
# ranks of 400 items: 0.5 GB a plan) is planned at every step, as without.
COORDINATOR_PLAN_ITEMS = 50_000

def first_delivery(part: RankPart | Refused) -> bool:
    """Whether ``part`` reaches ``write_data`` for the first time in this process
    (marks it delivered): False for an earlier save's part, which DCP's plan cache
    (``DefaultSavePlanner(enable_plan_caching=True)``) hands back in place of a new one
    where a rank's plan did not change."""
    with DELIVERED_LOCK:
        if part.part_id in DELIVERED:
            return False
        DELIVERED.add(part.part_id)
        return True

@dataclass(frozen=True)
class TensorBytes:
    """A dense tensor of the common state as its bytes, dtype and shape
    (``common_state.tensor_value``): rebuilt in microseconds, where a ``torch.save`` on
    its rank and a ``torch.load`` on the coordinator cost about 0.1-0.2 ms each (an
    FSDP2 + AdamW state's 48 step tensors: the coordinator's ``finish`` 17 -> 12 ms)."""

    dtype: str  # the name of a ``torch`` dtype of ``common_state.RAW_DTYPES``
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class CommonValue:
    """A value of the common state, on its way to the coordinator (on its WriteResult):
    a tensor's bytes (``TensorBytes``) or its ``torch.save`` bytes (``saved_bytes``),
    or those DCP's planner serialized a Python value to. Never a tensor itself: DCP
    pickles the results, and torch's pickling of some dtypes (complex32,
    float8_e8m0fnu, the fnuz float8s, float4) does not load back."""

    fqn: str
    value: bytes | TensorBytes

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

def is_sharded(item: WriteItem) -> bool:
    return item.type == WriteItemType.SHARD

def is_plain(item: WriteItem) -> bool:
    return item.type == WriteItemType.TENSOR

def plain_kind(item: WriteItem) -> tuple[str, tuple[int, ...], torch.dtype]:
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
        for item in [*filter(is_sharded, plan.items), *(plain_arrays[rank] if plain_arrays else ())]:
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

def new_id() -> str:
    """A DCP save or load id, as DCP's own storage layer makes them."""
    return str(uuid.uuid4())

def id_text(checkpoint_id: CheckpointId | None) -> str | None:
    """A checkpoint id as the commit record keeps it (text): a path as given, a
    Location by its address."""
    if checkpoint_id is None:
        return None
    if isinstance(checkpoint_id, (str, os.PathLike)):
        return os.fsdecode(checkpoint_id)
    return checkpoint_id.describe()
