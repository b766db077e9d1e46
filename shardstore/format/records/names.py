"""What a checkpoint's files and markers are called, where its chunks and object
shards lie, and what a checkpoint key may be.

The root ``zarr.json`` is the commit record (``COMMIT_RECORD``); ``common.pt`` the common
state; ``__objects__/<shard key>.pt`` a ShardedObject's shards (``object_path``), or
``<shard key>.pt`` where Megatron-Core's own save wrote them (``is_megatron_object_file``);
``<key>/c.1.0`` an array's chunks (``chunk_key``). A save in progress, a replacement and
the manager's deletion leave markers and directories named here.

A key is a ``/``-separated path inside the checkpoint (``check_key``): a key read back
must stay inside it; a key written must also not collide with the format's own names
(``check_storable_key``). A set of keys implies groups (``parent_groups``), which no
array may also be (``array_group_collisions``).
"""

from __future__ import annotations

__all__ = [
    "CHUNK_SEPARATOR",
    "COMMIT_RECORD",
    "COMMON_FILE",
    "DELETION_MARKER",
    "LEGACY_CHUNK_SEPARATOR",
    "MAX_KEY_LENGTH",
    "MAX_SEGMENT_LENGTH",
    "MOVING_IN",
    "OBJECTS_DIR",
    "REPLACED_TAG",
    "REPLACING_PHASE",
    "RESERVED_NAMES",
    "RESERVED_ROOT_NAMES",
    "SAVE_MARKER",
    "SETTING_ASIDE",
    "STAGING_TAG",
    "ZARR_JSON",
    "array_group_collisions",
    "check_key",
    "check_storable_key",
    "chunk_key",
    "is_megatron_object_file",
    "object_path",
    "parent_groups",
]

import re
from typing import Any

from shardstore.errors import CheckpointingException
from shardstore.format.config import CONFIG_FNAME
from shardstore.format.features import (
    PACK_NAME,
    PACKS_DIR,
)
from shardstore.stores.base import NameLimits

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


MAX_KEY_LENGTH = 1024
MAX_SEGMENT_LENGTH = 255
# Names no segment of a key being written may take: the metadata document of every Zarr
# group and array; and, as the first segment, the checkpoint's own files (``__objects__``
# is refused as ``__``-prefixed, the save machinery's names as ``.``-prefixed).
RESERVED_NAMES = frozenset({ZARR_JSON})
RESERVED_ROOT_NAMES = {CONFIG_FNAME: "backend metadata", COMMON_FILE: "common state"}
# One search instead of a generator over the key's characters: a third of ``check_key``'s
# time, which every save and load spends on every key.
_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f]")


def check_key(
    key: Any, where: str | None = None, storage: NameLimits | None = None, files: tuple[str, ...] = ()
) -> None:
    """Rejects keys that could escape the checkpoint or clash with the format.

    A key is a ``/``-separated path inside the checkpoint. Refused: non-strings, empty
    segments (so no leading, trailing or double ``/``), ``.`` and ``..``, segments
    starting with ``__`` (reserved for shardstore), backslashes, NUL and other control
    characters, and absurd lengths.

    ``storage``: the key is about to be written there (a save), so it must also name
    files that cannot collide with the format's own or fail to be created. Refused then:
    ``zarr.json`` as any segment, ``metadata.json`` and ``common.pt`` as the first,
    ``packs/<rank>-<n>.zip`` (a pack's name) as the first two,
    segments starting with ``.`` (the save machinery's marker and temporary files, other
    tools' metadata such as DCP's ``.metadata``), segments over 255 bytes of UTF-8; and
    ``files`` (the key's files, relative to the checkpoint) whose name or path is longer
    than ``storage`` takes. Reading checks without ``storage``: what an older version
    committed stays readable (on S3 nothing collides with ``common.pt/zarr.json``), and a
    key read back only has to stay inside the checkpoint.
    """
    context = f" in {where}" if where else ""

    def fail(reason: str) -> None:
        raise CheckpointingException(f"Invalid checkpoint key {key!r}{context}: {reason}")

    if not isinstance(key, str):
        fail("keys must be strings")
    if len(key) > MAX_KEY_LENGTH:
        fail(f"longer than {MAX_KEY_LENGTH} characters")
    if _CONTROL_CHARACTER.search(key):
        fail("contains NUL or another control character")
    if "\\" in key:
        fail("contains a backslash")
    segments = key.split("/")
    for segment in segments:
        if segment == "":
            fail("has an empty path segment (leading, trailing or double '/')")
        if segment in (".", ".."):
            fail(f"has a {segment!r} path segment")
        if segment.startswith("__"):
            fail("has a segment starting with '__' (reserved for shardstore)")
        if len(segment) > MAX_SEGMENT_LENGTH:
            fail(f"has a path segment longer than {MAX_SEGMENT_LENGTH} characters")
    if storage is not None and (reason := _unstorable(key, segments, storage, files)):
        fail(reason)


