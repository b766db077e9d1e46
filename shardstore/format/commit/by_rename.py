"""``ByRename``: a save published by renaming its private staging directory onto the
target (local and shared POSIX file systems), or, into a shared directory, by moving its
entries in beside other programs' files; the rules are in its docstring.
"""

from __future__ import annotations

__all__ = ["ByRename"]

import logging
from dataclasses import replace

from shardstore.errors import CheckpointingException
from shardstore.format.commit.dead_saves import _marker_id, _remove_dir, remove_dead_saves
from shardstore.format.commit.options import SaveIntent, SaveOptions
from shardstore.format.commit.pending import (
    PendingCheckpoint,
    Publisher,
    _lost_race,
    _remove_own_marker,
)
from shardstore.format.commit.replaced import _mark_replacing, _put_back, restore_replaced
from shardstore.format.commit.targets import (
    _check_target,
    _committed_id_or_none,
    _committed_record,
    _refuse_other_checkpoint,
    _refuse_unmovable_beside,
)
from shardstore.format.records import (
    COMMIT_RECORD,
    REPLACED_TAG,
    SAVE_MARKER,
    STAGING_TAG,
    CommitRecord,
    own_markers,
)
from shardstore.format.records.markers import interrupted_replacement
from shardstore.format.records.names import MOVING_IN, SETTING_ASIDE
from shardstore.format.reuse import reuse_save_id
from shardstore.stores.base import DirectoryPublishing, Location

logger = logging.getLogger(__name__)


