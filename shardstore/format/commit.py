"""How a save becomes a checkpoint, and what a save may delete.

Rules (DESIGN.md, invariants):

* A committed checkpoint stays loadable until its replacement commits (object stores,
  which cannot rename, have a window with ``overwrite=True``: ``InPlace``; so does a
  replacement in a shared directory that other programs' files share with it, which
  sets the old entries aside one by one: ``ByRename._replace_beside``, whose
  interruption the next save or ``restore_replaced`` undoes).
* Two saves into one place cannot both commit; the loser fails with a clear error.
* shardstore deletes only what it can prove one of its own unfinished saves wrote. A
  non-empty target without a commit record (another tool's checkpoint, an experiment
  folder, the leftovers of a shardstore older than this scheme) is refused with an
  error that names what is there.

How a save is published is a ``Publisher``, one class per way, each owning its rules
(its docstring states them): how the save begins and is joined, where its writers
write, what its commit and abandon do.

* ``ByRename`` (local and shared POSIX file systems): a private staging directory next
  to the target, published by one rename or atomic exchange, a compare-and-swap under
  an ``flock``; into a **shared directory** (``SaveOptions.shared_directory``: DCP's
  door, Megatron-LM's iteration) by moving its entries in beside the other files, the
  checkpoint it replaces there (if any) first set aside entry by entry.
* ``InPlace`` (object stores): written at the target, marker first, commit record last.
* ``IntoCallersDirectory`` (a directory Megatron-Core's own ``save`` made and wrote
  into, ``adopt_save``): written in place, the caller's files listed as external,
  nothing there ever deleted.

One is chosen once from the store's capabilities (``publisher_for``) and held by the
``PendingCheckpoint``; nothing asks a location or a publisher which class it is.

**Stores private to a process (``memory://``)** take saves from one rank only
(``check_shared``, on every rank before anything is written), and a save claims its
prefix from begin to release (``Store.claim_for_save``): a concurrent save into it
fails at its begin, before it removes or writes anything.

Entry points: ``begin_save`` (coordinator), ``join_save`` (every other rank),
``adopt_save``, then the ``PendingCheckpoint``'s ``commit`` or ``abandon``
(coordinator). The on-disk rules are in docs/format.md ("Publishing a save"), what
they promise in docs/guide/guarantees.md.
"""

from __future__ import annotations

__all__ = [
    "ByRename", "InPlace", "IntoCallersDirectory", "PendingCheckpoint", "Publisher",
    "SaveIntent", "SaveLocation", "SaveOptions", "adopt_save", "begin_save", "check_shared",
    "join_save", "publisher_for", "restore_replaced",
]

import contextlib
import json
import logging
import os
import threading
import uuid
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypeVar, cast

from shardstore.errors import CheckpointingException
from shardstore.format.chunks import ChunkStore, chunk_store_for
from shardstore.format.claims import PrefixClaim
from shardstore.format.records import (
    COMMIT_RECORD,
    MAX_RECORD_BYTES,
    MOVING_IN,
    PACKS_DIR,
    REPLACED_TAG,
    REPLACING_PHASE,
    SAVE_MARKER,
    SETTING_ASIDE,
    STAGING_TAG,
    ArrayPlaces,
    ArrayRecord,
    CommitRecord,
    ZarrMetadata,
    interrupted_replacement,
    marker_save_id,
    other_checkpoint_beside,
    other_checkpoint_files,
    other_checkpoint_kind,
    own_markers,
    write_commit_record,
)
from shardstore.format.reuse import ChunkReuse, reuse_save_id
from shardstore.format.storage_layout import CALLERS_DIRECTORY_LAYOUT, LayoutSite, StorageLayout
from shardstore.stores.base import Capabilities, DirectoryPublishing, Location, StorageError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def new_save_id() -> str:
    """A fresh save id (32 hex digits): names the staging directory, the commit record's
    ``save_id`` and the marker."""
    return uuid.uuid4().hex


@dataclass(frozen=True, init=False)
class SaveOptions:
    """How a save may treat its target and where it puts its bytes: decided once by the
    door a save comes through (``shardstore.save``'s keywords, the DCP writer,
    ``shardstore.megatron.install``, the manager) and handed whole to the start of the
    save (``SavePipeline.open``).

    Attributes:
        overwrite: a committed shardstore checkpoint there may be replaced (never
            another tool's checkpoint, never other programs' files).
        reuse_from: an earlier checkpoint whose unchanged chunks the save may share
            (``format.reuse``), or None: a path, URL or Location as the caller names it;
            ``SavePipeline.open`` opens it once, so a begun save holds a Location.
        shared_directory: other programs keep files in the target: the save is
            published beside them, deleting or moving none of them (by rename only; in
            place, a non-empty target is refused). Otherwise the target must be empty
            or hold the checkpoint it replaces (docs/guide/guarantees.md).
        layout: where the bytes go (``format.storage_layout.StorageLayout``; its
            ``AUTO`` fields are chosen when the save begins, the same on every rank).
            ``zarr_metadata=`` and ``pack_arrays_up_to=`` are accepted as spellings of
            its fields, and read back from it.
        array_places: internal: where an import of model files (``tools.convert``)
            found arrays whose keys do not spell their places (``records.ArrayPlaces``);
            None for every other save.
    """

    overwrite: bool
    reuse_from: Any
    shared_directory: bool
    layout: StorageLayout
    array_places: ArrayPlaces | None

    def __init__(
        self, overwrite: bool = False, reuse_from: Any = None, shared_directory: bool = False,
        layout: StorageLayout | None = None, array_places: ArrayPlaces | None = None, *,
        zarr_metadata: str | None = None, pack_arrays_up_to: int | None = None,
    ) -> None:
        spelled = {k: v for k, v in (("zarr_metadata", zarr_metadata), ("pack_arrays_up_to", pack_arrays_up_to))
                   if v is not None}
        for name, value in (("overwrite", overwrite), ("reuse_from", reuse_from),
                            ("shared_directory", shared_directory), ("array_places", array_places)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "layout", StorageLayout.of(layout, **spelled))

    @property
    def zarr_metadata(self) -> ZarrMetadata | str:
        """``layout.zarr_metadata`` (``AUTO`` until the save begins)."""
        return self.layout.zarr_metadata

    @property
    def pack_arrays_up_to(self) -> int | str:
        """``layout.pack_arrays_up_to`` (``AUTO`` until the save begins)."""
        return self.layout.pack_arrays_up_to

    @staticmethod
    def resolve(options: SaveOptions | None, keywords: SaveOptions) -> SaveOptions:
        """The options of a call that takes them either as one object (``options``;
        None: not given) or as keywords (``keywords``, built from them): the two
        combined where they do not contradict each other (a keyword at its default
        takes the object's value; ``shardstore.save``, the checkpoint manager).

        Raises:
            CheckpointingException: both set one field to different values, naming it."""
        if options is None:
            return keywords
        default = SaveOptions()
        merged: dict[str, Any] = {}
        for name in ("overwrite", "reuse_from", "shared_directory", "array_places"):
            given, other = getattr(keywords, name), getattr(options, name)
            if given != getattr(default, name) and other != getattr(default, name) and given != other:
                raise CheckpointingException(
                    f"save() was given {name}={given!r} and options={options} with {name}={other!r}: pass one of them"
                )
            merged[name] = given if given != getattr(default, name) else other
        try:
            layout = options.layout.combined(keywords.layout)
        except ValueError as exc:
            raise CheckpointingException(f"save() was given options={options} and layout keywords: {exc}") from None
        return SaveOptions(layout=layout, **merged)

    def chosen_for(self, site: LayoutSite) -> SaveOptions:
        """These options with the layout's ``AUTO`` fields chosen for ``site``."""
        return self if self.layout.chosen else replace(self, layout=self.layout.chosen_for(site))

    def opened(self, opener: Callable[[Any], Location]) -> SaveOptions:
        """These options with ``reuse_from`` opened by ``opener`` (the one place a
        save opens it: ``SavePipeline.open``)."""
        return self if self.reuse_from is None else replace(self, reuse_from=opener(self.reuse_from))


