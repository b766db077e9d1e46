"""What a checkpoint key may be (``check_key``), what a save may write under it
(``check_storable_key``), and the groups a set of keys implies (``parent_groups``,
``array_group_collisions``).

A key is a ``/``-separated path inside the checkpoint: a key read back must stay inside
it; a key written must also not collide with the format's own names.
"""

from __future__ import annotations

__all__ = [
    "MAX_KEY_LENGTH",
    "MAX_SEGMENT_LENGTH",
    "RESERVED_NAMES",
    "RESERVED_ROOT_NAMES",
    "array_group_collisions",
    "check_key",
    "check_storable_key",
    "parent_groups",
]

import re
from typing import Any

from shardstore.errors import CheckpointingException
from shardstore.format.config import CONFIG_FNAME
from shardstore.format.pack_listing import (
    PACK_NAME,
    PACKS_DIR,
)
from shardstore.format.records.names import COMMON_FILE, ZARR_JSON
from shardstore.stores.base import NameLimits

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
