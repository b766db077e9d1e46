"""The entry points of a save: ``begin_save`` (coordinator), ``join_save`` (every other
rank) and ``adopt_save`` (a strategy handed a directory), each returning the
``PendingCheckpoint`` whose publisher ``publisher_for`` chose from the store's
capabilities; a directory the caller made and wrote into is published by
``IntoCallersDirectory``, adopted, never begun or joined, and nothing there is ever
deleted.
"""

from __future__ import annotations

__all__ = [
    "IntoCallersDirectory",
    "adopt_save",
    "adopted",
    "begin_save",
    "join_save",
    "publisher_for",
]

import contextlib
import logging
from dataclasses import replace

from shardstore.format.commit.by_rename import ByRename
from shardstore.format.commit.in_place import InPlace
from shardstore.format.commit.options import SaveIntent, SaveOptions, new_save_id
from shardstore.format.commit.pending import PendingCheckpoint, Publisher, SaveLocation
from shardstore.format.commit.targets import _refuse_inside_checkpoint
from shardstore.format.records import CommitRecord, write_commit_record
from shardstore.format.storage_layout import StorageLayout
from shardstore.stores.base import Capabilities, Location


class IntoCallersDirectory(Publisher):
    """A directory the caller created and already wrote into (Megatron-Core's ``save``):
    written in place, the commit record last, the caller's files bound as external ones.
    Nothing there is provably ours, so an abandoned save deletes nothing, and nothing is
    held open there (a background writer forked by the caller drops its copy
    unreleased). Such a save is adopted (``adopt_save``), never begun or joined."""

    holds_resources = False
    binds_callers_files = True

    def commit(self, save: PendingCheckpoint, record: CommitRecord) -> CommitRecord:
        write_commit_record(save.target, record)
        return record

    def abandon(self, save: PendingCheckpoint) -> None:
        return None  # the caller's directory: nothing in it is provably ours


logger = logging.getLogger(__name__)


def publisher_for(capabilities: Capabilities) -> Publisher:
    """The publisher of a save into a store with ``capabilities``: by rename where whole
    directories move atomically, else in place."""
    return ByRename() if capabilities.supports_rename else InPlace()


def begin_save(target: Location, options: SaveOptions) -> PendingCheckpoint:
    """Coordinator: checks the target against ``options``, clears dead saves' leftovers,
    creates the staging area with its marker. Raises a CheckpointingException instead of
    deleting anything that is not provably ours. ``options.reuse_from`` (opened) is
    checked here, before an in-place save on an object store removes anything;
    ``options.shared_directory``: other programs' files there, already or written while
    the save runs, are kept and the checkpoint published beside them
    (``ByRename._publish_beside``). The target's store is claimed for the save first
    (``Store.claim_for_save``), until the save is released. ``options.layout``: as
    the save chose it (``SaveOptions.chosen_for``), no field ``AUTO``."""
    if not options.layout.chosen:
        raise ValueError(f"Internal error: the save into {target.describe()} began with no layout chosen")
    save_id = new_save_id()
    release_claim = target.store.claim_for_save(save_id)
    try:
        pending = _begin_claimed(target, options, save_id)
    except BaseException:
        release_claim()
        raise
    pending.hold_until_released(release_claim)
    return pending


def _begin_claimed(target: Location, options: SaveOptions, save_id: str) -> PendingCheckpoint:
    """``begin_save`` once the target is claimed."""
    if not options.shared_directory:
        _refuse_inside_checkpoint(target)
    publisher = publisher_for(target.capabilities)
    pending = publisher.begin(target, options, save_id)
    with contextlib.ExitStack() as on_failure:
        # A staging area that fails half-made (disk full while creating it or writing its
        # marker) is removed and its descriptors and lock closed: without its marker no
        # later save would ever recognise it as a dead save's.
        on_failure.callback(pending.abandon)
        pending.publisher.prepare_writes(pending)
        pending.location.begin_writes()
        pending.publisher.mark(pending)
        on_failure.pop_all()
    return pending


def join_save(target: Location, intent: SaveIntent, options: SaveOptions) -> PendingCheckpoint:
    """Every rank but the coordinator: the pending checkpoint the coordinator began
    (``options``: the same the coordinator was given, opened). Where the documents go
    is the coordinator's choice (``SaveIntent.zarr_metadata``); a rank given another
    is told so in the log and follows it."""
    if options.layout.chosen and options.layout != intent.layout:
        logger.warning(
            "Saving %s: this rank was given the layout %s, the coordinator %s; writing as the coordinator "
            "decided (pass the same on every rank)", target.describe(), options.layout.describe(),
            intent.layout.describe(),
        )
    options = replace(options, layout=intent.layout)
    pending = publisher_for(target.capabilities).join(target, intent, options)
    try:
        pending.location.begin_writes()
    except BaseException:  # not joined: nothing of the save is held here
        pending.release()
        raise
    return pending


def adopted(location: Location) -> PendingCheckpoint | None:
    """The pending checkpoint whose ``location`` this is (``SaveLocation.save``: this
    process began or joined that save, ``begin_save``, ``join_save``), or None."""
    return location.save if isinstance(location, SaveLocation) else None


def adopt_save(location: Location, chosen: StorageLayout | None = None) -> PendingCheckpoint:
    """The save that writes into ``location``: its own (``adopted``), else ``location``
    as a directory the caller made (``IntoCallersDirectory``: Megatron-Core's ``save``
    and the seed's strategy API called directly), with a fresh save id, written by
    ``chosen``, the layout the save chose for a caller's directory
    (``LayoutSite.callers_directory``: ``SavePipeline.into_callers_directory``).

    Raises:
        ValueError: no chosen layout for a caller's directory (an internal error)."""
    found = adopted(location)
    if found is not None:
        return found
    if chosen is None or not chosen.chosen:
        raise ValueError(f"Internal error: the save into {location.describe()} was adopted with no chosen layout")
    intent = SaveIntent(new_save_id(), None, layout=chosen, agreed=False)
    return PendingCheckpoint(location, location, intent, IntoCallersDirectory(), SaveOptions(layout=chosen))
