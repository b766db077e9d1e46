"""Checks on keys, on the global sharding, and on load mismatches (``StrictHandling``).

The global checks run on the coordinator over the gathered layout
(``protocol.gather_and_plan``), which sends every rank either its part of the plan or the same
error, before anything is written or read.
"""

from __future__ import annotations

import bisect
import logging
import math
import pickle
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import replace
from enum import Enum
from typing import Any

import numpy as np

from shardstore.core import CheckpointingException
from shardstore.dict_utils import diff, extract_matching_values, nested_values
from shardstore.format.pickles import serialize
from shardstore.format.records import (
    ZARR_JSON,
    array_group_collisions,
    check_key,
    checksum,
    chunk_key,
    object_path,
)
from shardstore.mapping import (
    CommonStateDict,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
)
from shardstore.planning.layout import GlobalLayout, ObjectShardRecord, ShardRecord
from shardstore.planning.plans import RankLoadPlan
from shardstore.protocol.collectives import Group
from shardstore.stores.base import NameLimits

logger = logging.getLogger(__name__)

# Grid cells the exact coverage check may allocate; past it, a volume check is used.
MAX_COVERAGE_CELLS = 16_000_000
MAX_REPORTED_PROBLEMS = 10
# What a layout's keys are checked against where no storage is named (a layout checked
# on its own; every save passes its target's, ``protocol.gather_and_plan``): the
# format's own names and limits only.
FORMAT_NAME_LIMITS = NameLimits()


class StrictHandling(Enum):
    """How ``load`` handles keys that do not match between the request and the checkpoint.

    "Unexpected" keys are requested by the application but absent from the checkpoint;
    "missing" keys are in the checkpoint but requested by no rank. The ``*_UNEXPECTED``
    modes ignore missing keys (which would need an exchange between ranks); the
    ``*_ALL`` modes check both.
    """

    # Let the strategy raise on unexpected keys; no extra checkpoint access.
    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    # Log unexpected keys (WARNING) and skip them; ignore missing keys.
    LOG_UNEXPECTED = "log_unexpected"
    # Log all mismatched keys and skip the unexpected ones.
    LOG_ALL = "log_all"
    # Raise on unexpected keys before loading anything.
    RAISE_UNEXPECTED = "raise_unexpected"
    # Raise on any mismatch (like ``strict=True`` in ``load_state_dict``).
    RAISE_ALL = "raise_all"
    # Skip unexpected keys and return them with the state dict; ignore missing keys.
    RETURN_UNEXPECTED = "return_unexpected"
    # Skip unexpected keys and return both kinds with the state dict.
    RETURN_ALL = "return_all"
    # Skip unexpected keys and report nothing (not recommended).
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: StrictHandling) -> bool:
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: StrictHandling) -> bool:
        return val in (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: StrictHandling) -> bool:
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: str | StrictHandling) -> StrictHandling:
    """Accepts a StrictHandling or its string value."""
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict)
    except (ValueError, TypeError) as exc:
        choices = ", ".join(s.value for s in StrictHandling)
        raise ValueError(f"Invalid strict flag {strict!r}; choose one of: {choices}") from exc


def local_records(
    sharded_tensors: list[ShardedTensor], sharded_objects: list[ShardedObject], rank: int, where: str | None = None
) -> tuple[list[ShardRecord], list[ObjectShardRecord]]:
    """This rank's contribution to the layout; raises on invalid keys (naming the
    checkpoint ``where``) or dtypes."""
    for item in (*sharded_tensors, *sharded_objects):
        check_key(item.key, where)
    tensors = [ShardRecord.from_sharded_tensor(t, rank, i) for i, t in enumerate(sharded_tensors)]
    objects = [ObjectShardRecord.from_sharded_object(o, rank) for o in sharded_objects]
    return tensors, objects


