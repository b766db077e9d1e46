"""The one helper every collective stage of a save and a load runs through: ``run_stage``.

A stage, in order (PyTorch DCP's ``_DistWrapper`` plays the same part):

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
                             chunks of a save, the replicated blocks of a load),
                             planned with the work, so a failure in planning them is
                             agreed as well

Collectives (``torch.distributed`` calls): a stage without a reduction agrees with one
all-reduce of a failure flag and the setting's digest (a failure, or settings that
differ, then gather every rank's to name them); with a reduction, one gather and one
scatter or broadcast (``Group.gather_to_answer``: sizes ride inside the messages) carry
the failures as well, so agreement costs nothing more. Transfers add one batch of
point-to-point messages.

Every collective of a save and a load goes through here, Megatron-Core's direct
collective APIs (``validation.validate_common_state_dict``,
``determine_global_metadata``) and the common-state check included: a failure on any
rank just before any of them raises the same error on every rank within seconds, never
a wait for the process group's timeout (``tests/test_stage_failures.py`` finds every
collective call site of a save and a load and fails each in turn). An agreement alone
is ``run_stage(group, what, lambda: None, local_error=error)``.

Waiting: all of a stage's collectives share one wait budget, the process group's
timeout (``collectives.WaitBudget``): a rank waits for its peers at most that long per
stage in all, however many collectives the stage has. A lost peer raises
``collectives.PeerLost`` (not a ``StageFailed``: the peers may not know).

One rank (world size 1, or no process group): there is nobody to tell, so a failure is
raised as it is, a ``CheckpointingException`` unchanged, anything else as a
``StageFailed`` naming the stage (not "rank 0").
"""

from __future__ import annotations

__all__ = ["Deliver", "Transfers", "every_rank_stopped", "raise_stage_failure", "run_stage"]

import dataclasses
import hashlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NoReturn

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
    ``peer``) land in ``receives[me]`` of the peer, in order (``Group.exchange``: the
    small ones packed, a message per pair of ranks; large ones each a message)."""

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
    same_setting: tuple[str, Any] | None = None,
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
        transfers: this rank's result -> its point-to-point transfers (stages without
            ``reduce`` only); planned as part of the work, so a failure there is agreed
            as well, and run once every rank is known to have succeeded.
        same_setting: ``(name, value)`` of a setting every rank must pass alike (one
            the stage's transfers depend on; stages without ``reduce`` only): its
            digest rides the agreement (a dataclass's by the fields its ``==``
            compares), so a rank that differs fails the stage on every rank, naming
            each rank's value, before any transfer.

    Returns:
        This rank's part of the reduction, the broadcast result, or (without
        ``reduce``) this rank's ``work()`` result.

    Raises:
        StageFailed: on every rank, when any rank's work or the reduction failed (one
            rank: its CheckpointingException as it is); PeerLost when a peer is lost
            during a collective or does not answer within the stage's wait budget.
    """
    if (transfers is not None or same_setting is not None) and reduce is not None:
        raise ValueError("run_stage: a stage with a reduction has no transfers (plan them in the next stage)")
    group = group.budgeted(group.new_budget())  # one budget for every wait of the stage
    result, planned, error = None, None, local_error
    if error is None:
        try:
            result = work()
            if transfers is not None:  # planned and allocated before the agreement: a failure here is agreed too
                wanted = transfers(result)
                planned = group.prepare_exchange(wanted.sends, wanted.receives)
        except Exception as exc:  # told to every rank by this stage's agreement
            error = exc
    if reduce is None:
        _agree(group, error, what, same_setting)
    else:
        result = _reduce_on_coordinator(group, what, result, error, reduce, deliver)
    if planned is not None:
        group.run_exchange(planned)
    return result


def _agree(group: Group, error: BaseException | None, what: str, setting: tuple[str, Any] | None = None) -> None:
    """Collective (one all-reduce of a failure flag and the digest of the rank's
    ``setting``; then, only when a rank failed or the settings differ, one all-gather
    of what each rank had): raises the same ``StageFailed`` on every rank when any rank
    failed, so a failure on one rank is a clear error on all of them instead of a hang,
    or when the ranks' settings differ."""
    if group.world_size == 1:
        if error is not None:
            raise_stage_failure(group, what, error)
        return
    local = None if error is None else RankFailure.from_exception(group.rank, error)
    digest = 0 if setting is None else _digest(setting[1])
    failed, highest, lowest = group.reduce_over_ranks([int(local is not None), digest, -digest], "max", what)
    if not failed and highest == -lowest:
        return
    # every rank learned the same: all of them gather what each had, to name it
    gathered = group.all_gather_object((local, None if setting is None else setting[1]))
    failures = [f for f, _ in gathered if f is not None]
    if failures:
        raise StageFailed(failure_message(failures, what)) from error
    values = [value for _, value in gathered]
    each = ", ".join(f"rank {rank}: {value!r}" for rank, value in enumerate(values))
    raise StageFailed(
        f"{what} failed: the ranks passed different {setting[0]} ({each}); pass every rank the same value"
    )


def _digest(value: Any) -> int:
    """A 62-bit digest of ``value``, alike on every rank for equal values: pickled, a
    dataclass by the fields its ``==`` compares."""
    data = pickle.dumps(_compared(value), protocol=4)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


