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
import tensorstore as ts
import torch

from shardstore import ShardedTensor, load, save
from shardstore.engine.walk import read_location
from shardstore.format.records import COMMIT_RECORD
from shardstore.stores import local as local_backend
from shardstore.stores.base import StorageError, Store, kvstore_spec
from shardstore.stores.local import LocalStore
from shardstore.stores.locations import BACKENDS as SCHEMES
from shardstore.stores.locations import open_location, open_store
from shardstore.stores.memory import MemoryStore
from shardstore.stores.s3 import S3Options, S3Store
from shardstore.strategies.zarr import _create_zarr_array, _load_from_array, _save_to_existing_array
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


@pytest.mark.parametrize("url", ["s3://bkt/run/iter_0000100", "memory://run/iter_0000100"])
def test_a_url_that_pathlib_collapsed_is_refused_not_saved_locally(url: str, tmp_path: Path, monkeypatch) -> None:
    """``Path("s3://bkt/run")`` is ``s3:/bkt/run``, which has no ``://``: it was taken as
    a local path, so a save "to S3" wrote a directory ``s3:`` under the working
    directory and reported success (a load with the same Path read it back, so nothing
    told). Refused now, naming the URL to pass as a str."""
    monkeypatch.chdir(tmp_path)
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, 4))}
    with pytest.raises(StorageError, match="as a str") as refused:
        save(state, Path(url))
    assert url in str(refused.value)
    assert not list(tmp_path.iterdir())  # nothing written under the working directory


def test_the_tensorstore_spec_of_a_local_path_with_dot_dot_opens_the_array(tmp_path: Path) -> None:
    """``kvstore_spec`` of ``<tmp>/x/../ckpt`` kept the ``..``, which TensorStore's file
    driver refuses ("Invalid file path"): Megatron's zarr functions
    (``_create_zarr_array``, ``_load_from_array``) failed with TensorStore's bare
    ValueError on a directory every other entry reads. The spec now names the same
    directory without it, as the kernel resolves it."""
    (tmp_path / "x").mkdir()
    (tmp_path / "ckpt").mkdir()
    spelled = f"{tmp_path}/x/../ckpt"
    tensor = ShardedTensor.from_rank_offsets("w", torch.arange(16.0).reshape(4, 4))
    _save_to_existing_array(tensor, _create_zarr_array(tensor, spelled))
    loaded = _load_from_array(ShardedTensor.from_rank_offsets("w", torch.empty(4, 4)), spelled)
    assert torch.equal(loaded, tensor.data)
    spec = kvstore_spec(open_location(spelled), "w")
    assert ts.open({"driver": "zarr3", "kvstore": spec}).result().read().result().tolist() == tensor.data.tolist()


def test_a_bytes_path_opens_the_directory_it_names(tmp_path: Path) -> None:
    """``os.fspath`` passes bytes through, so a bytes path reached ``"://" in text`` and
    failed with a bare ``TypeError: a bytes-like object is required, not 'str'`` that
    named neither the path nor what to pass (and ``read_location`` took the bytes for a
    Location). It names the directory now, as for the ``os`` functions."""
    path = os.fsencode(tmp_path / "ckpt")
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, 4))}, path)
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 4))}, path)
    assert torch.equal(loaded["w"], torch.ones(4, 4))
    assert read_location(path).describe() == str(tmp_path / "ckpt")
