"""Verified bytes: checksums of non-array files, and a whole-checkpoint check.

Array chunks carry their own crc32c (Zarr's ``crc32c`` codec), checked by every
reader. The other files (common state, sharded objects, ``metadata.json``) are
checksummed in the commit record at commit time; a load reads them through
``ChecksummedLocation``, which refuses bytes that do not match.

``verify(checkpoint_dir)`` reads everything a load or a plain reader (zarr-python,
TensorStore) would read, and checks it against the commit record: every chunk of every
array, every listed file, every array's and group's ``zarr.json`` (where the record says
they are written, ``CommitRecord.stored_documents``) and the consolidated metadata
(which the record implies, ``CommitRecord.node_documents``), and the record's
own digest; each pack of small arrays (feature ``packs``) as plain zip readers read it
(``format.packs.check_pack``). It also lists every file under the checkpoint and flags those the record
does not list: a file added after the commit, e.g. a ``common.pt`` copied in from
another checkpoint. It returns a report naming each finding by key and chunk or file.
"""

from __future__ import annotations

__all__ = [
    "ChecksummedLocation",
    "MAX_NODE_DOCUMENT_BYTES",
    "Problem",
    "VERIFY_REMOTE_THREADS",
    "VerifyReport",
    "FileSums",
    "caller_file_checksums",
    "callers_objects",
    "file_checksums",
    "file_mismatch",
    "verify",
]

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from shardstore._zarr_autoload import EXTENSION_METADATA
from shardstore.errors import CheckpointingException
from shardstore.format.chunks import (
    ArrayChunks,
    ChunkFile,
    ChunkStore,
    chunk_digest,
    chunk_store_for,
)
from shardstore.format.codecs import recognized
from shardstore.format.config import CONFIG_FNAME
from shardstore.format.dtypes import BY_ZARR_NAME
from shardstore.format.packs import check_pack
from shardstore.format.records import (
    COMMIT_RECORD,
    MAX_RECORD_BYTES,
    OBJECTS_DIR,
    ArrayRecord,
    CommitRecord,
    ObjectRecord,
    check_key,
    file_digest,
    own_markers,
    read_commit_record,
)
from shardstore.format.records.array_record import zero_fill_value
from shardstore.format.records.encoding import checksum
from shardstore.format.records.names import is_megatron_object_file
from shardstore.format.records.reading import other_checkpoint_beside
from shardstore.format.removal_marker import REMOVAL_MARKER, leftover_files
from shardstore.progress import Tick, operation, progress_shown, tracked
from shardstore.stores.base import Location
from shardstore.stores.locations import open_location

logger = logging.getLogger(__name__)

VERIFY_REMOTE_THREADS = 16
# Largest array or group zarr.json read by verify (ours are about 1 KiB).
MAX_NODE_DOCUMENT_BYTES = 2**20


@dataclass(frozen=True)
class FileSums:
    """What a commit record keeps of some non-array files, by relative path: each one's
    crc32c (``checksum``) and XXH3-128 (``file_digest``)."""

    checksums: dict[str, str] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)

    def add(self, rel: str, data: bytes) -> None:
        self.checksums[rel], self.digests[rel] = checksum(data), file_digest(data)


def file_checksums(location: Location, record: CommitRecord) -> FileSums:
    """Checksums of the non-array files of a checkpoint about to be committed.

    Read back from storage, so what is vouched for is what is there. Every object
    shard must exist; ``common.pt`` and ``metadata.json`` are listed when present.
    """
    sums = FileSums()
    for rel in sorted(record.expected_files()):
        data = location.read_bytes_or_none(rel)
        if data is None:
            if rel.endswith(".pt") and rel != "common.pt":
                raise CheckpointingException(f"Sharded object file {location.describe(rel)} is missing at commit")
            continue
        sums.add(rel, data)
    return sums


