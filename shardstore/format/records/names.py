"""What the files and markers of a checkpoint are called, and where its chunks and
object shards lie.

The root ``zarr.json`` is the commit record (``COMMIT_RECORD``); ``common.pt`` the common
state; ``__objects__/<shard key>.pt`` a ShardedObject's shards (``object_path``), or
``<shard key>.pt`` where Megatron-Core's own save wrote them (``is_megatron_object_file``);
``<key>/c.1.0`` an array's chunks (``chunk_key``). A save in progress, a replacement and
the manager's deletion leave markers and directories named here.
"""

from __future__ import annotations

__all__ = [
    "CHUNK_SEPARATOR",
    "COMMIT_RECORD",
    "COMMON_FILE",
    "DELETION_MARKER",
    "LEGACY_CHUNK_SEPARATOR",
    "MOVING_IN",
    "OBJECTS_DIR",
    "REPLACED_TAG",
    "REPLACING_PHASE",
    "SAVE_MARKER",
    "SETTING_ASIDE",
    "STAGING_TAG",
    "ZARR_JSON",
    "chunk_key",
    "is_megatron_object_file",
    "object_path",
]

import re

CHUNK_SEPARATOR = "."
LEGACY_CHUNK_SEPARATOR = "/"
ZARR_JSON = "zarr.json"
COMMIT_RECORD = ZARR_JSON
COMMON_FILE = "common.pt"
OBJECTS_DIR = "__objects__"
# A save in progress (shardstore.format.commit): its marker file, naming its save id, and the
# names of its staging directory and of a replaced checkpoint set aside, next to the target.
SAVE_MARKER = ".shardstore-save.json"
# Written into a checkpoint before the manager deletes it (``shardstore.tools.manager``): proves
# that a directory without a commit record is one of ours being deleted.
DELETION_MARKER = ".shardstore-deleting.json"
STAGING_TAG = ".shardstore-save-"
REPLACED_TAG = ".shardstore-replaced-"
# The field of the save marker that a replacement in a shared directory writes into the
# target (``ByRename._replace_beside``), with its phase: ``SETTING_ASIDE`` while the old
# checkpoint's entries move out to its replaced directory, ``MOVING_IN`` once all have
# and the new checkpoint's move in.
REPLACING_PHASE = "replacing_beside"
SETTING_ASIDE, MOVING_IN = "setting_aside", "moving_in"


def chunk_key(index: tuple[int, ...], separator: str = CHUNK_SEPARATOR) -> str:
    """Zarr v3's default chunk key encoding: ``c.1.0`` (``c/1/0`` with the ``/`` separator
    of formats 1 and 2; ``c`` for a 0-d array)."""
    return separator.join(["c", *map(str, index)])


# A ShardedObject shard's file as Megatron-Core's common strategy writes it: ``<unique key>.pt``.
_MEGATRON_OBJECT_FILE = re.compile(rf"(?!{OBJECTS_DIR}/)[^/].*/shard_[0-9.]*_[0-9.]*\.pt")


def is_megatron_object_file(rel: str) -> bool:
    """Whether ``rel`` is named as Megatron-Core's common strategy names a ShardedObject
    shard's file (``<unique key>.pt``) outside ``OBJECTS_DIR``."""
    return _MEGATRON_OBJECT_FILE.fullmatch(rel) is not None


def object_path(shard_key: str) -> str:
    """Relative path of a ShardedObject shard's file."""
    return f"{OBJECTS_DIR}/{shard_key}.pt"