def _compared(value: Any) -> Any:
    """What ``==`` compares of ``value``: a dataclass's compared fields, else itself."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value).__qualname__, tuple(
            _compared(getattr(value, f.name)) for f in dataclasses.fields(value) if f.compare)
    return value


def every_rank_stopped(group: Group, error: BaseException) -> bool:
    """Whether no rank of ``group`` can still be working on the stage ``error`` ended:
    every rank raised the same ``StageFailed``, or this process is the only rank (any
    exception, an interrupt included, once it unwound the rank's own writes)."""
    return group.world_size == 1 or isinstance(error, StageFailed)


def raise_stage_failure(group: Group, what: str, error: BaseException) -> NoReturn:
    """Raises what ``error`` of this rank's own step ``what`` becomes for the stage
    (a reduction that fails raises it, for every rank to hear): a ``StageFailed``
    naming this rank; with one rank, a CheckpointingException as it is (its own words
    name the checkpoint and key), anything else as a ``StageFailed`` naming the step."""
    if group.world_size > 1:
        raise StageFailed(failure_message([RankFailure.from_exception(group.rank, error)], what)) from error
    if isinstance(error, CheckpointingException):
        raise error
    raise StageFailed(f"{what} failed: {type(error).__name__}: {error}") from error


def _reduce_on_coordinator(
    group: Group, what: str, result: Any, error: BaseException | None, reduce: Callable[[list[Any]], Any],
    deliver: Deliver,
) -> Any:
    """Gather -> reduce -> scatter or broadcast, each message carrying either the
    result or the one failure message every rank raises. Messages are pickled here,
    before the collective (``_pack``), so a result that cannot be pickled is a failure
    every rank learns of, not a rank that never joins the collective."""
    if group.world_size == 1:
        return _reduce_alone(group, what, result, error, reduce, deliver)
    mine = RankFailure.from_exception(group.rank, error) if error is not None else result
    coordinator_errors: list[Exception] = []

    def answer(messages: list[bytes]) -> Any:
        try:
            gathered = [_unpack(group, m) for m in messages]
        except Exception as exc:  # told to every rank by the delivery, as the reduction's own failure
            coordinator_errors.append(exc)
            return _failure_delivery(group, _coordinator_failure(what, exc), deliver)
        delivery, coordinator_error = _delivery(group, what, gathered, reduce, deliver)
        coordinator_errors.extend([coordinator_error] if coordinator_error is not None else [])
        return delivery

    reply = group.gather_to_answer(_pack_result(group, mine), answer, scatter=deliver is Deliver.SCATTER)
    message, part = _unpack(group, reply)
    if message is not None:
        raise StageFailed(message) from (error or (coordinator_errors[0] if coordinator_errors else None))
    return part


def _reduce_alone(
    group: Group, what: str, result: Any, error: BaseException | None, reduce: Callable[[list[Any]], Any],
    deliver: Deliver,
) -> Any:
    """``_reduce_on_coordinator`` for a single rank: the reduction of its own result,
    or its failure (``raise_stage_failure``)."""
    if error is not None:
        raise_stage_failure(group, what, error)
    try:
        reduced = reduce([result])
    except Exception as exc:  # noqa: BLE001  (raised as it is, or named, below)
        raise_stage_failure(group, what, exc)
    return list(reduced)[0] if deliver is Deliver.SCATTER else reduced


def _delivery(
    group: Group, what: str, gathered: list[Any], reduce: Callable[[list[Any]], Any], deliver: Deliver
) -> tuple[Any, Exception | None]:
    """Coordinator: what it sends (one packed ``(failure message, part)`` per rank to
    scatter, or one packed ``(failure message, result)`` to broadcast), and the
    reduction's own failure, if any."""
    failures = [g for g in gathered if isinstance(g, RankFailure)]
    if failures:
        return _failure_delivery(group, failure_message(failures, what), deliver), None
    try:
        reduced = reduce(gathered)
        if deliver is Deliver.BROADCAST:
            return _pack(group, (None, reduced)), None
        parts = list(reduced)
        if len(parts) != group.world_size:
            raise ValueError(f"the reduction made {len(parts)} parts for {group.world_size} ranks")
        return [_pack(group, (None, part)) for part in parts], None
    except Exception as exc:  # told to every rank by the delivery
        return _failure_delivery(group, _coordinator_failure(what, exc), deliver), exc


def _failure_delivery(group: Group, message: str, deliver: Deliver) -> Any:
    packed = _pack(group, (message, None))
    return [packed] * group.world_size if deliver is Deliver.SCATTER else packed


def _pack(group: Group, obj: Any) -> Any:
    """``obj`` as it travels: pickled by us (so a failure to pickle raises before the
    collective, where the stage can still tell every rank), as is for a single rank."""
    return obj if group.world_size == 1 else pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _pack_result(group: Group, obj: Any) -> Any:
    """``_pack``; a result that cannot be pickled travels as this rank's failure."""
    try:
        return _pack(group, obj)
    except Exception as exc:  # noqa: BLE001  (told to every rank by the coordinator)
        return _pack(group, RankFailure.from_exception(group.rank, exc))


def _unpack(group: Group, message: Any) -> Any:
    """What ``_pack`` packed (a peer of the same job pickled it, as ``torch.distributed``'s
    object collectives do)."""
    return message if group.world_size == 1 else pickle.loads(message)  # noqa: S301


def _coordinator_failure(what: str, exc: Exception) -> str:
    """A reduction's failure as every rank reports it: a CheckpointingException's own
    words (they name checkpoint and key), anything else as the coordinator's failure."""
    if isinstance(exc, CheckpointingException):
        return str(exc)
    return f"{what} failed on the coordinator: {type(exc).__name__}: {exc}"