def callers_objects(location: Location, record: CommitRecord) -> CommitRecord:
    """``record`` with the ShardedObject shards an in-place save's caller wrote under
    ``OBJECTS_DIR`` before the commit (Megatron-Core's ``save`` order through the seed's
    ``TorchCommonSaveStrategy.save_sharded_objects``: the objects first, then the
    sharded save, which never sees them) among its objects, so that the commit vouches
    for their files and a load and the metadata queries find them. A file there that
    names no valid shard (``<key>/shard_<offset>_<shape>.pt``) is left out, for
    ``verify`` to flag."""
    shards: dict[str, set[str]] = {}
    for rel in location.child(OBJECTS_DIR).list_files():
        shard_key = rel.removesuffix(".pt")
        key, _, shard = shard_key.rpartition("/")
        if shard_key == rel or not key or not shard.startswith("shard_") or key in record.objects:
            continue
        try:
            check_key(shard_key, where=location.describe())
        except CheckpointingException as exc:
            logger.warning("Not listing %s in the commit record (verify will flag it): %s",
                           location.describe(f"{OBJECTS_DIR}/{rel}"), exc)
            continue
        shards.setdefault(key, set()).add(shard_key)
    adopted = {key: ObjectRecord(key, tuple(sorted(keys))) for key, keys in shards.items()}
    return replace(record, objects={**record.objects, **adopted}) if adopted else record


def caller_file_checksums(location: Location, record: CommitRecord) -> FileSums:
    """Checksums of the files an in-place save's caller wrote into the checkpoint
    before the commit: every file there that the record does not vouch for yet
    (Megatron-Core's own ``save`` writes its sharded objects before it calls ours)."""
    adopted = FileSums()
    for rel in sorted(set(location.list_files()) - record.vouched_paths()):
        try:
            check_key(rel, where=location.describe())  # what the record's reader accepts
        except CheckpointingException as exc:
            logger.warning("Not listing %s in the commit record (verify will flag it): %s", location.describe(rel), exc)
            continue
        adopted.add(rel, location.read_bytes(rel))
    return adopted


def file_mismatch(data: bytes, rel: str, record: CommitRecord) -> str | None:
    """Why ``data``, read at ``rel``, is not the file ``record`` vouches for there, or
    None: its crc32c and, where the record keeps one (``file_digests``; not in records
    written before it), its XXH3-128 must match."""
    expected = record.files.get(rel, record.external_files.get(rel))
    actual = checksum(data)
    if actual != expected:
        return f"its checksum {actual} differs from {expected} in the commit record"
    digest = record.file_digests.get(rel)
    if digest is not None and (actual := file_digest(data)) != digest:
        return f"its XXH3-128 {actual} differs from {digest} in the commit record (its crc32c matches)"
    return None


class ChecksummedLocation(Location):
    """A committed checkpoint's location: every read of a file the commit record could
    vouch for (common state, sharded objects, ``metadata.json``, the files an in-place
    save's caller wrote) is checked against the record, and such a file the record
    does not list is refused. It shares
    ``inner``'s store and changes only reads."""

    def __init__(self, inner: Location, record: CommitRecord, fetched: Mapping[str, bytes | None] | None = None) -> None:
        super().__init__(inner.store)
        self.inner, self.record = inner, record
        self._vouchable = record.expected_files()
        self.fetched = dict(fetched or {})

    def read_bytes_or_none(self, rel: str, max_bytes: int | None = None) -> bytes | None:
        """The file's bytes, checked as the class says; a file in ``fetched`` (what
        another rank read of it, None where it found none) is taken from there, not
        read again, and checked the same way."""
        if rel in self.fetched and (max_bytes is None or len(self.fetched[rel] or b"") <= max_bytes):
            data = self.fetched[rel]
        else:
            data = self.inner.read_bytes_or_none(rel, max_bytes)
        if data is None or not self._of_a_vouched_kind(rel):
            return data
        listed = rel in self.record.files or rel in self.record.external_files
        if not listed and rel == CONFIG_FNAME:
            # Megatron-Core's own save (shardstore.tools.megatron_strategy) writes metadata.json after the
            # commit. It only names the backends; the commit record stays the authority.
            return data
        if not listed:
            raise CheckpointingException(
                f"{self.inner.describe(rel)} is not vouched for by the commit record of {self.inner.describe()} "
                "(added after the commit?); refusing to read it"
            )
        if why := file_mismatch(data, rel, self.record):
            raise CheckpointingException(
                f"Corrupt file {self.inner.describe(rel)}: {why}; restore it or load an earlier checkpoint"
            )
        return data

    def _of_a_vouched_kind(self, rel: str) -> bool:
        """Whether ``rel`` is a file of a kind the record vouches for: one it may list
        (``CommitRecord.expected_files``, or a file the caller of an in-place save wrote),
        or any ShardedObject shard, listed or not, in this library's layout or in
        Megatron-Core's (a shard the record does not list was added after the commit)."""
        return (
            rel in self._vouchable or rel.startswith(f"{OBJECTS_DIR}/") or rel in self.record.external_files
            or is_megatron_object_file(rel)
        )


