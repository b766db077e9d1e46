"""Incremental saves: a chunk whose bytes did not change since an earlier checkpoint is
shared with it, not written again.

Fine-tuning, LoRA and RL loops save the same frozen bytes at every step. A save given an
earlier committed checkpoint to reuse from (``shardstore.save(..., reuse_from=...)``;
the checkpoint manager passes its newest step) shares each chunk whose new bytes equal
that checkpoint's chunk of the same array at the same grid index:

- **Packed arrays** (``format.packs``, feature ``packs``) are never shared, neither
  from a base whose array is packed nor into a save that packs it: their chunks are
  members of a zip, rewritten with their pack.
- **Equal** means the same content digest (XXH3-128 of the chunk's bytes, recorded for
  every chunk at write time, ``format.chunks.chunk_digest``) *and* the same crc32c (as
  the array's codec reports it, ``ChunkCodec.held``), for an array stored the same way
  (shape, data type, chunk shape, chunk key encoding, codec). crc32c alone never
  decides it: different bytes with the same crc32c take four forged bytes.
- **Shared** means a copy-on-write clone or else a hard link on a local file system
  (``stores.local_files.share_file``), a server-side copy on an object store
  (``Store.copy_from``). Where neither is possible the chunk is written as usual.
- **Proven** by the store before the commit binds it (``ChunkStore.share_from``), by
  the tag the source's record keeps for the object (``RecordedBytes``): an S3 copy by
  its ETag; a local file by its identity (``stores.file_identity``), else by reading
  it back; the scrub (below) reads some back though their identity matches.
- **Every checkpoint stands alone.** A shared chunk is listed in the new commit record
  with its crc32c and digest like any other; deleting the earlier checkpoint leaves the
  new one whole (a hard link keeps the file; a copy is a copy). The earlier checkpoint's
  files are never written: shardstore creates every chunk file anew
  (``stores.local_files.create_new_file``), never truncating one in place.

Who decides what: the coordinator, when the save begins (``reuse_save_id``), checks that
the source is a committed shardstore checkpoint that the save does not overwrite in
place, and sends its save id in the save's intent. Each rank then opens the source
itself (``ChunkReuse.open``, no collective), checks that it still holds that save, and
shares chunk by chunk as it writes. A source that cannot be used (missing, another
tool's, older records without digests, another kind of store, replaced meanwhile, another
checkpoint than the coordinator's) is logged once and the save writes everything: never an
error.

The scrub (``scrub_plan``): a shared chunk whose recorded identity matches
(``stores.file_identity``) is proven without reading its bytes; bit rot and writes whose
author set ``mtime`` back change no identity field. So each reusing save on a local file
system also re-reads a bounded share of the chunks the base's record proves by identity,
those unread longest first (the count each chunk's identity keeps; ties in key and grid
order), and compares them with the bytes being saved: a chunk that no longer holds them
is written, not shared, and the save warns ("run `shardstore verify`").
"""

from __future__ import annotations

__all__ = [
    "SCRUB",
    "ChunkReuse",
    "RecordedBytes",
    "ReusableArray",
    "ReuseTally",
    "ScrubPolicy",
    "reuse_save_id",
    "scrub_plan",
]

import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shardstore.format.chunks import (
    ChunkFile,
    ChunkMismatch,
    ChunkStore,
    ShareChunk,
    WrittenChunk,
)
from shardstore.format.codecs import HeldBytes
from shardstore.format.records import ArrayRecord, CommitRecord, is_committed, read_commit_record
from shardstore.progress import info_on_first_rank
from shardstore.stores.base import Location
from shardstore.stores.file_identity import FileIdentity

logger = logging.getLogger(__name__)


def reuse_save_id(source: Location, target: Location, in_place: bool) -> str | None:
    """Coordinator, when a save into ``target`` begins: the save id of the committed
    checkpoint at ``source`` that the save may share chunks with, or None (logged) where
    it may not."""
    if in_place and source.describe() == target.describe():
        why = "the save replaces it in place (an object store has no staging area)"
    else:
        try:
            if is_committed(source):
                return read_commit_record(source).save_id
            why = "it holds no committed shardstore checkpoint"
        except Exception as exc:  # unreadable, no permission, damaged: the save writes everything
            why = f"it cannot be read ({exc})"
    logger.info("Not reusing chunks from %s for the save into %s: %s", source.describe(), target.describe(), why)
    return None


@dataclass(frozen=True)
class ReusableArray:
    """An array of the source stored exactly as the new one is, with the crc32c and
    digest of each of its chunks."""

    record: ArrayRecord

    def matches(self, index: tuple[int, ...], data: memoryview, digest: str) -> RecordedBytes | None:
        """What a shared object for chunk ``index`` must hold (``ChunkCodec.held``, with
        the tag the record keeps for it), when the recorded digest is ``digest`` and the
        recorded crc32c the one the codec reports for ``data`` (encoded only once the
        digest matched), else None."""
        ordinal = self.record.chunk_ordinal(index)
        assert self.record.chunk_digests is not None and self.record.chunk_crcs is not None
        if self.record.chunk_digests[ordinal] != digest:
            return None
        held = self.record.codec.held(data, digest)
        if held.crc != self.record.chunk_crcs[ordinal]:
            return None
        etag = self.record.chunk_etags[ordinal] if self.record.chunk_etags is not None else None
        return RecordedBytes(held, etag)


