"""The api's entries to a place a caller names, each saying how far it is trusted.

* ``open_read``: a checkpoint to read, opened once for every door that reads one (below);
* ``bare_location``: a place taken as it is, no commit record asked for: a directory of
  the seed's own functions (Megatron's zarr module functions, ``maybe_load_config``), a
  checkpoint ``verify`` examines in whatever state it is, a root of checkpoints, a
  destination whose kind is asked;
* ``write_location``: where a writer with the seed's signature (``save_common``,
  ``save_sharded_objects``, ``_create_zarr_array``, ``_create_or_open_zarr_arrays``,
  ``save_config``) writes a file into a caller's directory; a committed shardstore
  checkpoint there is refused (but for a ``metadata.json`` its record does not list),
  since a file changed or added under its commit record is damage.

A save is opened by ``execution.pipeline.SavePipeline`` (staged, published by the
commit rules); nothing above this module turns a path into a location itself
(``scripts/count_doors.py``).

A checkpoint to read is either

* a committed shardstore checkpoint: its commit record read first (an unfinished save
  is refused here, before anything else), every later read of a file the record
  vouches for checked against it (``format.integrity.ChecksummedLocation``), its
  ``metadata.json`` (the backends) in hand; refused where another tool's checkpoint
  lies in the same directory (DCP's ``FileSystemWriter`` saved over it): which of the
  two the path means is ambiguous (``refuse_ambiguous``); or
* another tool's checkpoint (PyTorch DCP, Megatron-Core torch_dist or zarr), detected
  once by the registry (``other_formats``), read without a commit record.

``shardstore.load`` and the metadata queries, inspection, conversion and the DCP reader
take the ``OpenedCheckpoint`` instead of asking a location what it is:

    opened = open_read("/ckpt/step_100")        # path, URL, Location or OpenedCheckpoint
    record = opened.require_record()            # a shardstore checkpoint's record, or a
                                                # CheckpointingException naming the other tool
    opened.location.read_bytes("common.pt")     # checked against the record
"""

from __future__ import annotations

__all__ = [
    "SHARED_FILE_BYTES", "OpenedCheckpoint", "bare_location", "holds_committed_checkpoint", "open_read",
    "open_read_together", "other_format_of", "read_location", "refuse_ambiguous", "write_location",
]

import os
from dataclasses import dataclass

from shardstore.errors import CheckpointingException
from shardstore.format.config import CONFIG_FNAME, CheckpointingConfig, maybe_load_config
from shardstore.format.integrity import ChecksummedLocation
from shardstore.format.records import COMMIT_RECORD, CommitRecord, is_committed, read_commit_record
from shardstore.format.records.names import COMMON_FILE
from shardstore.format.records.other_checkpoints import other_checkpoint_beside
from shardstore.other_formats import registry
from shardstore.other_formats.base import OtherFormat
from shardstore.protocol.collectives import Group
from shardstore.stores.base import Location
from shardstore.stores.locations import open_location


@dataclass(frozen=True)
class OpenedCheckpoint:
    """A checkpoint opened for reading (module docstring).

    Attributes:
        location: where its files are read; for a shardstore checkpoint, reads checked
            against its commit record.
        record: the commit record; None for another tool's checkpoint.
        other_format: the other tool's format; None for a shardstore checkpoint.
    """

    location: Location
    record: CommitRecord | None
    other_format: OtherFormat | None = None

    def describe(self, rel: str = "") -> str:
        return self.location.describe(rel)

    @property
    def is_shardstore(self) -> bool:
        return self.record is not None

    def require_record(self) -> CommitRecord:
        """The commit record of a shardstore checkpoint.

        Raises:
            CheckpointingException: another tool's checkpoint (named), which has none.
        """
        if self.record is None:
            kind = self.other_format.title if self.other_format is not None else "another tool's checkpoint"
            raise CheckpointingException(
                f"{self.describe()} is {kind}, not a shardstore checkpoint: it has no commit record. Load it with "
                "shardstore.load, or convert it first (`shardstore convert`)"
            )
        return self.record

    def config(self) -> CheckpointingConfig | None:
        """Its ``metadata.json`` (the backends that wrote it), read through the checked
        location; None where there is none."""
        return maybe_load_config(self.location) if self.record is not None else None


