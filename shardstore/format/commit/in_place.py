"""``InPlace``: a save written at the target itself, under a claim on the prefix that
its commit record replaces (object stores, and any store that cannot rename a
directory); the rules are in its docstring and in ``format.claims``.
"""

from __future__ import annotations

__all__ = ["InPlace", "remove_unfinished"]

import logging

from shardstore.errors import CheckpointingException
from shardstore.format.claims import PrefixClaim, Taken
from shardstore.format.commit.options import SaveIntent, SaveOptions, new_save_id
from shardstore.format.commit.pending import PendingCheckpoint, Publisher
from shardstore.format.commit.targets import _check_target
from shardstore.format.records import COMMIT_RECORD, CommitRecord
from shardstore.format.reuse import reuse_save_id
from shardstore.stores.base import Location
from shardstore.stores.conditional import VersionedObject

logger = logging.getLogger(__name__)

# Objects deleted between two checks of the claim (one DeleteObjects request on S3).
DELETE_BATCH = 1000


class InPlace(Publisher):
    """Written at the target itself: object stores and any store that cannot rename a
    directory.

    The save first claims the prefix (``format.claims.PrefixClaim``): its claim stands
    in the root ``zarr.json``, written only where nothing, a committed record it may
    replace (``overwrite=True``) or the claim of a save that is over stands. A running
    save's claim refuses every other save before it changes anything. Then the save
    removes what stood there (the replaced checkpoint's objects, or what a save that is
    over left), checking its claim before each batch: from the claim until the commit,
    the prefix holds no loadable checkpoint (save each step to a new prefix to avoid that
    window). The commit replaces the claim with the record, only where the claim is
    still this save's. A save that ends without a commit gives its claim up, leaving its
    objects to the next save into the prefix (``verify`` lists them).

    Attributes:
        claim: the coordinator's claim (None on the other ranks).
    """

    def __init__(self, claim: PrefixClaim | None = None) -> None:
        self.claim = claim

    def begin(self, target: Location, options: SaveOptions, save_id: str) -> PendingCheckpoint:
        target.prepare()
        claim, taken = PrefixClaim.take(
            target, save_id, when_empty=lambda: _refuse_unless_empty(target, options),
            when_committed=lambda found: _replaceable(target, options, found),
        )
        removing = False
        try:
            source = options.reuse_from
            reuses = reuse_save_id(source, target, in_place=True) if source is not None else None
            if taken.over is not None:
                logger.warning("Removing the leftovers of an interrupted save at %s: %s", target.describe(),
                               taken.over.describe())
            if taken.over is not None or taken.replaced is not None:
                keys = _objects_but_claim(target)
                removing = True  # from the first deletion on, the replaced record cannot be put back
                _remove_under_claim(target, keys, claim)
        except BaseException:
            _undo_begin(claim, taken, removing)
            raise
        intent = SaveIntent(save_id, taken.replaces, reuses, options.layout)
        pending = PendingCheckpoint(target, target, intent, InPlace(claim), options)
        pending.hold_until_released(claim.stop)
        return pending

    def join(self, target: Location, intent: SaveIntent, options: SaveOptions) -> PendingCheckpoint:
        return PendingCheckpoint(target, target, intent, self, options)

    def mark(self, save: PendingCheckpoint) -> None:
        return None  # the claim is the marker

    def commit(self, save: PendingCheckpoint, record: CommitRecord) -> CommitRecord:
        self._coordinators_claim(save).commit(record.to_json())
        return record

    def abandon(self, save: PendingCheckpoint) -> None:
        claim = self._coordinators_claim(save)
        if claim.abandon() and claim.writes.lease_s == 0:
            # The store keeps saves apart for as long as they run (``memory://``): no
            # writer of this save can still be writing, so what it wrote goes now.
            _remove_under_claim(save.target, _objects_but_claim(save.target), None)
            save.target.remove(COMMIT_RECORD)

    def _coordinators_claim(self, save: PendingCheckpoint) -> PrefixClaim:
        if self.claim is None:
            raise CheckpointingException(
                f"Internal error: the save into {save.describe()} is committed or abandoned by a rank that did not "
                "begin it; please report it"
            )
        return self.claim


def remove_unfinished(target: Location) -> bool:
    """Removes what a save that is over left at ``target`` (its claim stands in
    ``zarr.json``: given up, its process gone, or its lease lapsed), taking its claim
    over first and removing it last. False, with nothing changed, where ``target``
    holds no claim or one that may still be renewed (never waited for), a committed
    checkpoint, or anything else.

    Raises:
        CheckpointingException: a failure while removing (what is left stays claimed)."""
    def refuse(*_: object) -> None:
        raise CheckpointingException(f"{target.describe()} holds no claim")

    try:
        claim, taken = PrefixClaim.take(target, new_save_id(), when_empty=refuse, when_committed=refuse, wait=False)
    except CheckpointingException:
        return False
    assert taken.over is not None  # where nothing or a record stood, ``refuse`` raised
    try:
        _remove_under_claim(target, _objects_but_claim(target), claim)
    except BaseException:
        claim.abandon()
        raise
    claim.release_unused()
    logger.warning("Removed what an interrupted save left at %s: %s", target.describe(), taken.over.describe())
    return True


def _refuse_unless_empty(target: Location, options: SaveOptions) -> None:
    """Before a claim is written where ``zarr.json`` holds nothing: refuses a prefix that
    holds other objects (another program's, or what no claim proves a save's)."""
    tops = target.list_top(None)
    if tops and COMMIT_RECORD not in tops:  # one written since is read anew (the claim's write fails)
        _check_target(target, options.overwrite, empty=False)


def _replaceable(target: Location, options: SaveOptions, found: VersionedObject) -> str | None:
    """The save id of the committed checkpoint ``found`` (its record as read) at
    ``target``, where this save may replace it; else the refusal ``_check_target`` gives."""
    return _check_target(target, options.overwrite, empty=False, record_read=found.data)


def _objects_but_claim(target: Location) -> list[str]:
    """Every object of ``target`` but its ``zarr.json`` (the claim)."""
    return [key for key in target.store.list("") if key != COMMIT_RECORD]


def _remove_under_claim(target: Location, keys: list[str], claim: PrefixClaim | None) -> None:
    """Removes ``keys`` from ``target``, checking before each batch that the claim is
    still this save's (``PrefixClaim.check``)."""
    for start in range(0, len(keys), DELETE_BATCH):
        if claim is not None:
            claim.check()
        target.store.delete_many(keys[start:start + DELETE_BATCH])


def _undo_begin(claim: PrefixClaim, taken: Taken, removing: bool) -> None:
    """After a failure in ``begin``: puts back the record the claim replaced where
    nothing was removed yet, removes a claim that stands alone in an empty prefix, else
    gives the claim up (what is there stays a save's that is over)."""
    if not removing and taken.replaced is not None:
        claim.restore(taken.replaced)
    elif not removing and taken.over is None:
        claim.release_unused()
    else:
        claim.abandon()
