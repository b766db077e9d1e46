"""Megatron-Core's common-state consistency check, as a collective: only rank 0's common
state is saved, so the ranks whose common state differs from it are warned about.

Digests of each rank's top-level entries travel with the plan's gather
(``common_state_digests``; ``planning.checks.ranks_with_differing_common_state`` picks
the differing ranks); only those ranks then compare in full
(``check_common_state_consistency``, two ``run_stage`` stages: rank 0's state scattered
to them, their differences gathered to it).
"""

from __future__ import annotations

__all__ = ["check_common_state_consistency", "common_state_digests"]

import logging
import pickle
from typing import Any

from shardstore.dict_utils import diff
from shardstore.format.pickles import serialize
from shardstore.format.records import file_digest
from shardstore.mapping import CommonStateDict
from shardstore.protocol.collectives import Group
from shardstore.protocol.stage import Deliver, run_stage

logger = logging.getLogger(__name__)

def common_state_digests(common_state_dict: CommonStateDict) -> dict[str, str]:
    """A checksum of each top-level entry of the common state, as ``common.pt`` would
    store it (entries that cannot be serialized get their repr's), by the ``repr`` of
    its key (``1`` and ``"1"`` are two entries)."""
    digests = {}
    for key, value in common_state_dict.items():
        try:
            data = serialize(value)
        except Exception:  # noqa: BLE001  (compared, not saved: a repr is good enough)
            data = safe_repr(value).encode()
        digests[repr(key)] = file_digest(data)  # 128 bits: a crc32c could hold two values equal
    return digests


def check_common_state_consistency(
    common_state_dict: CommonStateDict | None, differing: list[int], group: Group
) -> None:
    """Collective (two ``run_stage`` stages, only when ``differing`` is not empty):
    Megatron-Core's common-state consistency check, for the ranks whose digests differed
    from rank 0's (``ranks_with_differing_common_state``; every rank passes the same
    list). Only rank 0's common state is saved.

    Rank 0's common state goes to those ranks only (a scatter); each diffs it with its
    own (``dict_utils.diff``) and, where they differ, logs Megatron-Core's (>= 0.14)
    warning "Rank <r> common state dict differs from rank 0 common state dict. Keys only
    on rank 0: [...], Keys only on <r>: [...], Mismatched keys: [...]". The coordinator
    then logs the differences of all ranks in Megatron's earlier format: "There is
    difference in the common state dict in different ranks. The differences are
    {rank: (only_left, only_right, mismatch)}". Digests that differ where ``diff``
    finds the values equal (equal tensors of different dtypes) log nothing. A value
    that cannot be pickled or compared is compared by its repr (a repr that raises, by
    its type and that error) and reported as differing; a failure of the check itself
    on any rank raises the same ``StageFailed`` on every rank, never a wait.
    """
    if not differing or group.world_size == 1:
        return
    received = run_stage(
        group, "Sending rank 0's common state for the consistency check",
        lambda: _travelling(common_state_dict) if group.is_coordinator else None,
        reduce=lambda gathered: [gathered[0] if r in differing else None for r in range(group.world_size)],
        deliver=Deliver.SCATTER,
    )
    run_stage(
        group, "Comparing the common state with rank 0's",
        lambda: _compare_with_reference(common_state_dict, received, group.rank),
        reduce=_log_differences, deliver=Deliver.BROADCAST,
    )


def _compare_with_reference(
    common_state_dict: CommonStateDict | None, received: tuple[Any, bool] | None, rank: int
) -> tuple[list, list, list] | None:
    """This rank's differences from rank 0's common state (``received``; None on the
    ranks that do not compare), logged here; None when there are none."""
    if received is None:
        return None
    reference, by_repr = received
    mine = _comparable(common_state_dict or {}, by_repr)
    try:
        only_left, only_right, mismatch = diff(reference, mine)
    except Exception:  # noqa: BLE001  (a warning, never a failed save)
        only_left, only_right, mismatch = [], [], [((), type(reference), type(mine))]
    if not (only_left or only_right or mismatch):
        return None
    logger.warning(
        f"Rank {rank} common state dict differs from rank 0 common state dict. "
        f"Keys only on rank 0: {only_left}, Keys only on {rank}: {only_right}, "
        f"Mismatched keys: {mismatch}"
    )
    report = (only_left, only_right, mismatch)
    try:  # it travels to the coordinator: keys and types it cannot pickle go as repr's
        pickle.dumps(report)
    except Exception:  # noqa: BLE001  (logged, never saved)
        report = tuple([safe_repr(x) for x in part] for part in report)
    return report


def _log_differences(reports: list[tuple[list, list, list] | None]) -> None:
    """Coordinator: Megatron's earlier warning, naming every rank that differs."""
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
    return {key: safe_repr(value) for key, value in state.items()} if by_repr else state


def safe_repr(value: Any) -> str:
    """``repr(value)``, or (when that raises) its type and the error: what the check
    compares and logs for a value it cannot pickle."""
    try:
        return repr(value)
    except Exception as exc:  # noqa: BLE001  (compared and logged, never saved)
        return f"<{type(value).__qualname__} whose repr raised {type(exc).__name__}: {exc}>"