@dataclass(frozen=True)
class Problem:
    """One missing or corrupt object: ``key`` is the array key (or file path), ``part``
    the chunk key (``c.0.1``; ``c/0/1`` before format version 3) or ``"file"``."""

    key: str
    part: str
    message: str


@dataclass
class VerifyReport:
    """What ``verify`` found. ``not_ours``: files under entries another program put into
    the checkpoint's shared directory before its commit (``CommitRecord.beside``, such as
    ModelOpt's state in a Megatron-LM iteration): not checked, and no problem."""

    checkpoint: str
    problems: list[Problem] = field(default_factory=list)
    arrays_checked: int = 0
    chunks_checked: int = 0
    files_checked: int = 0
    bytes_checked: int = 0
    not_ours: list[str] = field(default_factory=list)
    unlisted: list[str] = field(default_factory=list)

    @property
    def not_ours_note(self) -> str:
        """The summary's words on ``not_ours`` (empty when there is none)."""
        return f"{len(self.not_ours)} file(s) of another program beside it, not checked; " if self.not_ours else ""

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        head = (
            f"checkpoint {self.checkpoint}: {self.arrays_checked} arrays, {self.chunks_checked} chunks, "
            f"{self.files_checked} files checked; {self.not_ours_note}"
        )
        if self.ok:
            return head + "no problems"
        lines = [f"  {p.key} [{p.part}]: {p.message}" for p in self.problems]
        return head + f"{len(self.problems)} problem(s):\n" + "\n".join(lines)

    def raise_if_damaged(self, *, for_a_load: bool = False) -> None:
        """Raises the report's problems. ``for_a_load``: only those that change what a
        load returns. A file the commit record does not list (``unlisted``: added after
        the commit, such as ModelOpt's state that Megatron-LM writes into an iteration
        after a synchronous save) is never read by a load, which reads chunks and files
        by the record, so it does not count there."""
        report = self
        if for_a_load:
            added = set(self.unlisted)
            report = replace(self, problems=[p for p in self.problems if not (p.part == "file" and p.key in added)])
        if not report.ok:
            raise CheckpointingException(str(report))


def verify(checkpoint_dir: str | os.PathLike | Location, progress: bool = False) -> VerifyReport:
    """Checks every chunk of every array and every checksummed file of a checkpoint.

    Never raises for damage: the report lists it (``report.ok``, ``str(report)``,
    ``report.raise_if_damaged()``). ``progress``: a progress bar of the bytes checked,
    on standard error.
    """
    location = open_location(checkpoint_dir)
    with progress_shown(progress), operation("verify", location.describe()) as timing:
        report = _verify(location)
        timing.nbytes = report.bytes_checked
    return report


def _verify(location: Location) -> VerifyReport:
    report = VerifyReport(location.describe())
    try:
        record = read_commit_record(location)
    except CheckpointingException as exc:
        report.problems.append(Problem(COMMIT_RECORD, "file", str(exc)))
        return report
    for rel in sorted({*record.files, *record.external_files}):
        report.files_checked += 1
        try:
            data = location.read_bytes_or_none(rel)
        except CheckpointingException as exc:
            report.problems.append(Problem(rel, "file", str(exc)))
            continue
        if data is None:
            report.problems.append(Problem(rel, "file", "missing"))
        elif why := file_mismatch(data, rel, record):
            report.problems.append(Problem(rel, "file", why))
    _verify_node_documents(location, record, report)
    _verify_consolidated(location, record, report)
    try:
        store: ChunkStore | None = chunk_store_for(location, VERIFY_REMOTE_THREADS)
    except CheckpointingException as exc:
        store, unopened = None, Problem("", "store", str(exc))
    # one listing where the chunks' sizes are needed (an object store): it names the files too
    sizes = None if store is None or store.tells_longer else _listed_sizes(location, report)
    if sizes is not None or store is None or store.tells_longer:  # else that listing failed, reported once
        _flag_unlisted_files(location, record, report, None if sizes is None else sorted(sizes))
    if store is None:
        report.problems.append(unopened)
        return report
    _verify_packs(store, record, report)
    with tracked("verify", (a.nbytes for a in record.arrays.values())) as tick:
        for _, array in sorted(record.arrays.items()):
            report.arrays_checked += 1
            _verify_array(store, array, report, tick, sizes)
    return report


