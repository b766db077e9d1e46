"""The collective stage every save and load starts with: gather, plan once, scatter.

Every rank sends the metadata of its shards (never data) to the coordinator, which
checks it, plans the whole operation with a pure planner (``shardstore.planning.plans``,
``validation.plan_load``) and sends each rank only its own part. A failure anywhere,
on any rank or in the plan, becomes the same CheckpointingException on every rank, and
nothing is written or read. It runs, as every stage after it (I/O, exchanges, commit)
does, through ``protocol.stage.run_stage``.
"""

from __future__ import annotations

__all__ = ["PLAN_CACHE_SETTINGS", "check_same_place", "gather_and_plan"]

from collections.abc import Callable
from typing import Any

from shardstore.errors import CheckpointingException
from shardstore.mapping import ShardedObject, ShardedTensor
from shardstore.planning.checks import (
    check_layout,
    local_records,
    ranks_with_differing_common_state,
)
from shardstore.planning.layout import GatheredShards, ShardRecord
from shardstore.protocol.collectives import Group
from shardstore.protocol.common_state import check_common_state_consistency
from shardstore.protocol.stage import Deliver, run_stage
from shardstore.stores.base import Location

# What to do where the ranks disagree on keeping a plan (``protocol.plan_cache``).
PLAN_CACHE_SETTINGS = "every rank must use the same strategy settings, cache_plan or do_cache_distribution included"


def gather_and_plan(
    sharded_tensors: list[ShardedTensor],
    sharded_objects: list[ShardedObject],
    group: Group,
    planner: Callable[[GatheredShards], list[Any]],
    local_error: BaseException | None = None,
    place: str | None = None,
    common_digests: dict[str, str] | None = None,
    save_to: Location | None = None,
    common_state: dict[str, Any] | None = None,
) -> Any:
    """Collective, plan once: the shard records (metadata, never data) travel to the
    coordinator only, which runs ``planner`` on the global layout; rank r receives
    ``planner(layout)[r]`` (``shardstore.planning.plans``). Any failure, on any rank, raises the
    same CheckpointingException on every rank, before anything is written or read.

    A rank whose own shards are invalid (bad key, unsupported dtype) or that passes a
    ``local_error`` from an earlier step fails every rank, with that rank's reason.
    ``place``: the checkpoint this rank names (default: ``save_to``'s), named in key
    errors; ranks that name different ones all fail (one save must not be split over
    two directories). ``common_digests``: a digest of each top-level entry of this
    rank's common state (``common_state``, as compared); the coordinator names the ranks
    whose digests differ from its own in every rank's part of the scatter, and only
    then do those ranks compare their common state with rank 0's in full and warn
    (``protocol.common_state.check_common_state_consistency``, Megatron-Core's messages; only rank
    0's common state is saved). When nothing differs this costs no collective.
    ``save_to``: where a save writes (None for a load, whose planner decides what to
    check): the coordinator checks the global sharding, and every key against the
    location's ``name_limits`` (``planning.checks.check_layout``), before
    planning. Every save path passes its target here, so that one check refuses a key
    the target cannot store before the first byte is written.
    """
    if place is None and save_to is not None:
        place = save_to.describe()
    # a save's records name the dtype it writes, a load's the one it returns
    record = ShardRecord.from_sharded_tensor if save_to is not None else ShardRecord.of_request

    def plan(gathered: list[tuple[str | None, Any, dict[str, str] | None]]) -> list[tuple[Any, list[int]]]:
        layout = _layout_of(gathered)
        if save_to is not None:
            check_layout(layout, save_to.name_limits, save_to.describe())
        differing = []
        if common_digests is not None:
            differing = ranks_with_differing_common_state([d for _, _, d in gathered])
        return [(part, differing) for part in planner(layout)]

    part, differing = run_stage(
        group, "Checking the state dict",
        lambda: (place, local_records(sharded_tensors, sharded_objects, group.rank, place, record), common_digests),
        reduce=plan, deliver=Deliver.SCATTER, local_error=local_error,
    )
    if differing:  # the same list on every rank: all of them take part
        check_common_state_consistency(common_state, differing, group)
    return part


def _layout_of(gathered: list[tuple[str | None, Any, Any]]) -> GatheredShards:
    """The layout of every rank's ``(place, records, digests)``; raises when the ranks
    name different checkpoints, or some sent a plan cache's vote instead of records."""
    voted = [rank for rank, g in enumerate(gathered) if not isinstance(g, tuple)]
    if voted:
        raise CheckpointingException(
            f"The ranks disagree on the plan cache: rank(s) {voted[:8]} keep plans and this coordinator does not: "
            f"{PLAN_CACHE_SETTINGS}"
        )
    check_same_place([p for p, _, _ in gathered])
    return GatheredShards.from_gathered([c for _, c, _ in gathered])


def check_same_place(places: list[str | None]) -> None:
    """Raises when the ranks (one place per rank) name different checkpoints: one save
    or load must not be split over two directories."""
    if len(set(places)) > 1:
        by_rank = ", ".join(f"rank {r}: {p}" for r, p in enumerate(places) if r < 8)
        raise CheckpointingException(
            f"The ranks name different checkpoint directories ({by_rank}); every rank of a save or load "
            "must pass the same one. Nothing was written."
        )
