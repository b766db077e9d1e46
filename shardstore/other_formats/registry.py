"""The one list of other tools' formats that shardstore reads, and the one place that
tells which of them a path holds.

Two kinds of format stand in ``FORMATS`` (``base``): checkpoint directories that ``load``
reads as they are (``OtherFormat``: DCP, Megatron-Core torch_dist and zarr), and model
files that shardstore converts from and to (``FileFormat``: safetensors, ``torch.save``).
Every door asks ``detect``, naming the kind it can use: ``load`` and the metadata
queries (``opened``, ``engine.other_formats``) and inspection ask for an
``OtherFormat``; ``convert`` and the command's ``convert`` ask for a ``FileFormat``
first, then open the path as a checkpoint; the errors about a directory without a
commit record (``format.records``, below this layer: what a directory or file is
instead) are handed this module's lookups of both kinds when it is imported.

A format is one module under ``other_formats`` that defines its entry, listed once in
``FORMATS`` below; a format added at run time (a plug-in, a test) calls ``register``.
Order matters where two formats could claim one path: the first that detects it wins
(Megatron's torch_dist before the plain DCP it is made of).
"""

from __future__ import annotations

__all__ = ["FORMATS", "detect", "files_found", "formats", "named", "register"]

from typing import TypeVar

from shardstore.errors import CheckpointingException
from shardstore.format.records.reading import (
    OtherCheckpointFiles,
    name_other_formats_with,
)
from shardstore.other_formats.base import FileFormat, Format, OtherFormat
from shardstore.other_formats.dcp import DCP_FORMAT, TORCH_DIST_FORMAT
from shardstore.other_formats.megatron_zarr import MEGATRON_ZARR_FORMAT
from shardstore.other_formats.safetensors import SAFETENSORS_FORMAT
from shardstore.other_formats.torch_file import TORCH_FILE_FORMAT
from shardstore.stores.base import Location

FORMATS: list[Format] = [
    TORCH_DIST_FORMAT, MEGATRON_ZARR_FORMAT, DCP_FORMAT, SAFETENSORS_FORMAT, TORCH_FILE_FORMAT,
]

F = TypeVar("F", bound=Format)


def register(new_format: Format) -> Format:
    """Adds a format after the built-in ones; its name must be new (it is what
    ``named`` and a checkpoint's ``kind`` go by)."""
    if any(f.name == new_format.name for f in FORMATS):
        raise CheckpointingException(
            f"A reader of the format {new_format.name!r} is registered already; give the new one another name"
        )
    FORMATS.append(new_format)
    return new_format


def formats(kind: type[F]) -> list[F]:
    """The registered formats of the kind ``kind`` (``OtherFormat``, ``FileFormat``),
    in the order they are tried."""
    return [f for f in FORMATS if isinstance(f, kind)]


def detect(location: Location, kind: type[F]) -> F | None:
    """The first registered format of the kind ``kind`` whose checkpoint or files
    ``location`` holds, or None."""
    return next((f for f in formats(kind) if f.detect(location)), None)


def named(name: str) -> Format:
    """The registered format called ``name``."""
    for found in FORMATS:
        if found.name == name:
            return found
    raise CheckpointingException(
        f"No reader of the format {name!r} is registered (known: {', '.join(f.name for f in FORMATS)})"
    )


def _title_of(location: Location, kind: type[Format] = OtherFormat) -> str | None:
    found = detect(location, kind)
    return found.title if found else None


def _title_of_files(location: Location) -> str | None:
    return _title_of(location, FileFormat)


def files_found(location: Location) -> OtherCheckpointFiles | None:
    """The checkpoint of a registered format whose files lie at ``location`` among
    others (``records.other_checkpoint_files``): the formats that name their files
    (``OtherFormat.files``) whose metadata file is there, the one that detects the
    directory first (else the last of them, the most general: plain DCP rather than
    Megatron's torch_dist made of it); None where there is none."""
    named = [f for f in formats(OtherFormat) if f.files is not None]
    # formats share metadata files (DCP's and torch_dist's .metadata): each looked up once
    there = {name: location.exists(name) for name in dict.fromkeys(f.metadata_file for f in named)}
    present = [f for f in named if there[f.metadata_file]]
    if not present:
        return None
    found = next((f for f in present if f.detect(location)), present[-1])
    assert found.files is not None  # only formats that name their files are present
    return OtherCheckpointFiles(found.title, tuple(found.files(location)))


name_other_formats_with(_title_of, files_found, _title_of_files)