def check_storable_key(key: str, where: str | None, storage: NameLimits, files: tuple[str, ...] = ()) -> None:
    """``check_key(key, where, storage, files)`` of a key ``check_key`` accepted already
    (a save's keys, checked by each rank as it made their records): only what
    ``storage`` adds, with the same message."""
    if reason := _unstorable(key, key.split("/"), storage, files):
        raise CheckpointingException(f"Invalid checkpoint key {key!r}{f' in {where}' if where else ''}: {reason}")


def _unstorable(key: str, segments: list[str], storage: NameLimits, files: tuple[str, ...]) -> str | None:
    """Why a key (already checked as safe) cannot be written to ``storage``, with what to
    do about it; None if it can. An ASCII name's bytes are its characters (no encoding)."""
    plain = key.isascii()
    if not plain:
        try:
            key.encode()
        except UnicodeEncodeError:
            return "is not valid Unicode text (it holds a lone surrogate); rename the key"
    if segments[0] in RESERVED_ROOT_NAMES:
        return (f"{segments[0]!r} is the name of the checkpoint's own file of the "
                f"{RESERVED_ROOT_NAMES[segments[0]]}, which the key's files would collide with; rename the key")
    if segments[0] == PACKS_DIR and PACK_NAME.fullmatch(pack := "/".join(segments[:2])):
        return (f"{pack!r} is the name of a file of packed small arrays "
                "(SaveOptions.pack_arrays_up_to), which the key's files would collide with; rename the key")
    for segment in segments:
        if segment in RESERVED_NAMES:
            return (f"{segment!r} is the name of the metadata document of every Zarr group and array, which "
                    "the key's files would collide with; rename the key")
        if segment.startswith("."):
            return (f"has a segment starting with '.' ({segment!r}): such names are kept for the save's own "
                    "marker and temporary files and for other tools' metadata; rename the key")
        if not plain and (size := len(segment.encode())) > MAX_SEGMENT_LENGTH:
            return (f"has a path segment of {size} bytes in UTF-8, longer than the {MAX_SEGMENT_LENGTH} bytes "
                    "a name may have; shorten the key")
    for rel in files:
        plain = rel.isascii()
        size = len(rel) if plain else len(rel.encode())
        if storage.max_path_bytes is not None and size > storage.max_path_bytes:
            return (f"its file {rel!r} would have a path of {size} bytes, more than the {storage.max_path_bytes} "
                    f"left by {storage.path_limit}; shorten the key (or save to a shorter path)")
        name = max(map(len, rel.split("/"))) if plain else max(len(n.encode()) for n in rel.split("/"))
        if storage.max_name_bytes is not None and name > storage.max_name_bytes:
            return (f"its file {rel!r} would have a name of {name} bytes, longer than the "
                    f"{storage.max_name_bytes} bytes a file name may have there; shorten the key")
    return None


def array_group_collisions(keys: list[str]) -> list[str]:
    """Keys that cannot all live in one Zarr hierarchy: ``a`` and ``a/b`` would make
    ``a`` both an array and the group holding ``b`` (the second save would write its
    chunks inside the first's array). One message per clash, naming both keys."""
    arrays = set(keys)
    return [
        f"{group!r} is both an array and the group of {key!r}"
        for key in sorted(k for k in arrays if "/" in k)
        for group in parent_groups([key])
        if group in arrays
    ]


def parent_groups(keys: list[str]) -> list[str]:
    """Every intermediate group path implied by ``/`` in the keys, parents first."""
    groups = set()
    for key in keys:
        parts = key.split("/")
        for i in range(1, len(parts)):
            groups.add("/".join(parts[:i]))
    return sorted(groups, key=lambda g: (g.count("/"), g))