def ranks_with_differing_common_state(digests: list[dict[str, str] | None]) -> list[int]:
    """The ranks whose common-state digests (a checksum per top-level entry, one dict
    per rank, on the coordinator) differ from rank 0's: the only ones whose common
    state ``check_common_state_consistency`` then compares in full."""
    reference = digests[0] or {}
    return [rank for rank, theirs in enumerate(digests[1:], start=1) if (theirs or {}) != reference]


def check_common_state_consistency(
    common_state_dict: CommonStateDict | None, differing: list[int], group: Group
) -> None:
    """Collective: Megatron-Core's common-state consistency check, for the ranks whose
    digests differed from rank 0's (``ranks_with_differing_common_state``; every rank
    passes the same list). Only rank 0's common state is saved.

    Rank 0's common state goes to those ranks only; each diffs it with its own
    (``dict_utils.diff``) and, where they differ, logs Megatron-Core's (>= 0.14) warning
    "Rank <r> common state dict differs from rank 0 common state dict. Keys only on
    rank 0: [...], Keys only on <r>: [...], Mismatched keys: [...]". The coordinator
    then logs the differences of all ranks in Megatron's earlier format: "There is
    difference in the common state dict in different ranks. The differences are
    {rank: (only_left, only_right, mismatch)}". Digests that differ where ``diff``
    finds the values equal (equal tensors of different dtypes) log nothing. Nothing
    here fails the save: a value that cannot be compared is reported as differing.
    """
    if not differing or group.world_size == 1:
        return
    payload = _travelling(common_state_dict) if group.is_coordinator else None
    received = group.scatter_object([payload if r in differing else None for r in range(group.world_size)])
    report = None
    if group.rank in differing and received is not None:
        reference, by_repr = received
        mine = _comparable(common_state_dict or {}, by_repr)
        try:
            only_left, only_right, mismatch = diff(reference, mine)
        except Exception:  # noqa: BLE001  (a warning, never a failed save)
            only_left, only_right, mismatch = [], [], [((), type(reference), type(mine))]
        if only_left or only_right or mismatch:
            logger.warning(
                f"Rank {group.rank} common state dict differs from rank 0 common state dict. "
                f"Keys only on rank 0: {only_left}, Keys only on {group.rank}: {only_right}, "
                f"Mismatched keys: {mismatch}"
            )
            report = (only_left, only_right, mismatch)
    reports = group.gather_object(report)
    differences = {rank: r for rank, r in enumerate(reports) if r is not None}
    if differences:
        logger.warning(
            f"There is difference in the common state dict in different ranks. The differences are {differences}"
        )


def _travelling(common_state_dict: CommonStateDict | None) -> tuple[Any, bool]:
    """Rank 0's common state as it can travel: itself, or (when it cannot be pickled)
    each top-level entry's repr, with the flag saying so."""
    state = common_state_dict or {}
    try:
        pickle.dumps(state)
    except Exception:  # noqa: BLE001  (compared, not saved: a repr is good enough)
        return _comparable(state, True), True
    return state, False


def _comparable(state: CommonStateDict, by_repr: bool) -> Any:
    return {key: repr(value) for key, value in state.items()} if by_repr else state


