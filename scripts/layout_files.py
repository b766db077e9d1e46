"""Files (objects) of a checkpoint as the real planner lays it out, by storage layout.

``chosen_layout`` is the layout a door chooses when given none
(``StorageLayout().chosen_for(LayoutSite(...))``, as ``execution.pipeline.SavePipeline``
chooses it); ``plan_with`` plans a save with it through the strategy's own
``ZarrSaveShardedStrategy.plan_save``; ``planned_files`` counts what those plans write:

- a data file per chunk or Zarr v3 shard of every array not packed (the records' chunk
  grid: a sharded array's grid is its shards);
- a zip pack per rank that packs arrays (``packs/<r>-<n>.zip``; one more per
  ``PACK_BYTES`` or ``PACK_MEMBERS``): the arrays of at most ``pack_arrays_up_to``
  bytes whose document the rank writes and whose every element it writes (its own
  blocks, or the whole chunk gathered to it), as ``execution.save.packed_keys`` picks
  them;
- a ``zarr.json`` per array not packed and per group, unless the metadata are
  consolidated only;
- ``FIXED_FILES``: the root ``zarr.json`` (the commit record), ``metadata.json``,
  ``common.pt``.

``DOORS``: the ways a save enters, and whether the ranks can exchange blocks there. DCP's
writer is modelled with a process group of its own for the exchange (``can_exchange``),
the design item 2 of issue 65 asks for.
"""

from __future__ import annotations

__all__ = ["DOORS", "FIXED_FILES", "Door", "LayoutFiles", "bound", "chosen_layout", "files_by_door", "planned_files",
           "plan_with"]

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from shardstore.engine.zarr_strategies import ZarrSaveShardedStrategy
from shardstore.format.codecs import BYTES_CRC32C
from shardstore.format.features import ZarrMetadata
from shardstore.format.packs import PACK_BYTES, PACK_MEMBERS, fits_one_pack
from shardstore.format.records import ArrayRecord, parent_groups
from shardstore.format.storage_layout import DEFAULT_SHARD_BYTES, LayoutSite, StorageLayout
from shardstore.planning.layout import GatheredShards
from shardstore.planning.plans import RankSavePlan

FIXED_FILES = 3
"""Files beside the arrays: the root zarr.json (commit record), metadata.json, common.pt."""


@dataclass(frozen=True)
class Door:
    """A way into a save, and whether its ranks can exchange blocks (``LayoutSite``)."""

    name: str
    can_exchange: bool = True
    note: str = ""


DOORS = (
    Door("shardstore.save"),
    Door("megatron install()"),
    Door("dcp.save(ShardstoreWriter)", note="modelled with a process group of its own for the exchange"),
)


def chosen_layout(world: int, object_store: bool, door: Door = DOORS[0],
                  layout: StorageLayout | None = None) -> StorageLayout:
    """The layout a save through ``door`` chooses at ``world`` ranks (``layout``: the
    caller's, default none: every field shardstore's to choose)."""
    return (layout or StorageLayout()).chosen_for(LayoutSite(world, object_store, door.can_exchange))


def plan_with(layout: GatheredShards, storage: StorageLayout) -> list[RankSavePlan]:
    """Every rank's part of the save of ``layout`` with the chosen ``storage``, planned by
    the default strategy as a save plans it."""
    return ZarrSaveShardedStrategy().plan_save(layout, storage)


@dataclass(frozen=True)
class LayoutFiles:
    """What a planned save writes (``planned_files``)."""

    layout: str
    data_files: int
    packs: int
    documents: int
    sharded_arrays: int
    packed_arrays: int
    directories: int

    @property
    def total(self) -> int:
        """Files on a file system, objects (one PUT each) on S3."""
        return self.data_files + self.packs + self.documents + FIXED_FILES


def _packed(plan: RankSavePlan, arrays: dict[str, ArrayRecord], up_to: int) -> list[ArrayRecord]:
    """The arrays ``plan``'s rank packs: small ``[bytes, crc32c]`` arrays whose document
    it writes and whose every element it writes."""
    if not up_to:
        return []
    covered: dict[str, int] = defaultdict(int)
    for s in plan.shards:
        if s.flat_range is None and s.key not in plan.gathered:
            covered[s.key] += math.prod(s.block_shape)
    for _, chunk in plan.straddling:
        if chunk.writer == plan.rank:
            covered[chunk.key] += chunk.volume
    out = []
    for key in plan.array_metadata:
        record = arrays[key]
        if (record.codec == BYTES_CRC32C and 0 < record.nbytes <= up_to
                and covered.get(key) == math.prod(record.shape) and fits_one_pack(record)):
            out.append(record)
    return out


def planned_files(plans: list[RankSavePlan], storage: StorageLayout) -> LayoutFiles:
    """The files (objects) of the save ``plans`` make with ``storage``."""
    commit = plans[0].commit
    assert commit is not None, "the coordinator's plan carries the commit record"
    arrays = commit.arrays
    packed: set[str] = set()
    packs = 0
    for plan in plans:
        mine = _packed(plan, arrays, int(storage.pack_arrays_up_to))
        if mine:
            nbytes = sum(r.nbytes for r in mine)
            members = sum(r.chunk_count + 1 for r in mine)
            packs += max(1, -(-nbytes // PACK_BYTES), -(-members // PACK_MEMBERS))
            packed.update(r.key for r in mine)
    loose = [a for k, a in arrays.items() if k not in packed]
    groups = parent_groups(list(arrays))
    per_node = ZarrMetadata(storage.zarr_metadata) is ZarrMetadata.PER_NODE
    return LayoutFiles(
        layout=storage.describe(),
        data_files=sum(a.chunk_count for a in loose),
        packs=packs,
        documents=len(loose) + len(groups) if per_node else 0,
        sharded_arrays=sum(1 for a in arrays.values() if a.codec != BYTES_CRC32C),
        packed_arrays=len(packed),
        directories=1 + len(loose) + len(groups) + (1 if packs else 0),
    )


def bound(nbytes: int, arrays: int, ranks: int, shard_bytes: int | None = None) -> int:
    """Issue 65's bound on files and S3 requests of a save: bytes / shard size + 2 x
    arrays + ranks (``shard_bytes``: the layout's, else ``DEFAULT_SHARD_BYTES``)."""
    return -(-nbytes // (shard_bytes or DEFAULT_SHARD_BYTES)) + 2 * arrays + ranks


def _plans_alike(storage: StorageLayout) -> tuple:
    """What of a layout the plan depends on (where documents go does not change it)."""
    return (storage.max_chunk_bytes, storage.shard_bytes, storage.pack_arrays_up_to)


def files_by_door(
    global_layout: Callable[[], GatheredShards], world: int, plans: list[RankSavePlan], planned_with: StorageLayout,
    layout: StorageLayout | None = None,
) -> dict[str, LayoutFiles]:
    """The files of the save through every door of ``DOORS`` on a file system and on S3,
    keyed ``"<door>, local"`` / ``"<door>, S3"``, each with the layout it chooses
    (``layout``: the caller's). ``plans`` (planned with ``planned_with``) serve every
    layout that plans alike; the others are planned here from ``global_layout()``."""
    planned = {_plans_alike(planned_with): plans}
    out = {}
    for door in DOORS:
        for site, object_store in (("local", False), ("S3", True)):
            storage = chosen_layout(world, object_store, door, layout)
            alike = _plans_alike(storage)
            if alike not in planned:
                planned[alike] = plan_with(global_layout(), storage)
            out[f"{door.name}, {site}"] = planned_files(planned[alike], storage)
    return out
