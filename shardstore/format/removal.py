"""Removing arrays and object shards from a committed checkpoint
(``remove_sharded_tensors``), in an order that a process killed at any point leaves
recoverable.

1. A marker, ``REMOVAL_MARKER``, is written atomically into the checkpoint: the save
   id of its record, the key prefix, and what the removal deletes (``RemovalPlan``).
2. The commit record is rewritten without the removed entries: from here on the
   checkpoint no longer has them, and it never names a file that is gone.
3. The entries' files go: array directories, packs, object shards, group documents,
   then the folders left empty.
4. The marker goes.

A marker whose save id is the record's is provably this checkpoint's removal. The next
removal (the same one called again, or another) first finishes it: where the record
still lists what the marker removes (a kill before step 2), only the marker goes;
otherwise step 3 runs again, deleting only what the record does not vouch for. ``verify``
names the files such a removal still had to delete as its own (``leftover_files``), with
how to finish it, instead of as another program's.
"""

from __future__ import annotations

__all__ = ["RemovalPlan", "leftover_files", "remove_entries"]

import json
import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace

from shardstore.errors import CheckpointingException
from shardstore.format.records import (
    MAX_RECORD_BYTES,
    REMOVAL_MARKER,
    ZARR_JSON,
    CommitRecord,
    ZarrMetadata,
    object_path,
    parent_groups,
    write_commit_record,
)
from shardstore.stores.locations import Location

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemovalPlan:
    """What removing ``key_prefix`` from the checkpoint of save ``save_id`` deletes.

    Attributes:
        arrays: the removed arrays' keys.
        trees: the directories of the removed arrays that are not packed, each with the
            names directly under it that stay (packs of arrays that stay).
        files: packs and object shard files.
        documents: the documents of groups left without arrays (where the save wrote them).
        folders: removed where empty afterwards, innermost first.
    """

    save_id: str
    key_prefix: str
    arrays: tuple[str, ...]
    trees: tuple[tuple[str, tuple[str, ...]], ...]
    files: tuple[str, ...]
    documents: tuple[str, ...]
    folders: tuple[str, ...]

    @classmethod
    def of(cls, record: CommitRecord, key_prefix: str, where: str) -> tuple[RemovalPlan, CommitRecord]:
        """The plan for removing ``key_prefix`` from ``record``, and the record without it.

        Raises:
            CheckpointingException: a pack to remove also holds an array that stays."""
        removed = sorted(k for k in record.arrays if k.startswith(key_prefix))
        kept, object_files = _without_object_shards(record, key_prefix)
        kept = replace(kept, arrays={k: a for k, a in record.arrays.items() if k not in removed})
        gone_packs = {record.arrays[k].pack for k in removed} - {None}
        if shared := sorted((a.pack, k) for k, a in kept.arrays.items() if a.pack in gone_packs):
            pack, key = shared[0]
            raise CheckpointingException(
                f"Cannot remove the tensors under {key_prefix!r} from {where}: some are packed in {pack} with "
                f"{key!r}, which stays (a pack is removed whole). Remove a prefix that covers the pack's arrays, "
                "or save the checkpoint again without them"
            )
        kept = replace(kept, packs={p: n for p, n in record.packs.items() if p not in gone_packs})
        groups = sorted(set(parent_groups(removed)) - set(parent_groups(list(kept.arrays))), reverse=True)
        folders = set(groups) | set(parent_groups(object_files)) | set(parent_groups(sorted(gone_packs)))
        plan = cls(
            save_id=record.save_id,
            key_prefix=key_prefix,
            arrays=tuple(removed),
            trees=tuple((k, _packs_under(k, kept.packs)) for k in removed if record.arrays[k].pack is None),
            files=tuple(sorted(gone_packs) + object_files),
            documents=tuple(f"{g}/{ZARR_JSON}" for g in groups if record.zarr_metadata is ZarrMetadata.PER_NODE),
            folders=tuple(sorted(folders, key=lambda f: (f.count("/"), f), reverse=True)),
        )
        return plan, kept

    def to_json(self) -> bytes:
        return json.dumps({
            "save_id": self.save_id, "key_prefix": self.key_prefix, "arrays": list(self.arrays),
            "trees": [[k, list(keep)] for k, keep in self.trees], "files": list(self.files),
            "documents": list(self.documents), "folders": list(self.folders),
        }).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RemovalPlan | None:
        """The plan a removal marker holds; None where ``data`` is no marker we wrote."""
        try:
            value = json.loads(data)
            return cls(
                save_id=_text(value["save_id"]), key_prefix=_text(value["key_prefix"]),
                arrays=_texts(value["arrays"]),
                trees=tuple((_text(k), _texts(keep)) for k, keep in value["trees"]),
                files=_texts(value["files"]), documents=_texts(value["documents"]),
                folders=_texts(value["folders"]),
            )
        except (ValueError, KeyError, TypeError, RecursionError):
            return None

    def is_empty(self) -> bool:
        return not (self.arrays or self.files)

    def took_effect(self, record: CommitRecord) -> bool:
        """Whether ``record`` (the checkpoint's now) is the one the removal wrote: it
        lists none of the removed arrays and files (a kill before the record was
        rewritten leaves all of them listed)."""
        vouched = record.vouched_paths()
        return not any(k in record.arrays for k in self.arrays) and not any(f in vouched for f in self.files)

    def covers(self, rel: str) -> bool:
        """Whether the removal deletes the file ``rel``."""
        return rel in self.files or rel in self.documents or any(
            rel.startswith(f"{key}/") and rel.removeprefix(f"{key}/") not in keep for key, keep in self.trees
        )

    def delete(self, location: Location, record: CommitRecord) -> None:
        """Step 3: deletes what the plan names that ``record`` does not vouch for.

        Raises:
            CheckpointingException: ``record`` vouches for a file the plan deletes."""
        vouched = record.vouched_paths()
        if claimed := sorted(p for p in vouched if self.covers(p)):
            raise CheckpointingException(
                f"The removal of {self.key_prefix!r} from {location.describe()} would delete {claimed[0]}, which its "
                f"commit record lists: the checkpoint changed since the removal began. Nothing was deleted; move "
                f"{REMOVAL_MARKER} out of the checkpoint once you have checked it"
            )
        for key, keep in self.trees:
            location.remove_tree(key, keep=keep)
        for rel in (*self.files, *self.documents):
            location.remove(rel)
        for folder in self.folders:
            if not location.child(folder).list_files():
                location.remove_tree(folder)  # an empty directory on a file system