def validate_sharding_integrity(
    layout: GlobalLayout | list[list[ShardedBase]],
    storage: NameLimits | None = FORMAT_NAME_LIMITS,
    where: str = "",
    *,
    common_state_dict: CommonStateDict | None = None,
) -> None:
    """Every key can be stored, every element of every global tensor is covered exactly
    once by main replicas, shapes and dtypes agree across ranks, and ShardedObjects are
    complete.

    ``layout``: the gathered layout (shardstore's save and load check it on the
    coordinator), or Megatron-Core's global metadata, every rank's data-less
    ShardedTensors and ShardedObjects (``determine_global_metadata(...)[1]``), which
    every rank passes and rank 0 alone checks, as in Megatron-Core.
    ``storage``: where a save writes (its location's ``name_limits``; the default knows
    only the format's own names and limits), so the keys are checked first
    (``check_storable_keys``); None for a load's request, whose keys name what is stored.
    ``common_state_dict``: Megatron-Core's keyword: every rank passes its common state,
    and the ranks whose common state differs from rank 0's are warned about
    (``validate_common_state_dict``; collective).

    Raises:
        CheckpointingException: listing up to ten problems, each naming its key.
    """
    if common_state_dict is not None:
        validate_common_state_dict(common_state_dict, Group())
    if not isinstance(layout, GlobalLayout):
        if Group().rank != 0:
            return
        layout = _layout_of_global_metadata(layout)
    if storage is not None:
        check_storable_keys(layout, storage, where)
    problems: list[str] = [
        f"{key!r} names both a ShardedTensor and a ShardedObject" for key in sorted(set(layout.tensors) & set(layout.objects))
    ]
    problems += array_group_collisions([*layout.tensors, *layout.objects])
    for key, shards in sorted(layout.tensors.items()):
        problems += _tensor_problems(key, shards)
        if len(problems) >= MAX_REPORTED_PROBLEMS:
            break
    for key, shards in sorted(layout.objects.items()):
        problems += _object_problems(key, shards)
    if problems:
        shown = "\n  ".join(problems[:MAX_REPORTED_PROBLEMS])
        raise CheckpointingException(f"Invalid global sharding ({len(problems)} problem(s)):\n  {shown}")


def _layout_of_global_metadata(global_metadata: list[list[ShardedBase]]) -> GlobalLayout:
    """The layout of Megatron-Core's global metadata (one list of sharded items per rank)."""
    per_rank = []
    for rank, items in enumerate(global_metadata):
        tensors = [x for x in items if isinstance(x, ShardedTensor)]
        objects = [x for x in items if isinstance(x, ShardedObject)]
        per_rank.append(local_records(tensors, objects, rank))
    return GlobalLayout.from_gathered(per_rank)


def common_state_digests(common_state_dict: CommonStateDict) -> dict[str, str]:
    """A checksum of each top-level entry of the common state, as ``common.pt`` would
    store it (entries that cannot be serialized get their repr's)."""
    digests = {}
    for key, value in common_state_dict.items():
        try:
            data = serialize(value)
        except Exception:  # noqa: BLE001  (compared, not saved: a repr is good enough)
            data = repr(value).encode()
        digests[str(key)] = checksum(data)
    return digests


def validate_common_state_dict(common_state_dict: CommonStateDict, group: Group) -> None:
    """Collective: warns where a rank's common state differs from rank 0's (which is the
    one saved), as Megatron-Core's check does. The digests of every rank's entries go to
    the coordinator; only where they differ are the states compared in full
    (``check_common_state_consistency``). ``save`` does the same inside its plan
    stage, at no extra collective when nothing differs."""
    if group.world_size == 1:
        return
    digests = group.gather_object(common_state_digests(common_state_dict))
    differing = group.broadcast_object(ranks_with_differing_common_state(digests) if group.is_coordinator else None)
    check_common_state_consistency(common_state_dict, differing, group)


def check_storable_keys(layout: GlobalLayout, storage: NameLimits, where: str = "") -> None:
    """The one check of a save's keys, on the coordinator before anything is written:
    every ShardedTensor key, ShardedObject key and shard key, with the files each will
    be written to, through ``format.check_key`` against ``storage``'s limits.

    Raises:
        CheckpointingException: naming the checkpoint (``where``), up to ten keys with
            the ranks holding each, why it cannot be stored and what to do.
    """
    problems = []
    for key, what, files, shards in _keys_and_files(layout):
        try:
            check_key(key, where, storage, files)
        except CheckpointingException as exc:
            ranks = ", ".join(map(str, sorted({s.rank for s in shards})))
            problems.append(f"{exc} ({what}, held by rank(s) {ranks})")
    if problems:
        shown = "\n  ".join(problems[:MAX_REPORTED_PROBLEMS])
        raise CheckpointingException(
            f"{len(problems)} key(s) cannot be stored{f' in {where}' if where else ''}; nothing was written:\n  {shown}"
        )


