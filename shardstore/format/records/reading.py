"""What a location holds where a checkpoint is looked for: its commit record read
(``read_commit_record``, ``is_committed``); without one, an error that says what is there
instead: nothing, an unfinished save, an interrupted replacement or deletion, another
tool's checkpoint, or no checkpoint at all.

Another tool's checkpoint: what it is (``other_checkpoint_kind``), its files among others
(``other_checkpoint_files``, ``other_checkpoint_beside``), and the backend
``metadata.json`` names (``sharded_backend``). The registry of other formats
(``shardstore.other_formats.registry``) lies a layer above: it hands its lookups down when
it is imported (``name_other_formats_with``).
"""

from __future__ import annotations

__all__ = [
    "OtherCheckpointFiles",
    "holds_claim",
    "is_committed",
    "name_other_formats_with",
    "other_checkpoint_beside",
    "other_checkpoint_files",
    "other_checkpoint_kind",
    "read_commit_record",
    "sharded_backend",
    "title_of_model_files",
]

import json
from collections.abc import Callable
from dataclasses import dataclass, replace

from shardstore.errors import CheckpointingException
from shardstore.format.config import CONFIG_FNAME, MAX_CONFIG_BYTES
from shardstore.format.records.claim_document import MAX_CLAIM_BYTES, is_claim
from shardstore.format.records.commit_record import MAX_RECORD_BYTES, CommitRecord
from shardstore.format.records.markers import interrupted_replacement, unfinished_saves
from shardstore.format.records.names import (
    COMMIT_RECORD,
    COMMON_FILE,
    DELETION_MARKER,
    OBJECTS_DIR,
    REPLACED_TAG,
    SAVE_MARKER,
)
from shardstore.stores.base import Location, StorageError


def _replaced_name(location: Location, save_id: str) -> str:
    """The name of the directory next to ``location`` where a replacement sets aside the
    checkpoint ``save_id`` committed (``REPLACED_TAG``)."""
    local = location.local_path()
    name = local.name if local is not None else location.describe().rstrip("/").rsplit("/", 1)[-1]
    return f".{name}{REPLACED_TAG}{save_id}"


def is_committed(location: Location) -> bool:
    """Whether ``location`` holds a commit record (not an in-place save's claim, which
    stands in its place while that save writes: ``records.claim_document``)."""
    if location.capabilities.supports_rename:  # a claim stands only where saves publish in place
        return location.exists(COMMIT_RECORD)
    size = location.store.size(COMMIT_RECORD)
    if size is None or size > MAX_CLAIM_BYTES:  # a claim is small: a larger object is no claim
        return size is not None
    try:
        data = location.read_bytes_or_none(COMMIT_RECORD, max_bytes=MAX_CLAIM_BYTES)
    except StorageError:  # grown past a claim since (replaced by a record): committed
        return True
    return data is not None and not is_claim(data)


def holds_claim(location: Location) -> bool:
    """Whether ``location``'s ``zarr.json`` is an in-place save's claim
    (``records.claim_document``): a save in flight there, or one that ended without a
    commit, whose objects the next save into it removes."""
    if location.capabilities.supports_rename:
        return False
    try:
        data = location.read_bytes_or_none(COMMIT_RECORD, max_bytes=MAX_CLAIM_BYTES)
    except StorageError:  # larger than any claim: a record's (or another program's)
        return False
    return data is not None and is_claim(data)


