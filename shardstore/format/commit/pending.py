"""A save on its way to being published: ``PendingCheckpoint`` (what the coordinator
decided, what the save holds open, its one outcome), ``SaveLocation`` (where its writers
write, naming itself as the checkpoint), and ``Publisher``, the interface of a way of
publishing it (the ways: ``by_rename``, ``in_place``, ``callers_directory``), with the
steps every publisher shares (the save marker, the error of a lost race).
"""

from __future__ import annotations

__all__ = ["PendingCheckpoint", "Publisher", "SaveLocation"]

import json
import logging
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, TypeVar, cast

from shardstore.errors import CheckpointingException
from shardstore.format.chunks import ChunkStore, chunk_store_for
from shardstore.format.commit.options import SaveIntent, SaveOptions
from shardstore.format.records import SAVE_MARKER, ArrayRecord, CommitRecord
from shardstore.format.reuse import ChunkReuse
from shardstore.stores.base import Location

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def _no_save() -> None:
    """The save of a location unpickled alone: none."""
    return None


class SaveLocation(Location):
    """Where a save's writers write (its staging directory, or the target itself when the
    save writes in place), naming itself as the checkpoint the save publishes: errors
    name the checkpoint the user asked for, not the staging directory. It knows its save
    (``save``), so a strategy handed it as a checkpoint directory writes into that save
    (``adopt_save``)."""

    def __init__(self, writes_into: Location, target: Location, save: PendingCheckpoint) -> None:
        super().__init__(writes_into.store)
        self.target = target
        self._save = weakref.ref(save)  # the save holds its location, not the reverse
        # An in-place save's files are each new in the prefix it claimed (``Store.put_new``).
        self._in_place = not writes_into.capabilities.supports_rename

    def write_bytes(self, rel: str, data: bytes) -> None:
        if self._in_place:
            self.store.put_new({rel: data})
        else:
            super().write_bytes(rel, data)

    def write_many(self, files: dict[str, bytes]) -> None:
        if self._in_place:
            self.store.put_new(files)
        else:
            super().write_many(files)

    def write_atomic(self, rel: str, data: bytes) -> None:
        if self._in_place:  # a PUT is atomic on an object store
            self.store.put_new({rel: data})
        else:
            super().write_atomic(rel, data)

    @property
    def save(self) -> PendingCheckpoint | None:
        """The pending checkpoint this location is the writes of; None once it is dropped."""
        return self._save()

    def describe(self, rel: str = "") -> str:
        return self.target.describe(rel)

    def __getstate__(self) -> dict:
        """Pickled with its save (``PendingCheckpoint.__getstate__``), which links it again."""
        return {**self.__dict__, "_save": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._save = _no_save


class PendingCheckpoint:
    """One save on its way to being published: what the coordinator decided when it
    began (``intent``, ``options``, ``tops_at_begin``), how it gets published
    (``publisher``), where its writers write (``location``) and what it holds open
    (its staging lock, its claim on the target). Every fact is given at construction;
    its one outcome, ``committed``, is set by ``commit``.

    Every rank builds one from the coordinator's ``SaveIntent``; only the coordinator
    calls ``commit`` or ``abandon``.

    Attributes:
        target: where the checkpoint is published.
        location: where this rank writes (``SaveLocation``).
        intent: the coordinator's decision, the same on every rank.
        publisher: how ``commit`` publishes.
        options: the save's options (``options.reuse_from`` opened: where
            ``intent.reuses`` was committed).
        tops_at_begin: the top-level names the target held when the save began (the
            checkpoint it replaces, or other programs' files in a shared directory);
            known on the coordinator only.
    """

    def __init__(
        self, target: Location, writes_into: Location, intent: SaveIntent, publisher: Publisher,
        options: SaveOptions | None = None, tops_at_begin: frozenset[str] = frozenset(),
    ) -> None:
        self.target, self.intent, self.publisher = target, intent, publisher
        self.options = options or SaveOptions()
        self.tops_at_begin = tops_at_begin
        self._committed: CommitRecord | None = None
        self._abandoned = False
        self.location = SaveLocation(writes_into, target, self)
        self._locks: list[int] = []  # descriptors holding the staging directory's flock
        self._releases: list[Callable[[], None]] = []  # claims on the target (``Store.claim_for_save``)
        # A save dropped without commit, abandon or release (an AsyncRequest never
        # scheduled, a caller's exception between the stages) still lets go of its
        # descriptors and lock once collected: the next save into the same place can then
        # remove its files, and the file system can be unmounted.
        self._release_when_dropped = weakref.finalize(
            self, _release_dropped, self.location, self._locks, self._releases, target.describe()
        )
        self._release_when_dropped.atexit = False  # the process's end closes them anyway
        if not publisher.holds_resources:
            self._release_when_dropped.detach()
        self._reuse: dict[str, ChunkReuse | None] = {}
        self._reuse_lock = threading.Lock()
        self._shared: dict[type, object] = {}
        self._shared_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"PendingCheckpoint({self.target.describe()!r}, save {self.intent.save_id})"

    def __getstate__(self) -> dict:
        """What a writer in another process needs (a spawned one: Megatron's persistent
        checkpoint worker pickles the request): where to write and how it is published.
        The staging lock, the claim on the target and the reuse opened here stay with
        this process, which commits or abandons; the other process opens its own reuse."""
        state = dict(self.__dict__)
        for name in ("_locks", "_releases", "_release_when_dropped", "_reuse", "_reuse_lock", "_shared",
                     "_shared_lock"):
            del state[name]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._locks, self._releases = [], []
        self._release_when_dropped = weakref.finalize(self, lambda: None)
        self._release_when_dropped.detach()  # nothing held here: release() is a no-op
        self._reuse, self._reuse_lock = {}, threading.Lock()
        self._shared, self._shared_lock = {}, threading.Lock()
        self.location._save = weakref.ref(self)

    def shared(self, kind: type[_T], make: Callable[[], _T]) -> _T:
        """The one ``kind`` this save holds in this process, made by ``make`` at the first
        call: what every holder of the save shares (``execution.pipeline.SaveProgress``:
        a strategy handed ``location`` holds the save in a pipeline of its own)."""
        with self._shared_lock:
            found = self._shared.get(kind)
            if found is None:
                found = self._shared[kind] = make()
        return cast(_T, found)

    def describe(self, rel: str = "") -> str:
        """The checkpoint this save publishes (``rel`` inside it), for messages."""
        return self.target.describe(rel)

    def chunk_reuse(self, target_store: ChunkStore, records: dict[str, ArrayRecord]) -> ChunkReuse | None:
        """This rank's reuse of the earlier checkpoint the save shares unchanged chunks
        with (``format.reuse``), opened once per save; None without one."""
        source = self.options.reuse_from
        if self.intent.reuses is None or source is None:
            return None
        with self._reuse_lock:
            if "opened" not in self._reuse:
                self._reuse["opened"] = _open_reuse(source, self.intent.reuses, target_store, records)
            return self._reuse["opened"]

    def commit(self, record: CommitRecord) -> CommitRecord:
        """Coordinator: writes the commit record and publishes the checkpoint (by its
        ``publisher``). Returns the record as published (published beside another
        program's files, it names them: ``CommitRecord.beside``)."""
        record = self.publisher.commit(self, record)
        self._committed = record
        self.release()
        return record

    @property
    def committed(self) -> CommitRecord | None:
        """The record ``commit`` published (on the coordinator, once it has); None until
        then and on the other ranks."""
        return self._committed

    def abandon(self) -> None:
        """Coordinator, after a failed save: deletes what this save wrote (what its
        ``publisher`` can prove is this save's). Safe to call again: a failed save is
        abandoned where its commit stage fails and again as ``save`` unwinds, and only
        the first call deletes (a second one found an object store's marker gone and
        warned that another save had taken the prefix over)."""
        if self._abandoned:
            return
        try:
            self.publisher.abandon(self)
            self._abandoned = True  # one that failed is tried again
        finally:
            self.release()

    def hold_staging_lock(self) -> None:
        """Coordinator: takes the staging directory's ``flock`` for as long as the save
        runs (``release`` lets it go), so that no other save removes it as a dead one's."""
        staging = self.location.store.publishing()
        assert staging is not None  # only stores that publish by rename stage apart from the target
        fd = staging.hold_lock()
        if fd is not None:
            self._locks.append(fd)

    def hold_until_released(self, release: Callable[[], None]) -> None:
        """``release`` is called once the save is over (with ``release``)."""
        self._releases.append(release)

    def release(self) -> None:
        """Every rank, once the save is over: closes what the save holds open (its
        durability descriptor, its staging lock) and lets go of its claim on the target.
        Safe to call again."""
        if self._release_when_dropped.detach() is not None:
            _close_descriptors(self.location, self._locks, self._releases)


def _close_descriptors(staging: Location, locks: list[int], releases: list[Callable[[], None]]) -> None:
    """Closes a save's durability descriptor (``begin_writes``) and its lock
    descriptors, then lets go of its claims, each once (``locks`` and ``releases`` are
    emptied)."""
    try:
        staging.end_writes()
    finally:
        try:
            while locks:
                os.close(locks.pop())
        finally:
            while releases:
                releases.pop()()


def _release_dropped(staging: Location, locks: list[int], releases: list[Callable[[], None]], where: str) -> None:
    logger.warning(
        "A save into %s was dropped before it was committed or abandoned (an async save never finalized?); "
        "closed its staging directory %s, which the next save into the same place removes",
        where, staging.describe(),
    )
    _close_descriptors(staging, locks, releases)


def _open_reuse(
    source: Location, save_id: str, target_store: ChunkStore, records: dict[str, ArrayRecord]
) -> ChunkReuse | None:
    """``ChunkReuse.open`` of ``source``, whose storage may not even open: then None
    (logged), and the save writes every chunk."""
    try:
        source_store = chunk_store_for(source, target_store.threads, target_store.threads)
    except Exception as exc:
        logger.info("Not reusing chunks from %s: its storage cannot be opened (%s)", source.describe(), exc)
        return None
    return ChunkReuse.open(source, save_id, source_store, target_store, records)


class Publisher(ABC):
    """How a save becomes visible: each way of publishing is a subclass that owns its
    rules (its docstring gives them): how the coordinator begins the save and how
    every other rank joins it, what is prepared before the writes, what its commit and
    abandon do. A ``PendingCheckpoint`` holds the one its save uses; nothing asks which.

    Attributes:
        holds_resources: the save holds descriptors, locks or claims to let go of when it
            is dropped without a release.
        binds_callers_files: the files the caller wrote into the target before the
            commit are bound by the commit record as external ones.
    """

    holds_resources: ClassVar[bool] = True
    binds_callers_files: ClassVar[bool] = False

    def begin(self, target: Location, options: SaveOptions, save_id: str) -> PendingCheckpoint:
        """Coordinator, the target claimed: checks the target against ``options``, clears
        what dead saves left and returns the pending checkpoint (nothing written yet).
        Deletes nothing that is not provably ours."""
        raise CheckpointingException(
            f"Internal error: a save into {target.describe()} cannot begin with {type(self).__name__}; please report it"
        )

    def join(self, target: Location, intent: SaveIntent, options: SaveOptions) -> PendingCheckpoint:
        """Every rank but the coordinator: the pending checkpoint the coordinator began
        (``options``: the same the coordinator was given)."""
        raise CheckpointingException(
            f"Internal error: a save into {target.describe()} cannot be joined with {type(self).__name__}; please "
            "report it"
        )

    def prepare_writes(self, save: PendingCheckpoint) -> None:
        """Coordinator, before the marker is written: makes the place the writers write
        into (nothing to do where that is the target)."""
        return None

    def mark(self, save: PendingCheckpoint) -> None:
        """Coordinator, once the writers' place is ready: writes the save marker there,
        which proves what is there this save's."""
        _write_marker(save.location, save.intent.save_id)

    @abstractmethod
    def commit(self, save: PendingCheckpoint, record: CommitRecord) -> CommitRecord:
        """Coordinator: writes ``record`` and publishes; returns the record published.

        Raises:
            CheckpointingException: another save committed meanwhile (nothing published).
        """

    @abstractmethod
    def abandon(self, save: PendingCheckpoint) -> None:
        """Coordinator, after a failed save: deletes what ``save`` provably wrote."""


def _write_marker(location: Location, save_id: str, replaces: str | None = None) -> None:
    """Writes the save marker naming ``save_id`` and, for an in-place save about to
    remove the checkpoint it replaces, that checkpoint's save id (``replaces``), which
    proves the marker ours beside that checkpoint's record (``records.own_markers``)."""
    fields = {"save_id": save_id} if replaces is None else {"save_id": save_id, "replaces": replaces}
    location.write_bytes(SAVE_MARKER, json.dumps(fields).encode())


def _remove_own_marker(save: PendingCheckpoint) -> None:
    """Removes the save's marker from the checkpoint it just committed; a failure is
    logged, not raised: the save is committed, and a marker left there names the
    record's save id, so neither ``verify`` nor the next save counts it as another
    program's file (``records.own_markers``), and that save's replacement removes it."""
    try:
        save.target.remove(SAVE_MARKER)
    except OSError as exc:
        logger.warning(
            "Committed %s, but could not remove its save marker %s (harmless: the next save into it removes it): %s",
            save.target.describe(), SAVE_MARKER, exc,
        )


def _lost_race(save: PendingCheckpoint, current: str | None, otherwise: str = "") -> CheckpointingException:
    """The error of a commit that found the target changed: ``current``, the save id of
    the checkpoint committed there now (None: none, but ``otherwise`` found)."""
    expected = f"checkpoint {save.intent.replaces}" if save.intent.replaces else "no checkpoint"
    found = (f"the checkpoint of save {current}: another save committed there while it ran; that checkpoint is "
             "kept" if current is not None else otherwise)
    return CheckpointingException(
        f"Not committing the save into {save.target.describe()}: expected {expected} there, found {found}. "
        "Nothing of it was changed by this save; save this one again (overwrite=True to replace it) or to a new "
        "directory."
    )
