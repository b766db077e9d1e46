"""``memory://name/prefix`` checkpoint locations: fsspec's in-process memory file system.

For tests and for throw-away checkpoints inside one process: every ``memory://`` store
of a process shares fsspec's one memory file system, and nothing outlives the process.
It needs fsspec (``pip install 'shardstore[memory]'``; s3fs brings it too).

TensorStore cannot see fsspec's memory, so chunks go through this store's own
``get``/``put`` (``ChunkAccess`` with neither a local root nor a kvstore). A put stores
the whole value in one dictionary assignment, so readers see an object whole or not at
all, and it is durable for as long as the process lives; there is no rename, so a save
is published in place, commit record last, as on S3.

Another process never sees these objects (``Capabilities.shared_across_processes`` is
False): a save with several ranks is refused before it writes (``format.commit.check_shared``).
Within the process, threads that save into one prefix at once would each remove and
overwrite the other's files, so a save claims its prefix (``claim_for_save``) for as
long as it runs: a second save into it, or into a prefix inside it or around it, fails
at once and the first one commits alone. Its conditional writes (``conditional_writes``)
run under one lock; a marker no claim holds is a dead save's at once (``lease_s`` 0).
"""

from __future__ import annotations

__all__ = ["MemoryStore"]

import hashlib
import threading
from collections.abc import Callable
from typing import Any

from shardstore.stores.base import Capabilities, ChunkAccess, StorageError
from shardstore.stores.conditional import ConditionalWrites, PreconditionFailed, VersionedObject
from shardstore.stores.fsspec_base import FsspecStore

SCHEME = "memory://"

# Prefixes (file system paths) claimed by running saves of this process -> their save
# ids; one table, like fsspec's one memory file system.
_claims: dict[str, str] = {}
_claims_lock = threading.Lock()


class MemoryStore(FsspecStore):
    """A checkpoint under ``memory://prefix``.

    Args:
        url: ``memory://some/prefix`` (the prefix must not be empty).
    """

    capabilities = Capabilities(shared_across_processes=False)

    def __init__(self, url: str) -> None:
        if not url.startswith(SCHEME) or not url[len(SCHEME):].strip("/"):
            raise StorageError(f"Not a memory:// location: {url!r}; expected memory://name/prefix")
        self.prefix = url[len(SCHEME):].strip("/")
        try:
            from fsspec.implementations.memory import MemoryFileSystem
        except ImportError as exc:
            raise StorageError(
                f"{url}: memory:// locations need fsspec, which is not installed; pip install 'shardstore[memory]'"
            ) from exc
        self._fs = MemoryFileSystem()

    @property
    def fs(self) -> Any:
        return self._fs

    def __repr__(self) -> str:
        return f"MemoryStore({self.describe()!r})"

    def _path(self, key: str) -> str:
        return "/" + "/".join(p for p in (self.prefix, key.strip("/")) if p)

    def describe(self, key: str = "") -> str:
        return f"{SCHEME}{self._path(key)[1:]}"

    def child(self, name: str) -> MemoryStore:
        return MemoryStore(self.describe(name))

    def chunk_access(self) -> ChunkAccess:
        return ChunkAccess()

    def claim_for_save(self, save_id: str) -> Callable[[], None]:
        root = self._path("")
        with _claims_lock:
            held = next((p for p in _claims if p == root or p.startswith(root + "/") or root.startswith(p + "/")), None)
            if held is not None:
                raise StorageError(
                    f"Cannot save into {self.describe()}: save {_claims[held]} into {SCHEME}{held[1:]} is still "
                    "running in this process, and saves into one memory:// prefix (or prefixes inside one another) "
                    "run one at a time; wait for it to finish, or save to another prefix"
                )
            _claims[root] = save_id

        def release() -> None:
            with _claims_lock:
                if _claims.get(root) == save_id:
                    del _claims[root]

        return release

    def conditional_writes(self) -> ConditionalWrites:
        return _MemoryConditional(self)


class _MemoryConditional(ConditionalWrites):
    """``ConditionalWrites`` of a ``MemoryStore``: one lock for the process's memory file
    system; a version is the MD5 of the bytes (values written conditionally are unique)."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def _put(self, key: str, data: bytes, version: str | None) -> str:
        with _claims_lock:
            found = self.store.get(key)
            if (found is None) != (version is None) or (found is not None and _version(found) != version):
                raise PreconditionFailed(key)
            self.store.put(key, data)
        return _version(data)

    def _delete(self, key: str) -> None:
        self.store.delete(key)

    def delete_if_version(self, key: str, version: str) -> bool:
        with _claims_lock:
            found = self.store.get(key)
            if found is None or _version(found) != version:
                return False
            self.store.delete(key)
        return True

    def get_versioned(self, key: str, max_bytes: int) -> VersionedObject | None:
        with _claims_lock:
            found = self.store.get(key)
        return None if found is None else VersionedObject(found[: max_bytes + 1], _version(found), 0.0)


def _version(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()