@dataclass(frozen=True)
class RecordedBytes:
    """``held`` with the tag the source's record bound to the object being shared
    (``stores.base.ExpectedBytes.source_etag``: an ETag, or a local file's identity):
    a registered codec's own held bytes need not carry a field for it."""

    held: HeldBytes
    source_etag: str | None

    @property
    def crc(self) -> int:
        return self.held.crc

    @property
    def nbytes(self) -> int:
        return self.held.nbytes

    def holds(self, blocks: Iterable[memoryview]) -> bool:
        return self.held.holds(blocks)

    def check(self, blocks: Iterable[memoryview], source: str) -> None:
        self.held.check(blocks, source)

    def md5_hex(self) -> str:
        return self.held.md5_hex()


def _reusable(source: ArrayRecord | None, new: ArrayRecord) -> ReusableArray | None:
    """The source's array where its chunks may be shared into the new one: not a packed
    array's (``format.packs``: its chunks are members of a zip, no objects of their
    own to link or copy; a packed array of the new save is written anew too)."""
    if source is None or source.chunk_digests is None or source.chunk_crcs is None or source.pack is not None:
        return None
    same = (source.shape, source.dtype, source.chunk_shape, source.chunk_separator, source.codec) == (
        new.shape, new.dtype, new.chunk_shape, new.chunk_separator, new.codec)
    return ReusableArray(source) if same else None


# Why a chunk the record called unchanged was written instead (``ChunkReuse._note``).
CANNOT_SHARE = "the storage cannot share it"
DAMAGED = "the earlier checkpoint's chunk does not hold the bytes being saved"
FAILED = "sharing it failed"


@dataclass
class ReuseTally:
    """What one rank's sharing did during one save (``ChunkReuse``), for its log line.

    Attributes:
        shared: chunks shared and proven.
        shared_bytes: their stored bytes.
        written: chunks the record called unchanged that were written instead.
        seconds: time spent sharing and proving, summed over the I/O threads.
        scrubbed_bytes: stored bytes of the chunks re-read by the scrub (``scrub_plan``).
    """

    shared: int = 0
    shared_bytes: int = 0
    written: int = 0
    seconds: float = 0.0
    scrubbed_bytes: int = 0