def _verify_packs(store: ChunkStore, record: CommitRecord, report: VerifyReport) -> None:
    """Each pack (feature ``packs``) as plain zip readers read it: its size, its members
    and their places, CRC-32s and documents (``format.packs.check_pack``); the packed
    chunks' bytes are checked with every other chunk's."""
    by_pack: dict[str, list[ArrayRecord]] = {}
    for array in record.arrays.values():
        if array.pack is not None:
            by_pack.setdefault(array.pack, []).append(array)
    for pack, size in sorted(record.packs.items()):
        report.files_checked += 1
        for key, part, message in check_pack(store, pack, size, by_pack.get(pack, [])):
            report.problems.append(Problem(key, part, message))


def _listed_sizes(location: Location, report: VerifyReport) -> dict[str, int] | None:
    """Every object's size, from one listing, for a chunk store whose reads stop at the
    bytes expected (``ChunkStore.tells_longer``); None, and a problem, where the listing
    fails."""
    try:
        return location.store.list_sizes()
    except OSError as exc:
        report.problems.append(Problem("", "listing", (
            f"cannot list the checkpoint's objects, so files the record does not list and chunk objects grown "
            f"since the commit go unnoticed: {exc}"
        )))
        return None


def _grown(file: ChunkFile, nbytes: int, sizes: dict[str, int]) -> str | None:
    """Why a chunk object whose expected bytes read correctly is damaged all the same:
    its listed size says it is longer than its codec stores ``nbytes`` decoded bytes
    in. None where it is not, or where that length depends on the bytes."""
    expected, listed = file.codec.stored_nbytes(nbytes), sizes.get(file.rel)
    if expected is None or listed is None or listed <= expected:
        return None
    return (
        f"{file.path} holds {listed} bytes, longer than the {expected} its commit record gives: bytes were added "
        "after the commit (those it gives match); restore the checkpoint from a copy"
    )


# Fields of a Zarr v3 node document that do not change the values a reader gets.
_DESCRIPTIVE_FIELDS = frozenset({"dimension_names", "attributes"})
# The separator each chunk key encoding uses when its configuration names none.
_DEFAULT_SEPARATORS = {"default": "/", "v2": "."}
# The fill value complex arrays had before it was spelled ``[0.0, 0.0]``.
_LEGACY_COMPLEX_FILL = 0.0


def _as_read(document: Any) -> Any:
    """What of a node document decides the values a reader gets: descriptive fields
    dropped, the chunk key encoding's default separator spelled out, the codecs as the
    chunk codec that recognizes them (``format.codecs``: another spelling of the same
    layout is no finding), and the fill value ``0.0`` that earlier saves wrote for
    complex arrays read as the zero it meant (``records.zero_fill_value``): what those
    saves wrote is checked, not flagged."""
    if not isinstance(document, dict):
        return document
    view = {k: v for k, v in document.items() if k not in _DESCRIPTIVE_FIELDS}
    dtype = view.get("data_type")
    if "codecs" in view and isinstance(dtype, str) and dtype in BY_ZARR_NAME:
        view["codecs"] = recognized(view["codecs"], BY_ZARR_NAME[dtype].itemsize) or view["codecs"]
    fill = view.get("fill_value")
    if str(view.get("data_type")).startswith("complex") and isinstance(fill, float) and fill == _LEGACY_COMPLEX_FILL:
        view["fill_value"] = zero_fill_value(view["data_type"])
    encoding = view.get("chunk_key_encoding")
    if isinstance(encoding, dict) and encoding.get("name") in _DEFAULT_SEPARATORS:
        separator = (encoding.get("configuration") or {}).get("separator", _DEFAULT_SEPARATORS[encoding["name"]])
        view["chunk_key_encoding"] = {"name": encoding["name"], "configuration": {"separator": separator}}
    return view