@dataclass(frozen=True)
class SaveIntent:
    """What the coordinator decided when the save began (sent to every rank).

    Attributes:
        save_id: this save's id, also in its commit record.
        replaces: save id of the committed checkpoint this save will replace, or None
            when the target held none.
        reuses: save id of the earlier checkpoint whose unchanged chunks this save
            shares (``format.reuse``), or None.
        layout: where the bytes go, as the coordinator chose it (no ``AUTO`` field):
            every rank writes by it (``join_save``).
        agreed: ``save_id`` is the coordinator's, the same on every rank; False for a
            save id a rank chose alone (a DCP writer whose plan stage did not run).
    """

    save_id: str
    replaces: str | None
    reuses: str | None = None
    layout: StorageLayout = StorageLayout()
    agreed: bool = True

    @property
    def zarr_metadata(self) -> ZarrMetadata:
        return ZarrMetadata(self.layout.zarr_metadata)

    @property
    def pack_arrays_up_to(self) -> int:
        return int(self.layout.pack_arrays_up_to)


def check_shared(target: Location, world_size: int) -> None:
    """Refuses a save by ``world_size`` ranks into a store that processes do not share
    (``Capabilities.shared_across_processes``): each rank would write into its own
    process's copy, and the coordinator would commit a checkpoint that lacks the other
    ranks' chunks. Every rank calls it before the save writes anything (the save
    reports a failure on any rank to all of them); any writer of a multi-rank save
    (``serialization.save``, DCP's storage writer) should.

    Raises:
        CheckpointingException: ``world_size`` > 1 and the store is private to its process.
    """
    if world_size > 1 and not target.capabilities.shared_across_processes:
        raise CheckpointingException(
            f"Cannot save {target.describe()} from {world_size} ranks: that store lives inside one process, "
            "so each rank would write its part into its own copy and no complete checkpoint would exist. "
            "Save to a path on a file system every rank sees, or to s3://bucket/prefix; keep memory:// for "
            "single-process saves."
        )


def committed_save_id(location: Location) -> str | None:
    """The save id of the checkpoint committed at ``location``, or None if there is none.

    Raises:
        CheckpointingException: the root ``zarr.json`` is not a shardstore commit record
            (a foreign Zarr group: never ours to replace).
    """
    record = _committed_record(location)
    return record.save_id if record is not None else None


def _committed_record(location: Location) -> CommitRecord | None:
    data = location.read_bytes_or_none(COMMIT_RECORD, max_bytes=MAX_RECORD_BYTES)
    if data is None:
        return None
    return CommitRecord.from_json(data, where=location.describe(COMMIT_RECORD))


def _refuse_foreign(target: Location) -> None:
    """Refuses a non-empty target that holds no committed checkpoint, naming what is there."""
    found = ", ".join(target.list_top(5))
    other = other_checkpoint_kind(target)
    if other:
        found = f"{other[0]}: {found}"
    raise CheckpointingException(
        f"{target.describe()} is not empty and holds no committed shardstore checkpoint (found {found}); "
        "refusing to delete anything in it. If it is another tool's checkpoint, convert it (`shardstore "
        "convert`); if it is an "
        "interrupted save of an older shardstore, delete it yourself. Otherwise save to an empty or new directory."
    )


def _marker_id(location: Location) -> str | None:
    """The save id in the save marker at ``location`` (``records.marker_save_id``)."""
    return marker_save_id(location, SAVE_MARKER)


def _write_marker(location: Location, save_id: str, replaces: str | None = None) -> None:
    """Writes the save marker naming ``save_id`` and, for an in-place save about to
    remove the checkpoint it replaces, that checkpoint's save id (``replaces``), which
    proves the marker ours beside that checkpoint's record (``records.own_markers``)."""
    fields = {"save_id": save_id} if replaces is None else {"save_id": save_id, "replaces": replaces}
    location.write_bytes(SAVE_MARKER, json.dumps(fields).encode())


def _refuse_other_checkpoint(target: Location, overwrite: bool) -> None:
    """Refuses a target that holds another tool's checkpoint (``records.other_checkpoint_files``:
    DCP's ``.metadata`` and ``*.distcp``, Megatron-Core's torch_dist), naming every file of
    it, ``overwrite`` or not: shardstore never deletes it (nothing there is provably
    ours, and no store replaces some files of a directory atomically), and publishing
    beside it would make a directory of two checkpoints that loads refuse as ambiguous."""
    found = other_checkpoint_files(target)
    if found is None:
        return
    where = target.describe()
    raise CheckpointingException(
        f"{where} holds no committed shardstore checkpoint but {found.title} ({found.listed()}); shardstore never "
        f"deletes another tool's checkpoint{', overwrite=True included' if overwrite else ''}, and a checkpoint "
        "saved beside it would make the directory ambiguous. To replace it, delete those files yourself, then "
        f"save again; to keep it, save to a new directory; to make a shardstore checkpoint of it, `shardstore "
        f"convert {where} NEW_DIR`"
    )


def _refuse_format_names(target: Location) -> None:
    """Refuses a shared directory holding entries under names the checkpoint's format
    keeps for itself (``CommitRecord.refuses_beside``: ``metadata.json``, ``common.pt``,
    ``__objects__``, ``.shardstore*``, a reserved ``__`` name): the checkpoint's own would
    collide with them, or its record could not name them as another program's. Such
    entries are the leftovers of a save that died while it published beside other
    files, or another program's: not provably ours, so never deleted."""
    taken = [name for name in target.list_top(None) if CommitRecord(arrays={}).refuses_beside(name)]
    if taken:
        raise CheckpointingException(
            f"Refusing to save into {target.describe()}: it holds {', '.join(taken[:5])}, names a shardstore "
            "checkpoint keeps for its own entries (the leftovers of an interrupted save, or another program's "
            "files), which are not provably ours to delete. Move them out (or delete them if you know they are "
            "not needed), or save to a new directory"
        )