def other_format_of(location: Location) -> OtherFormat | None:
    """The registered format of another tool's local checkpoint at ``location`` that
    shardstore reads, as it is: no shardstore commit record; None for anything else (a
    file, S3, a shardstore checkpoint or a directory of neither)."""
    path = location.local_path()
    if path is None or not path.is_dir() or is_committed(location):
        return None
    return registry.detect(location, OtherFormat)


def open_read(checkpoint: str | os.PathLike | Location | OpenedCheckpoint) -> OpenedCheckpoint:
    """The checkpoint at ``checkpoint``, opened once (one already opened is returned as
    it is).

    Raises:
        CheckpointingException: neither a committed shardstore checkpoint nor another
            tool's that shardstore reads (the message says what is there: nothing, an
            unfinished save, something else).
    """
    if isinstance(checkpoint, OpenedCheckpoint):
        return checkpoint
    location = open_location(checkpoint)
    other = other_format_of(location)
    if other is not None:
        return OpenedCheckpoint(location, None, other)
    record = read_commit_record(location)
    refuse_ambiguous(location, record)
    return OpenedCheckpoint(ChecksummedLocation(location, record), record)


SHARED_FILE_BYTES = 16 << 20
"""The largest common file (``common.pt``, ``metadata.json``) the coordinator of a load
reads for every rank (``open_read_together``); a larger one each rank reads itself."""


def open_read_together(target: Location | OpenedCheckpoint, group: Group) -> OpenedCheckpoint:
    """Collective on ``group``: ``open_read`` of ``target`` by the coordinator alone,
    which hands every rank the commit record and the files every rank of a load reads
    (``metadata.json``, ``common.pt``, each up to ``SHARED_FILE_BYTES``), so that a load
    of N ranks asks the storage for them once, not N times (4 requests per rank on
    S3). Each rank checks those bytes against the record as it reads them
    (``ChecksummedLocation``). Another tool's checkpoint is opened by each rank.

    Raises:
        CheckpointingException: on every rank, the coordinator's failure to open it."""
    if group.world_size == 1 or isinstance(target, OpenedCheckpoint):
        return open_read(target)
    opened: OpenedCheckpoint | None = None
    answer: tuple[CommitRecord, dict[str, bytes | None]] | CheckpointingException | None = None
    failure: Exception | None = None
    if group.is_coordinator:
        try:
            opened = open_read(target)
            answer = _shared_files(opened)
        except Exception as exc:  # raised on every rank: the others wait in the broadcast
            failure = exc
            answer = exc if isinstance(exc, CheckpointingException) else CheckpointingException(
                f"Opening checkpoint {target.describe()} failed: {type(exc).__name__}: {exc}")
    answer = group.broadcast_object(answer)
    if isinstance(answer, CheckpointingException):
        raise answer from failure
    if opened is not None:
        return opened
    if answer is None:  # another tool's checkpoint
        return open_read(target)
    record, fetched = answer
    return OpenedCheckpoint(ChecksummedLocation(target, record, fetched), record)


def _shared_files(opened: OpenedCheckpoint) -> tuple[CommitRecord, dict[str, bytes | None]] | None:
    """What the coordinator of a load hands the other ranks (``open_read_together``):
    the record and the common files as it read them (kept on its own location too, so
    that it does not read them again); None for another tool's checkpoint."""
    if opened.record is None or not isinstance(opened.location, ChecksummedLocation):
        return None
    location = opened.location
    for rel in (CONFIG_FNAME, COMMON_FILE):
        data = location.inner.read_bytes_or_none(rel)
        if data is None or len(data) <= SHARED_FILE_BYTES:
            location.fetched[rel] = data
    return opened.record, location.fetched


