"""``verify`` of every checkpoint under one root (a checkpoint manager's directory, a
Megatron-LM run's ``iter_*`` directories), naming the files that several of them share.

Incremental saves (``format.reuse``) share an unchanged chunk between checkpoints: on a
local file system as one file under several names (a hard link), so one damaged file is
damage in every checkpoint that links it. A verify of one checkpoint cannot say that; this
one groups the damaged files of all checkpoints under the root by the file they are (device
and inode) and lists, for each, every checkpoint that holds it. On object stores and after
a copy-on-write clone, checkpoints share no object: each damaged file is its own.
"""

from __future__ import annotations

__all__ = [
    "RootVerifyReport", "SharedDamage", "entries_under", "holds_commit_record", "leftovers_under",
    "refuse_unreadable_version", "verify_checkpoints", "verify_root",
]

import json
import os
import re
from dataclasses import dataclass, field

from shardstore.errors import CheckpointingException
from shardstore.format import (
    COMMIT_RECORD,
    COMMON_FILE,
    MAX_RECORD_BYTES,
    REPLACED_TAG,
    STAGING_TAG,
    Problem,
    UnsupportedFormatVersion,
    VerifyReport,
    holds_claim,
    read_commit_record,
    verify,
)
from shardstore.opened import bare_location
from shardstore.stores import Location

# A chunk's key within its array (``ArrayRecord.chunk_key``: ``c.0.1``, ``c/0/1``, ``c``).
_CHUNK_KEY = re.compile(r"c([./]\d+)*")


@dataclass(frozen=True)
class SharedDamage:
    """One damaged file and every checkpoint under the root that holds it.

    Attributes:
        key: the array key (or file path) as ``Problem.key``.
        part: the chunk key, or ``"file"``.
        message: the problem, as the first checkpoint's verify put it.
        checkpoints: the names (under the root) of the checkpoints that hold this very
            file, in name order; one name where nothing shares it.
    """

    key: str
    part: str
    message: str
    checkpoints: tuple[str, ...]


@dataclass
class RootVerifyReport:
    """What ``verify_root`` found: each checkpoint's own report, and the damaged files
    grouped by the file they are.

    Attributes:
        leftovers: entries under the root that interrupted saves left (a staging
            directory, an old checkpoint a replacement set aside, an object store's
            prefix whose save is in flight or ended without a commit), by name: not verified
            as checkpoints (a half-moved one would read as damage, which a cleanup
            script may answer by deleting it), named so that none goes unseen.
    """

    root: str
    reports: dict[str, VerifyReport] = field(default_factory=dict)
    damage: list[SharedDamage] = field(default_factory=list)
    leftovers: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.reports.values())

    def __str__(self) -> str:
        head = f"{self.root}: {len(self.reports)} checkpoint(s) checked; "
        if self.leftovers:
            head = (
                f"{self.root}: left by interrupted saves, not checked: {', '.join(self.leftovers)} (the next save "
                "into each checkpoint's path cleans them up; `shardstore restore PATH` puts back a checkpoint a "
                "replacement set aside)\n" + head
            )
        if self.ok:
            return head + "no problems"
        lines = [
            f"  {d.key} [{d.part}] in {', '.join(d.checkpoints)}"
            + (f" (one file shared by {len(d.checkpoints)} checkpoints)" if len(d.checkpoints) > 1 else "")
            + f": {d.message}"
            for d in self.damage
        ]
        return head + f"{len(self.damage)} damaged file(s):\n" + "\n".join(lines)


def entries_under(root: Location) -> tuple[dict[str, Location], tuple[str, ...]]:
    """From one listing of ``root``: the entries directly under it that hold a commit
    record, by name (a damaged record counts: its verify says what is wrong), and the
    leftovers of interrupted saves (``leftovers_under``), which are none of them.
    Neither under a root that holds a save's own files (``common.pt``): it is one
    checkpoint, unfinished, whose array directories each hold a ``zarr.json`` that is
    no commit record."""
    names = _top_names(root)
    leftovers = _leftovers(names)
    found, claimed = {}, []
    for name in names:
        if name in leftovers:
            continue
        child = root.child(name)
        if holds_commit_record(child):
            found[name] = child
        elif holds_claim(child):
            claimed.append(name)
    return found, tuple(sorted((*leftovers, *claimed)))


def leftovers_under(root: Location) -> tuple[str, ...]:
    """The entries directly under ``root`` that interrupted saves left, by name
    (``RootVerifyReport.leftovers``); none under a root that is itself a save's."""
    return entries_under(root)[1]


def _top_names(root: Location) -> list[str]:
    """The names directly under ``root``; none where it holds a save's own files."""
    return [] if root.exists(COMMON_FILE) else root.list_top(limit=None)