def _refuse_packs_beside(target: Location, own: frozenset[str]) -> None:
    """Refuses a save that may pack small arrays (``SaveOptions.pack_arrays_up_to``) into
    a shared directory where ``packs`` is another program's entry (not one of ``own``,
    the top-level names of the checkpoint there): the packs go under that name, so the
    save could only fail at its commit, after every rank wrote."""
    if PACKS_DIR in own or PACKS_DIR not in target.list_top(None):
        return
    raise CheckpointingException(
        f"Refusing to save into {target.describe()} with pack_arrays_up_to: it holds {PACKS_DIR}, another "
        f"program's entry, where the save would put its packs of small arrays ({PACKS_DIR}/<rank>-<n>.zip). Move "
        "it out, save without packing (pack_arrays_up_to=0), or save to a new directory"
    )


def _refuse_non_directory(target: Location) -> None:
    """Refuses a local target that exists but is no directory (a regular file, a FIFO):
    listing it reads as empty, so the save would otherwise write everything and fail only
    at the publishing rename, naming its staging directory."""
    path = target.local_path()
    if path is not None and path.exists() and not path.is_dir():
        raise CheckpointingException(
            f"Cannot save into {target.describe()}: it is a file, not a directory. Move or delete that file if it "
            "is not needed, or save to another path"
        )


def _refuse_inside_checkpoint(target: Location) -> None:
    """Refuses a target inside a committed shardstore checkpoint (``ckpt/sub``, or an
    array's directory of it), naming that checkpoint: its record lists none of the new
    save's files, so ``verify`` would report each as unlisted and a save replacing it
    would refuse to delete them. An enclosing directory this process cannot read (an S3
    prefix outside the caller's permissions) is logged and passed over."""
    for store in target.store.enclosing():
        outer = Location(store)
        try:
            committed = committed_save_id(outer) is not None
        except StorageError as exc:
            logger.info("Saving %s: not checking whether %s holds a checkpoint: %s", target.describe(),
                        outer.describe(), exc)
            continue
        except CheckpointingException:  # a Zarr group of another tool: not a checkpoint of ours
            continue
        if committed:
            raise CheckpointingException(
                f"Refusing to save into {target.describe()}: it lies inside the committed checkpoint "
                f"{outer.describe()}, whose record would list none of its files (`shardstore verify` reports them, "
                "and a save replacing that checkpoint refuses to delete them). Save to a directory outside it, or "
                "pass shared_directory=True where files of other programs inside that checkpoint are intended "
                "(as Megatron-LM's ModelOpt state in an iteration is)"
            )


def _check_target(
    target: Location, overwrite: bool, shared_directory: bool = False, empty: bool | None = None,
    packing: bool = False,
) -> str | None:
    """The save id the new save will replace (None: nothing committed there). Refused:
    another tool's checkpoint (``_refuse_other_checkpoint``); any other non-empty
    directory without a commit record unless ``shared_directory`` (then still what
    ``_refuse_format_names`` refuses); a committed checkpoint without ``overwrite``, or
    beside files its save did not write (a replacement by rename would delete them)
    unless ``shared_directory`` and they are top-level entries of their own, which the
    replacement keeps in place (``_refuse_unmovable_beside``); a shared directory
    another program keeps ``packs`` in where the save may pack (``packing``,
    ``_refuse_packs_beside``); and a path that is no directory (``_refuse_non_directory``).
    ``empty``: whether the caller just listed the target empty (None: it is listed
    here; on S3 a listing is a request)."""
    _refuse_non_directory(target)
    if target.is_empty() if empty is None else empty:
        return None
    try:
        record = _committed_record(target)
    except CheckpointingException as exc:
        raise CheckpointingException(f"Refusing to save into {target.describe()}: {exc}") from exc
    if record is None:
        _refuse_other_checkpoint(target, overwrite)
        if not shared_directory or other_checkpoint_kind(target):
            _refuse_foreign(target)
        _refuse_format_names(target)
        if packing:
            _refuse_packs_beside(target, frozenset())
        return None
    if packing and shared_directory:
        _refuse_packs_beside(target, record.own_top_names)
    if not overwrite:
        raise CheckpointingException(
            f"{target.describe()} already holds a committed checkpoint; pass overwrite=True to replace it "
            "(the old one stays loadable until the new one commits), or save to a new directory"
        )
    found = target.list_files()
    others = record.unlisted(found, own_markers(target, record, found))
    if others and shared_directory:
        _refuse_unmovable_beside(target, record, others)
        return record.save_id
    if others:
        raise CheckpointingException(
            f"Refusing to replace the checkpoint at {target.describe()}: it also holds files its save did not "
            f"write ({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}), which replacing it would "
            "delete. Move them out (or delete them if you know they are not needed), or save each checkpoint to "
            "a new directory of its own"
        )
    return record.save_id


def _refuse_unmovable_beside(target: Location, record: CommitRecord, others: list[str]) -> None:
    """Refuses to replace the checkpoint ``record`` commits at ``target``, in a shared
    directory, where ``others`` (the files its save did not write, ``CommitRecord.unlisted``)
    cannot be kept in place while its own entries are set aside
    (``ByRename._replace_beside``): a file inside one of those entries (it would go with
    them), a top-level name the format keeps for its markers that no marker proves ours,
    or another tool's checkpoint (two checkpoints in one directory are ambiguous)."""
    inside = [rel for rel in others if rel.split("/", 1)[0] in record.own_top_names]
    marked = sorted({rel.split("/", 1)[0] for rel in others if rel.startswith(".shardstore")})
    where = target.describe()
    if inside or marked:
        found = (inside or marked)[:5]
        raise CheckpointingException(
            f"Refusing to replace the checkpoint at {where}: it holds {', '.join(found)}"
            f"{', ...' if len(inside or marked) > 5 else ''}, which its save did not write, "
            + ("inside the checkpoint's own entries, which replacing it would delete" if inside else
               "under names shardstore keeps for its markers, which no marker proves ours")
            + ". Move them out (or delete them if you know they are not needed), or save to a new directory; "
            "files of other programs at the top of the directory are kept beside the new checkpoint"
        )
    beside = other_checkpoint_beside(target, record)
    if beside is not None:
        raise CheckpointingException(
            f"Refusing to replace the checkpoint at {where}: the directory also holds {beside.title} "
            f"({beside.listed()}), which shardstore never deletes, and a checkpoint saved beside it would make "
            "the directory ambiguous. Move those files out, or save to a new directory"
        )


# ------------------------------------------------------------------ pending saves


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
        ``publisher`` can prove is this save's)."""
        try:
            self.publisher.abandon(self)
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


def _remove_dir(directory: DirectoryPublishing | None, proof: str) -> None:
    """Deletes a directory this save owns (``_remove_proven``); a failure is logged, not
    raised: the save's outcome is already decided and the next save removes what is left."""
    if directory is None:
        return
    try:
        _remove_proven(directory, proof)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("Could not remove %s (the next save into the same place will): %s", directory.describe(), exc)


def _remove_proven(directory: DirectoryPublishing, proof: str) -> None:
    """Deletes a directory of ours, the file that proves it ours (``proof``: its save's
    marker, or the commit record of a checkpoint set aside) last: an interruption leaves
    what is left still proven ours, for ``remove_dead_saves`` to remove."""
    Location(directory).remove_tree("", keep=(proof,))
    directory.remove_directory()


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