def _keys_and_files(
    layout: GlobalLayout,
) -> Iterator[tuple[str, str, tuple[str, ...], list[ShardRecord] | list[ObjectShardRecord]]]:
    """Every key a save writes, what it is, its longest files (relative to the
    checkpoint) and the shards that hold it: an array's ``zarr.json`` and its last chunk
    (an upper bound: the grid has at most as many chunks along an axis as the shape has
    elements), a ShardedObject's key (its files are its shards') and each shard's file."""
    for key, shards in layout.tensors.items():
        last = tuple(max(n - 1, 0) for n in shards[0].global_shape)
        yield key, "ShardedTensor", (f"{key}/{ZARR_JSON}", f"{key}/{chunk_key(last)}"), shards
    for key, objects in layout.objects.items():
        yield key, "ShardedObject", (), objects
        by_shard: dict[str, list[ObjectShardRecord]] = defaultdict(list)
        for s in objects:
            by_shard[s.unique_key].append(s)
        for unique_key, holders in by_shard.items():
            yield unique_key, f"a shard of ShardedObject {key!r}", (object_path(unique_key),), holders


def _tensor_problems(key: str, shards: list[ShardRecord]) -> list[str]:
    first = shards[0]
    for s in shards[1:]:
        if s.global_shape != first.global_shape:
            return [
                f"{key!r}: inconsistent global shape: rank {first.rank} has {first.global_shape}, "
                f"rank {s.rank} has {s.global_shape}"
            ]
        if s.dtype != first.dtype:
            return [f"{key!r}: inconsistent dtype: rank {first.rank} has {first.dtype}, rank {s.rank} has {s.dtype}"]
    main = [s for s in shards if s.main]
    if not main:
        return [f"{key!r}: no rank holds a main replica (replica_id 0), so nobody would write it"]
    for s in main:
        if any(o < 0 or o + b > g for o, b, g in zip(s.offset, s.block_shape, s.global_shape)):
            return [f"{key!r}: rank {s.rank}'s shard at offset {s.offset} with shape {s.block_shape} "
                    f"lies outside the global shape {s.global_shape}"]
    flat = [s.flat_range is not None for s in main]
    if any(flat) and not all(flat):
        return [f"{key!r}: some main replicas are flattened and some are not"]
    if all(flat):
        problems = _flat_problems(key, main)
        if problems:
            return problems
        main = list({s.offset: s for s in main}.values())
    return _coverage_problems(key, main, first.global_shape)


def _flat_problems(key: str, main: list[ShardRecord]) -> list[str]:
    blocks: dict[tuple[int, ...], list[ShardRecord]] = defaultdict(list)
    for s in main:
        blocks[s.offset].append(s)
    for offset, ranges in blocks.items():
        if len({r.block_shape for r in ranges}) > 1:
            return [f"{key!r}: flattened shards of block {offset} disagree on the block shape"]
        position, volume = 0, ranges[0].block_volume
        for r in sorted(ranges, key=lambda r: r.flat_range):
            start, stop = r.flat_range
            if start > position:
                return [f"{key!r}: block at {offset}: flat elements [{position}, {start}) are not covered"]
            if start < position:
                return [f"{key!r}: block at {offset}: flat ranges overlap at element {start} (rank {r.rank})"]
            position = stop
        if position != volume:
            return [f"{key!r}: block at {offset}: flat elements [{position}, {volume}) are not covered"]
    return []