def _leftovers(names: list[str]) -> tuple[str, ...]:
    return tuple(sorted(name for name in names if _is_leftover(name)))


def _is_leftover(name: str) -> bool:
    """Whether ``name`` is a save's staging directory or a checkpoint a replacement set
    aside (``.<name>.shardstore-save-<id>``, ``.<name>.shardstore-replaced-<id>``)."""
    return name.startswith(".") and (STAGING_TAG in name or REPLACED_TAG in name)


def holds_commit_record(location: Location) -> bool:
    """Whether ``location``'s ``zarr.json`` is a commit record, a damaged one included
    (not a JSON object, or unreadable: its verify says why); not the metadata of another
    Zarr node: an array's (an unfinished save holds one per array) or a group's without
    ``attributes.shardstore``."""
    if not location.exists(COMMIT_RECORD):
        return False
    try:
        data = location.read_bytes_or_none(COMMIT_RECORD, max_bytes=MAX_RECORD_BYTES)
    except OSError:  # unreadable, or larger than any record: verify names the problem
        return True
    if data is None:  # removed since
        return False
    try:
        node = json.loads(data)
    except (ValueError, RecursionError):  # damaged (RecursionError: nested past the parser's depth)
        return True
    if not isinstance(node, dict):
        return True
    attributes = node.get("attributes")
    return isinstance(attributes, dict) and "shardstore" in attributes


def refuse_unreadable_version(location: Location) -> None:
    """Raises where ``location``'s commit record is of a format version this shardstore
    cannot read: an error (upgrade shardstore), not damage, which a script may act on by
    deleting the checkpoint. Other errors of the record are left to ``verify``, which
    reports them as the damage they are.

    Raises:
        UnsupportedFormatVersion: a newer shardstore wrote the record."""
    try:
        read_commit_record(location)
    except UnsupportedFormatVersion:
        raise
    except CheckpointingException:  # damage: verify() reports it as a problem line
        return


def verify_root(root: str | os.PathLike, progress: bool = False) -> RootVerifyReport:
    """Verifies every checkpoint directly under ``root`` (``entries_under``). Never
    raises for damage: the report lists it, each damaged file once with every
    checkpoint that shares it.

    Raises:
        CheckpointingException: ``root`` holds no checkpoint under it, nor what an
            interrupted save left (missing, empty, or a checkpoint itself, which
            ``verify`` checks): a report of nothing checked would read as "no problems".
        UnsupportedFormatVersion: a checkpoint's record is of a format version this
            shardstore cannot read (``refuse_unreadable_version``), before any is verified."""
    location = bare_location(root)
    found, leftovers = entries_under(location)
    if not found and not leftovers:
        raise CheckpointingException(
            f"{location.describe()} holds no checkpoint under it (no entry with a commit record), so there is "
            "nothing to verify as a root; to verify one checkpoint, call shardstore.verify on it"
        )
    return verify_checkpoints(location.describe(), found, progress, leftovers)


def verify_checkpoints(
    root: str, checkpoints: dict[str, Location], progress: bool = False, leftovers: tuple[str, ...] = ()
) -> RootVerifyReport:
    """``verify`` of each of ``checkpoints`` (by name), their damage grouped by file; a
    record of a newer format version raises first (``verify_root``). ``leftovers``:
    named in the report, not verified (``RootVerifyReport.leftovers``)."""
    for location in checkpoints.values():
        refuse_unreadable_version(location)
    report = RootVerifyReport(
        root, {name: verify(loc, progress) for name, loc in sorted(checkpoints.items())}, leftovers=leftovers
    )
    groups: dict[object, list[tuple[str, Problem]]] = {}
    for name, single in report.reports.items():
        for problem in single.problems:
            groups.setdefault(_file_identity(checkpoints[name], name, problem), []).append((name, problem))
    for found in groups.values():
        first = found[0][1]
        names = tuple(sorted({name for name, _ in found}))
        report.damage.append(SharedDamage(first.key, first.part, first.message, names))
    return report


def _file_identity(checkpoint: Location, name: str, problem: Problem) -> object:
    """What tells two checkpoints' damaged files apart: the file itself (device and
    inode) where the problem names a local file that exists (a file, an array's
    ``zarr.json`` or a chunk), else the checkpoint and the part."""
    own = (name, problem.key, problem.part)
    if problem.part in ("file", "metadata"):
        rel = problem.key
    elif _CHUNK_KEY.fullmatch(problem.part):
        rel = f"{problem.key}/{problem.part}"
    else:  # the whole store, its listing, the consolidated metadata: no one file
        return own
    path = checkpoint.local_path(rel)
    if path is None:
        return own
    try:
        info = os.lstat(path)
    except OSError:  # missing or unreadable: nothing to share, this checkpoint's own problem
        return own
    return (info.st_dev, info.st_ino)
