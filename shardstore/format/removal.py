"""Removing arrays and object shards from a committed checkpoint
(``remove_sharded_tensors``), in an order that a process killed at any point leaves
recoverable.

1. A marker, ``REMOVAL_MARKER``, is written atomically into the checkpoint: the save
   id of its record, the key prefix, and what the removal deletes (``RemovalPlan``).
2. The commit record is rewritten without the removed entries: from here on the
   checkpoint no longer has them, and it never names a file that is gone.
3. The entries' files go: array directories, packs, object shards, group documents,
   then the folders left empty. A pack that also holds arrays that stay was first
   written anew without the removed ones under a new name (``rewrite_packs``, between
   steps 1 and 2, named in the marker); the record names the new one, the old one goes.
4. The marker goes.

A marker whose save id is the record's is provably this checkpoint's removal. The next
removal (the same one called again, or another) first finishes it: where the record
still lists what the marker removes (a kill before step 2), only the marker and the packs
written anew go; otherwise step 3 runs again, deleting only what the record does not
vouch for. ``verify`` names the files such a removal still had to delete as its own
(``leftover_files``), with how to finish it, instead of as another program's.

A removal is bound to the checkpoint it began from (``_Binding``), whatever replaces it
meanwhile (a save with ``overwrite=True``, paused removals resumed): on a file system it
works through a descriptor of the checkpoint's directory, so a directory renamed over
it is never touched; on an object store it rewrites the record only where it is still
the version read first, and checks that version before each deletion.
"""

from __future__ import annotations

__all__ = ["plan_removal", "remove_entries", "rewrite_packs"]

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from shardstore.errors import CheckpointingException
from shardstore.format.chunks import chunk_store_for
from shardstore.format.features import PACK_NAME, ZarrMetadata
from shardstore.format.packs import PackCollector, pack_name, read_members, write_pack
from shardstore.format.records import (
    COMMIT_RECORD,
    MAX_RECORD_BYTES,
    ZARR_JSON,
    CommitRecord,
    object_path,
    parent_groups,
    read_commit_record,
    write_commit_record,
)
from shardstore.format.removal_marker import REMOVAL_MARKER, RemovalPlan, pending_removal
from shardstore.stores.base import Store
from shardstore.stores.locations import Location

logger = logging.getLogger(__name__)


def plan_removal(record: CommitRecord, key_prefix: str, where: str) -> tuple[RemovalPlan, CommitRecord]:
    """The plan for removing ``key_prefix`` from ``record``, and the record without it
    (its arrays packed with removed ones still name their old pack: ``rewrite_packs``
    moves them to the plan's new ones)."""
    removed = sorted(k for k in record.arrays if k.startswith(key_prefix))
    kept, object_files = _without_object_shards(record, key_prefix)
    kept = replace(kept, arrays={k: a for k, a in record.arrays.items() if k not in removed})
    gone_packs = {record.arrays[k].pack for k in removed} - {None}
    rewritten = _rewritten_names(sorted({a.pack for a in kept.arrays.values() if a.pack in gone_packs}), record.packs)
    kept = replace(kept, packs={p: n for p, n in record.packs.items() if p not in gone_packs})
    groups = sorted(set(parent_groups(removed)) - set(parent_groups(list(kept.arrays))), reverse=True)
    folders = set(groups) | set(parent_groups(object_files)) | set(parent_groups(sorted(gone_packs)))
    staying_packs = [*kept.packs, *rewritten.values()]
    plan = RemovalPlan(
        save_id=record.save_id,
        key_prefix=key_prefix,
        arrays=tuple(removed),
        trees=tuple((k, _packs_under(k, staying_packs)) for k in removed if record.arrays[k].pack is None),
        files=tuple(sorted(gone_packs) + object_files),
        documents=tuple(f"{g}/{ZARR_JSON}" for g in groups if record.zarr_metadata is ZarrMetadata.PER_NODE),
        folders=tuple(sorted(folders, key=lambda f: (f.count("/"), f), reverse=True)),
        rewritten=tuple(rewritten.items()),
    )
    return plan, kept


