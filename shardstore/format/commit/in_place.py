"""``InPlace``: a save written at the target itself, its commit record last (one atomic
PUT), under a claim on the prefix (object stores, and any store that cannot rename a
directory); the rules are in its docstring.
"""

from __future__ import annotations

__all__ = ["InPlace"]

import logging

from shardstore.errors import CheckpointingException
from shardstore.format.claims import PrefixClaim
from shardstore.format.commit.options import SaveIntent, SaveOptions
from shardstore.format.commit.pending import (
    PendingCheckpoint,
    Publisher,
    _lost_race,
    _remove_own_marker,
)
from shardstore.format.commit.targets import _check_target, committed_save_id
from shardstore.format.records import COMMIT_RECORD, SAVE_MARKER, CommitRecord
from shardstore.format.reuse import reuse_save_id
from shardstore.stores.base import Location

logger = logging.getLogger(__name__)


class InPlace(Publisher):
    """Written at the target itself, commit record last (one atomic PUT): object stores
    and any store that cannot rename a directory.

    The save first claims the prefix (``format.claims.PrefixClaim``): its marker,
    written only where none is and renewed while it runs. A running save's claim refuses
    every other save before it changes anything; a dead save's is taken over, and what
    that save left is removed. With ``overwrite=True`` the save names the checkpoint it
    replaces in its marker, deletes the old commit record, then the rest, so from then
    until the new commit the prefix holds no loadable checkpoint (save each step to a
    new prefix to avoid that window). The commit checks that the claim is still held,
    writes the commit record only where none is, then removes the marker.

    Attributes:
        claim: the coordinator's claim (None on the other ranks).
    """

    def __init__(self, claim: PrefixClaim | None = None) -> None:
        self.claim = claim

    def begin(self, target: Location, options: SaveOptions, save_id: str) -> PendingCheckpoint:
        target.prepare()
        claim, dead = PrefixClaim.take(target, save_id)
        removing = False
        try:
            tops = [name for name in target.list_top(None) if name != SAVE_MARKER]
            if dead is not None and tops and COMMIT_RECORD not in tops:
                logger.warning("Removing the leftovers of an interrupted save at %s: %s", target.describe(),
                               dead.describe())
                removing = True
                target.remove_tree("", keep=(SAVE_MARKER,))
                tops = []
            if COMMIT_RECORD in tops and options.overwrite:
                _name_replaced(claim, target)
            replaces = _check_target(target, options.overwrite, empty=not tops)
            source = options.reuse_from
            reuses = reuse_save_id(source, target, in_place=True) if source is not None else None
            if replaces is not None:
                removing = True  # what an interrupted removal leaves stays marked
                target.remove(COMMIT_RECORD)  # the documented window on object stores starts here
                target.remove_tree("", keep=(SAVE_MARKER,))
        except BaseException:
            claim.stop()
            if not removing:
                _give_up_claim(claim)
            raise
        intent = SaveIntent(save_id, replaces, reuses, options.layout)
        pending = PendingCheckpoint(target, target, intent, InPlace(claim), options)
        pending.hold_until_released(claim.stop)
        return pending

    def join(self, target: Location, intent: SaveIntent, options: SaveOptions) -> PendingCheckpoint:
        return PendingCheckpoint(target, target, intent, self, options)

    def mark(self, save: PendingCheckpoint) -> None:
        return None  # the claim is the marker

    def commit(self, save: PendingCheckpoint, record: CommitRecord) -> CommitRecord:
        claim = self._coordinators_claim(save)
        claim.ensure_held()
        if claim.writes.put_if_absent(COMMIT_RECORD, record.to_json()) is None:
            raise _lost_race(save, committed_save_id(save.target))
        _remove_own_marker(save)
        return record

    def abandon(self, save: PendingCheckpoint) -> None:
        claim = self._coordinators_claim(save)
        claim.stop()
        if not claim.owns_marker():
            logger.warning("Abandoning the save into %s: its save marker is no longer its own (another save took "
                           "the prefix over); removed nothing", save.describe())
        elif committed_save_id(save.target) is None:
            _remove_marked(save.target)

    def _coordinators_claim(self, save: PendingCheckpoint) -> PrefixClaim:
        if self.claim is None:
            raise CheckpointingException(
                f"Internal error: the save into {save.describe()} is committed or abandoned by a rank that did not "
                "begin it; please report it"
            )
        return self.claim


def _give_up_claim(claim: PrefixClaim) -> None:
    """Removes the marker of a save that failed before it removed or wrote anything, so
    that the next save need not wait a lease; a failure to is logged (the claim then
    lapses a lease later), the save's own error being the one raised."""
    try:
        if claim.owns_marker():
            claim.target.remove(SAVE_MARKER)
    except OSError as exc:
        logger.warning("Could not remove the save marker of %s (the next save takes it over a lease later): %s",
                       claim.target.describe(SAVE_MARKER), exc)


def _name_replaced(claim: PrefixClaim, target: Location) -> None:
    """Names the committed checkpoint at ``target`` in ``claim``'s marker, where it is a
    shardstore checkpoint (``_check_target`` refuses any other)."""
    try:
        replaces = committed_save_id(target)
    except CheckpointingException:
        return
    if replaces is not None:
        claim.mark_replacing(replaces)


def _remove_marked(target: Location) -> None:
    """Removes a save's objects in place, its marker last: an interruption at any point
    leaves what is left still marked (the next save removes it), never objects that no
    later save can prove ours."""
    target.remove_tree("", keep=(SAVE_MARKER,))
    target.remove(SAVE_MARKER)
