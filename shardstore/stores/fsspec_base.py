"""The bytes-by-key operations of a ``Store`` on an fsspec file system, shared by the
backends that reach their bytes through fsspec (``s3``, ``memory``).

A backend subclass says where its file system is (``fs``), how a key becomes a path on
it (``_path``) and how it describes a key; listing, reading with a size cap, writing
and deleting are the same fsspec calls for all of them. ``_refresh`` lets a backend
whose file system caches listings (s3fs) drop them before a call that must see the
store as it is now.

Keys and prefixes are literal. fsspec's ``rm``, ``glob`` and ``expand_path`` expand glob
characters (``*``, ``?``, ``[...]``): ``rm("bkt/run[1]", recursive=True)`` deletes
``bkt/run1``. So nothing here passes a path to them: a listing is ``find``/``ls`` of
one literal path (neither expands, on s3fs or memory) filtered by that path, and a
deletion deletes the exact keys listed (``_delete_keys``).
"""

from __future__ import annotations

__all__ = ["FsspecStore"]

import copy
import logging
from abc import abstractmethod
from collections.abc import Collection
from typing import Any

from shardstore.stores.base import CopiedObject, StorageError, Store, run_parallel

logger = logging.getLogger(__name__)


class FsspecStore(Store):
    """A ``Store`` whose bytes live on an fsspec file system, under ``prefix``."""

    prefix: str

    @property
    @abstractmethod
    def fs(self) -> Any:
        """The fsspec file system (made on first use where that is costly)."""

    @abstractmethod
    def _path(self, key: str) -> str:
        """The file system's path of ``key``."""

    def enclosing(self) -> list[Store]:
        """The prefixes that hold this one, down to the root (``""``): copies of this
        store (same options) that share its file system, made here once."""
        fs = self.fs
        parts = self.prefix.split("/") if self.prefix else []
        return [self._at_prefix("/".join(parts[:n]), fs) for n in range(len(parts) - 1, -1, -1)]

    def _at_prefix(self, prefix: str, fs: Any) -> FsspecStore:
        store = copy.copy(self)
        store.prefix, store._fs = prefix, fs
        return store

    def _refresh(self) -> None:
        """Drops cached listings before a call that must see the store as it is now."""

    def _call(self, what: str, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Runs an fsspec call; a failure other than a missing file names the object."""
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise StorageError(f"Cannot {what} {self.describe(key)}: {exc}") from exc

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        try:
            if max_bytes is None:
                return self._call("read", key, self.fs.cat_file, self._path(key))
            data = self._call("read", key, self.fs.cat_file, self._path(key), start=0, end=max_bytes + 1)
        except FileNotFoundError:
            return None
        if len(data) > max_bytes:
            raise StorageError(f"{self.describe(key)} holds more than the {max_bytes} bytes expected there")
        return data

    def size(self, key: str) -> int | None:
        """One ``info`` of the object, never from a cached listing (a HEAD on S3)."""
        try:
            info = self._call("look up", key, self.fs.info, self._path(key), refresh=True)
        except FileNotFoundError:
            return None
        return int(info["size"]) if info.get("type") == "file" else None

    def put(self, key: str, data: bytes) -> None:
        self._call("write", key, self.fs.pipe_file, self._path(key), bytes(data))

    def copy_from(self, source: Store, key: str) -> CopiedObject | None:
        """fsspec's ``cp_file`` of one literal path, between stores on one file system
        object (same endpoint and credentials); it reports no ETag."""
        if not isinstance(source, FsspecStore) or source.fs is not self.fs:
            return None
        try:
            self._call("copy to", key, self.fs.cp_file, source._path(key), self._path(key))
        except FileNotFoundError:
            return None
        return CopiedObject()

    def put_atomic(self, key: str, data: bytes) -> None:
        """One object write: the backends here make an object visible whole or not at all.

        A write that failed may have stored the object all the same (its request was
        sent, every answer to it lost): where the object now holds exactly ``data``,
        the write is done (a commit record, a save's marker: reporting it failed would
        fail a save that committed)."""
        try:
            self.put(key, data)
        except StorageError as exc:
            if not self._holds(key, data):
                raise
            logger.warning("%s; %s holds the bytes written all the same: done", exc, self.describe(key))

    def _holds(self, key: str, data: bytes) -> bool:
        """Whether ``key`` holds exactly ``data`` now (False where it cannot be read)."""
        try:
            return self.get(key, max_bytes=len(data)) == data
        except StorageError as exc:
            logger.debug("Cannot read %s back: %s", self.describe(key), exc)
            return False

    def exists(self, key: str) -> bool:
        self._refresh()
        return bool(self._call("check", key, self.fs.exists, self._path(key)))

    def list_dir(self, prefix: str = "") -> list[str]:
        self._refresh()
        try:
            entries = self._call("list", prefix, self._entries, self._path(prefix))
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def _entries(self, path: str) -> list[str]:
        """The paths of the files and directories directly under ``path``."""
        return self.fs.ls(path, detail=False, refresh=True)

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self.list_sizes(prefix))

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """One listing (``find``; on S3 a ListObjectsV2 per 1,000 keys), which names
        each object's size."""
        self._refresh()
        root = self._path("").rstrip("/") + "/"
        top = self._path(prefix).rstrip("/") + "/"
        try:
            found = self._call("list", prefix, self.fs.find, top, detail=True)
        except FileNotFoundError:
            return {}
        return {path[len(root):]: int(info["size"]) for path, info in found.items() if path.startswith(top)}

    def delete(self, key: str) -> None:
        try:
            self._call("remove", key, self.fs.rm_file, self._path(key))
        except FileNotFoundError:
            pass

    def delete_prefix(self, prefix: str = "", keep: Collection[str] = ()) -> None:
        """Deletes the exact keys ``list(prefix)`` names but those ``keep`` names, and
        ``prefix`` itself where it names an object (never ``fs.rm``, which would expand
        glob characters)."""
        kept = {f"{prefix}/{name}" if prefix else name for name in keep}
        keys = [key for key in self.list(prefix) if key not in kept]
        if prefix:
            keys.append(prefix)
        self._delete_keys(keys)
        self._refresh()

    def delete_many(self, keys: list[str]) -> None:
        self._delete_keys(keys)
        self._refresh()

    def _delete_keys(self, keys: list[str]) -> None:
        """Deletes these exact keys (missing ones are no error); one call per key here, a
        backend with a batch delete overrides it."""
        run_parallel(self.delete, keys)