class ByRename(Publisher):
    """A private staging directory next to the target, published by one rename (or an
    atomic exchange with the checkpoint it replaces): local and shared POSIX file
    systems.

    A save never writes into the directory it may replace. The coordinator creates
    ``<parent>/.<name>.shardstore-save-<save id>``, holding an ``flock`` on it while the
    save runs and a marker file (``.shardstore-save.json``) naming the save id. Every
    rank writes there; the commit record is written there last; then one rename
    publishes it:

    * target missing, or an empty directory: ``rename(2)`` (atomic);
    * target a committed shardstore checkpoint and ``overwrite=True``: ``renameat2``
      with ``RENAME_EXCHANGE`` swaps the directories atomically, then the old one is
      renamed aside (``.<name>.shardstore-replaced-<its save id>``) and deleted; where
      the file system cannot exchange, the old one is renamed aside first.

    Publishing is a compare-and-swap under an ``flock`` on the parent directory: the
    target must still hold the checkpoint the save saw when it began (same save id), or
    still nothing; otherwise another save committed meanwhile, and this one fails. A
    staging directory whose marker matches its name and whose lock is free belongs to a
    save that died: the next save into the same target deletes it (``remove_dead_saves``).

    A save into a shared directory (``SaveOptions.shared_directory``) is published
    beside the other programs' files by moving its entries in, the commit record last; a
    checkpoint there is replaced entry by entry (``_replace_beside``), which an
    interruption leaves for the next save to put back (``restore_replaced``). The rules
    in full: docs/format.md ("Publishing").
    """


    def begin(self, target: Location, options: SaveOptions, save_id: str) -> PendingCheckpoint:
        directory = _directory(target).resolved()
        target = Location(directory)
        restore_replaced(target)  # before the dead saves go: an interrupted one's staging may hold new entries
        remove_dead_saves(directory)
        replaces = _check_target(target, options.overwrite, options.shared_directory,
                                 packing=options.pack_arrays_up_to > 0)
        source = options.reuse_from
        reuses = reuse_save_id(source, target, in_place=False) if source is not None else None
        intent = SaveIntent(save_id, replaces, reuses, options.layout)
        tops = frozenset(target.list_top(None))
        return PendingCheckpoint(target, _staging_for(directory, save_id), intent, self, options, tops)

    def join(self, target: Location, intent: SaveIntent, options: SaveOptions) -> PendingCheckpoint:
        directory = _directory(target).resolved()
        staging = _staging_for(directory, intent.save_id)
        _require_coordinators_staging(staging, intent.save_id, target)
        return PendingCheckpoint(Location(directory), staging, intent, self, options)

    def prepare_writes(self, save: PendingCheckpoint) -> None:
        save.location.prepare()
        save.hold_staging_lock()

    def abandon(self, save: PendingCheckpoint) -> None:
        try:
            replacing = interrupted_replacement(save.target)
        except OSError:
            replacing = None
        if replacing is not None and replacing[0] == save.intent.save_id and not save.target.exists(COMMIT_RECORD):
            # a replacement beside other files that could not put the old checkpoint back: new entries
            # still in the target are told from others by what the staging directory no longer holds
            logger.warning("Keeping %s for putting back the checkpoint it was replacing at %s",
                           save.location.store.describe(), save.target.describe())
            return
        _remove_dir(save.location.store.publishing(), SAVE_MARKER)

    def commit(self, save: PendingCheckpoint, record: CommitRecord) -> CommitRecord:
        staging, target = save.location.store.publishing(), save.target.store.publishing()
        assert staging is not None and target is not None  # begin staged apart only for these
        save.location.write_atomic(COMMIT_RECORD, record.to_json())
        replaced: DirectoryPublishing | None = None
        emptied: DirectoryPublishing | None = None  # the staging directory, where its entries moved out one by one
        with target.parent_locked():
            empty = save.target.is_empty()
            old = None if empty else _committed_record(save.target)
            current = old.save_id if old is not None else None
            if current != save.intent.replaces or (not empty and current is None and not save.options.shared_directory):
                raise _lost_race(save, current, "files of a directory that is not a checkpoint")
            if current is None and not empty:
                return self._publish_beside(save, staging, target, record)
            theirs = _entries_beside(save.target, old) if old is not None and save.options.shared_directory else None
            if old is not None and theirs:
                record, replaced = self._replace_beside(save, staging, target, old, record, theirs)
                emptied = staging
            else:
                if old is not None:
                    self._refuse_added_entries(save, old)
                replaced = self._rename_whole(staging, target, current)
            target.fsync_parent()
        _remove_own_marker(save)
        _remove_dir(emptied, SAVE_MARKER)
        _remove_dir(replaced, COMMIT_RECORD)
        return record

    @staticmethod
    def _rename_whole(
        staging: DirectoryPublishing, target: DirectoryPublishing, current: str | None
    ) -> DirectoryPublishing | None:
        """Publishes the staging directory onto ``target`` by one rename, or by an atomic
        exchange with the checkpoint ``current`` committed there (where the storage cannot
        exchange: two renames, ``_rename_or_put_back``). Returns where that checkpoint
        was set aside (None: there was none). Under the parent's lock."""
        if current is None:
            staging.rename_to(target, exchange=False)
            return None
        if staging.rename_to(target, exchange=True):
            return _set_aside(staging, target, current)  # the old checkpoint was at the staging path
        replaced = target.sibling(f".{target.name}{REPLACED_TAG}{current}")
        target.rename_to(replaced, exchange=False)
        _rename_or_put_back(staging, target, replaced)
        return replaced

    @staticmethod
    def _refuse_added_entries(save: PendingCheckpoint, old: CommitRecord) -> None:
        """Before the checkpoint this save replaces goes (under the parent's lock): a
        top-level entry its save did not write, added since this save began checked it
        (``_check_target``), is another program's, which replacing would delete: the save
        loses instead, changing nothing. One directory read; a file added deeper, inside
        one of its arrays, is not looked for here. ``old``: its commit record."""
        added = sorted(set(save.target.list_top(None)) - old.own_top_names - save.tops_at_begin)
        if added:
            raise CheckpointingException(
                f"Not committing the save into {save.target.describe()}: another program wrote "
                f"{', '.join(added[:5])} into the checkpoint it replaces while it ran, which replacing it would "
                "delete. Nothing there was changed; move them out, or save to a new directory"
            )

    @staticmethod
    def _publish_beside(
        save: PendingCheckpoint, staging: DirectoryPublishing, target: DirectoryPublishing, record: CommitRecord
    ) -> CommitRecord:
        """The target, shared with other programs (``SaveOptions.shared_directory``),
        holds files they put there before the save began (a job's log, the ``model.pt``
        ``torch_save_to_dcp`` converts) or while it ran (Megatron-LM writes ModelOpt's
        state into the iteration's directory right after ``dist_checkpointing.save``
        returns, while an async save still writes): they are kept, not ours to move or
        delete, and the save's entries are moved in beside them, the commit record last
        (until then the directory is no checkpoint). A name both hold, or another tool's
        checkpoint written there meanwhile (``_refuse_other_checkpoint``), fails the
        save, naming it; a rename that fails part way moves the entries already moved
        back (``_take_back_moved``), while a crash part way leaves a directory that
        later saves refuse to touch (``_refuse_foreign`` names what is there). The commit record is written again naming their top-level entries
        (``CommitRecord.beside``): it does not vouch for them, and ``verify`` names them
        as another program's, not as damage; a name the record cannot carry (one of the
        format's own, an invalid key) is left out, and ``verify`` flags what lies under
        it. Returns that record."""
        try:
            _refuse_other_checkpoint(save.target, overwrite=False)
        except CheckpointingException as exc:
            raise CheckpointingException(f"Not committing the save (it was written there while it ran): {exc}") from exc
        theirs = set(save.target.list_top(None))
        ours = [name for name in save.location.list_top(None) if name not in (COMMIT_RECORD, SAVE_MARKER)]
        clash = sorted(theirs & {*ours, COMMIT_RECORD, SAVE_MARKER})
        if clash:
            raise _taken_names(save, clash)
        added = sorted(theirs - save.tops_at_begin)
        if added:
            logger.warning(
                "%s received %s from another program while the save ran; they are kept beside the checkpoint "
                "(its commit record does not vouch for them)", save.target.describe(), ", ".join(added[:5]),
            )
        record = replace(record, beside=tuple(sorted(n for n in theirs if record.refuses_beside(n) is None)))
        save.location.write_atomic(COMMIT_RECORD, record.to_json())
        try:
            staging.move_entries_into(target, ours)
            staging.move_entries_into(target, [COMMIT_RECORD])
        except BaseException as exc:
            if _committed_id_or_none(save.target) != save.intent.save_id:
                _take_back_moved(save, staging, target, ours, exc)
            raise
        _remove_dir(staging, SAVE_MARKER)
        return record


    @staticmethod
    def _replace_beside(
        save: PendingCheckpoint, staging: DirectoryPublishing, target: DirectoryPublishing, old: CommitRecord,
        record: CommitRecord, theirs: set[str],
    ) -> tuple[CommitRecord, DirectoryPublishing]:
        """Replaces the checkpoint ``old`` commits at ``target``, a shared directory
        (``SaveOptions.shared_directory``) that also holds other programs' top-level
        entries (``theirs``: ModelOpt's ``modelopt_state/`` in a Megatron-LM iteration
        saved again), which stay where they are: only the old checkpoint's own entries
        move, entry by entry, under the parent's lock. Returns the record published (its
        ``beside`` names ``theirs``) and the directory the old checkpoint was set aside to
        (``.<name>.shardstore-replaced-<its save id>``), for the caller to delete.

        The steps, and what a crash after each leaves (the target T, the replaced
        directory A, the staging directory S):

        1. The new record, naming ``theirs``, is written in S; T's marker then names this
           save, the old one's id and the phase ``SETTING_ASIDE``. T is still the old
           checkpoint (the marker is its own: ``records.own_markers``).
        2. A is made and the old record moved into it: from here T holds no committed
           checkpoint (the window that ``docs/guide/guarantees.md`` states), and A's
           record proves A ours. The old entries follow, one rename each.
        3. The marker's phase becomes ``MOVING_IN`` (A holds the whole old checkpoint);
           the new entries move from S into T, then the new record: committed.

        A crash in the window leaves T without a record, its marker naming both saves
        and the phase: the next save into T (``remove_dead_saves``, under the same lock),
        ``shardstore restore``, or this save's own failure handling puts the old
        checkpoint back (``_put_back``), the new entries returning to S first, which is
        then a dead save's staging directory. Nothing of ``theirs`` is ever moved."""
        where, save_id = save.target, save.intent.save_id
        ours = [name for name in save.location.list_top(None) if name not in (COMMIT_RECORD, SAVE_MARKER)]
        clash = sorted(theirs & set(ours))
        if clash:
            raise _taken_names(save, clash)
        try:
            _refuse_unmovable_beside(where, old, sorted(theirs))
        except CheckpointingException as exc:
            raise CheckpointingException(f"Not committing the save (they were written there while it ran): {exc}") from exc
        aside = target.sibling(f".{target.name}{REPLACED_TAG}{old.save_id}")
        if not Location(aside).is_empty():
            raise CheckpointingException(
                f"Not committing the save into {where.describe()}: {aside.describe()}, where it would set the "
                "checkpoint it replaces aside, already exists and is not a checkpoint of ours. Nothing there was "
                "changed; move that directory away (or delete it if you know it is not needed), then save again"
            )
        added = sorted(theirs - save.tops_at_begin)
        if added:
            logger.warning(
                "%s received %s from another program while the save ran; they are kept beside the checkpoint "
                "(its commit record does not vouch for them)", where.describe(), ", ".join(added[:5]),
            )
        record = replace(record, beside=tuple(sorted(n for n in theirs if record.refuses_beside(n) is None)))
        save.location.write_atomic(COMMIT_RECORD, record.to_json())
        olds = sorted(set(where.list_top(None)) - theirs - {COMMIT_RECORD, SAVE_MARKER})
        _mark_replacing(where, save_id, old.save_id, SETTING_ASIDE)
        try:
            Location(aside).prepare()
            aside.fsync_parent()
            target.move_entries_into(aside, [COMMIT_RECORD])  # the window opens: T is no checkpoint
            target.move_entries_into(aside, olds)
            _mark_replacing(where, save_id, old.save_id, MOVING_IN)
            staging.move_entries_into(target, ours)
            staging.move_entries_into(target, [COMMIT_RECORD])  # committed: the window closes
        except BaseException as exc:
            if _committed_id_or_none(where) != save_id:
                try:
                    _put_back(target, staging, aside, old.save_id)
                except BaseException as back:
                    exc.add_note(
                        f"The checkpoint it replaced could not be put back ({back}); its record and the entries "
                        f"moved so far are in {aside.describe()}. The next save into {where.describe()} puts it "
                        f"back, or run `shardstore restore {where.describe()}`"
                    )
            raise
        logger.info("Replaced the checkpoint at %s beside %s", where.describe(), ", ".join(sorted(theirs)[:5]))
        return record, aside