def remove_entries(location: Location, record: CommitRecord, key_prefix: str) -> None:
    """Removes the arrays and object shards under ``key_prefix`` from the committed
    checkpoint at ``location`` (``record``: its commit record), after finishing a removal
    a killed process began there (the module docstring gives the order).

    Raises:
        CheckpointingException: as ``RemovalPlan.of`` and ``RemovalPlan.delete``; a
            marker that is not one of ours."""
    _finish_interrupted(location, record)
    plan, kept = RemovalPlan.of(record, key_prefix, location.describe())
    if plan.is_empty():
        return
    location.write_atomic(REMOVAL_MARKER, plan.to_json())  # durable before the record changes
    write_commit_record(location, kept)
    plan.delete(location, kept)
    location.remove(REMOVAL_MARKER)


def leftover_files(location: Location, record: CommitRecord, found: Iterable[str]) -> tuple[str, list[str]] | None:
    """The key prefix of a removal that was interrupted after it rewrote ``record`` and
    the files among ``found`` it still had to delete; None where there is none."""
    plan = _pending(location, record)
    if plan is None or not plan.took_effect(record):
        return None
    return plan.key_prefix, sorted(rel for rel in found if plan.covers(rel))


def _pending(location: Location, record: CommitRecord) -> RemovalPlan | None:
    """The plan of this checkpoint's interrupted removal (its marker names the record's
    save); None where there is none, or the file is no marker of ours for this save."""
    data = location.read_bytes_or_none(REMOVAL_MARKER, max_bytes=MAX_RECORD_BYTES)
    plan = None if data is None else RemovalPlan.from_json(data)
    return plan if plan is not None and record.save_id and plan.save_id == record.save_id else None


def _finish_interrupted(location: Location, record: CommitRecord) -> None:
    """Finishes the removal whose marker lies in the checkpoint (``record``: its record).

    Raises:
        CheckpointingException: a file of the marker's name that is not this
            checkpoint's removal marker (nothing is removed)."""
    plan = _pending(location, record)
    if plan is None:
        if location.exists(REMOVAL_MARKER):
            raise CheckpointingException(
                f"{location.describe(REMOVAL_MARKER)} is no removal marker of this checkpoint (save "
                f"{record.save_id}), so what it names is not provably a removal's: nothing was removed. Find out "
                "what wrote it, and move it out of the checkpoint"
            )
        return
    if plan.took_effect(record):
        plan.delete(location, record)
        logger.info("Finished removing %r from %s (a removal cut short)", plan.key_prefix, location.describe())
    else:
        logger.info("A removal of %r from %s stopped before it changed anything", plan.key_prefix, location.describe())
    location.remove(REMOVAL_MARKER)


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


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def _texts(values: Collection[object]) -> tuple[str, ...]:
    if not isinstance(values, list):
        raise TypeError(f"{values!r} is not a list")
    return tuple(_text(v) for v in values)