def _coverage_problems(key: str, main: list[ShardRecord], global_shape: tuple[int, ...]) -> list[str]:
    if math.prod(global_shape) == 0:
        return []
    if len(main) == 1 and main[0].block_shape == global_shape:  # the common whole-tensor case, no grid to count
        return []
    volume = sum(s.block_volume for s in main)
    bounds = [
        sorted({0, g} | {s.offset[a] for s in main} | {s.offset[a] + s.block_shape[a] for s in main})
        for a, g in enumerate(global_shape)
    ]
    cells = math.prod(len(b) - 1 for b in bounds)
    if cells > MAX_COVERAGE_CELLS:
        # Too irregular to count cell by cell: fall back to the total volume.
        if volume != math.prod(global_shape):
            return [f"{key!r}: main replicas cover {volume} elements, the global shape has {math.prod(global_shape)}"]
        return []
    counts = np.zeros([len(b) - 1 for b in bounds], dtype=np.int32)
    for s in main:
        index = tuple(
            slice(bisect.bisect_left(b, o), bisect.bisect_left(b, o + e))
            for b, o, e in zip(bounds, s.offset, s.block_shape)
        )
        counts[index] += 1
    problems = []
    for bad, what in ((counts == 0, "is not covered by any main replica (gap)"),
                      (counts > 1, "is covered by more than one main replica (overlap)")):
        if bad.any():
            cell = tuple(int(i) for i in np.argwhere(bad)[0])
            start = tuple(b[i] for b, i in zip(bounds, cell))
            problems.append(f"{key!r}: the region starting at {start} {what}")
    return problems


def _object_problems(key: str, shards: list[ObjectShardRecord]) -> list[str]:
    shapes = {s.global_shape for s in shards}
    if len(shapes) > 1:
        return [f"ShardedObject {key!r}: inconsistent global shapes {sorted(shapes)}"]
    main_keys = [s.unique_key for s in shards if s.main]
    if len(main_keys) != len(set(main_keys)):
        return [f"ShardedObject {key!r}: a shard has more than one main replica"]
    expected = math.prod(shards[0].global_shape)
    if len(main_keys) != expected:
        return [f"ShardedObject {key!r}: {expected - len(main_keys)} of {expected} shards have no main replica"]
    return []


def determine_global_metadata(
    sharded_state_dict: ShardedStateDict, process_group: Any = None
) -> tuple[list[ShardedBase], list[list[ShardedBase]]]:
    """Collective (Megatron-Core's name): this rank's ShardedTensors and ShardedObjects
    without data, and every rank's, by rank.

    For callers of that API; shardstore's own save and load gather compact records to
    the coordinator instead (``protocol.gather_and_plan``).
    """
    local = [item.without_data() for item in nested_values(sharded_state_dict) if isinstance(item, ShardedBase)]
    return local, Group(process_group).all_gather_object(local)


def validate_sharded_objects_handling(sharded_strategy: Any, common_strategy: Any) -> None:
    """One of the two strategies must handle ShardedObjects."""
    if not sharded_strategy.can_handle_sharded_objects and not common_strategy.can_handle_sharded_objects:
        raise CheckpointingException(
            f"Either the sharded strategy or the common strategy must handle ShardedObjects; "
            f"neither {sharded_strategy} nor {common_strategy} does"
        )


def plan_load(
    layout: GlobalLayout,
    ckpt_keys: set[str],
    strict: StrictHandling,
    validate_access_integrity: bool,
    read_planner: Callable[[GlobalLayout], list[Any]],
    where: str = "",
) -> list[RankLoadPlan]:
    """The coordinator's part of a load, from every rank's request (index = group rank).

    Applies ``strict``: keys a rank requested that the checkpoint lacks ("unexpected")
    are dropped from the plan (the raising modes raise here, so on every rank, naming
    every rank's keys); checkpoint keys no rank requested ("missing") are found for the
    ``*_ALL`` modes. Then checks that the main replicas of the requests cover every
    requested tensor exactly once (``validate_access_integrity``), and lets the sharded
    strategy plan the reads (``read_planner``, e.g. ``planner.plan_reads``).
    """
    unexpected: list[set[str]] = [set() for _ in range(layout.world_size)]
    missing: set[str] = set()
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        for shards in (*layout.tensors.values(), *layout.objects.values()):
            for s in shards:
                if s.key not in ckpt_keys:
                    unexpected[s.rank].add(s.key)
        if StrictHandling.requires_global_app_metadata(strict):
            missing = ckpt_keys - (layout.tensors.keys() | layout.objects.keys())
        if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
            maybe_report_missing_and_unexpected_keys(missing, set().union(*unexpected), True, where)
        layout = without_keys(layout, set().union(*unexpected))
    if validate_access_integrity:
        validate_sharding_integrity(layout, storage=None)
    reads = read_planner(layout)
    return [
        RankLoadPlan(rank, frozenset(missing), frozenset(unexpected[rank]), reads[rank])
        for rank in range(layout.world_size)
    ]


