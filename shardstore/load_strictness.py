"""How a load handles keys that do not match the checkpoint: the ``StrictHandling``
modes, the coordinator's load plan (``plan_load``: drops the "unexpected" keys, finds the
"missing" ones, checks access integrity, lets the strategy plan the reads) and what each
rank reports (``reported_mismatches``). Megatron-Core's ``dist_checkpointing.validation``
names for these and its other checks are ``shardstore.compat.megatron.validation``.
"""

from __future__ import annotations

__all__ = [
    "StrictHandling", "maybe_report_missing_and_unexpected_keys", "parse_strict_flag", "plan_load",
    "reported_mismatches", "without_keys",
]

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from enum import Enum
from typing import Any

from shardstore.errors import CheckpointingException
from shardstore.planning.checks import check_layout
from shardstore.planning.layout import GatheredShards, ShardRecord
from shardstore.planning.plans import RankLoadPlan

logger = logging.getLogger(__name__)

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
        """Whether the checkpoint's keys that no rank requested ("missing") are looked
        for (Megatron-Core's list, IGNORE_ALL included, though it reports nothing)."""
        return val in (
            StrictHandling.IGNORE_ALL, StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL
        )

    @staticmethod
    def reports_missing_keys(val: StrictHandling) -> bool:
        """Whether the mode logs, raises or returns the missing keys (``IGNORE_ALL``
        would only drop them: a load does not look for them there)."""
        return StrictHandling.requires_global_app_metadata(val) and val != StrictHandling.IGNORE_ALL

    @staticmethod
    def requires_returning_mismatch_keys(val: StrictHandling) -> bool:
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: str | Enum) -> StrictHandling:
    """Accepts a StrictHandling, Megatron-Core's (any enum of the same values), or its
    string value."""
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict.value if isinstance(strict, Enum) else strict)
    except (ValueError, TypeError) as exc:
        choices = ", ".join(s.value for s in StrictHandling)
        raise ValueError(f"Invalid strict flag {strict!r}; choose one of: {choices}") from exc


def plan_load(
    layout: GatheredShards,
    ckpt_keys: set[str],
    strict: StrictHandling,
    validate_access_integrity: bool,
    read_planner: Callable[[GatheredShards], list[Any]],
    where: str = "",
) -> list[RankLoadPlan]:
    """The coordinator's part of a load, from every rank's request (index = group rank).

    Applies ``strict``: keys a rank requested that the checkpoint lacks ("unexpected")
    are dropped from the plan (the raising modes raise here, so on every rank, naming
    every rank's keys); checkpoint keys no rank requested ("missing") are found for the
    ``*_ALL`` modes. Then checks that the main replicas of the requests cover every
    requested tensor exactly once (``validate_access_integrity``), and lets the sharded
    strategy plan the reads (``read_planner``, e.g. ``planning.plans.plan_reads``).
    """
    unexpected: list[set[str]] = [set() for _ in range(layout.world_size)]
    missing: set[str] = set()
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        for shards in (*layout.tensors.values(), *layout.objects.values()):
            for s in shards:
                if s.key not in ckpt_keys:
                    unexpected[s.rank].add(s.key)
        if StrictHandling.reports_missing_keys(strict):
            missing = ckpt_keys - (layout.tensors.keys() | layout.objects.keys())
        if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
            maybe_report_missing_and_unexpected_keys(missing, set().union(*unexpected), True, where)
        layout = without_keys(layout, set().union(*unexpected))
    if validate_access_integrity:
        check_layout(layout, None, where)
    reads = read_planner(layout)
    return [
        RankLoadPlan(rank, frozenset(missing), frozenset(unexpected[rank]), reads[rank])
        for rank in range(layout.world_size)
    ]


def without_keys(layout: GatheredShards, keys: set[str]) -> GatheredShards:
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
    return GatheredShards(
        {k: renumbered[k] for k in layout.tensors if k in renumbered},
        {k: v for k, v in layout.objects.items() if k not in keys},
        layout.world_size,
    )



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
