"""Save and load plans: decided once, by the coordinator, from the gathered layout; each
rank receives only its own part. Pure functions, one idea a
module (below).

Save protocol (``engine.save``; "coordinator" is group rank 0):

    every rank   records     its shards' metadata (``planning.checks.local_records``)
    collective   gather      the records travel to the coordinator only
    coordinator  validate    the global layout (``validation.validate_sharding_integrity``)
    coordinator  plan        ``plan_save``: writers of replicated blocks (fully parallel),
                             the chunk grid of every array, every rank's chunk writes,
                             straddling-chunk exchanges and metadata files, the commit
                             record to be
    collective   scatter     rank r receives ``RankSavePlan`` r (or the error, on every rank)

So a rank's work and the bytes it receives grow with its own shards, not with the
world size; the coordinator's grow linearly with all records (``scripts/plan_scaling.py``
measures both).

Load protocol (``engine.load``):

    every rank   records     the regions it requests (``planning.checks.local_records``)
    collective   gather      to the coordinator only
    coordinator  plan        ``validation.plan_load``: missing and unexpected keys
                             (``StrictHandling``), the access-integrity check, and the
                             strategy's read plan (``plan_reads``: which rank reads each
                             requested block from storage, who sends it to whom; a
                             sharded array's shards each by one rank where the
                             strategy asks, by default from 32 ranks)
    collective   scatter     rank r receives ``RankLoadPlan`` r (or the error)
    collective   read        its reads only; agree; exchange

A plan names a rank's tensors by their index in its own list of ShardedTensors (the
order of ``utils.local_sharded_items``), so it is applied to the same state dict
whose records were gathered (for a load: after dropping the unexpected keys the plan
names, which ``validation.plan_load`` renumbers for).

The modules, save side: ``rank_plans`` (the frozen per-rank plans, a save's exchange
waves), ``save_plans`` (``plan_save``: each array placed by its kind: blocks, packed
small arrays, gathered shards, flattened ranges), ``array_storage`` (each array's record:
chunks, or shards across or inside blocks), ``shard_sizes`` (bounds and shapes of shards
and inner chunks), ``block_grid`` (an array's blocks as a grid). Load side:
``read_plans`` (``plan_reads``: requests split at chunk edges, a block or shard read once
for every rank that asks).
"""

from __future__ import annotations

__all__ = [
    "MAX_FORWARDED_BYTES", "MIN_INNER_BYTES", "RankLoadPlan", "RankReadPlan", "RankSavePlan",
    "SHARDED_FILES_SHARE", "SHARD_SLACK", "array_records", "exchange_waves",
    "in_block_sharded_record", "largest_shard_bytes", "largest_shard_data_bytes",
    "plan_flat_writes", "plan_gathered_writes", "plan_packed_whole", "plan_reads", "plan_save",
    "object_bounds", "planned_requests", "sharded_record", "stored_at_most",
]

from shardstore.format.storage_layout import SHARD_SLACK
from shardstore.planning.plans.array_storage import (
    SHARDED_FILES_SHARE,
    array_records,
    in_block_sharded_record,
    sharded_record,
)
from shardstore.planning.plans.rank_plans import (
    RankLoadPlan,
    RankReadPlan,
    RankSavePlan,
    exchange_waves,
)
from shardstore.planning.plans.read_plans import MAX_FORWARDED_BYTES, plan_reads, planned_requests
from shardstore.planning.plans.save_plans import (
    plan_flat_writes,
    plan_gathered_writes,
    plan_packed_whole,
    plan_save,
)
from shardstore.planning.plans.shard_sizes import (
    MIN_INNER_BYTES,
    largest_shard_bytes,
    largest_shard_data_bytes,
    object_bounds,
    stored_at_most,
)