def _document_problem(stored: Any, expected: dict[str, Any]) -> str | None:
    """How a stored Zarr metadata document differs, in what a reader reads, from the
    one the record implies."""
    stored, expected = _as_read(stored), _as_read(expected)
    if stored == expected:
        return None
    if not isinstance(stored, dict):
        return f"it holds a {type(stored).__name__}, not a Zarr metadata document"
    fields = sorted(k for k in stored.keys() | expected.keys() if stored.get(k) != expected.get(k))
    shown = "; ".join(f"{k}: {stored.get(k)!r} where the record says {expected.get(k)!r}" for k in fields[:3])
    return (
        f"it differs from the commit record ({shown}), so zarr-python and TensorStore would read "
        "other values than load returns; restore it from a copy or save the checkpoint again"
    )


def _read_document(location: Location, rel: str, bound: int) -> Any:
    data = location.read_bytes_or_none(rel, max_bytes=bound)
    if data is None:
        raise CheckpointingException("missing")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # not JSON, or nested past the parser's depth
        raise CheckpointingException(f"not valid JSON: {exc}") from exc


def _verify_node_documents(location: Location, record: CommitRecord, report: VerifyReport) -> None:
    """Every array's and group's ``zarr.json``, as plain readers open them (none where
    the record keeps them in the consolidated metadata only)."""
    for rel, expected in sorted(record.stored_documents().items()):
        report.files_checked += 1
        try:
            stored = _read_document(location, rel, MAX_NODE_DOCUMENT_BYTES)
        except (CheckpointingException, OSError) as exc:
            report.problems.append(Problem(rel, "metadata", str(exc)))
            continue
        if why := _document_problem(stored, expected):
            report.problems.append(Problem(rel, "metadata", why))


def _verify_consolidated(location: Location, record: CommitRecord, report: VerifyReport) -> None:
    """The root's consolidated metadata, which zarr-python reads instead of the nodes'
    own documents (a version 4 record's digest already covers it; older ones have none).

    Its ``metadata`` must list every group and every array of a core data type, and
    ``EXTENSION_METADATA`` the arrays of extension data types (bfloat16, float8), each
    with the document the record implies. Checkpoints saved before that split list the
    latter in ``metadata`` too (zarr-python without shardstore could not open them at all);
    such a listing is what their save wrote, so it is checked, not flagged."""
    try:
        root = _read_document(location, COMMIT_RECORD, MAX_RECORD_BYTES)
    except (CheckpointingException, OSError) as exc:
        report.problems.append(Problem(COMMIT_RECORD, "consolidated", str(exc)))
        return
    consolidated = root.get("consolidated_metadata") if isinstance(root, dict) else None
    stored = consolidated.get("metadata") if isinstance(consolidated, dict) else None
    stored_extension = consolidated.get(EXTENSION_METADATA, {}) if isinstance(consolidated, dict) else None
    if not isinstance(stored, dict):
        report.problems.append(Problem(COMMIT_RECORD, "consolidated", "no consolidated metadata: zarr-python lists no arrays"))
        return
    if not isinstance(stored_extension, dict):
        report.problems.append(Problem(COMMIT_RECORD, "consolidated", f"its {EXTENSION_METADATA} is not a JSON object"))
        return
    expected, expected_extension = record.consolidated_metadata()
    every_node = stored.keys() | stored_extension.keys() | expected.keys() | expected_extension.keys()
    for node in sorted(every_node):
        if node in expected_extension:
            found = [part[node] for part in (stored_extension, stored) if node in part]
            problems = (_document_problem(document, expected_extension[node]) for document in found)
            why = next(filter(None, problems), None) if found else (
                "missing: zarr-python would not list this array, even with shardstore installed")
        elif node not in expected:
            why = "a node the commit record does not list: plain readers would show it"
        elif node in stored_extension:
            why = "listed with the arrays of extension data types, which zarr-python with shardstore reads instead"
        elif node not in stored:
            why = "missing: zarr-python would not list this array or group"
        else:
            why = _document_problem(stored[node], expected[node])
        if why:
            report.problems.append(Problem(COMMIT_RECORD, f"consolidated {node}", why))


