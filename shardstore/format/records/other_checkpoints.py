"""Another tool's checkpoint where a shardstore checkpoint is looked for: what it is
(``other_checkpoint_kind``), its files among others (``other_checkpoint_files``,
``other_checkpoint_beside``), and the backend ``metadata.json`` names (``sharded_backend``).

The registry of other formats (``shardstore.other_formats.registry``) lies a layer above:
it hands its lookups down when it is imported (``name_other_formats_with``).
"""

from __future__ import annotations

__all__ = [
    "OtherCheckpointFiles",
    "name_other_formats_with",
    "other_checkpoint_beside",
    "other_checkpoint_files",
    "other_checkpoint_kind",
    "sharded_backend",
    "title_of_model_files",
]

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from shardstore.format.config import CONFIG_FNAME, MAX_CONFIG_BYTES
from shardstore.stores.base import Location

if TYPE_CHECKING:
    from shardstore.format.records.commit_record import CommitRecord


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