def refuse_ambiguous(location: Location, record: CommitRecord) -> None:
    """Refuses the directory of the shardstore checkpoint ``record`` commits when it also
    holds another tool's checkpoint (``records.other_checkpoint_beside``: DCP's
    ``.metadata`` and ``*.distcp``, typically written later by DCP's own writer saving
    into the same path): returning the shardstore checkpoint's values would silently
    ignore what was saved last.

    Raises:
        CheckpointingException: naming both checkpoints' files and what to do.
    """
    other = other_checkpoint_beside(location, record)
    if other is None:
        return
    where = location.describe()
    ours = ", ".join(name for name in location.list_top(None) if name in record.own_top_names)
    raise CheckpointingException(
        f"{where} holds two checkpoints, so which one it means is ambiguous: a shardstore checkpoint (save "
        f"{record.save_id or 'of an older version'}: {ours}) and {other.title} ({other.listed()}), which its commit "
        "record does not list (another tool, such as DCP's FileSystemWriter, saved into the same directory). "
        f"Refusing to load either. Move one of the two into a directory of its own: {other.listed()} to load the "
        "shardstore checkpoint here, or the shardstore checkpoint's entries to leave the other alone (DCP's "
        "FileSystemReader reads it where it is)"
    )


def bare_location(place: str | os.PathLike | Location | OpenedCheckpoint) -> Location:
    """The place a caller names, as it is (module docstring): nothing is read; a Location
    is returned as it is, an opened checkpoint's location too."""
    if isinstance(place, OpenedCheckpoint):
        return place.location
    return open_location(place)


def write_location(checkpoint_dir: str | os.PathLike | Location, *, writes_config: bool = False) -> Location:
    """Where a writer with the seed's signature writes into ``checkpoint_dir``: the
    directory of Megatron's own protocol a direct caller names, or the pending checkpoint
    of a save that hands it down.

    Refused where a committed shardstore checkpoint is there: its commit record vouches
    for every file it holds, and a file added after the commit is damage ``verify``
    reports. The one exception, ``writes_config``: ``metadata.json`` where the record does
    not list it, which Megatron-Core's own save writes after the commit
    (``CommitRecord.unlisted``).

    Raises:
        CheckpointingException: a committed shardstore checkpoint is there.
    """
    location = bare_location(checkpoint_dir)
    if not is_committed(location):
        return location
    if writes_config and CONFIG_FNAME not in read_commit_record(location).files:
        return location
    what = CONFIG_FNAME if writes_config else "a file"
    raise CheckpointingException(
        f"{location.describe()} holds a committed shardstore checkpoint ({COMMIT_RECORD} is there): {what} written "
        "into it now would be damage under its commit record. Write into an empty directory, or save with "
        "shardstore.save(..., overwrite=True) to replace the checkpoint"
    )


def holds_committed_checkpoint(checkpoint_dir: str | os.PathLike | Location) -> bool:
    """Collective over the default process group (every rank calls it): whether
    ``checkpoint_dir`` holds a committed shardstore checkpoint, as the coordinator sees
    it, so that ranks whose views of a shared file system differ for a moment still
    decide alike and none is left waiting in a later collective. A place shardstore
    cannot open (another scheme, such as Megatron's ``msc://``) holds none of ours.

    Raises:
        CheckpointingException: on every rank, where the coordinator's check failed
            (the storage's error, named)."""
    group = Group()
    answer: bool | CheckpointingException = False
    failure: Exception | None = None
    if group.is_coordinator:
        try:
            location = bare_location(checkpoint_dir)
        except CheckpointingException:
            location = None
        try:
            answer = location is not None and is_committed(location)
        except Exception as exc:  # raised on every rank: the others would wait in the broadcast
            failure = exc
            answer = CheckpointingException(
                f"Could not tell whether {checkpoint_dir} holds a committed shardstore checkpoint: "
                f"{type(exc).__name__}: {exc}"
            )
    answer = group.broadcast_object(answer)
    if isinstance(answer, CheckpointingException):
        raise answer from failure
    return bool(answer)


def read_location(checkpoint: str | bytes | os.PathLike | Location | OpenedCheckpoint) -> Location:
    """Where a reader with the seed's signature (a strategy's ``load_common``,
    ``load_sharded_objects``, the zarr module's ``_load_from_array``) reads ``checkpoint``.

    A load hands such a reader the location it opened (checked against the record
    already) and it is used as it is. A path or URL, as a direct caller of the seed's API
    passes, is opened here by ``open_read``: a committed checkpoint's files are then
    checked against its record on that route too (read unchecked, a flipped bit in
    ``common.pt`` came back as a wrong integer), and an unfinished save is refused."""
    if isinstance(checkpoint, (str, bytes, os.PathLike, OpenedCheckpoint)):
        return open_read(checkpoint).location
    return checkpoint