def read_commit_record(location: Location) -> CommitRecord:
    """The checkpoint's commit record; without one, an error that says what is there
    instead: nothing, an unfinished save, another tool's checkpoint, or no checkpoint at
    all (a file, a Hugging Face model, any other directory), which no save finishes."""
    local = location.local_path()
    if local is not None and local.exists() and not local.is_dir():
        files = title_of_model_files(location)
        raise CheckpointingException(
            f"{location.describe()} is a file, not a checkpoint directory (one holding {COMMIT_RECORD})"
            + (f"; to make a checkpoint of {files}: `shardstore convert {location.describe()} <new directory>`"
               if files else "")
        )
    try:
        data = location.read_bytes_or_none(COMMIT_RECORD, max_bytes=MAX_RECORD_BYTES)
    except OSError as exc:
        raise CheckpointingException(f"Cannot read the commit record of {location.describe()}: {exc}") from exc
    if data is None:
        if location.is_empty():
            unfinished = unfinished_saves(location)
            if unfinished:
                raise CheckpointingException(
                    f"No committed checkpoint at {location.describe()}: a save into it is incomplete "
                    f"(unfinished: {unfinished[:3]}); load an earlier checkpoint or save again"
                )
            if local is not None and not local.exists():  # Megatron-Core's words, which its users match
                raise CheckpointingException(f"Checkpoint directory {location.describe()} does not exist")
            missing = location.store.missing_container() if local is None else None
            if missing is not None:
                raise CheckpointingException(
                    f"{location.describe()} is not a distributed checkpoint: its {missing} does not exist; check "
                    "the URL, and the endpoint and region it is looked up at"
                )
            raise CheckpointingException(  # "is not a distributed checkpoint": Megatron-Core's words too
                f"{location.describe()} is not a distributed checkpoint: the checkpoint directory is empty"
                + ("" if local is not None else " (no object under this prefix)")
                + "; save into it first, or name the directory of a committed checkpoint"
            )
        other = other_checkpoint_kind(location)
        if other:
            title, readable = other
            how = (
                "`load` and the metadata queries read it as it is; to verify it or keep it in shardstore's "
                f"format, convert it: `shardstore convert {location.describe()} <new directory>`"
                if readable
                else "load it with the tool that wrote it (megatron.core.dist_checkpointing)"
            )
            raise CheckpointingException(
                f"{location.describe()} is not a shardstore checkpoint: it is {title}. {how}"
            )
        replacing = interrupted_replacement(location)
        if replacing is not None:
            raise CheckpointingException(
                f"No committed checkpoint at {location.describe()}: save {replacing[0]}, which replaced the "
                f"checkpoint there (save {replacing[1]}) beside other programs' files, was interrupted while it "
                f"moved the checkpoints' entries (other programs' files there were not touched); the old "
                f"checkpoint's record and the entries it had moved are in the hidden directory "
                f"{_replaced_name(location, replacing[1])} next to it. The next save into this directory puts the "
                f"old checkpoint back first; to put it back without saving: `shardstore restore {location.describe()}`"
            )
        names = location.list_top(None)
        if not _holds_save_files(location, names):
            raise CheckpointingException(_not_a_checkpoint(location.describe(), names, title_of_model_files(location)))
        if DELETION_MARKER in names:
            raise CheckpointingException(
                f"{location.describe()} is no longer a checkpoint: a deletion of it by shardstore's CheckpointManager "
                f"was interrupted after its commit record went ({DELETION_MARKER} proves it). The manager's next "
                "retention, rollback or save of this step finishes it, or now: CheckpointManager(<root>).delete(step)"
            )
        raise CheckpointingException(
            f"Checkpoint at {location.describe()} is incomplete: it has no commit record "
            f"({COMMIT_RECORD}), so its save did not finish. Load an earlier checkpoint, "
            "or save again into this directory."
        )
    return CommitRecord.from_json(data, where=location.describe(COMMIT_RECORD))


def _holds_save_files(location: Location, names: list[str]) -> bool:
    """Whether a directory without a commit record holds what a shardstore save writes
    into it before that record (an in-place save: S3, Megatron's plug-in) or what the
    manager leaves while deleting one; one holding none of it is no checkpoint at all."""
    ours = {SAVE_MARKER, DELETION_MARKER, COMMON_FILE, OBJECTS_DIR}
    return bool(ours.intersection(names)) or sharded_backend(location) == "shardstore"


def _not_a_checkpoint(where: str, names: list[str], model_files: str | None) -> str:
    """What a directory that is no checkpoint holds, and what to do with it;
    ``model_files``: the title of the registered format of model files it holds, if any."""
    weights = [n for n in names if n.endswith(".safetensors")]
    if weights or "config.json" in names:
        kind = "a Hugging Face model directory" if "config.json" in names else "a directory of safetensors files"
        listed = ", ".join([n for n in ("config.json",) if n in names] + weights[:2])
        how = f"; `shardstore convert {where} <new directory>` imports its weights" if model_files else ""
        return f"{where} is {kind} ({listed}), not a shardstore checkpoint{how}"
    found = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return (
        f"{where} is not a shardstore checkpoint: it holds no commit record ({COMMIT_RECORD}) nor any file a "
        f"save writes ({found}); name a checkpoint directory, one holding {COMMIT_RECORD}"
    )


