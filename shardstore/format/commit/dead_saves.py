"""What a save may delete, and the leftovers of saves that died: a directory is removed
only when proven ours (its save's marker, or the commit record of a checkpoint set
aside), that proof last (``_remove_proven``), so an interruption leaves what is left
still proven ours; the next save into a target removes what dead saves left next to it
(``remove_dead_saves``).
"""

from __future__ import annotations

__all__ = ["remove_dead_saves"]

import logging
import os

from shardstore.errors import CheckpointingException
from shardstore.format.commit.targets import _committed_id_or_none, committed_save_id
from shardstore.format.records import COMMIT_RECORD, REPLACED_TAG, SAVE_MARKER, STAGING_TAG
from shardstore.format.records.markers import marker_save_id
from shardstore.stores.base import DirectoryPublishing, Location

logger = logging.getLogger(__name__)


def _marker_id(location: Location) -> str | None:
    """The save id in the save marker at ``location`` (``records.marker_save_id``)."""
    return marker_save_id(location, SAVE_MARKER)


def _remove_dir(directory: DirectoryPublishing | None, proof: str) -> None:
    """Deletes a directory this save owns (``_remove_proven``); a failure is logged, not
    raised: the save's outcome is already decided and the next save removes what is left."""
    if directory is None:
        return
    try:
        _remove_proven(directory, proof)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("Could not remove %s (the next save into the same place will): %s", directory.describe(), exc)


def _remove_proven(directory: DirectoryPublishing, proof: str) -> None:
    """Deletes a directory of ours, the file that proves it ours (``proof``: its save's
    marker, or the commit record of a checkpoint set aside) last: an interruption leaves
    what is left still proven ours, for ``remove_dead_saves`` to remove."""
    Location(directory).remove_tree("", keep=(proof,))
    directory.remove_directory()


def _remove_if_empty(directory: DirectoryPublishing) -> bool:
    """Removes ``directory`` if it holds nothing (``rmdir``: never a file that appears
    meanwhile); True where it did."""
    path = directory.local_path()
    if path is None:
        return False
    try:
        os.rmdir(path)
    except OSError:
        return False
    return True


def _holds_committed(target: DirectoryPublishing) -> bool:
    """Whether ``target`` holds a committed shardstore checkpoint (a foreign Zarr group
    there does not count)."""
    try:
        return committed_save_id(Location(target)) is not None
    except CheckpointingException:
        return False


def _removed_leftover(candidate: DirectoryPublishing, proof: str) -> bool:
    """Removes a leftover proven ours (``_remove_proven``); False, logged, where it cannot
    be: a leftover that stays (a file held open on NFS, a read-only subdirectory) must
    not fail the save that found it."""
    try:
        _remove_proven(candidate, proof)
    except OSError as exc:
        logger.warning("Could not remove %s, the leftover of an interrupted save (%s); delete it yourself",
                       candidate.describe(), exc)
        return False
    return True


def _left_by_an_exchange(candidate: DirectoryPublishing, target: DirectoryPublishing, save_id: str) -> bool:
    """Whether the staging directory ``candidate`` of save ``save_id`` holds the checkpoint
    that save's exchange replaced (``ByRename._rename_whole``), left there by a crash
    before it moved on to its replaced name (``_set_aside``): ``target`` commits
    ``save_id`` (the exchange happened) and ``candidate`` holds a commit record of
    another save (that checkpoint's, proving it ours)."""
    if _committed_id_or_none(Location(target)) != save_id:
        return False
    return _committed_id_or_none(Location(candidate)) not in (None, save_id)


def _removed_if_empty_and_free(candidate: DirectoryPublishing) -> bool:
    """Removes the staging directory ``candidate``, without a marker, where it holds
    nothing and its lock is free: a save killed between making it and writing its marker
    (``_begin_claimed``), or after its marker went while it was removed
    (``_remove_proven``). ``rmdir`` never removes a file, so nothing but the empty
    directory can go; a running save holds the lock from before its marker is written
    (``ByRename.prepare_writes``). True where it was removed."""
    path = candidate.local_path()
    if path is None or path.is_symlink() or not path.is_dir() or any(path.iterdir()):
        return False
    fd = candidate.hold_lock()
    if fd is None:
        return False  # a save that is still running
    try:
        return _remove_if_empty(candidate)
    finally:
        os.close(fd)


def remove_dead_saves(target: DirectoryPublishing) -> list[str]:
    """Deletes the staging directories of saves into ``target`` that died, and old
    checkpoints left aside by an interrupted replacement. Only what is provably ours:
    a staging directory whose marker names the save id in its name and whose lock is
    free, or that holds the checkpoint its save's exchange replaced
    (``_left_by_an_exchange``), or that is empty with its lock free
    (``_removed_if_empty_and_free``); a replaced directory whose commit record carries the id
    in its name, and only once ``target`` holds a committed checkpoint: until then it is
    the last checkpoint there (a replacement without exchange that died between its two
    renames), kept and named in the log."""
    removed = []
    for name in target.siblings(f".{target.name}{STAGING_TAG}"):
        save_id = name.rsplit(STAGING_TAG, 1)[1]
        candidate = target.sibling(name)
        if _marker_id(Location(candidate)) != save_id:
            if _left_by_an_exchange(candidate, target, save_id) and _removed_leftover(candidate, COMMIT_RECORD):
                removed.append(name)
            elif _removed_if_empty_and_free(candidate):
                removed.append(name)
            continue
        fd = candidate.hold_lock()
        if fd is None:
            continue  # a save that is still running
        try:
            if _removed_leftover(candidate, SAVE_MARKER):
                removed.append(name)
        finally:
            os.close(fd)
    replaced = target.siblings(f".{target.name}{REPLACED_TAG}")
    replaced_by_one = bool(replaced) and _holds_committed(target)
    for name in replaced:
        candidate = target.sibling(name)
        if _remove_if_empty(candidate):  # made by a replacement beside other files that died before its first move
            removed.append(name)
            continue
        try:
            if committed_save_id(Location(candidate)) != name.rsplit(REPLACED_TAG, 1)[1]:
                continue
        except CheckpointingException:
            continue
        if not replaced_by_one:
            logger.warning(
                "Keeping %s: a complete checkpoint set aside by a replacement that did not publish, and %s holds "
                "no committed checkpoint; rename it back to load it", candidate.describe(), target.describe(),
            )
            continue
        if _removed_leftover(candidate, COMMIT_RECORD):
            removed.append(name)
    if removed:
        logger.warning("Removed the leftovers of interrupted saves next to %s: %s", target.describe(), removed)
    return removed