# ------------------------------------------------------------------ publishers


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


class ByRename(Publisher):
    """A private staging directory next to the target, published by one rename (or an
    atomic exchange with the checkpoint it replaces): local and shared POSIX file
    systems.

    A save never writes into the directory it may replace. The coordinator creates
    ``<parent>/.<name>.shardstore-save-<save id>``, holding an ``flock`` on it while the
    save runs and a marker file (``.shardstore-save.json``) naming the save id. Every
    rank writes there; the commit record is written there last; then one rename
    publishes it:

    * target missing, or an empty directory: ``rename(2)`` (atomic);
    * target a committed shardstore checkpoint and ``overwrite=True``: ``renameat2``
      with ``RENAME_EXCHANGE`` swaps the directories atomically, then the old one is
      renamed aside (``.<name>.shardstore-replaced-<its save id>``) and deleted; where
      the file system cannot exchange, the old one is renamed aside first.

    Publishing is a compare-and-swap under an ``flock`` on the parent directory: the
    target must still hold the checkpoint the save saw when it began (same save id), or
    still nothing; otherwise another save committed meanwhile, and this one fails. A
    staging directory whose marker matches its name and whose lock is free belongs to a
    save that died: the next save into the same target deletes it (``remove_dead_saves``).

    A save into a shared directory (``SaveOptions.shared_directory``) is published
    beside the other programs' files by moving its entries in, the commit record last; a
    checkpoint there is replaced entry by entry (``_replace_beside``), which an
    interruption leaves for the next save to put back (``restore_replaced``). The rules
    in full: docs/format.md ("Publishing").
    """


    def begin(self, target: Location, options: SaveOptions, save_id: str) -> PendingCheckpoint:
        directory = _directory(target).resolved()
        target = Location(directory)
        restore_replaced(target)  # before the dead saves go: an interrupted one's staging may hold new entries
        remove_dead_saves(directory)
        replaces = _check_target(target, options.overwrite, options.shared_directory,
                                 packing=options.pack_arrays_up_to > 0)
        source = options.reuse_from
        reuses = reuse_save_id(source, target, in_place=False) if source is not None else None
        intent = SaveIntent(save_id, replaces, reuses, options.layout)
        tops = frozenset(target.list_top(None))
        return PendingCheckpoint(target, _staging_for(directory, save_id), intent, self, options, tops)

    def join(self, target: Location, intent: SaveIntent, options: SaveOptions) -> PendingCheckpoint:
        directory = _directory(target).resolved()
        staging = _staging_for(directory, intent.save_id)
        _require_coordinators_staging(staging, intent.save_id, target)
        return PendingCheckpoint(Location(directory), staging, intent, self, options)

    def prepare_writes(self, save: PendingCheckpoint) -> None:
        save.location.prepare()
        save.hold_staging_lock()

    def abandon(self, save: PendingCheckpoint) -> None:
        try:
            replacing = interrupted_replacement(save.target)
        except OSError:
            replacing = None
        if replacing is not None and replacing[0] == save.intent.save_id and not save.target.exists(COMMIT_RECORD):
            # a replacement beside other files that could not put the old checkpoint back: new entries
            # still in the target are told from others by what the staging directory no longer holds
            logger.warning("Keeping %s for putting back the checkpoint it was replacing at %s",
                           save.location.store.describe(), save.target.describe())
            return
        _remove_dir(save.location.store.publishing(), SAVE_MARKER)

    def commit(self, save: PendingCheckpoint, record: CommitRecord) -> CommitRecord:
        staging, target = save.location.store.publishing(), save.target.store.publishing()
        assert staging is not None and target is not None  # begin staged apart only for these
        save.location.write_atomic(COMMIT_RECORD, record.to_json())
        replaced: DirectoryPublishing | None = None
        emptied: DirectoryPublishing | None = None  # the staging directory, where its entries moved out one by one
        with target.parent_locked():
            empty = save.target.is_empty()
            old = None if empty else _committed_record(save.target)
            current = old.save_id if old is not None else None
            if current != save.intent.replaces or (not empty and current is None and not save.options.shared_directory):
                raise _lost_race(save, current, "files of a directory that is not a checkpoint")
            if current is None and not empty:
                return self._publish_beside(save, staging, target, record)
            theirs = _entries_beside(save.target, old) if old is not None and save.options.shared_directory else None
            if old is not None and theirs:
                record, replaced = self._replace_beside(save, staging, target, old, record, theirs)
                emptied = staging
            else:
                if old is not None:
                    self._refuse_added_entries(save, old)
                replaced = self._rename_whole(staging, target, current)
            target.fsync_parent()
        _remove_own_marker(save)
        _remove_dir(emptied, SAVE_MARKER)
        _remove_dir(replaced, COMMIT_RECORD)
        return record

    @staticmethod
    def _rename_whole(
        staging: DirectoryPublishing, target: DirectoryPublishing, current: str | None
    ) -> DirectoryPublishing | None:
        """Publishes the staging directory onto ``target`` by one rename, or by an atomic
        exchange with the checkpoint ``current`` committed there (where the storage cannot
        exchange: two renames, ``_rename_or_put_back``). Returns where that checkpoint
        was set aside (None: there was none). Under the parent's lock."""
        if current is None:
            staging.rename_to(target, exchange=False)
            return None
        if staging.rename_to(target, exchange=True):
            return _set_aside(staging, target, current)  # the old checkpoint was at the staging path
        replaced = target.sibling(f".{target.name}{REPLACED_TAG}{current}")
        target.rename_to(replaced, exchange=False)
        _rename_or_put_back(staging, target, replaced)
        return replaced

    @staticmethod
    def _refuse_added_entries(save: PendingCheckpoint, old: CommitRecord) -> None:
        """Before the checkpoint this save replaces goes (under the parent's lock): a
        top-level entry its save did not write, added since this save began checked it
        (``_check_target``), is another program's, which replacing would delete: the save
        loses instead, changing nothing. One directory read; a file added deeper, inside
        one of its arrays, is not looked for here. ``old``: its commit record."""
        added = sorted(set(save.target.list_top(None)) - old.own_top_names - save.tops_at_begin)
        if added:
            raise CheckpointingException(
                f"Not committing the save into {save.target.describe()}: another program wrote "
                f"{', '.join(added[:5])} into the checkpoint it replaces while it ran, which replacing it would "
                "delete. Nothing there was changed; move them out, or save to a new directory"
            )

    @staticmethod
    def _publish_beside(
        save: PendingCheckpoint, staging: DirectoryPublishing, target: DirectoryPublishing, record: CommitRecord
    ) -> CommitRecord:
        """The target, shared with other programs (``SaveOptions.shared_directory``),
        holds files they put there before the save began (a job's log, the ``model.pt``
        ``torch_save_to_dcp`` converts) or while it ran (Megatron-LM writes ModelOpt's
        state into the iteration's directory right after ``dist_checkpointing.save``
        returns, while an async save still writes): they are kept, not ours to move or
        delete, and the save's entries are moved in beside them, the commit record last
        (until then the directory is no checkpoint). A name both hold, or another tool's
        checkpoint written there meanwhile (``_refuse_other_checkpoint``), fails the
        save, naming it; a rename that fails part way moves the entries already moved
        back (``_take_back_moved``), while a crash part way leaves a directory that
        later saves refuse to touch (``_refuse_foreign`` names what is there). The commit record is written again naming their top-level entries
        (``CommitRecord.beside``): it does not vouch for them, and ``verify`` names them
        as another program's, not as damage; a name the record cannot carry (one of the
        format's own, an invalid key) is left out, and ``verify`` flags what lies under
        it. Returns that record."""
        try:
            _refuse_other_checkpoint(save.target, overwrite=False)
        except CheckpointingException as exc:
            raise CheckpointingException(f"Not committing the save (it was written there while it ran): {exc}") from exc
        theirs = set(save.target.list_top(None))
        ours = [name for name in save.location.list_top(None) if name not in (COMMIT_RECORD, SAVE_MARKER)]
        clash = sorted(theirs & {*ours, COMMIT_RECORD, SAVE_MARKER})
        if clash:
            raise _taken_names(save, clash)
        added = sorted(theirs - save.tops_at_begin)
        if added:
            logger.warning(
                "%s received %s from another program while the save ran; they are kept beside the checkpoint "
                "(its commit record does not vouch for them)", save.target.describe(), ", ".join(added[:5]),
            )
        record = replace(record, beside=tuple(sorted(n for n in theirs if record.refuses_beside(n) is None)))
        save.location.write_atomic(COMMIT_RECORD, record.to_json())
        try:
            staging.move_entries_into(target, ours)
            staging.move_entries_into(target, [COMMIT_RECORD])
        except BaseException as exc:
            if _committed_id_or_none(save.target) != save.intent.save_id:
                _take_back_moved(save, staging, target, ours, exc)
            raise
        _remove_dir(staging, SAVE_MARKER)
        return record


    @staticmethod
    def _replace_beside(
        save: PendingCheckpoint, staging: DirectoryPublishing, target: DirectoryPublishing, old: CommitRecord,
        record: CommitRecord, theirs: set[str],
    ) -> tuple[CommitRecord, DirectoryPublishing]:
        """Replaces the checkpoint ``old`` commits at ``target``, a shared directory
        (``SaveOptions.shared_directory``) that also holds other programs' top-level
        entries (``theirs``: ModelOpt's ``modelopt_state/`` in a Megatron-LM iteration
        saved again), which stay where they are: only the old checkpoint's own entries
        move, entry by entry, under the parent's lock. Returns the record published (its
        ``beside`` names ``theirs``) and the directory the old checkpoint was set aside to
        (``.<name>.shardstore-replaced-<its save id>``), for the caller to delete.

        The steps, and what a crash after each leaves (the target T, the replaced
        directory A, the staging directory S):

        1. The new record, naming ``theirs``, is written in S; T's marker then names this
           save, the old one's id and the phase ``SETTING_ASIDE``. T is still the old
           checkpoint (the marker is its own: ``records.own_markers``).
        2. A is made and the old record moved into it: from here T holds no committed
           checkpoint (the window that ``docs/guide/guarantees.md`` states), and A's
           record proves A ours. The old entries follow, one rename each.
        3. The marker's phase becomes ``MOVING_IN`` (A holds the whole old checkpoint);
           the new entries move from S into T, then the new record: committed.

        A crash in the window leaves T without a record, its marker naming both saves
        and the phase: the next save into T (``remove_dead_saves``, under the same lock),
        ``shardstore restore``, or this save's own failure handling puts the old
        checkpoint back (``_put_back``), the new entries returning to S first, which is
        then a dead save's staging directory. Nothing of ``theirs`` is ever moved."""
        where, save_id = save.target, save.intent.save_id
        ours = [name for name in save.location.list_top(None) if name not in (COMMIT_RECORD, SAVE_MARKER)]
        clash = sorted(theirs & set(ours))
        if clash:
            raise _taken_names(save, clash)
        try:
            _refuse_unmovable_beside(where, old, sorted(theirs))
        except CheckpointingException as exc:
            raise CheckpointingException(f"Not committing the save (they were written there while it ran): {exc}") from exc
        aside = target.sibling(f".{target.name}{REPLACED_TAG}{old.save_id}")
        if not Location(aside).is_empty():
            raise CheckpointingException(
                f"Not committing the save into {where.describe()}: {aside.describe()}, where it would set the "
                "checkpoint it replaces aside, already exists and is not a checkpoint of ours. Nothing there was "
                "changed; move that directory away (or delete it if you know it is not needed), then save again"
            )
        added = sorted(theirs - save.tops_at_begin)
        if added:
            logger.warning(
                "%s received %s from another program while the save ran; they are kept beside the checkpoint "
                "(its commit record does not vouch for them)", where.describe(), ", ".join(added[:5]),
            )
        record = replace(record, beside=tuple(sorted(n for n in theirs if record.refuses_beside(n) is None)))
        save.location.write_atomic(COMMIT_RECORD, record.to_json())
        olds = sorted(set(where.list_top(None)) - theirs - {COMMIT_RECORD, SAVE_MARKER})
        _mark_replacing(where, save_id, old.save_id, SETTING_ASIDE)
        try:
            Location(aside).prepare()
            aside.fsync_parent()
            target.move_entries_into(aside, [COMMIT_RECORD])  # the window opens: T is no checkpoint
            target.move_entries_into(aside, olds)
            _mark_replacing(where, save_id, old.save_id, MOVING_IN)
            staging.move_entries_into(target, ours)
            staging.move_entries_into(target, [COMMIT_RECORD])  # committed: the window closes
        except BaseException as exc:
            if _committed_id_or_none(where) != save_id:
                try:
                    _put_back(target, staging, aside, old.save_id)
                except BaseException as back:
                    exc.add_note(
                        f"The checkpoint it replaced could not be put back ({back}); its record and the entries "
                        f"moved so far are in {aside.describe()}. The next save into {where.describe()} puts it "
                        f"back, or run `shardstore restore {where.describe()}`"
                    )
            raise
        logger.info("Replaced the checkpoint at %s beside %s", where.describe(), ", ".join(sorted(theirs)[:5]))
        return record, aside