def sharded_backend(location: Location) -> str | None:
    """The backend ``metadata.json`` names, or None (no such file, or not a config): a
    lenient look, for telling what a directory holds, never an error."""
    try:
        config = json.loads(location.read_bytes_or_none(CONFIG_FNAME, max_bytes=MAX_CONFIG_BYTES) or b"null")
    except (ValueError, RecursionError, OSError):  # RecursionError: nested past the parser's depth
        return None
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    return backend if isinstance(backend, str) else None


@dataclass(frozen=True)
class OtherCheckpointFiles:
    """Another tool's checkpoint found in a directory, among whatever else is there.

    Attributes:
        title: what messages call it (``"a PyTorch DCP checkpoint"``).
        names: its top-level entries there, sorted (DCP's ``.metadata`` and ``*.distcp``).
    """

    title: str
    names: tuple[str, ...]

    def listed(self, limit: int = 8) -> str:
        """Its entries for a message: the first ``limit``, then how many more."""
        shown = ", ".join(self.names[:limit])
        return shown + (f" and {len(self.names) - limit} more" if len(self.names) > limit else "")


def _no_registry(location: Location) -> None:
    return None


# How this layer names another tool's checkpoint: the registry of other formats
# (``shardstore.other_formats.registry``) lies a layer above, so it hands its lookups down
# when it is imported, which ``shardstore.strategies`` (every load and save) and the command do.
_title_of_other_format: Callable[[Location], str | None] = _no_registry
_files_of_other_format: Callable[[Location], OtherCheckpointFiles | None] = _no_registry
_title_of_model_files: Callable[[Location], str | None] = _no_registry


def name_other_formats_with(
    title_of: Callable[[Location], str | None], files_of: Callable[[Location], OtherCheckpointFiles | None],
    title_of_files: Callable[[Location], str | None] = _no_registry,
) -> None:
    """Installs the registry's lookups: ``title_of(location)`` is the title of the
    registered format whose checkpoint ``location`` holds, or None; ``files_of(location)``
    the checkpoint of a registered format whose files lie there among others
    (``other_checkpoint_files``), or None; ``title_of_files(location)`` the title of the
    registered format of model files (``torch.save``, safetensors) at ``location``, which
    ``shardstore convert`` imports, or None."""
    global _title_of_other_format, _files_of_other_format, _title_of_model_files
    _title_of_other_format, _files_of_other_format, _title_of_model_files = title_of, files_of, title_of_files


def other_checkpoint_files(location: Location) -> OtherCheckpointFiles | None:
    """Another tool's checkpoint (a registered format's, ``shardstore.other_formats``)
    whose files lie at ``location``, whatever else is there: other programs' files, or a
    shardstore checkpoint the tool saved over (DCP's ``FileSystemWriter`` into the same
    directory). None where there is none. What a save refuses to delete and a load
    refuses to choose between (``other_checkpoint_beside``)."""
    return _files_of_other_format(location)


def other_checkpoint_beside(location: Location, record: CommitRecord) -> OtherCheckpointFiles | None:
    """Another tool's checkpoint whose files lie in the directory of the shardstore
    checkpoint ``record`` commits at ``location``, without the entries that are the
    record's own; None where there is none. Such a directory holds two checkpoints, and
    which one its path means is ambiguous."""
    found = other_checkpoint_files(location)
    if found is None:
        return None
    theirs = tuple(name for name in found.names if name not in record.own_top_names)
    return replace(found, names=theirs) if theirs else None


def other_checkpoint_kind(location: Location) -> tuple[str, bool] | None:
    """What another tool's checkpoint at ``location`` is, and whether shardstore reads
    it; None if it looks like none (also a directory with a commit record).

    A format in the registry is read (``shardstore.other_formats``); besides those,
    Megatron-Core names any other backend it wrote in ``metadata.json`` (``torch``, a
    ``torch_dist`` save without DCP's ``.metadata``), which only Megatron-Core reads.
    """
    title = _title_of_other_format(location)
    if title:
        return title, True
    backend = sharded_backend(location)
    # shardstore's own first checkpoints also named the backend "zarr", but they are a
    # Zarr v3 group (a root zarr.json); Megatron's are detected by the registry
    if backend is not None and backend not in ("zarr", "shardstore"):
        return f"a Megatron-Core {backend!r} checkpoint", False
    return None


def title_of_model_files(location: Location) -> str | None:
    """The title of the registered format of model files (``torch.save``, safetensors)
    at ``location``, which ``shardstore convert`` imports, or None (``name_other_formats_with``)."""
    return _title_of_model_files(location)