def remove_entries(location: Location, record: CommitRecord, key_prefix: str) -> None:
    """Removes the arrays and object shards under ``key_prefix`` from the committed
    checkpoint at ``location`` (``record``: its commit record, as the caller read it),
    after finishing a removal a killed process began there (the module docstring gives
    the order), bound to that checkpoint.

    Raises:
        CheckpointingException: as ``RemovalPlan.of`` and ``RemovalPlan.delete``; a
            marker that is not one of ours; the checkpoint was replaced before or while
            the removal ran (saying what was and was not changed)."""
    with _Binding.to(location, record) as bound:
        here, record = bound.location, bound.record
        try:
            _finish_interrupted(here, record, bound)
            plan, kept = plan_removal(record, key_prefix, location.describe())
            if plan.is_empty():
                return
            bound.check()
            here.write_atomic(REMOVAL_MARKER, plan.to_json())  # durable before the record changes
            kept = rewrite_packs(here, plan, kept)
            bound.write_record(kept)
            plan.delete(here, kept, bound.check)
            bound.check()  # the record is still the one this removal wrote
            here.remove(REMOVAL_MARKER)
        except OSError:
            bound.check()  # a held directory removed by the save that replaced it: say so
            raise


class _Binding:
    """A removal's hold on the checkpoint it began from (module docstring).

    Attributes:
        location: where the removal reads and writes: the checkpoint's directory held
            open (a file system), else ``location`` itself.
        record: the checkpoint's record, as read through ``location``.
    """

    def __init__(self, given: Location, location: Location, record: CommitRecord, version: str | None,
                 held: Any) -> None:
        self.given, self.location, self.record = given, location, record
        self._version, self._held = version, held

    @classmethod
    @contextmanager
    def to(cls, location: Location, record: CommitRecord) -> Iterator[_Binding]:
        """Binds a removal to the checkpoint ``record`` commits at ``location``; on a
        file system, checks at the end that ``location`` still names that checkpoint.

        Raises:
            CheckpointingException: ``location`` commits another checkpoint now."""
        directory = location.store.publishing()
        if directory is not None:
            with directory.held() as held:
                if held is not None:
                    here = _HeldLocation(held.store, location)
                    binding = cls(location, here, _record_of(here, record, location), None, held)
                    yield binding
                    binding.check()
                    return
        writes = location.store.conditional_writes()
        found = writes.get_versioned(COMMIT_RECORD, MAX_RECORD_BYTES) if writes is not None else None
        version = found.version if found is not None else None
        data = found.data if found is not None else location.read_bytes_or_none(COMMIT_RECORD, MAX_RECORD_BYTES)
        current = CommitRecord.from_json(data, where=location.describe(COMMIT_RECORD)) if data else None
        yield cls(location, location, _same_save(current, record, location), version, None)

    def write_record(self, kept: CommitRecord) -> None:
        """Writes the record without the removed entries: through the held directory, or
        only where the record is still the version the removal began from."""
        if self._version is None:
            self.check()
            write_commit_record(self.location, kept)
            return
        writes = self.location.store.conditional_writes()
        assert writes is not None  # a version was read through them
        version = writes.put_if_version(COMMIT_RECORD, kept.to_json(), self._version)
        if version is None:
            raise _replaced(self.given, "before it changed the commit record; it changed nothing of the checkpoint "
                            f"there now (its {REMOVAL_MARKER} and any packs it rewrote stay, listed by `verify`)")
        self._version = version

    def check(self) -> None:
        """Raises where the checkpoint was replaced since: the path names another
        directory than the one held, or (object stores) the record is no longer the
        version this removal wrote or read."""
        if self._held is not None:
            if not self._held.still_named():
                raise _replaced(self.given, "while it ran; it worked on the replaced checkpoint only, and changed "
                                "nothing of the one there now")
            return
        if self._version is None:
            return
        writes = self.location.store.conditional_writes()
        assert writes is not None
        if writes.version_of(COMMIT_RECORD) != self._version:
            raise _replaced(self.given, "while it deleted the removed entries' files; it deleted nothing more")

class _HeldLocation(Location):
    """A checkpoint's directory held open (``DirectoryPublishing.held``), named in
    messages as the location it was opened at."""

    def __init__(self, store: Store, opened_at: Location) -> None:
        super().__init__(store)
        self._opened_at = opened_at

    def describe(self, rel: str = "") -> str:
        return self._opened_at.describe(rel)


def _record_of(held: Location, expected: CommitRecord, given: Location) -> CommitRecord:
    return _same_save(read_commit_record(held), expected, given)


def _same_save(current: CommitRecord | None, expected: CommitRecord, given: Location) -> CommitRecord:
    """``current`` (the record read where the removal binds), where it commits the save
    the caller read; else the checkpoint was replaced before the removal began."""
    if current is None or current.save_id != expected.save_id:
        raise _replaced(given, "before it began; nothing was removed")
    return current