def _take_back_moved(
    save: PendingCheckpoint, staging: DirectoryPublishing, target: DirectoryPublishing, ours: list[str],
    failure: BaseException,
) -> None:
    """Moves the entries a save publishing beside other programs' files
    (``ByRename._publish_beside``) had moved into ``target`` before a rename failed back
    into its ``staging`` directory, before the failure is raised: ``target`` then holds
    their files only, as before the save, and its abandon removes the staging directory
    whole (left in ``target`` without a record, no later save could prove them ours).
    Ours: the names of ``ours`` that ``target`` holds and ``staging`` no longer does (no
    name of ``ours`` was in ``target`` when the moves began). Under the parent's lock.
    A move back that fails is added to ``failure``'s notes, naming what is left."""
    present, left = set(save.target.list_top(None)), set(save.location.list_top(None))
    moved = sorted(name for name in ours if name in present and name not in left)
    try:
        target.move_entries_into(staging, moved)
    except OSError as back:
        failure.add_note(
            f"The entries it had moved into {save.target.describe()} could not be moved back ({back}): "
            f"{', '.join(moved)} there are this failed save's; delete them, then save again"
        )


def _entries_beside(target: Location, old: CommitRecord) -> set[str]:
    """The top-level names at ``target`` that are not the entries of the checkpoint
    ``old`` commits there, nor markers proven its own: other programs'."""
    present = target.list_top(None)
    return set(present) - old.own_top_names - own_markers(target, old, present)


