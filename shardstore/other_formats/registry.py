"""The one list of other tools' checkpoint formats that shardstore reads, and the one
place that tells which of them a location holds.

``load`` and the metadata queries (``strategies.other_formats``), inspection, the
``shardstore`` command and ``convert`` all ask ``detect``; the errors about a directory
without a commit record (``format.records.other_checkpoint_kind``) name what it finds.
A reader is one module under ``other_formats`` that defines an ``OtherFormat``
(``base``), listed once in ``FORMATS`` below; a format added at run time (a plug-in, a
test) calls ``register``.

Order matters where two formats could claim one directory: the first that detects it
wins (Megatron's torch_dist before the plain DCP it is made of).
"""

from __future__ import annotations

from shardstore.errors import CheckpointingException
from shardstore.format.records import OtherCheckpointFiles, name_other_formats_with
from shardstore.other_formats.base import OtherFormat
from shardstore.other_formats.dcp import DCP_FORMAT, TORCH_DIST_FORMAT
from shardstore.other_formats.megatron_zarr import MEGATRON_ZARR_FORMAT
from shardstore.stores.base import Location

FORMATS: list[OtherFormat] = [TORCH_DIST_FORMAT, MEGATRON_ZARR_FORMAT, DCP_FORMAT]


def register(other_format: OtherFormat) -> OtherFormat:
    """Adds a format after the built-in ones; its name must be new (it is what
    ``named`` and a checkpoint's ``kind`` go by)."""
    if any(f.name == other_format.name for f in FORMATS):
        raise CheckpointingException(
            f"A reader of the format {other_format.name!r} is registered already; give the new one another name"
        )
    FORMATS.append(other_format)
    return other_format


def detect(location: Location) -> OtherFormat | None:
    """The first registered format whose checkpoint ``location`` holds, or None."""
    return next((f for f in FORMATS if f.detect(location)), None)


def named(name: str) -> OtherFormat:
    """The registered format called ``name``."""
    for other_format in FORMATS:
        if other_format.name == name:
            return other_format
    raise CheckpointingException(
        f"No reader of the format {name!r} is registered (known: {', '.join(f.name for f in FORMATS)})"
    )


def _title_of(location: Location) -> str | None:
    found = detect(location)
    return found.title if found else None


def files_found(location: Location) -> OtherCheckpointFiles | None:
    """The checkpoint of a registered format whose files lie at ``location`` among
    others (``records.other_checkpoint_files``): the formats that name their files
    (``OtherFormat.files``) whose metadata file is there, the one that detects the
    directory first (else the last of them, the most general: plain DCP rather than
    Megatron's torch_dist made of it); None where there is none."""
    present = [f for f in FORMATS if f.files is not None and location.exists(f.metadata_file)]
    if not present:
        return None
    found = next((f for f in present if f.detect(location)), present[-1])
    assert found.files is not None  # only formats that name their files are present
    return OtherCheckpointFiles(found.title, tuple(found.files(location)))


name_other_formats_with(_title_of, files_found)

__all__ = ["FORMATS", "detect", "files_found", "named", "register"]
