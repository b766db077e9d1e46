"""The one helper every collective stage of a save and a load runs through: ``run_stage``.

A stage, in order (PyTorch DCP's ``_DistWrapper`` plays the same part)::

    every rank    work       its local step (records, host copies, reads, writes' outcome)
    coordinator   reduce     every rank's result, gathered to it alone: plans, commits
    every rank    deliver    its own part of the reduction (scatter) or the one result
                             (broadcast)
    every rank    agree      any rank's failure (in its work, or the coordinator's in the
                             reduction) raises the same ``StageFailed`` on every rank,
                             naming the failing ranks, so no rank waits for a peer that
                             gave up
    ranks named   transfer   only when every rank succeeded: the point-to-point byte
                             transfers the stage's result calls for (the straddling
                             chunks of a save, the replicated blocks of a load)

Collectives: a stage without a reduction agrees with one all-gather of failures; with a
reduction, the gather and the scatter or broadcast carry the failures as well, so
agreement costs nothing more. Transfers add one batch of point-to-point messages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from shardstore.errors import CheckpointingException
from shardstore.protocol.collectives import Group, RankFailure, StageFailed, failure_message


class Deliver(Enum):
    """How the coordinator's reduction reaches the ranks."""

    SCATTER = "scatter"  # the reduction is one part per group rank; rank r receives part r
    BROADCAST = "broadcast"  # every rank receives the whole reduction


@dataclass(frozen=True)
class Transfers:
    """A rank's point-to-point transfers: ``sends[peer]`` (this rank's tensors for
    ``peer``) land in ``receives[me]`` of the peer, in order; one packed message per
    pair of ranks (``Group.exchange``)."""

    sends: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    receives: dict[int, list[torch.Tensor]] = field(default_factory=dict)


def run_stage(
    group: Group,
    what: str,
    work: Callable[[], Any],
    *,
    reduce: Callable[[list[Any]], Any] | None = None,
    deliver: Deliver = Deliver.BROADCAST,
    transfers: Callable[[Any], Transfers] | None = None,
    local_error: BaseException | None = None,
) -> Any:
    """Collective: runs one stage (module docstring) on every rank of ``group``.

    Args:
        what: the stage, as errors name it ("Writing checkpoint /ckpt").
        work: this rank's local step; not run when ``local_error`` (a failure of an
            earlier local step, reported by this stage) is given.
        reduce: on the coordinator only, every rank's ``work()`` result (index = group
            rank) -> one part per rank (``Deliver.SCATTER``) or one result
            (``Deliver.BROADCAST``). None: ``work()``'s result stays on its rank and
            only failures travel.
        transfers: this rank's result -> its point-to-point transfers, run once every
            rank is known to have succeeded.

    Returns:
        This rank's part of the reduction, the broadcast result, or (without
        ``reduce``) this rank's ``work()`` result.

    Raises:
        StageFailed: on every rank, when any rank's work or the reduction failed;
            CheckpointingException when a peer is lost during a collective.
    """
    result, error = None, local_error
    if error is None:
        try:
            result = work()
        except Exception as exc:  # told to every rank by this stage's agreement
            error = exc
    if reduce is None:
        group.agree(error, what)
    else:
        result = _reduce_on_coordinator(group, what, result, error, reduce, deliver)
    if transfers is not None:
        planned = transfers(result)
        group.exchange(planned.sends, planned.receives)
    return result


def _reduce_on_coordinator(
    group: Group, what: str, result: Any, error: BaseException | None, reduce: Callable[[list[Any]], Any],
    deliver: Deliver,
) -> Any:
    """Gather -> reduce -> scatter or broadcast, each message carrying either the
    result or the one failure message every rank raises."""
    gathered = group.gather_object(RankFailure.from_exception(group.rank, error) if error is not None else result)
    outcome: tuple[str | None, Any] = (None, None)
    cause = error
    if group.is_coordinator:
        failures = [g for g in gathered if isinstance(g, RankFailure)]
        if failures:
            outcome = (failure_message(failures, what), None)
        else:
            try:
                outcome = (None, reduce(gathered))
            except Exception as exc:  # told to every rank by the delivery
                cause = exc
                outcome = (_coordinator_failure(what, exc), None)
    if deliver is Deliver.SCATTER:
        message, mine = group.scatter_object(_parts(outcome, group.world_size) if group.is_coordinator else None)
    else:
        message, mine = group.broadcast_object(outcome)
    if message is not None:
        raise StageFailed(message) from cause
    return mine


def _parts(outcome: tuple[str | None, Any], world_size: int) -> list[tuple[str | None, Any]]:
    """What the coordinator scatters: rank r's part, or the failure to every rank."""
    message, reduced = outcome
    if message is not None:
        return [(message, None)] * world_size
    return [(None, part) for part in reduced]


def _coordinator_failure(what: str, exc: Exception) -> str:
    """A reduction's failure as every rank reports it: a CheckpointingException's own
    words (they name checkpoint and key), anything else as the coordinator's failure."""
    if isinstance(exc, CheckpointingException):
        return str(exc)
    return f"{what} failed on the coordinator: {type(exc).__name__}: {exc}"