def _committed_id_or_none(location: Location) -> str | None:
    """``committed_save_id``, None also where the record cannot be read."""
    try:
        return committed_save_id(location)
    except (CheckpointingException, OSError):
        return None


def _mark_replacing(target: Location, save_id: str, replaces: str, phase: str) -> None:
    """Writes (atomically) the marker of the save ``save_id`` replacing the checkpoint
    ``replaces`` in a shared directory, in ``phase`` (``records.interrupted_replacement``)."""
    fields = {"save_id": save_id, "replaces": replaces, REPLACING_PHASE: phase}
    target.write_atomic(SAVE_MARKER, json.dumps(fields).encode())


def _put_back(
    target: DirectoryPublishing, staging: DirectoryPublishing, aside: DirectoryPublishing, replaces: str
) -> None:
    """Undoes a replacement in a shared directory (``ByRename._replace_beside``) that did
    not commit: the new entries it moved into ``target`` go back to ``staging`` (those its
    staged record vouches for that ``target`` holds and ``staging`` no longer does), then
    the entries of the checkpoint ``replaces`` go back from ``aside``, its record last,
    and the marker and the emptied ``aside`` go. Under the parent's lock; each step can
    be repeated after a crash (the marker's phase says whether new entries moved in).

    Raises:
        CheckpointingException: an entry of the old checkpoint cannot go back, as
            ``target`` holds that name (written there meanwhile): named, nothing moved.
        OSError: a rename failed."""
    where = Location(target)
    replacing = interrupted_replacement(where)
    if replacing is not None and replacing[2] == MOVING_IN:
        staged = _committed_record(Location(staging))
        if staged is not None:
            left = set(Location(staging).list_top(None))
            present = set(where.list_top(None))
            written = {rel.split("/", 1)[0] for rel in staged.vouched_paths()} - {COMMIT_RECORD}
            target.move_entries_into(staging, sorted((written & present) - left))
        _mark_replacing(where, replacing[0], replaces, SETTING_ASIDE)
    entries = [name for name in Location(aside).list_top(None) if name != COMMIT_RECORD]
    taken = sorted(set(entries) & set(where.list_top(None)))
    if taken:
        raise CheckpointingException(
            f"Cannot put back the checkpoint set aside in {aside.describe()}: {where.describe()} now holds "
            f"{', '.join(taken[:5])}, which are not its. Move those out of {where.describe()}, then save again "
            f"(or run `shardstore restore {where.describe()}`)"
        )
    aside.move_entries_into(target, entries)
    if Location(aside).exists(COMMIT_RECORD):
        aside.move_entries_into(target, [COMMIT_RECORD])  # the old checkpoint is loadable again
    target.fsync_parent()
    _remove_if_empty(aside)
    with contextlib.suppress(OSError):
        where.remove(SAVE_MARKER)  # left, it names the checkpoint it replaced: its own (records.own_markers)


def _remove_if_empty(directory: DirectoryPublishing) -> bool:
    """Removes ``directory`` if it holds nothing (``rmdir``: never a file that appears
    meanwhile); True where it did."""
    path = directory.local_path()
    if path is None:
        return False
    try:
        os.rmdir(path)
    except OSError:
        return False
    return True


def restore_replaced(target: Location) -> bool:
    """Puts back the checkpoint that a replacement in a shared directory had begun to
    set aside when it was interrupted (``ByRename._replace_beside``), if ``target`` holds
    such an interrupted replacement; the next save into ``target`` does it first, and
    ``shardstore restore`` calls it. Proven before anything moves: ``target`` has no
    commit record, its marker names that save, the checkpoint it replaced and the phase,
    ``.<name>.shardstore-replaced-<that id>`` holds that checkpoint's record, and the
    interrupted save's staging directory (needed once new entries moved in) is marked
    as its own and no longer locked. Other programs' files are never moved. Returns
    whether it put a checkpoint back.

    Raises:
        CheckpointingException: it is such a replacement but cannot be put back (named)."""
    directory = target.store.publishing()
    if directory is None:
        return False
    directory = directory.resolved()
    where = Location(directory)
    path = directory.local_path()
    if path is None or not path.is_dir() or not where.exists(SAVE_MARKER):
        return False  # the common case, without taking the parent's lock
    with directory.parent_locked():
        replacing = interrupted_replacement(where)
        if replacing is None or where.exists(COMMIT_RECORD):
            return False
        save_id, replaces, phase = replacing
        aside = directory.sibling(f".{directory.name}{REPLACED_TAG}{replaces}")
        staging = directory.sibling(f".{directory.name}{STAGING_TAG}{save_id}")
        if _committed_id_or_none(Location(aside)) != replaces:
            raise CheckpointingException(
                f"{where.describe()} holds the marker of save {save_id}, which was replacing the checkpoint there "
                f"beside other programs' files, but {aside.describe()} holds no record of checkpoint {replaces}: "
                "not provably ours, so nothing was moved. Look there and in the hidden directories next to it"
            )
        fd = None
        if _marker_id(Location(staging)) == save_id:
            fd = staging.hold_lock()
            if fd is None:
                return False  # that save is still running (a file system without flock on the parent)
        elif phase == MOVING_IN:
            raise CheckpointingException(
                f"Cannot put back the checkpoint set aside in {aside.describe()}: the new entries in "
                f"{where.describe()} cannot be told from others, as the staging directory {staging.describe()} "
                "of the save that moved them in is gone. Nothing was moved"
            )
        try:
            _put_back(directory, staging, aside, replaces)
        finally:
            if fd is not None:
                os.close(fd)
    logger.warning(
        "Put back the checkpoint at %s (save %s) that save %s, interrupted while it replaced it beside other "
        "programs' files, had set aside in %s", where.describe(), replaces, save_id, aside.describe(),
    )
    return True


def _rename_or_put_back(
    staging: DirectoryPublishing, target: DirectoryPublishing, replaced: DirectoryPublishing
) -> None:
    """The second rename of a replacement without exchange: ``staging`` onto ``target``,
    whose checkpoint the first moved to ``replaced``. If it fails, that checkpoint is
    renamed back before the failure is raised, so the save fails with the old checkpoint
    loadable where it was (the next save would otherwise delete it as replaced)."""
    try:
        staging.rename_to(target, exchange=False)
    except BaseException as exc:
        try:
            replaced.rename_to(target, exchange=False)
        except OSError as back:
            exc.add_note(
                f"The checkpoint it replaced could not be put back ({back}); it is complete at "
                f"{replaced.describe()}: rename it to {target.describe()} to load it"
            )
        raise


