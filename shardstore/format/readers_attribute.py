"""The root group's ``readers`` attribute: how a reader without shardstore opens every
array, in words (issue 33.4) and as a recipe a program follows.

A checkpoint has it wherever an array does not open by its path alone: with
``consolidated_only``, with ``packs``, or with arrays of extension data types (bfloat16,
float8), whose ``KeyError: "'model/emb' not found in consolidated metadata."`` in
zarr-python names neither the cause nor a remedy. A checkpoint without it opens every
array by its path. Its ``recipe`` is data of a size that does not grow with the arrays:

- ``version``: ``RECIPE_VERSION``. A reader refuses another.
- ``sources``: where arrays are listed and how each opens, one object per listing:
  ``listed_in``, the path of keys in the root ``zarr.json`` to an object keyed by array
  key; ``store``, ``"directory"`` (chunks under ``<checkpoint>/<key>/``; the listing's
  values are Zarr documents, the arrays those of ``node_type`` ``"array"``) or
  ``"zip_pack"`` (the value is the pack's path relative to the checkpoint, a stored zip
  that is a Zarr v3 hierarchy, the array at ``<key>``); ``document``, ``"zarr_json"``
  (the array's own ``zarr.json`` is there: open it by path) or ``"listed"`` (the listed
  value is its only document: TensorStore takes it as ``"metadata"`` with
  ``assume_metadata=True``, zarr-python reads it through ``zarr.open_group``).
- ``tensorstore_only_data_types``: the data types of this checkpoint's arrays that
  zarr-python has no type for without shardstore: TensorStore opens those.

Each source is written beside its feature (``format.features.documents_recipe``,
``format.features.packs_recipe``); ``scripts/plain_read.py`` follows the recipe with
nothing but json, numpy, zarr and TensorStore.
"""

from __future__ import annotations

__all__ = ["READERS_ATTRIBUTE", "RECIPE", "RECIPE_VERSION", "readers_note", "readers_recipe"]

from collections.abc import Collection
from typing import Any

from shardstore._zarr_autoload import EXTENSION_METADATA
from shardstore.format.dtypes import CORE_DATA_TYPES
from shardstore.format.features import (
    PACKED_ARRAYS_ATTRIBUTE,
    ZarrMetadata,
    documents_recipe,
    packs_recipe,
)

READERS_ATTRIBUTE = "readers"
# The key of the recipe in the ``readers`` attribute, and its version.
RECIPE = "recipe"
RECIPE_VERSION = 1


def readers_recipe(
    where: ZarrMetadata, extension_listed: bool, packed: bool, tensorstore_only: Collection[str],
) -> dict[str, Any]:
    """The recipe of a checkpoint whose nodes' documents are ``where``, whose consolidated
    metadata lists arrays of extension data types beside ``metadata`` if
    ``extension_listed``, that has packs if ``packed``, and whose arrays of the data
    types ``tensorstore_only`` zarr-python cannot read without shardstore."""
    sources = documents_recipe(where, extension_listed)
    if packed:
        sources.append(packs_recipe())
    return {"version": RECIPE_VERSION, "sources": sources, "tensorstore_only_data_types": sorted(tensorstore_only)}


def readers_note(
    extension: dict[str, str], where: ZarrMetadata = ZarrMetadata.PER_NODE,
    packed: dict[str, str] | None = None,
) -> dict[str, Any]:
    """What ``zarr.open_group(ckpt).attrs["readers"]`` says: the arrays of extension data
    types (bfloat16, float8; ``extension``: their data types by key), and what reads them (without their own
    ``zarr.json``, ``where`` is ``CONSOLIDATED_ONLY``: TensorStore given the document); with
    ``packed`` (feature ``packs``: the packed arrays' data types by key), how to open the
    arrays packed into zips, naming those of extension data types; and the machine-readable
    recipe of all that (``readers_recipe``)."""
    note = _extension_note(extension, where) if extension else {}
    packed_extension = {k: t for k, t in (packed or {}).items() if t not in CORE_DATA_TYPES}
    tensorstore_only = {*extension.values(), *packed_extension.values()}
    note[RECIPE] = readers_recipe(where, bool(extension), packed is not None, tensorstore_only)
    if packed is not None:
        note["packed_arrays_note"] = (
            f"The arrays listed in the root attribute {PACKED_ARRAYS_ATTRIBUTE!r} are not in this directory or in its "
            "consolidated metadata: each lives in the pack named there, a stored (uncompressed) zip that is a "
            "Zarr v3 hierarchy of its own, the array at its key. zarr-python: zarr.open_group(zarr.storage."
            "ZipStore('<checkpoint>/<pack>', mode='r'), mode='r')[key]; TensorStore: tensorstore.open({'driver': "
            "'zarr3', 'kvstore': {'driver': 'zip', 'base': 'file://<checkpoint>/<pack>'}, 'path': key})."
        )
        if packed_extension:
            note["packed_arrays_note"] += (
                " The packed arrays listed in 'packed_arrays_needing_shardstore_or_tensorstore' (bfloat16, float8) "
                "open in zarr-python only with shardstore installed; TensorStore opens them as they are."
            )
            note["packed_arrays_needing_shardstore_or_tensorstore"] = dict(sorted(packed_extension.items()))
    return note


def _extension_note(extension: dict[str, str], where: ZarrMetadata) -> dict[str, Any]:
    """``readers_note``'s part on the arrays of extension data types."""
    if where is ZarrMetadata.CONSOLIDATED_ONLY:
        opener = (
            "TensorStore reads them given their metadata document, which only this file holds (consolidated_metadata."
            f"{EXTENSION_METADATA}[key]): tensorstore.open({{'driver': 'zarr3', 'kvstore': {{'driver': 'file', "
            "'path': '<checkpoint>/<key>/'}, 'metadata': document}, open=True, assume_metadata=True), ml_dtypes "
            "giving the numpy type."
        )
    else:
        opener = (
            "TensorStore reads them as they are: tensorstore.open({'driver': 'zarr3', 'kvstore': "
            "{'driver': 'file', 'path': '<checkpoint>/<key>/'}}), ml_dtypes giving the numpy type."
        )
    return {
        "note": (
            "The arrays listed here use data types that zarr-python reads only once they are registered: "
            "zarr-python reports them as not found in consolidated metadata, or as 'No Zarr data type found'. "
            "With shardstore installed (not on a package index: pip install . in a clone of its repository) zarr.open_group lists and reads them; "
            + opener
        ),
        "arrays_needing_shardstore_or_tensorstore": dict(sorted(extension.items())),
    }
