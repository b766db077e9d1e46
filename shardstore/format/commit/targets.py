"""The checks of a target before a save writes anything: what it holds (a committed
checkpoint, another tool's, other programs' files), and what a save into it must refuse
(``_check_target``; every refusal names what is there and what to do). Also
``check_shared``: a store private to a process takes saves from one rank only.
"""

from __future__ import annotations

__all__ = ["check_shared", "committed_save_id"]

import logging

from shardstore.errors import CheckpointingException
from shardstore.format.features import PACKS_DIR
from shardstore.format.records import COMMIT_RECORD, MAX_RECORD_BYTES, CommitRecord, own_markers
from shardstore.format.records.claim_document import is_claim
from shardstore.format.records.reading import (
    other_checkpoint_beside,
    other_checkpoint_files,
    other_checkpoint_kind,
)
from shardstore.stores.base import Location, StorageError

logger = logging.getLogger(__name__)


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


def _committed_record(location: Location, data: bytes | None = None) -> CommitRecord | None:
    """The record at ``location`` (``data``: its bytes as the caller just read them; None:
    read here), or None where there is none."""
    if data is None:
        data = location.read_bytes_or_none(COMMIT_RECORD, max_bytes=MAX_RECORD_BYTES)
    if data is None or is_claim(data):  # nothing, or an in-place save's claim (``format.claims``)
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
    packing: bool = False, record_read: bytes | None = None,
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
    here; on S3 a listing is a request); ``record_read``: the commit record's bytes as
    the caller just read them (None: read here)."""
    _refuse_non_directory(target)
    if target.is_empty() if empty is None else empty:
        return None
    try:
        record = _committed_record(target, record_read)
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


def _committed_id_or_none(location: Location) -> str | None:
    """``committed_save_id``, None also where the record cannot be read."""
    try:
        return committed_save_id(location)
    except (CheckpointingException, OSError):
        return None