def _set_aside(old: DirectoryPublishing, target: DirectoryPublishing, save_id: str) -> DirectoryPublishing:
    """Moves the checkpoint an exchange left at the staging path (``old``, committed by
    ``save_id``) to ``.<name>.shardstore-replaced-<save_id>``, the name whose commit record
    proves it ours to the next save (``remove_dead_saves``), which removes one left at the
    staging path too (``_left_by_an_exchange``). Under the parent's lock. Returns where it
    is now; a failed rename is logged (it stays where it was)."""
    aside = target.sibling(f".{target.name}{REPLACED_TAG}{save_id}")
    try:
        old.rename_to(aside, exchange=False)
    except OSError as exc:
        logger.warning(
            "Could not move the checkpoint %s replaced to %s (%s); it stays at %s, which the next save into %s "
            "removes", target.describe(), aside.describe(), exc, old.describe(), target.describe(),
        )
        return old
    return aside


def _taken_names(save: PendingCheckpoint, clash: list[str]) -> CheckpointingException:
    """The error of a save into a shared directory whose entries' names ``clash`` with
    what another program put there, before the save began or while it ran."""
    names, where = ", ".join(clash[:5]), save.target.describe()
    if set(clash) <= save.tops_at_begin:
        return CheckpointingException(
            f"Not committing the save into {where}: it already held {names}, which the checkpoint's own entries "
            "would replace. Nothing there was changed; rename those keys of the state dict, move the files out, "
            "or save to a new directory"
        )
    return CheckpointingException(
        f"Not committing the save into {where}: another program wrote {names} there while it ran. Nothing there "
        "was changed; save again to an empty or new directory"
    )


class InPlace(Publisher):
    """Written at the target itself, commit record last (one atomic PUT): object stores
    and any store that cannot rename a directory.

    The save first claims the prefix (``format.claims.PrefixClaim``): its marker,
    written only where none is and renewed while it runs. A running save's claim refuses
    every other save before it changes anything; a dead save's is taken over, and what
    that save left is removed. With ``overwrite=True`` the save names the checkpoint it
    replaces in its marker, deletes the old commit record, then the rest, so from then
    until the new commit the prefix holds no loadable checkpoint (save each step to a
    new prefix to avoid that window). The commit checks that the claim is still held,
    writes the commit record only where none is, then removes the marker.

    Attributes:
        claim: the coordinator's claim (None on the other ranks).
    """

    def __init__(self, claim: PrefixClaim | None = None) -> None:
        self.claim = claim

    def begin(self, target: Location, options: SaveOptions, save_id: str) -> PendingCheckpoint:
        target.prepare()
        claim, dead = PrefixClaim.take(target, save_id)
        removing = False
        try:
            tops = [name for name in target.list_top(None) if name != SAVE_MARKER]
            if dead is not None and tops and COMMIT_RECORD not in tops:
                logger.warning("Removing the leftovers of an interrupted save at %s: %s", target.describe(),
                               dead.describe())
                removing = True
                target.remove_tree("", keep=(SAVE_MARKER,))
                tops = []
            if COMMIT_RECORD in tops and options.overwrite:
                _name_replaced(claim, target)
            replaces = _check_target(target, options.overwrite, empty=not tops)
            source = options.reuse_from
            reuses = reuse_save_id(source, target, in_place=True) if source is not None else None
            if replaces is not None:
                removing = True  # what an interrupted removal leaves stays marked
                target.remove(COMMIT_RECORD)  # the documented window on object stores starts here
                target.remove_tree("", keep=(SAVE_MARKER,))
        except BaseException:
            claim.stop()
            if not removing:
                _give_up_claim(claim)
            raise
        intent = SaveIntent(save_id, replaces, reuses, options.layout)
        pending = PendingCheckpoint(target, target, intent, InPlace(claim), options)
        pending.hold_until_released(claim.stop)
        return pending

    def join(self, target: Location, intent: SaveIntent, options: SaveOptions) -> PendingCheckpoint:
        return PendingCheckpoint(target, target, intent, self, options)

    def mark(self, save: PendingCheckpoint) -> None:
        return None  # the claim is the marker

    def commit(self, save: PendingCheckpoint, record: CommitRecord) -> CommitRecord:
        claim = self._coordinators_claim(save)
        claim.ensure_held()
        if claim.writes.put_if_absent(COMMIT_RECORD, record.to_json()) is None:
            raise _lost_race(save, committed_save_id(save.target))
        _remove_own_marker(save)
        return record

    def abandon(self, save: PendingCheckpoint) -> None:
        claim = self._coordinators_claim(save)
        claim.stop()
        if not claim.owns_marker():
            logger.warning("Abandoning the save into %s: its save marker is no longer its own (another save took "
                           "the prefix over); removed nothing", save.describe())
        elif committed_save_id(save.target) is None:
            _remove_marked(save.target)

    def _coordinators_claim(self, save: PendingCheckpoint) -> PrefixClaim:
        if self.claim is None:
            raise CheckpointingException(
                f"Internal error: the save into {save.describe()} is committed or abandoned by a rank that did not "
                "begin it; please report it"
            )
        return self.claim


def _give_up_claim(claim: PrefixClaim) -> None:
    """Removes the marker of a save that failed before it removed or wrote anything, so
    that the next save need not wait a lease; a failure to is logged (the claim then
    lapses a lease later), the save's own error being the one raised."""
    try:
        if claim.owns_marker():
            claim.target.remove(SAVE_MARKER)
    except OSError as exc:
        logger.warning("Could not remove the save marker of %s (the next save takes it over a lease later): %s",
                       claim.target.describe(SAVE_MARKER), exc)


def _name_replaced(claim: PrefixClaim, target: Location) -> None:
    """Names the committed checkpoint at ``target`` in ``claim``'s marker, where it is a
    shardstore checkpoint (``_check_target`` refuses any other)."""
    try:
        replaces = committed_save_id(target)
    except CheckpointingException:
        return
    if replaces is not None:
        claim.mark_replacing(replaces)


def _remove_marked(target: Location) -> None:
    """Removes a save's objects in place, its marker last: an interruption at any point
    leaves what is left still marked (the next save removes it), never objects that no
    later save can prove ours."""
    target.remove_tree("", keep=(SAVE_MARKER,))
    target.remove(SAVE_MARKER)


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


def publisher_for(capabilities: Capabilities) -> Publisher:
    """The publisher of a save into a store with ``capabilities``: by rename where whole
    directories move atomically, else in place."""
    return ByRename() if capabilities.supports_rename else InPlace()


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


def begin_save(target: Location, options: SaveOptions) -> PendingCheckpoint:
    """Coordinator: checks the target against ``options``, clears dead saves' leftovers,
    creates the staging area with its marker. Raises a CheckpointingException instead of
    deleting anything that is not provably ours. ``options.reuse_from`` (opened) is
    checked here, before an in-place save on an object store removes anything;
    ``options.shared_directory``: other programs' files there, already or written while
    the save runs, are kept and the checkpoint published beside them
    (``ByRename._publish_beside``). The target's store is claimed for the save first
    (``Store.claim_for_save``), until the save is released."""
    options = options.chosen_for(LayoutSite.of(target.capabilities, 1, can_exchange=False))
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