def without_keys(layout: GlobalLayout, keys: set[str]) -> GlobalLayout:
    """``layout`` without the requests for ``keys``, each rank's remaining tensors
    renumbered as in its state dict once those keys are dropped from it."""
    if not keys:
        return layout
    kept: dict[int, list[ShardRecord]] = defaultdict(list)
    for key, shards in layout.tensors.items():
        if key not in keys:
            for s in shards:
                kept[s.rank].append(s)
    renumbered: dict[str, list[ShardRecord]] = defaultdict(list)
    for shards in kept.values():
        for index, s in enumerate(sorted(shards, key=lambda s: s.index)):
            renumbered[s.key].append(replace(s, index=index))
    return GlobalLayout(
        {k: renumbered[k] for k in layout.tensors if k in renumbered},
        {k: v for k, v in layout.objects.items() if k not in keys},
        layout.world_size,
    )


def adjust_non_strict_load(
    sharded_state_dict: ShardedStateDict, sharded_keys_to_remove: set[str] | frozenset[str]
) -> ShardedStateDict:
    """Drops the ShardedBase entries whose key is in ``sharded_keys_to_remove``."""
    if not sharded_keys_to_remove:
        return sharded_state_dict

    def is_unexpected(x: Any) -> bool:
        return isinstance(x, ShardedBase) and x.key in sharded_keys_to_remove

    _, kept = extract_matching_values(sharded_state_dict, is_unexpected)
    return kept


def maybe_report_missing_and_unexpected_keys(
    missing_keys: set[str], unexpected_keys: set[str], raise_error: bool = True, where: str = ""
) -> None:
    """Raises (or logs at WARNING) a message listing the mismatched keys, if any."""
    if not missing_keys and not unexpected_keys:
        return
    # Megatron-Core's key phrases ("Missing keys", "Unexpected keys") first: code that
    # matches on them keeps working; our detail follows.
    parts = []
    if unexpected_keys:
        parts.append(f"Unexpected keys (requested but not in the checkpoint): {sorted(unexpected_keys)}")
    if missing_keys:
        parts.append(f"Missing keys (in the checkpoint but not requested, for all ranks): {sorted(missing_keys)}")
    message = f"Checkpoint {where} does not match the requested state dict: " + "; ".join(parts)
    if raise_error:
        raise CheckpointingException(message)
    logger.warning(message)


def reported_mismatches(
    strict: StrictHandling, plan: RankLoadPlan, where: str = ""
) -> tuple[set[str], set[str]]:
    """This rank's ``(missing, unexpected)`` keys as ``strict`` reports them: logged at
    WARNING by the logging modes, returned by the returning modes, nothing for
    ``IGNORE_ALL`` (the raising modes raised while planning)."""
    missing, unexpected = set(plan.missing), set(plan.unexpected)
    if strict == StrictHandling.IGNORE_ALL:
        return set(), set()
    if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
        maybe_report_missing_and_unexpected_keys(missing, unexpected, False, where)
    return missing, unexpected


__all__ = [
    "CommonStateDict",
    "StrictHandling",
    "adjust_non_strict_load",
    "check_key",
    "check_storable_keys",
    "maybe_report_missing_and_unexpected_keys",
    "parse_strict_flag",
    "plan_load",
    "validate_common_state_dict",
    "validate_sharded_objects_handling",
    "validate_sharding_integrity",
]