def _take_back_moved(
    save: PendingCheckpoint, staging: DirectoryPublishing, target: DirectoryPublishing, ours: list[str],
    failure: BaseException,
) -> None:
    """Moves the entries a save publishing beside other programs' files
    (``ByRename._publish_beside``) had moved into ``target`` before a rename failed back
    into its ``staging`` directory, before the failure is raised: ``target`` then holds
    their files only, as before the save, and its abandon removes the staging directory
    whole (left in ``target`` without a record, no later save could prove them ours).
    Ours: the names of ``ours`` that ``target`` holds and ``staging`` no longer does (no
    name of ``ours`` was in ``target`` when the moves began). Under the parent's lock.
    A move back that fails is added to ``failure``'s notes, naming what is left."""
    present, left = set(save.target.list_top(None)), set(save.location.list_top(None))
    moved = sorted(name for name in ours if name in present and name not in left)
    try:
        target.move_entries_into(staging, moved)
    except OSError as back:
        failure.add_note(
            f"The entries it had moved into {save.target.describe()} could not be moved back ({back}): "
            f"{', '.join(moved)} there are this failed save's; delete them, then save again"
        )


def _entries_beside(target: Location, old: CommitRecord) -> set[str]:
    """The top-level names at ``target`` that are not the entries of the checkpoint
    ``old`` commits there, nor markers proven its own: other programs'."""
    present = target.list_top(None)
    return set(present) - old.own_top_names - own_markers(target, old, present)


