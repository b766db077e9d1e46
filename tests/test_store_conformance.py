"""Every storage backend passes ``shardstore.testing.StoreTests`` (what a ``Store`` must
do), in the spirit of zarr-python's ``zarr.testing.store.StoreTests``: local disk,
fsspec's memory, and S3 (moto's server on 127.0.0.1; these tests are integration tests).

A new backend joins with one subclass here: its ``store_type`` and a ``store`` fixture
that opens a fresh, empty store by URL through the scheme registry.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

import pytest

from shardstore.format.records import COMMIT_RECORD
from shardstore.stores import local as local_backend
from shardstore.stores.base import StorageError, Store
from shardstore.stores.local import LocalStore
from shardstore.stores.locations import BACKENDS as SCHEMES
from shardstore.stores.locations import open_store
from shardstore.stores.memory import MemoryStore
from shardstore.stores.s3 import S3Options, S3Store
from shardstore.testing import StoreTests
from tests.s3_support import KEY, REGION, SECRET, MotoServer

BUCKET = "conformance"


def _prepared(store: Store) -> Store:
    store.prepare()
    return store


class TestLocalStore(StoreTests):
    store_type = LocalStore

    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return _prepared(open_store(tmp_path / uuid.uuid4().hex / "ckpt"))


class TestMemoryStore(StoreTests):
    store_type = MemoryStore

    @pytest.fixture
    def store(self) -> Store:
        return _prepared(open_store(f"memory://conformance/{uuid.uuid4().hex}/ckpt"))


@pytest.fixture(scope="module")
def s3_server(moto_server: MotoServer) -> MotoServer:
    moto_server.create_bucket(BUCKET)
    return moto_server


class TestS3Store(StoreTests):
    store_type = S3Store

    @pytest.fixture
    def store(self, s3_server: MotoServer) -> Store:
        options = S3Options(endpoint_url=s3_server.endpoint, key=KEY, secret=SECRET, region=REGION)
        return _prepared(open_store(f"s3://{BUCKET}/{uuid.uuid4().hex}/ckpt", options=options))


def test_every_backend_runs_the_conformance_suite() -> None:
    covered = {cls.store_type for cls in StoreTests.__subclasses__()}
    missing = {LocalStore, *SCHEMES.values()} - covered
    assert not missing, f"no StoreTests subclass in tests/ for {sorted(c.__name__ for c in missing)}"


def test_every_url_scheme_is_registered_once() -> None:
    assert {"s3", "memory"} <= set(SCHEMES)
    with pytest.raises(StorageError, match="Unsupported checkpoint location scheme 'gopher'"):
        open_store("gopher://host/ckpt")


def test_a_local_atomic_put_that_fails_midway_leaves_the_old_content(tmp_path, monkeypatch) -> None:
    store = open_store(tmp_path / "ckpt")
    store.put_atomic(COMMIT_RECORD, b"old record")
    real_fdopen = os.fdopen

    class HalfWritten:
        """A file whose write stores half the bytes, then fails as a full disk does."""

        def __init__(self, f) -> None:
            self.f = f

        def __enter__(self) -> HalfWritten:
            return self

        def __exit__(self, *exc) -> None:
            self.f.close()

        def write(self, data: bytes) -> int:
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(local_backend.os, "fdopen", lambda fd, *a, **k: HalfWritten(real_fdopen(fd, *a, **k)))
    with pytest.raises(StorageError, match="No space left"):
        store.put_atomic(COMMIT_RECORD, b"a new record, longer than the old")
    monkeypatch.undo()
    assert store.get(COMMIT_RECORD) == b"old record"
    assert store.list() == [COMMIT_RECORD]  # the half-written temporary file is gone


def test_local_removals_never_go_through_a_linked_directory(tmp_path: Path) -> None:
    """``delete_prefix("a/w")`` with ``a`` a link to another directory ran
    ``shutil.rmtree(root/a/w)``, which refuses a link only as its last component: the
    other directory's ``w`` went, and ``delete("a/keep")`` unlinked through it too. Both
    are refused now, and so is a path that is itself a link."""
    other = tmp_path / "other"
    (other / "w").mkdir(parents=True)
    (other / "w" / "c.0.0").write_bytes(b"precious")
    (other / "keep").write_bytes(b"precious")
    root = tmp_path / "ckpt"
    root.mkdir()
    os.symlink(other, root / "a")
    store = LocalStore(root, fsync=False)
    for remove, key in [(store.delete_prefix, "a/w"), (store.delete, "a/keep"), (store.delete_prefix, "a"),
                        (store.delete, "a")]:
        with pytest.raises(StorageError, match="symbolic link"):
            remove(key)
    assert (other / "w" / "c.0.0").read_bytes() == b"precious"
    assert (other / "keep").read_bytes() == b"precious"
    assert (root / "a").is_symlink()
