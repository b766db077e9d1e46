"""The marker of a removal from a committed checkpoint (``format.removal``):
``REMOVAL_MARKER``, written before the commit record changes, holds a ``RemovalPlan``.

A marker whose ``save_id`` is the record's is provably this checkpoint's removal, and
the files its plan deletes that the record no longer vouches for are the checkpoint's
own (``leftover_files``): ``records.own_markers`` counts them as such, so a replacing
save or the manager's deletion removes them with the checkpoint, and ``verify`` names
them as that removal's.
"""

from __future__ import annotations

__all__ = ["MAX_REMOVAL_MARKER_BYTES", "REMOVAL_MARKER", "RemovalPlan", "leftover_files", "pending_removal"]

import json
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from shardstore.errors import CheckpointingException
from shardstore.stores.base import Location

REMOVAL_MARKER = ".shardstore-removing.json"
# The most bytes a removal marker holds: a list of keys, far below a commit record's bound.
MAX_REMOVAL_MARKER_BYTES = 2**30


class CommitRecord(Protocol):
    """What a removal reads of ``records.CommitRecord`` (which builds on this module)."""

    save_id: str
    arrays: Mapping[str, Any]

    def vouched_paths(self) -> set[str]: ...


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
        rewritten: each pack that also holds arrays that stay, with the new pack written
            without the removed ones (the old one is among ``files``).
    """

    save_id: str
    key_prefix: str
    arrays: tuple[str, ...]
    trees: tuple[tuple[str, tuple[str, ...]], ...]
    files: tuple[str, ...]
    documents: tuple[str, ...]
    folders: tuple[str, ...]
    rewritten: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> bytes:
        return json.dumps({
            "save_id": self.save_id, "key_prefix": self.key_prefix, "arrays": list(self.arrays),
            "trees": [[k, list(keep)] for k, keep in self.trees], "files": list(self.files),
            "documents": list(self.documents), "folders": list(self.folders),
            "rewritten": [list(pair) for pair in self.rewritten],
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
                rewritten=tuple((_text(old), _text(new)) for old, new in value.get("rewritten", [])),
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

    def delete(self, location: Location, record: CommitRecord, before_each: Callable[[], None] = lambda: None) -> None:
        """Step 3: deletes what the plan names that ``record`` does not vouch for,
        calling ``before_each`` before each deletion (it raises to stop them).

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
            before_each()
            location.remove_tree(key, keep=keep)
        for rel in (*self.files, *self.documents):
            before_each()
            location.remove(rel)
        for folder in self.folders:
            if not location.child(folder).list_files():
                before_each()
                location.remove_tree(folder)  # an empty directory on a file system


def leftover_files(location: Location, record: CommitRecord, found: Iterable[str]) -> tuple[str, list[str]] | None:
    """The key prefix of a removal that was interrupted after it rewrote ``record`` and
    the files among ``found`` it still had to delete; None where there is none."""
    plan = pending_removal(location, record)
    if plan is None or not plan.took_effect(record):
        return None
    return plan.key_prefix, sorted(rel for rel in found if plan.covers(rel))


def pending_removal(location: Location, record: CommitRecord) -> RemovalPlan | None:
    """The plan of this checkpoint's interrupted removal (its marker names the record's
    save); None where there is none, or the file is no marker of ours for this save."""
    data = location.read_bytes_or_none(REMOVAL_MARKER, max_bytes=MAX_REMOVAL_MARKER_BYTES)
    plan = None if data is None else RemovalPlan.from_json(data)
    return plan if plan is not None and record.save_id and plan.save_id == record.save_id else None


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def _texts(values: Collection[object]) -> tuple[str, ...]:
    if not isinstance(values, list):
        raise TypeError(f"{values!r} is not a list")
    return tuple(_text(v) for v in values)
