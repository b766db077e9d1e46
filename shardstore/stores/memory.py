"""``memory://name/prefix`` checkpoint locations: fsspec's in-process memory file system.

For tests and for throw-away checkpoints inside one process: every ``memory://`` store
of a process shares fsspec's one memory file system, and nothing outlives the process.
It needs fsspec (``pip install 'shardstore[memory]'``; s3fs brings it too).

TensorStore cannot see fsspec's memory, so chunks go through this store's own
``get``/``put`` (``ChunkAccess`` with neither a local root nor a kvstore). A put stores
the whole value in one dictionary assignment, so readers see an object whole or not at
all, and it is durable for as long as the process lives; there is no rename, so a save
is published in place, commit record last, as on S3.
"""

from __future__ import annotations

from typing import Any

from shardstore.stores.base import Capabilities, ChunkAccess, StorageError, Store

SCHEME = "memory://"


class MemoryStore(Store):
    """A checkpoint under ``memory://prefix``.

    Args:
        url: ``memory://some/prefix`` (the prefix must not be empty).
    """

    capabilities = Capabilities()

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
        self.fs = MemoryFileSystem()

    def __repr__(self) -> str:
        return f"MemoryStore({self.describe()!r})"

    def _path(self, key: str) -> str:
        return "/" + "/".join(p for p in (self.prefix, key.strip("/")) if p)

    def describe(self, key: str = "") -> str:
        return f"{SCHEME}{self._path(key)[1:]}"

    def _call(self, what: str, key: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise StorageError(f"Cannot {what} {self.describe(key)}: {exc}") from exc

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        try:
            data = self._call("read", key, self.fs.cat_file, self._path(key))
        except FileNotFoundError:
            return None
        if max_bytes is not None and len(data) > max_bytes:
            raise StorageError(f"{self.describe(key)} holds {len(data)} bytes, more than the {max_bytes} a record may have")
        return data

    def put(self, key: str, data: bytes) -> None:
        self._call("write", key, self.fs.pipe_file, self._path(key), bytes(data))

    def put_atomic(self, key: str, data: bytes) -> None:
        """The value is buffered whole and stored with one dictionary assignment."""
        self.put(key, data)

    def exists(self, key: str) -> bool:
        return bool(self._call("check", key, self.fs.exists, self._path(key)))

    def list_dir(self, prefix: str = "") -> list[str]:
        try:
            entries = self._call("list", prefix, self.fs.ls, self._path(prefix), False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def list(self, prefix: str = "") -> list[str]:
        root, top = self._path("") + "/", self._path(prefix) + "/"
        found = self._call("list", prefix, self.fs.find, top)
        return sorted(path[len(root):] for path in found if path.startswith(top))

    def delete(self, key: str) -> None:
        try:
            self._call("remove", key, self.fs.rm_file, self._path(key))
        except FileNotFoundError:
            pass

    def delete_prefix(self, prefix: str = "") -> None:
        top = self._path(prefix)
        if self.fs.isfile(top):
            self.delete(prefix)
            return
        for key in self.list(prefix):
            self.delete(key)

    def child(self, name: str) -> MemoryStore:
        return MemoryStore(self.describe(name))

    def chunk_access(self) -> ChunkAccess:
        return ChunkAccess()
