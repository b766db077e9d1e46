"""Megatron-Core's common-state consistency check, as a collective: only rank 0's common
state is saved, so the ranks whose common state differs from it are warned about.

Digests of each rank's top-level entries travel with the plan's gather
(``common_state_digests``; ``planning.checks.ranks_with_differing_common_state`` picks
the differing ranks); only those ranks then compare in full
(``check_common_state_consistency``).
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

from shardstore.dict_utils import diff
from shardstore.format.pickles import serialize
from shardstore.format.records import checksum
from shardstore.mapping import CommonStateDict
from shardstore.protocol.collectives import Group

logger = logging.getLogger(__name__)

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