def _rename_or_put_back(
    staging: DirectoryPublishing, target: DirectoryPublishing, replaced: DirectoryPublishing
) -> None:
    """The second rename of a replacement without exchange: ``staging`` onto ``target``,
    whose checkpoint the first moved to ``replaced``. If it fails, that checkpoint is
    renamed back before the failure is raised, so the save fails with the old checkpoint
    loadable where it was (the next save would otherwise delete it as replaced)."""
    try:
        staging.rename_to(target, exchange=False)
    except BaseException as exc:
        try:
            replaced.rename_to(target, exchange=False)
        except OSError as back:
            exc.add_note(
                f"The checkpoint it replaced could not be put back ({back}); it is complete at "
                f"{replaced.describe()}: rename it to {target.describe()} to load it"
            )
        raise


def _set_aside(old: DirectoryPublishing, target: DirectoryPublishing, save_id: str) -> DirectoryPublishing:
    """Moves the checkpoint an exchange left at the staging path (``old``, committed by
    ``save_id``) to ``.<name>.shardstore-replaced-<save_id>``, the name whose commit record
    proves it ours to the next save (``remove_dead_saves``), which removes one left at the
    staging path too (``_left_by_an_exchange``). Under the parent's lock. Returns where it
    is now; a failed rename is logged (it stays where it was)."""
    aside = target.sibling(f".{target.name}{REPLACED_TAG}{save_id}")
    try:
        old.rename_to(aside, exchange=False)
    except OSError as exc:
        logger.warning(
            "Could not move the checkpoint %s replaced to %s (%s); it stays at %s, which the next save into %s "
            "removes", target.describe(), aside.describe(), exc, old.describe(), target.describe(),
        )
        return old
    return aside