class ChunkReuse:
    """One rank's use of the source checkpoint during one save."""

    def __init__(self, source: Location, store: ChunkStore, arrays: dict[str, ReusableArray]) -> None:
        self.source, self.store, self.arrays = source, store, arrays
        self.scrub = scrub_plan({key: a.record for key, a in arrays.items()}, SCRUB)
        self.tally = ReuseTally()
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    @classmethod
    def open(
        cls, source: Location, save_id: str, source_store: ChunkStore, target_store: ChunkStore,
        records: dict[str, ArrayRecord],
    ) -> ChunkReuse | None:
        """This rank's reuse of the checkpoint at ``source`` (committed by ``save_id``)
        for a save of the arrays ``records`` into ``target_store``; None (logged) where
        it cannot help. Never raises for the source's sake: a source that cannot be
        read is one that cannot help."""
        why, level = None, logging.INFO  # what only this rank may see: at INFO on each
        if type(source_store) is not type(target_store):
            why = "it is on another kind of storage"
        else:
            try:
                record: CommitRecord | None = read_commit_record(source)
            except Exception as exc:  # damaged, unreadable, gone: the save writes everything
                record, why = None, f"it cannot be read ({exc})"
            if record is not None and record.save_id != save_id:
                why = (f"it holds save {record.save_id}, not save {save_id}, which the save's coordinator reuses "
                       "from: replaced since the save began, or another checkpoint than the coordinator's (ranks "
                       "that choose their base each for itself saw different ones)")
            elif record is not None:
                arrays = {key: r for key, new in records.items() if (r := _reusable(record.arrays.get(key), new))}
                if arrays:
                    return cls(source, source_store, arrays)
                why = "none of its arrays is stored as this save's are, with chunk digests"
                level = info_on_first_rank()  # as every rank finds, mostly: once per job
        logger.log(level, "Not reusing chunks from %s: %s", source.describe(), why)
        return None

    def sharer(self, target: ChunkStore) -> ShareChunk:
        """The ``format.chunks.run_writes`` hook that shares unchanged chunks into
        ``target``: a chunk is reported shared only once ``target`` proved it holds the
        bytes being saved (``ChunkStore.share_from``); anything else, an error of the
        source's storage included, leaves it to be written."""

        def share(file: ChunkFile, view: memoryview, digest: str) -> WrittenChunk | None:
            array = self.arrays.get(file.array_key)
            held = array.matches(file.index, view, digest) if array is not None else None
            if held is None:
                return None
            scrubbed = (file.array_key, array.record.chunk_ordinal(file.index)) in self.scrub  # type: ignore[union-attr]
            if scrubbed:  # read back, whatever its identity says (``scrub_plan``)
                held = RecordedBytes(held.held, None)
            start = time.perf_counter()
            error: Exception | None = None
            shared = None
            try:
                shared = target.share_from(self.store, file.rel, held)
                failure = None if shared is not None else CANNOT_SHARE
            except Exception as exc:  # the source cannot serve this chunk; writing it is the fallback
                failure, error = (DAMAGED if isinstance(exc, ChunkMismatch) else FAILED), exc
            if failure:
                self._note(failure, file, error)
            self._count(failure is None, held.nbytes, time.perf_counter() - start, scrubbed)
            if shared is None:
                return None
            return WrittenChunk(file.array_key, file.index, held.crc, digest, shared=held.nbytes, etag=shared.etag)

        return share

    def _count(self, shared: bool, nbytes: int, seconds: float, scrubbed: bool) -> None:
        with self._lock:
            self.tally.seconds += seconds
            self.tally.scrubbed_bytes += nbytes if scrubbed else 0
            if shared:
                self.tally.shared += 1
                self.tally.shared_bytes += nbytes
            else:
                self.tally.written += 1

    def _note(self, failure: str, file: ChunkFile, exc: Exception | None) -> None:
        """Logs the first failure of each kind, once per save and rank; the chunk and
        every later one like it are written instead."""
        with self._lock:
            if failure in self._logged:
                return
            self._logged.add(failure)
        where = f"chunk {file.chunk_key} of array {file.array_key!r} from {self.source.describe()}"
        if failure == CANNOT_SHARE:
            logger.info("Could not share %s (the storage cannot link, clone or copy it provably, or it is gone); "
                        "writing it, and any other such chunk, instead", where)
        elif failure == DAMAGED:
            logger.warning("Not sharing %s: %s. Writing it, and any other such chunk, instead; run `shardstore verify "
                           "%s` to see what else it lost", where, exc, self.source.describe())
        else:
            logger.warning("Could not share %s: %s: %s (of the earlier checkpoint's storage or of this save's). "
                           "Writing it, and any other such chunk, instead", where, type(exc).__name__, exc)

    def log_tally(self) -> None:
        """Logs (DEBUG) what this rank's sharing did since the last call (one wave of
        writes) and starts counting anew."""
        with self._lock:
            t, self.tally = self.tally, ReuseTally()
        logger.debug(
            "save: shared %d chunk(s), %d bytes, from %s, each proven against the bytes being saved; %d written "
            "instead; %d bytes re-read by the scrub; %.3f s sharing and proving (summed over threads)",
            t.shared, t.shared_bytes, self.source.describe(), t.written, t.scrubbed_bytes, t.seconds,
        )


# Each rank plans over every chunk of the arrays it writes chunks of, from the base's
# record alone (ranks that write chunks of the same arrays make the same plan), and reads
# the planned chunks it shares: at most ``ScrubPolicy.budget`` of the bytes the record
# proves by identity in those arrays, at least ``min_bytes``; a single chunk larger than
# the budget is read alone when it is the oldest. As each save moves on past more than
# ``budget - largest chunk`` bytes, every shared chunk is re-read at least once every
# ``ceil(S / (budget - largest chunk))`` saves (S: those bytes), about ``rotation_saves``
# with the default budget. The order is one over all chunks, so the oldest chunk of the
# checkpoint is read at every save by the rank that writes it, whatever the layout.
@dataclass(frozen=True)
class ScrubPolicy:
    """How much a reusing save re-reads of the chunks it could prove by identity.

    Attributes:
        rotation_saves: the budget is this fraction (1 / rotation_saves) of those
            chunks' bytes: each is re-read about once every ``rotation_saves`` saves.
        min_bytes: the budget's floor, bytes per save (small checkpoints rotate faster).
    """

    rotation_saves: int = 16
    min_bytes: int = 64 << 20

    def budget(self, nbytes: int) -> int:
        """Bytes to re-read in one save, of ``nbytes`` proven by identity."""
        return max(self.min_bytes, math.ceil(nbytes / self.rotation_saves))


SCRUB = ScrubPolicy()


def scrub_plan(arrays: Mapping[str, ArrayRecord], policy: ScrubPolicy = SCRUB) -> frozenset[tuple[str, int]]:
    """The ``(array key, chunk ordinal)`` of the base's chunks (``arrays``: its records
    of the arrays that may be shared) to re-read in this save; the same on every rank."""
    tagged = []
    for key in sorted(arrays):
        for ordinal, tag in enumerate(arrays[key].chunk_etags or ()):
            if (identity := FileIdentity.parse(tag)) is not None:
                tagged.append((-identity.unread, key, ordinal, identity.size))
    tagged.sort()
    budget = policy.budget(sum(t[3] for t in tagged))
    chosen: list[tuple[str, int]] = []
    total = 0
    for _, key, ordinal, size in tagged:
        if chosen and total + size > budget:
            break
        chosen.append((key, ordinal))
        total += size
    return frozenset(chosen)