def _flag_unlisted_files(
    location: Location, record: CommitRecord, report: VerifyReport, listed: list[str] | None = None,
) -> None:
    """Files under the checkpoint that its save did not write (``CommitRecord.unlisted``):
    problems, except those under an entry another program had put into a shared
    directory before the commit (``CommitRecord.beside``), which are listed apart. The
    files of another tool's checkpoint in the same directory (``other_checkpoint_beside``)
    are named as such: loads refuse the directory as ambiguous. ``listed``: the files
    under the checkpoint, from a listing already made (else it lists them)."""
    try:
        found = location.list_files() if listed is None else listed
        own = own_markers(location, record, found)
    except OSError as exc:
        report.problems.append(Problem("", "listing", f"cannot list the checkpoint's files: {exc}"))
        return
    other = other_checkpoint_beside(location, record)
    unlisted = record.unlisted(found, own)
    if (removal := leftover_files(location, record, found)) is not None and removal[1]:
        prefix, left = removal
        report.unlisted.extend(left)
        report.problems.append(Problem(REMOVAL_MARKER, "removal", (
            f"remove_sharded_tensors({location.describe()!r}, {prefix!r}) was interrupted after the commit record "
            f"dropped those entries: {len(left)} file(s) it had still to delete remain ({', '.join(left[:3])}"
            f"{', ...' if len(left) > 3 else ''}); the record lists none of them. Call it again (or any removal) "
            "to finish it"
        )))
    for rel in unlisted:
        if other is not None and rel.split("/", 1)[0] in other.names:
            report.unlisted.append(rel)
            report.problems.append(Problem(rel, "file", (
                f"a file of {other.title} ({other.listed()}) that another tool saved into this checkpoint's "
                "directory, which the commit record does not list; loads refuse the directory as ambiguous. Move "
                "one of the two checkpoints into a directory of its own"
            )))
        elif record.is_beside(rel):
            report.not_ours.append(rel)
        else:
            report.unlisted.append(rel)
            report.problems.append(Problem(
                rel, "file",
                "not listed by the commit record, so its save did not write it (added after the commit, or by "
                "another program); a plain reader or a later load may pick it up. Find out what wrote it; if "
                "nothing should have, move it out of the checkpoint or restore the checkpoint from a copy",
            ))


def _verify_array(
    store: ChunkStore, array: ArrayRecord, report: VerifyReport, tick: Tick | None, sizes: dict[str, int] | None,
) -> None:
    """Reads and checks every chunk of ``array``; ``sizes``: every object's listed size,
    where ``store`` cannot tell a longer object by reading it (``_listed_sizes``)."""
    chunks = ArrayChunks.of(store, array)
    try:
        buffer = np.empty(array.chunk_shape, chunks.dtype)
    except MemoryError:
        report.problems.append(Problem(array.key, "all", f"chunk shape {array.chunk_shape} too large to check here"))
        return
    for index in array.chunk_indices():
        report.chunks_checked += 1
        file = chunks.file(index)
        try:
            file.read_into(buffer)
        except Exception as exc:  # every failure is a finding, reported by chunk
            report.problems.append(Problem(array.key, array.chunk_key(index), str(exc)))
            continue
        if sizes is not None and (why := _grown(file, buffer.nbytes, sizes)):
            report.problems.append(Problem(array.key, array.chunk_key(index), why))
            continue
        if array.chunk_digests is not None and (
            chunk_digest(memoryview(buffer.reshape(-1).view(np.uint8))) != array.chunk_digests[array.chunk_ordinal(index)]
        ):
            report.problems.append(Problem(
                array.key, array.chunk_key(index),
                "its bytes match their crc32c but not the 128-bit digest the commit record keeps: the chunk was "
                "changed after the commit and its crc32c kept (forged) or recomputed; restore the checkpoint from "
                "a copy, or load an earlier one",
            ))
            continue
        nbytes = array.chunk_nbytes(index)
        report.bytes_checked += nbytes
        if tick:
            tick(nbytes)