def _directory(target: Location) -> DirectoryPublishing:
    """``target``'s store as a directory that publishes by rename (its capabilities said so)."""
    directory = target.store.publishing()
    if directory is None:
        raise CheckpointingException(
            f"Internal error: {target.describe()} claims supports_rename but cannot publish by rename; please report it"
        )
    return directory


def adopt_save(location: Location, layout: StorageLayout | None = None, world_size: int = 1) -> PendingCheckpoint:
    """The save that writes into ``location``: the pending checkpoint whose
    ``location`` it is (``SaveLocation.save``: this process began or joined that save,
    ``begin_save``, ``join_save``), else ``location`` as a
    directory the caller made (``IntoCallersDirectory``: Megatron-Core's ``save`` and the
    seed's strategy API called directly), with a fresh save id, written by ``layout``
    (a strategy's) in ``CALLERS_DIRECTORY_LAYOUT``'s documents, chosen for ``world_size``
    ranks."""
    found = location.save if isinstance(location, SaveLocation) else None
    if found is not None:
        return found
    site = LayoutSite.of(location.capabilities, world_size)
    chosen = CALLERS_DIRECTORY_LAYOUT.combined(layout or StorageLayout()).chosen_for(site)
    intent = SaveIntent(new_save_id(), None, layout=chosen, agreed=False)
    return PendingCheckpoint(location, location, intent, IntoCallersDirectory(), SaveOptions(layout=chosen))


def _staging_for(target: DirectoryPublishing, save_id: str) -> Location:
    """The staging directory of the save ``save_id`` into ``target`` (links resolved)."""
    return Location(target.sibling(f".{target.name}{STAGING_TAG}{save_id}"))


def _require_coordinators_staging(staging: Location, save_id: str, target: Location) -> None:
    """A joining rank sees the staging directory the coordinator made, its marker naming
    the save: on a path that is each node's own disk it sees none, and its chunks would
    go where the commit never looks, into a checkpoint committed without them.

    Raises:
        CheckpointingException: naming the staging directory, the checkpoint and what to do.
    """
    if _marker_id(staging) != save_id:
        raise CheckpointingException(
            f"This rank does not see {staging.describe()}, the staging directory the coordinator made for the save "
            f"into {target.describe()}: every rank of a save must write into one file system they share (a path on "
            "each node's own disk is another directory on each node, and the checkpoint would lack their chunks); "
            "save to a shared file system or to object storage"
        )


def _holds_committed(target: DirectoryPublishing) -> bool:
    """Whether ``target`` holds a committed shardstore checkpoint (a foreign Zarr group
    there does not count)."""
    try:
        return committed_save_id(Location(target)) is not None
    except CheckpointingException:
        return False


def _removed_leftover(candidate: DirectoryPublishing, proof: str) -> bool:
    """Removes a leftover proven ours (``_remove_proven``); False, logged, where it cannot
    be: a leftover that stays (a file held open on NFS, a read-only subdirectory) must
    not fail the save that found it."""
    try:
        _remove_proven(candidate, proof)
    except OSError as exc:
        logger.warning("Could not remove %s, the leftover of an interrupted save (%s); delete it yourself",
                       candidate.describe(), exc)
        return False
    return True


def _left_by_an_exchange(candidate: DirectoryPublishing, target: DirectoryPublishing, save_id: str) -> bool:
    """Whether the staging directory ``candidate`` of save ``save_id`` holds the checkpoint
    that save's exchange replaced (``ByRename._rename_whole``), left there by a crash
    before it moved on to its replaced name (``_set_aside``): ``target`` commits
    ``save_id`` (the exchange happened) and ``candidate`` holds a commit record of
    another save (that checkpoint's, proving it ours)."""
    if _committed_id_or_none(Location(target)) != save_id:
        return False
    return _committed_id_or_none(Location(candidate)) not in (None, save_id)


def _removed_if_empty_and_free(candidate: DirectoryPublishing) -> bool:
    """Removes the staging directory ``candidate``, without a marker, where it holds
    nothing and its lock is free: a save killed between making it and writing its marker
    (``_begin_claimed``), or after its marker went while it was removed
    (``_remove_proven``). ``rmdir`` never removes a file, so nothing but the empty
    directory can go; a running save holds the lock from before its marker is written
    (``ByRename.prepare_writes``). True where it was removed."""
    path = candidate.local_path()
    if path is None or path.is_symlink() or not path.is_dir() or any(path.iterdir()):
        return False
    fd = candidate.hold_lock()
    if fd is None:
        return False  # a save that is still running
    try:
        return _remove_if_empty(candidate)
    finally:
        os.close(fd)


def remove_dead_saves(target: DirectoryPublishing) -> list[str]:
    """Deletes the staging directories of saves into ``target`` that died, and old
    checkpoints left aside by an interrupted replacement. Only what is provably ours:
    a staging directory whose marker names the save id in its name and whose lock is
    free, or that holds the checkpoint its save's exchange replaced
    (``_left_by_an_exchange``), or that is empty with its lock free
    (``_removed_if_empty_and_free``); a replaced directory whose commit record carries the id
    in its name, and only once ``target`` holds a committed checkpoint: until then it is
    the last checkpoint there (a replacement without exchange that died between its two
    renames), kept and named in the log."""
    removed = []
    for name in target.siblings(f".{target.name}{STAGING_TAG}"):
        save_id = name.rsplit(STAGING_TAG, 1)[1]
        candidate = target.sibling(name)
        if _marker_id(Location(candidate)) != save_id:
            if _left_by_an_exchange(candidate, target, save_id) and _removed_leftover(candidate, COMMIT_RECORD):
                removed.append(name)
            elif _removed_if_empty_and_free(candidate):
                removed.append(name)
            continue
        fd = candidate.hold_lock()
        if fd is None:
            continue  # a save that is still running
        try:
            if _removed_leftover(candidate, SAVE_MARKER):
                removed.append(name)
        finally:
            os.close(fd)
    replaced = target.siblings(f".{target.name}{REPLACED_TAG}")
    replaced_by_one = bool(replaced) and _holds_committed(target)
    for name in replaced:
        candidate = target.sibling(name)
        if _remove_if_empty(candidate):  # made by a replacement beside other files that died before its first move
            removed.append(name)
            continue
        try:
            if committed_save_id(Location(candidate)) != name.rsplit(REPLACED_TAG, 1)[1]:
                continue
        except CheckpointingException:
            continue
        if not replaced_by_one:
            logger.warning(
                "Keeping %s: a complete checkpoint set aside by a replacement that did not publish, and %s holds "
                "no committed checkpoint; rename it back to load it", candidate.describe(), target.describe(),
            )
            continue
        if _removed_leftover(candidate, COMMIT_RECORD):
            removed.append(name)
    if removed:
        logger.warning("Removed the leftovers of interrupted saves next to %s: %s", target.describe(), removed)
    return removed