def _taken_names(save: PendingCheckpoint, clash: list[str]) -> CheckpointingException:
    """The error of a save into a shared directory whose entries' names ``clash`` with
    what another program put there, before the save began or while it ran."""
    names, where = ", ".join(clash[:5]), save.target.describe()
    if set(clash) <= save.tops_at_begin:
        return CheckpointingException(
            f"Not committing the save into {where}: it already held {names}, which the checkpoint's own entries "
            "would replace. Nothing there was changed; rename those keys of the state dict, move the files out, "
            "or save to a new directory"
        )
    return CheckpointingException(
        f"Not committing the save into {where}: another program wrote {names} there while it ran. Nothing there "
        "was changed; save again to an empty or new directory"
    )


def _directory(target: Location) -> DirectoryPublishing:
    """``target``'s store as a directory that publishes by rename (its capabilities said so)."""
    directory = target.store.publishing()
    if directory is None:
        raise CheckpointingException(
            f"Internal error: {target.describe()} claims supports_rename but cannot publish by rename; please report it"
        )
    return directory


def _staging_for(target: DirectoryPublishing, save_id: str) -> Location:
    """The staging directory of the save ``save_id`` into ``target`` (links resolved)."""
    return Location(target.sibling(f".{target.name}{STAGING_TAG}{save_id}"))


def _require_coordinators_staging(staging: Location, save_id: str, target: Location) -> None:
    """A joining rank sees the staging directory the coordinator made, its marker naming
    the save: on a path that is each node's own disk it sees none, and its chunks would
    go where the commit never looks, into a checkpoint committed without them.

    Raises:
        CheckpointingException: naming the staging directory, the checkpoint and what to do.
    """
    if _marker_id(staging) != save_id:
        raise CheckpointingException(
            f"This rank does not see {staging.describe()}, the staging directory the coordinator made for the save "
            f"into {target.describe()}: every rank of a save must write into one file system they share (a path on "
            "each node's own disk is another directory on each node, and the checkpoint would lack their chunks); "
            "save to a shared file system or to object storage"
        )