def _replaced(location: Location, when: str) -> CheckpointingException:
    return CheckpointingException(
        f"The removal from {location.describe()} stopped: the checkpoint there was replaced (by a save with "
        f"overwrite=True, or another removal) {when}. Open the checkpoint there now and remove the entries again if "
        "they are still wanted gone"
    )


def _finish_interrupted(location: Location, record: CommitRecord, bound: _Binding) -> None:
    """Finishes the removal whose marker lies in the checkpoint (``record``: its record).

    Raises:
        CheckpointingException: a file of the marker's name that is not this
            checkpoint's removal marker (nothing is removed)."""
    plan = pending_removal(location, record)
    if plan is None:
        if location.exists(REMOVAL_MARKER):
            raise CheckpointingException(
                f"{location.describe(REMOVAL_MARKER)} is no removal marker of this checkpoint (save "
                f"{record.save_id}), so what it names is not provably a removal's: nothing was removed. Find out "
                "what wrote it, and move it out of the checkpoint"
            )
        return
    if plan.took_effect(record):
        plan.delete(location, record, bound.check)
        logger.info("Finished removing %r from %s (a removal cut short)", plan.key_prefix, location.describe())
    else:
        vouched = record.vouched_paths()
        for _, new in plan.rewritten:
            if new not in vouched:  # the marker names it: the removal's own, never committed
                bound.check()
                location.remove(new)
        logger.info("A removal of %r from %s stopped before it changed anything", plan.key_prefix, location.describe())
    bound.check()
    location.remove(REMOVAL_MARKER)


def rewrite_packs(location: Location, plan: RemovalPlan, kept: CommitRecord) -> CommitRecord:
    """Writes each pack the plan rewrites anew, holding only its arrays that stay, under
    its new name (``RemovalPlan.rewritten``), and returns ``kept`` with those arrays in
    it: a pack is one zip that plain readers list whole, so the removed arrays leave it
    (the old one goes with the plan's ``files``). Packs are never shared between
    checkpoints (incremental reuse copies no packed array), so no other save reads them."""
    if not plan.rewritten:
        return kept
    store = chunk_store_for(location, io_concurrency=1)
    arrays, packs = dict(kept.arrays), dict(kept.packs)
    for old, new in plan.rewritten:
        records = [a for _, a in sorted(kept.arrays.items()) if a.pack == old]
        collector = PackCollector(threads=1)
        read_members(store, records, collector)
        offsets, packs[new] = write_pack(store, new, records, collector)
        arrays.update({r.key: r.with_pack(new, offsets[r.key]) for r in records})
    return replace(kept, arrays=arrays, packs=packs)


def _rewritten_names(packs: list[str], taken: Iterable[str]) -> dict[str, str]:
    """A new name for each of ``packs`` (``packs/<rank>-<n>.zip``), the same rank's next
    number after every pack in ``taken`` and those already given."""
    names: dict[str, str] = {}
    used = set(taken)
    for pack in packs:
        match = PACK_NAME.fullmatch(pack)
        assert match is not None, pack  # the record's packs are checked when it is read
        rank = int(match.group(1))
        number = 1 + max(int(m.group(2)) for p in used if (m := PACK_NAME.fullmatch(p)) and int(m.group(1)) == rank)
        names[pack] = pack_name(rank, number)
        used.add(names[pack])
    return names


def _packs_under(key: str, packs: Iterable[str]) -> tuple[str, ...]:
    """The names of those of ``packs`` (``packs/<rank>-<n>.zip``) that lie directly in
    the directory of the array ``key``: an array keyed ``packs`` shares it with them, so
    removing its tree must leave the packs of the arrays that stay."""
    return tuple(pack.removeprefix(f"{key}/") for pack in packs if pack.startswith(f"{key}/"))


def _without_object_shards(record: CommitRecord, key_prefix: str) -> tuple[CommitRecord, list[str]]:
    """``record`` without the ShardedObject shards whose unique key starts with
    ``key_prefix`` (an object left with none goes), and those shards' files."""
    objects, removed_files = {}, []
    for key, obj in record.objects.items():
        shard_keys = tuple(k for k in obj.shard_keys if not k.startswith(key_prefix))
        removed_files += [object_path(k) for k in obj.shard_keys if k.startswith(key_prefix)]
        if shard_keys:
            objects[key] = replace(obj, shard_keys=shard_keys)
    gone = set(removed_files)
    return replace(
        record, objects=objects, files={k: v for k, v in record.files.items() if k not in gone},
        file_digests={k: v for k, v in record.file_digests.items() if k not in gone},
    ), removed_files
