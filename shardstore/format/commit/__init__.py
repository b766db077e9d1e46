"""How a save becomes a checkpoint, and what a save may delete.

Rules (DESIGN.md, invariants):

* A committed checkpoint stays loadable until its replacement commits (object stores,
  which cannot rename, have a window with ``overwrite=True``: ``InPlace``; so does a
  replacement in a shared directory beside other programs' files, which sets the old
  entries aside one by one and whose interruption ``restore_replaced`` undoes).
* Two saves into one place cannot both commit; the loser fails with a clear error.
* shardstore deletes only what it can prove one of its own unfinished saves wrote. A
  non-empty target without a commit record is refused with an error that names what
  is there.

A ``Publisher`` is one way of publishing a save, owning its rules; one is chosen once
from the store's capabilities (``publisher_for``) and held by the ``PendingCheckpoint``.
Entry points: ``begin_save`` (coordinator), ``join_save`` (every other rank),
``adopt_save``, then the ``PendingCheckpoint``'s ``commit`` or ``abandon`` (coordinator).

Modules, one idea each:

* ``options``: ``SaveOptions`` (what a save is told), ``SaveIntent`` (what its
  coordinator decided, sent to every rank).
* ``targets``: the checks of a target before a save (``check_shared``, the refusals).
* ``pending``: ``PendingCheckpoint``, its ``SaveLocation``, the ``Publisher`` interface.
* ``by_rename``: ``ByRename`` (local and shared POSIX file systems: a staging directory
  and one rename; beside other programs' files in a shared directory).
* ``in_place``: ``InPlace`` (object stores: marker first, commit record last).
* ``replaced``: putting back a checkpoint an interrupted replacement set aside
  (``restore_replaced``).
* ``dead_saves``: removing only what is proven ours; dead saves' leftovers.
* ``begin``: ``begin_save``, ``join_save``, ``adopt_save``, ``publisher_for``, and
  ``IntoCallersDirectory`` (a directory Megatron-Core made, adopted).

The on-disk rules are in docs/format.md ("Publishing a save"), what they promise in
docs/guide/guarantees.md.
"""

from __future__ import annotations

__all__ = [
    "ByRename", "InPlace", "IntoCallersDirectory", "PendingCheckpoint", "Publisher",
    "SaveIntent", "SaveLocation", "SaveOptions", "adopt_save", "adopted", "begin_save", "check_shared",
    "join_save", "publisher_for", "remove_unfinished", "restore_replaced",
]

from shardstore.format.commit.begin import (
    IntoCallersDirectory,
    adopt_save,
    adopted,
    begin_save,
    join_save,
    publisher_for,
)
from shardstore.format.commit.by_rename import ByRename
from shardstore.format.commit.in_place import InPlace, remove_unfinished
from shardstore.format.commit.options import SaveIntent, SaveOptions
from shardstore.format.commit.pending import PendingCheckpoint, Publisher, SaveLocation
from shardstore.format.commit.replaced import restore_replaced
from shardstore.format.commit.targets import check_shared
