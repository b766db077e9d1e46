"""A cached plan: a save whose structure did not change reuses the last plan.

Megatron-Core's ``FullyParallelSaveStrategyWrapper(do_cache_distribution=True)`` (and
PyTorch DCP's cached save plans) skip the metadata exchange when the state dict's
structure is the same as last time. shardstore's own save plans in one round trip
(``protocol.plan_stage.gather_and_plan``: every rank's shard records to the coordinator,
validated, planned, each rank's part scattered); with a ``PlanCache`` it becomes:

    every rank    key        its shard records as gather_and_plan would send them
                             (``local_records``), its rank and the world size and the
                             planner's settings
    collective    check      (one gather, one scatter, as the plan's round trip) every
                             rank sends only the id of the plan it holds a part of, if
                             its key equals the key that part was planned for (else
                             None, as a rank holding no plan: its first save, or after
                             ``clear``), the checkpoint it names and its common-state
                             digests; the coordinator reuses only when every rank sent
                             the same id and the target stores names as long as the
                             plan's (``planning.checks.admits_names``), and then makes
                             what every save needs anew
                             (``anew``: the save's begin and its intent) and names the
                             ranks whose common state differs, in the same scatter
    collective    plan       only when some rank's structure changed (or some rank
                             holds no plan): the full ``gather_and_plan`` (one more
                             round trip), whose parts every rank then caches with a
                             new id

Never cached: what depends on the save or its target (``anew``'s result: the save id,
the staging directory; the commit record's time and checksums are made at commit),
the check that every rank names the same checkpoint, and the common-state comparison.
The keys' files were checked against the first target's name limits; the coordinator
keeps the longest name and path they need (``planning.checks.name_lengths_needed``),
and a target that cannot store those re-plans (and is refused by the full check).
Every rank takes the same path: every rank with a cache takes part in the check, even
one holding no plan (so a cache cleared on some ranks only, or a rank whose process
was replaced, re-plans instead of failing: the first save pays the check's round trip
once), a cache holds a part only after a plan's scatter succeeded on every rank, and
reuse needs every rank's vote.
"""

from __future__ import annotations

__all__ = ["PlanCache", "gather_and_plan_cached"]

import logging
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from shardstore.errors import CheckpointingException
from shardstore.mapping import ShardedObject, ShardedTensor
from shardstore.planning.checks import (
    admits_names,
    local_records,
    name_lengths_needed,
    ranks_with_differing_common_state,
)
from shardstore.protocol.collectives import Group
from shardstore.protocol.common_state import check_common_state_consistency
from shardstore.protocol.plan_stage import PLAN_CACHE_SETTINGS, check_same_place, gather_and_plan
from shardstore.protocol.stage import Deliver, run_stage
from shardstore.stores.base import Location, NameLimits

logger = logging.getLogger(__name__)


class PlanCache:
    """One strategy's cached plan on one rank: its part, the id of the plan it belongs
    to, the key (``gather_and_plan_cached``) it was planned for and, on the
    coordinator, the name lengths the plan's files need.

    Attributes:
        planned: plans made (the full round trip) through this cache.
        reused: plans reused.
    """

    def __init__(self) -> None:
        self.planned = 0
        self.reused = 0
        self._key: tuple | None = None
        self._plan_id: str | None = None
        self._part: Any = None
        self._needed: NameLimits | None = None

    @property
    def holds_plan(self) -> bool:
        """True while this rank holds its part of a plan (on every rank once a plan's
        parts reached them all, until ``clear``)."""
        return self._plan_id is not None

    def clear(self) -> None:
        """Forgets the cached plan: the next save plans in full on every rank of the
        save's group, whether or not the other ranks cleared theirs (a rank holding no
        plan votes against reuse in the check)."""
        self._key, self._plan_id, self._part, self._needed = None, None, None, None

    def _store(self, key: tuple | None, plan_id: str, part: Any, needed: NameLimits | None) -> None:
        self._key, self._plan_id, self._part, self._needed = key, plan_id, part, needed


@dataclass(frozen=True)
class _CachedPlanQuery:
    """What a rank sends in the check: the plan it can reuse (None: it cannot)."""

    place: str | None
    plan_id: str | None
    common_digests: dict[str, str] | None
    holds: bool = True  # whether it holds a plan at all (False: its first save, or cleared)


