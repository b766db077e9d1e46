"""The api's entries to a place a caller names, each saying how far it is trusted.

* ``bare_location``: what a caller names (a path, a URL, a Location), as a Location
  taken as it is, no commit record asked for: the one conversion a door (the tools,
  the dialects' entry points) makes, once, before it hands the Location on;
* ``open_read``: a checkpoint to read at a Location, opened once for every door that
  reads one (below);
* ``write_location``: a Location a writer with the seed's signature (``save_common``,
  ``save_sharded_objects``, ``_create_zarr_array``, ``_create_or_open_zarr_arrays``,
  ``save_config``) writes a file into; a committed shardstore checkpoint there is
  refused (but for a ``metadata.json`` its record does not list), since a file changed
  or added under its commit record is damage.

Only ``bare_location`` takes a path; the others take a Location (what the seed API's
checkpoint directories lead to is ``engine.walk``'s). A save is
opened by ``execution.pipeline.SavePipeline`` (staged, published by the commit rules);
nothing above this module turns a path into a location itself
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

    opened = open_read(bare_location("/ckpt/step_100"))
    record = opened.require_record()            # a shardstore checkpoint's record, or a
                                                # CheckpointingException naming the other tool
    opened.location.read_bytes("common.pt")     # checked against the record
"""

from __future__ import annotations

__all__ = [
    "SHARED_FILE_BYTES", "OpenedCheckpoint", "bare_location", "open_read", "open_read_together", "other_format_of",
    "refuse_ambiguous", "write_location",
]

import os
from dataclasses import dataclass

from shardstore.errors import CheckpointingException
from shardstore.format.commit.pending import SaveLocation
from shardstore.format.config import (
    CONFIG_FNAME,
    MAX_CONFIG_BYTES,
    CheckpointingConfig,
    read_config,
)
from shardstore.format.integrity import ChecksummedLocation
from shardstore.format.records import COMMIT_RECORD, CommitRecord, is_committed, read_commit_record
from shardstore.format.records.names import COMMON_FILE
from shardstore.format.records.reading import other_checkpoint_beside
from shardstore.other_formats import registry
from shardstore.other_formats.base import OtherFormat
from shardstore.protocol import Deliver, Group, run_stage
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
        return read_config(self.location) if self.record is not None else None


def other_format_of(location: Location) -> OtherFormat | None:
    """The registered format of another tool's local checkpoint at ``location`` that
    shardstore reads, as it is: no shardstore commit record; None for anything else (a
    file, S3, a shardstore checkpoint or a directory of neither)."""
    path = location.local_path()
    if path is None or not path.is_dir() or is_committed(location):
        return None
    return registry.detect(location, OtherFormat)


def open_read(checkpoint: Location | OpenedCheckpoint) -> OpenedCheckpoint:
    """The checkpoint at ``checkpoint``, opened once (one already opened is returned as
    it is; a caller's path becomes a Location by ``bare_location`` first).

    Raises:
        CheckpointingException: neither a committed shardstore checkpoint nor another
            tool's that shardstore reads (the message says what is there: nothing, an
            unfinished save, something else).
    """
    if isinstance(checkpoint, OpenedCheckpoint):
        return checkpoint
    location = checkpoint
    other = other_format_of(location)
    if other is not None:
        return OpenedCheckpoint(location, None, other)
    record = read_commit_record(location)
    refuse_ambiguous(location, record)
    return OpenedCheckpoint(ChecksummedLocation(location, record), record)


SHARED_FILE_BYTES = 16 << 20
"""The largest ``common.pt`` the coordinator of a load reads for every rank
(``open_read_together``); a larger one each rank reads itself (``metadata.json`` is
handed over whole: its readers refuse one over ``MAX_CONFIG_BYTES``)."""


def open_read_together(target: Location | OpenedCheckpoint, group: Group) -> OpenedCheckpoint:
    """Collective on ``group``: ``open_read`` of ``target`` by the coordinator alone,
    which hands every rank the commit record and the files every rank of a load reads
    (``metadata.json``, ``common.pt``, each up to ``SHARED_FILE_BYTES``), so that a load
    of N ranks asks the storage for them once, not N times (4 requests per rank on
    S3). Each rank checks those bytes against the record as it reads them
    (``ChecksummedLocation``). Another tool's checkpoint is opened by each rank.

    Every rank passes the same kind of ``target`` (an ``OpenedCheckpoint`` is used as
    it is, with no collective).

    One stage (``protocol.run_stage``): a failure to open it is raised on every rank.

    Raises:
        CheckpointingException: on every rank, the coordinator's failure to open it."""
    if group.world_size == 1 or isinstance(target, OpenedCheckpoint):
        return open_read(target)
    opened: list[OpenedCheckpoint] = []  # the coordinator's

    def open_on_coordinator() -> tuple[CommitRecord, dict[str, bytes | None]] | None:
        if not group.is_coordinator:
            return None
        opened.append(open_read(target))
        record = opened[0].record
        return None if record is None else (record, _shared_files(target))

    answer = run_stage(group, f"Opening checkpoint {target.describe()}", open_on_coordinator,
                       reduce=lambda answers: answers[0], deliver=Deliver.BROADCAST)
    if answer is None:  # another tool's checkpoint
        return opened[0] if opened else open_read(target)
    record, fetched = answer
    return OpenedCheckpoint(ChecksummedLocation(target, record, fetched), record)


def _shared_files(location: Location) -> dict[str, bytes | None]:
    """The files the coordinator of a load hands the other ranks (``open_read_together``)
    as it read them (None: not there); every rank, the coordinator too, reads them from
    there, checked against the record. ``metadata.json`` is read through the bound every
    reader of it uses (a larger one is refused, on every rank); ``common.pt`` only where
    it holds at most ``SHARED_FILE_BYTES`` (its size asked first: a larger one each rank
    reads itself, never read twice or of unchecked size here)."""
    shared: dict[str, bytes | None] = {CONFIG_FNAME: location.read_bytes_or_none(CONFIG_FNAME, MAX_CONFIG_BYTES)}
    size = location.store.size(COMMON_FILE)
    if size is None or size <= SHARED_FILE_BYTES:
        shared[COMMON_FILE] = None if size is None else location.read_bytes_or_none(COMMON_FILE, SHARED_FILE_BYTES)
    return shared


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


def write_location(location: Location, *, writes_config: bool = False) -> Location:
    """``location``, where a writer with the seed's signature writes a file: the
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
    if not is_committed(location):
        return location
    pending = location.save if isinstance(location, SaveLocation) else None
    if pending is not None and pending.committed is None and read_commit_record(location).save_id != (
        pending.intent.save_id
    ):  # in place, committed by another save
        raise CheckpointingException(
            f"Not writing into {location.describe()}: another save took the prefix over and committed there while "
            f"this save (save {pending.intent.save_id}) ran, which lost its claim on it (paused past its "
            "lease?). Nothing of this save is committed, and nothing was written over; save again"
        )
    if writes_config and CONFIG_FNAME not in read_commit_record(location).files:
        return location
    what = CONFIG_FNAME if writes_config else "a file"
    raise CheckpointingException(
        f"{location.describe()} holds a committed shardstore checkpoint ({COMMIT_RECORD} is there): {what} written "
        "into it now would be damage under its commit record. Write into an empty directory, or save with "
        "shardstore.save(..., overwrite=True) to replace the checkpoint"
    )
