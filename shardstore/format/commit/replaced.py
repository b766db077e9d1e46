"""A replacement in a shared directory that was interrupted (``ByRename._replace_beside``
sets the old checkpoint's entries aside one by one): its marker's phases, and putting the
old checkpoint back (``_put_back``; ``restore_replaced``, which the next save into the
target and ``shardstore restore`` call). Other programs' files are never moved.
"""

from __future__ import annotations

__all__ = ["restore_replaced"]

import contextlib
import json
import logging
import os

from shardstore.errors import CheckpointingException
from shardstore.format.commit.dead_saves import _marker_id, _remove_if_empty
from shardstore.format.commit.targets import _committed_id_or_none, _committed_record
from shardstore.format.records import COMMIT_RECORD, REPLACED_TAG, SAVE_MARKER, STAGING_TAG
from shardstore.format.records.markers import interrupted_replacement
from shardstore.format.records.names import MOVING_IN, REPLACING_PHASE, SETTING_ASIDE
from shardstore.stores.base import DirectoryPublishing, Location

logger = logging.getLogger(__name__)


def _mark_replacing(target: Location, save_id: str, replaces: str, phase: str) -> None:
    """Writes (atomically) the marker of the save ``save_id`` replacing the checkpoint
    ``replaces`` in a shared directory, in ``phase`` (``records.interrupted_replacement``)."""
    fields = {"save_id": save_id, "replaces": replaces, REPLACING_PHASE: phase}
    target.write_atomic(SAVE_MARKER, json.dumps(fields).encode())


def _put_back(
    target: DirectoryPublishing, staging: DirectoryPublishing, aside: DirectoryPublishing, replaces: str
) -> None:
    """Undoes a replacement in a shared directory (``ByRename._replace_beside``) that did
    not commit: the new entries it moved into ``target`` go back to ``staging`` (those its
    staged record vouches for that ``target`` holds and ``staging`` no longer does), then
    the entries of the checkpoint ``replaces`` go back from ``aside``, its record last,
    and the marker and the emptied ``aside`` go. Under the parent's lock; each step can
    be repeated after a crash (the marker's phase says whether new entries moved in).

    Raises:
        CheckpointingException: an entry of the old checkpoint cannot go back, as
            ``target`` holds that name (written there meanwhile): named, nothing moved.
        OSError: a rename failed."""
    where = Location(target)
    replacing = interrupted_replacement(where)
    if replacing is not None and replacing[2] == MOVING_IN:
        staged = _committed_record(Location(staging))
        if staged is not None:
            left = set(Location(staging).list_top(None))
            present = set(where.list_top(None))
            written = {rel.split("/", 1)[0] for rel in staged.vouched_paths()} - {COMMIT_RECORD}
            target.move_entries_into(staging, sorted((written & present) - left))
        _mark_replacing(where, replacing[0], replaces, SETTING_ASIDE)
    entries = [name for name in Location(aside).list_top(None) if name != COMMIT_RECORD]
    taken = sorted(set(entries) & set(where.list_top(None)))
    if taken:
        raise CheckpointingException(
            f"Cannot put back the checkpoint set aside in {aside.describe()}: {where.describe()} now holds "
            f"{', '.join(taken[:5])}, which are not its. Move those out of {where.describe()}, then save again "
            f"(or run `shardstore restore {where.describe()}`)"
        )
    aside.move_entries_into(target, entries)
    if Location(aside).exists(COMMIT_RECORD):
        aside.move_entries_into(target, [COMMIT_RECORD])  # the old checkpoint is loadable again
    target.fsync_parent()
    _remove_if_empty(aside)
    with contextlib.suppress(OSError):
        where.remove(SAVE_MARKER)  # left, it names the checkpoint it replaced: its own (records.own_markers)


def restore_replaced(target: Location) -> bool:
    """Puts back the checkpoint that a replacement in a shared directory had begun to
    set aside when it was interrupted (``ByRename._replace_beside``), if ``target`` holds
    such an interrupted replacement; the next save into ``target`` does it first, and
    ``shardstore restore`` calls it. Proven before anything moves: ``target`` has no
    commit record, its marker names that save, the checkpoint it replaced and the phase,
    ``.<name>.shardstore-replaced-<that id>`` holds that checkpoint's record, and the
    interrupted save's staging directory (needed once new entries moved in) is marked
    as its own and no longer locked. Other programs' files are never moved. Returns
    whether it put a checkpoint back.

    Raises:
        CheckpointingException: it is such a replacement but cannot be put back (named)."""
    directory = target.store.publishing()
    if directory is None:
        return False
    directory = directory.resolved()
    where = Location(directory)
    path = directory.local_path()
    if path is None or not path.is_dir() or not where.exists(SAVE_MARKER):
        return False  # the common case, without taking the parent's lock
    with directory.parent_locked():
        replacing = interrupted_replacement(where)
        if replacing is None or where.exists(COMMIT_RECORD):
            return False
        save_id, replaces, phase = replacing
        aside = directory.sibling(f".{directory.name}{REPLACED_TAG}{replaces}")
        staging = directory.sibling(f".{directory.name}{STAGING_TAG}{save_id}")
        if _committed_id_or_none(Location(aside)) != replaces:
            raise CheckpointingException(
                f"{where.describe()} holds the marker of save {save_id}, which was replacing the checkpoint there "
                f"beside other programs' files, but {aside.describe()} holds no record of checkpoint {replaces}: "
                "not provably ours, so nothing was moved. Look there and in the hidden directories next to it"
            )
        fd = None
        if _marker_id(Location(staging)) == save_id:
            fd = staging.hold_lock()
            if fd is None:
                return False  # that save is still running (a file system without flock on the parent)
        elif phase == MOVING_IN:
            raise CheckpointingException(
                f"Cannot put back the checkpoint set aside in {aside.describe()}: the new entries in "
                f"{where.describe()} cannot be told from others, as the staging directory {staging.describe()} "
                "of the save that moved them in is gone. Nothing was moved"
            )
        try:
            _put_back(directory, staging, aside, replaces)
        finally:
            if fd is not None:
                os.close(fd)
    logger.warning(
        "Put back the checkpoint at %s (save %s) that save %s, interrupted while it replaced it beside other "
        "programs' files, had set aside in %s", where.describe(), replaces, save_id, aside.describe(),
    )
    return True