def gather_and_plan_cached(
    cache: PlanCache | None,
    sharded_tensors: list[ShardedTensor],
    sharded_objects: list[ShardedObject],
    group: Group,
    planner: Callable[[Any], list[Any]],
    *,
    anew: Callable[[], Any] | None = None,
    local_error: BaseException | None = None,
    place: str | None = None,
    common_digests: dict[str, str] | None = None,
    save_to: Location | None = None,
    common_state: dict[str, Any] | None = None,
    settings: Hashable = (),
) -> Any:
    """Collective: ``gather_and_plan`` (same arguments), reusing ``cache``'s plan when
    every rank's structure is unchanged (module docstring) and the plan was made under
    the same ``settings`` (the planner's, and the layout it plans by: part of the key).
    ``cache`` None: exactly ``gather_and_plan``.

    ``anew``: on the coordinator, once the plan is made or reused, what every call
    needs anew (a save's begin); its result reaches every rank with its part.

    Returns:
        This rank's part of the plan; ``(anew's result, part)`` when ``anew`` is given.

    Raises:
        CheckpointingException: on every rank, as ``gather_and_plan``.
    """
    if place is None and save_to is not None:
        place = save_to.describe()
    key = None
    if cache is not None and local_error is None:
        try:
            key = _structure_key(settings, sharded_tensors, sharded_objects, group, place)
        except Exception:  # noqa: BLE001  (gather_and_plan reports the same failure on every rank)
            key = None
    if cache is not None:  # even holding no plan: a rank whose cache was cleared votes to re-plan
        reused = _reuse(cache, key, group, anew, local_error, place, common_digests, common_state, save_to)
        if reused is not None:
            return reused
    plan_id = uuid.uuid4().hex
    needed: list[NameLimits] = []  # the coordinator's, for a cached plan's next target

    def plan_and_make_anew(layout: Any) -> list[tuple[str, Any, Any]]:
        parts = planner(layout)
        if cache is not None and save_to is not None:
            needed.append(name_lengths_needed(layout))
        fresh = anew() if anew is not None else None
        return [(plan_id, fresh, part) for part in parts]

    received_id, fresh, part = gather_and_plan(
        sharded_tensors, sharded_objects, group, plan_and_make_anew, local_error=local_error, place=place,
        common_digests=common_digests, save_to=save_to, common_state=common_state,
    )
    if cache is not None:
        cache._store(key, received_id, part, needed[0] if needed else None)
        cache.planned += 1
    return (fresh, part) if anew is not None else part


def _structure_key(
    settings: Hashable, sharded_tensors: list[ShardedTensor], sharded_objects: list[ShardedObject], group: Group,
    place: str | None,
) -> tuple:
    """What this rank's part of the plan depends on: its records exactly as
    ``gather_and_plan`` would send them, its rank and the world size and the planner's
    settings (the target's name limits are the coordinator's to check)."""
    tensors, objects = local_records(sharded_tensors, sharded_objects, group.rank, place)
    return (group.rank, group.world_size, settings, tuple(tensors), tuple(objects))


def _reuse(
    cache: PlanCache, key: tuple | None, group: Group, anew: Callable[[], Any] | None,
    local_error: BaseException | None, place: str | None, common_digests: dict[str, str] | None,
    common_state: dict[str, Any] | None, save_to: Location | None,
) -> Any:
    """The check round trip: this rank's part with ``anew``'s result (or the part
    alone) when every rank reuses, else None (every rank then plans in full)."""
    mine = cache._plan_id if key is not None and key == cache._key else None

    def decide(queries: list[Any]) -> list[tuple[bool, Any, list[int]]]:
        if not all(isinstance(q, _CachedPlanQuery) for q in queries):
            raise CheckpointingException(
                f"The ranks disagree on the plan cache (some keep plans, some do not): {PLAN_CACHE_SETTINGS}"
            )
        check_same_place([q.place for q in queries])
        ids = {q.plan_id for q in queries}
        if len(ids) != 1 or None in ids:
            if any(q.holds for q in queries):  # not the first save of every rank
                changed = [r for r, q in enumerate(queries) if q.plan_id is None]
                logger.info("Plan cache: the structure changed (or the plan was cleared) on rank(s) %s; "
                            "planning in full", changed[:8])
            return [(False, None, [])] * group.world_size
        if save_to is not None and (cache._needed is None or not admits_names(save_to.name_limits, cache._needed)):
            logger.info("Plan cache: %s stores shorter names than the cached plan's; planning in full",
                        save_to.describe())
            return [(False, None, [])] * group.world_size
        differing = []
        if common_digests is not None:
            differing = ranks_with_differing_common_state([q.common_digests for q in queries])
        fresh = anew() if anew is not None else None
        return [(True, fresh, differing)] * group.world_size

    reuse, fresh, differing = run_stage(
        group, "Checking the state dict", lambda: _CachedPlanQuery(place, mine, common_digests, cache.holds_plan),
        reduce=decide, deliver=Deliver.SCATTER, local_error=local_error,
    )
    if not reuse:
        return None
    if differing:  # the same list on every rank: all of them take part
        check_common_state_consistency(common_state, differing, group)
    cache.reused += 1
    return (fresh, cache._part) if anew is not None else cache._part
