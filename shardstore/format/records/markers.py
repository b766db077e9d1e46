"""The markers a save, a replacement, the manager's deletion and a removal leave in a
checkpoint's directory (``read_marker``, ``marker_save_id``), which of them a committed
checkpoint's own save left (``own_markers``), an interrupted replacement
(``interrupted_replacement``) and the staging directories of unfinished saves
(``unfinished_saves``).
"""

from __future__ import annotations

__all__ = [
    "MAX_DELETION_MARKER_BYTES",
    "MAX_MARKER_BYTES",
    "interrupted_replacement",
    "marker_save_id",
    "own_markers",
    "read_marker",
    "unfinished_saves",
]

import json
import re
from collections.abc import Collection
from typing import Any

from shardstore.format.records.commit_record import MAX_RECORD_BYTES, CommitRecord
from shardstore.format.records.names import (
    COMMIT_RECORD,
    DELETION_MARKER,
    MOVING_IN,
    REPLACING_PHASE,
    SAVE_MARKER,
    SETTING_ASIDE,
    STAGING_TAG,
)
from shardstore.format.removal_marker import REMOVAL_MARKER, leftover_files
from shardstore.stores.base import Location, atomic_temp_of

# The most bytes a marker holds (a few ids); a larger file of that name is not ours.
MAX_MARKER_BYTES = 4096
# The checkpoint manager's deletion marker also holds a copy of the commit record (what
# finishing the deletion removes once the record itself is gone).
MAX_DELETION_MARKER_BYTES = MAX_RECORD_BYTES + 4096


def read_marker(location: Location, name: str) -> dict[str, Any] | None:
    """The marker ``name`` (``SAVE_MARKER`` or ``DELETION_MARKER``) at the top of
    ``location`` as a JSON object; None where there is none, or a file of that name that
    is no JSON object (no marker of ours).

    Raises:
        StorageError: it cannot be read, or holds more than a marker of that name
            holds (``MAX_MARKER_BYTES``; ``MAX_DELETION_MARKER_BYTES``)."""
    bound = MAX_DELETION_MARKER_BYTES if name in (DELETION_MARKER, REMOVAL_MARKER) else MAX_MARKER_BYTES
    data = location.read_bytes_or_none(name, max_bytes=bound)
    if data is None:
        return None
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth: not ours
        return None
    return value if isinstance(value, dict) else None


def marker_save_id(location: Location, name: str = SAVE_MARKER, field_name: str = "save_id") -> str | None:
    """The save id the marker ``name`` (``SAVE_MARKER`` or ``DELETION_MARKER``) at the
    top of ``location`` holds in ``field_name``: ``save_id``, the save that wrote it, or
    (a save marker of an in-place save that replaces a checkpoint) ``replaces``, the save
    id of that checkpoint. None where there is none, or a file of that name that is no
    marker of ours (not a JSON object with a string there).

    Raises:
        StorageError: as ``read_marker``."""
    marker = read_marker(location, name)
    save_id = marker.get(field_name) if marker is not None else None
    return save_id if isinstance(save_id, str) else None


def own_markers(location: Location, record: CommitRecord, found: Collection[str]) -> frozenset[str]:
    """The markers among ``found`` (listed at ``location``, a committed checkpoint) that
    name its own save, ``record.save_id``: proven by what each holds, never by its name.
    Its save's marker, left by a crash between the publishing and the marker's removal;
    the marker of an in-place save that replaces it (``replaces``), written before the
    old record goes and left by a crash before it went; the manager's deletion marker,
    left where a deletion stopped before the record went; ``remove_sharded_tensors``'s marker
    (``format.removal``), left where a removal was killed, and the files among ``found``
    that this removal still had to delete (its save wrote them; its marker names them). A marker naming another save
    is not among them (``CommitRecord.unlisted`` counts it). Also the temporary files of
    an atomic write of the record or of a marker (``stores.base.atomic_temp_name``: a
    128-bit random name only ``put_atomic`` makes), left at the top by a process killed
    before their rename (the manager's deletion marker, ``remove_sharded_tensors``'s
    record): their content may be cut short, so their name is what proves them.

    Raises:
        StorageError: a marker cannot be read."""
    if not record.save_id:
        return frozenset()
    own = {entry for entry in found if atomic_temp_of(entry) in (COMMIT_RECORD, SAVE_MARKER, DELETION_MARKER, REMOVAL_MARKER)}
    if SAVE_MARKER in found and record.save_id in (
        marker_save_id(location, SAVE_MARKER), marker_save_id(location, SAVE_MARKER, "replaces")
    ):
        own.add(SAVE_MARKER)
    own.update(m for m in (DELETION_MARKER, REMOVAL_MARKER) if m in found and marker_save_id(location, m) == record.save_id)
    own.update(left[1] if (left := leftover_files(location, record, found)) else ())
    return frozenset(own)


def interrupted_replacement(location: Location) -> tuple[str, str, str] | None:
    """The replacement in a shared directory (``format.commit.ByRename._replace_beside``)
    whose save marker lies at ``location``: that save's id, the id of the checkpoint it
    replaces and its phase (``SETTING_ASIDE`` or ``MOVING_IN``), or None where the marker
    is none of these (or there is none). Where ``location`` holds no commit record, that
    save was interrupted between setting the old checkpoint's record aside and
    publishing its own.

    Raises:
        StorageError: the marker cannot be read."""
    marker = read_marker(location, SAVE_MARKER)
    if marker is None or marker.get(REPLACING_PHASE) not in (SETTING_ASIDE, MOVING_IN):
        return None
    save_id, replaces = marker.get("save_id"), marker.get("replaces")
    if not all(isinstance(i, str) and re.fullmatch(r"[0-9a-f]{32}", i) for i in (save_id, replaces)):
        return None  # the ids name directories next to it: nothing else is ours
    return save_id, replaces, marker[REPLACING_PHASE]


def unfinished_saves(location: Location) -> list[str]:
    """Staging directories of saves into ``location`` that have not published (stores
    that publish by rename; running or dead)."""
    directory = location.store.publishing()
    if directory is None:
        return []
    try:
        return directory.siblings(f".{directory.name}{STAGING_TAG}")
    except OSError:  # an unreadable parent: only the error message loses this detail
        return []
