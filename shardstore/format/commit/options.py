"""What a save is told and what its coordinator decides: ``SaveOptions`` (how a save may
treat its target and where it puts its bytes, handed whole to the start of a save) and
``SaveIntent`` (the coordinator's decision when the save began, sent to every rank).
"""

from __future__ import annotations

__all__ = ["SaveIntent", "SaveOptions", "new_save_id"]

import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from shardstore.errors import CheckpointingException
from shardstore.format.features import ZarrMetadata
from shardstore.format.records import ArrayPlaces
from shardstore.format.storage_layout import LayoutSite, StorageLayout
from shardstore.stores.base import Location


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
        for name, value in (("overwrite", overwrite), ("reuse_from", reuse_from),
                            ("shared_directory", shared_directory), ("array_places", array_places)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "layout", StorageLayout.of(layout, zarr_metadata=zarr_metadata,
                                                            pack_arrays_up_to=pack_arrays_up_to))

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
