"""What every storage backend must do (``shardstore.stores.base.Store``), in the spirit of
zarr-python's ``zarr.testing.store.StoreTests``: one set of tests, run on local disk,
S3 (moto's server on 127.0.0.1) and fsspec's memory.

A new backend joins by adding its name to ``BACKENDS`` and a branch to ``make_store``.
"""

from __future__ import annotations

import errno
import os
import threading
import uuid

import pytest
import torch

from shardstore import ShardedTensor, load, save
from shardstore.format.integrity import verify
from shardstore.format.records import COMMIT_RECORD, is_committed, read_commit_record
from shardstore.stores import local as local_backend
from shardstore.stores.base import Location, StorageError, Store
from shardstore.stores.locations import BACKENDS as SCHEMES
from shardstore.stores.locations import open_store
from shardstore.strategies.zarr import ZarrSaveShardedStrategy

BACKENDS = ["local", "s3", "memory"]
BUCKET = "conformance"
# Characters a checkpoint key may hold (``format.records.check_key`` refuses only control
# characters, backslashes, empty segments, "." and ".."), and names of our own files.
ALLOWED_KEYS = [
    "zarr.json",
    "model/layer.0/weight/c.0.1",
    "optim/exp_avg-sq_v2/zarr.json",
    "names with spaces/and+plus=equals,comma;semi@at~tilde",
    "unicode/grüße-ß-δ-日本",
    "__objects__/shard.0.pt",
]


@pytest.fixture(scope="module")
def s3_server(moto_server: object) -> object:
    moto_server.create_bucket(BUCKET)
    return moto_server


def make_store(kind: str, request: pytest.FixtureRequest, tmp_path) -> Store:
    """A fresh, empty store of ``kind``, opened by URL through the scheme registry."""
    name = uuid.uuid4().hex
    if kind == "local":
        return open_store(tmp_path / name / "ckpt")
    if kind == "s3":
        from shardstore.stores.s3 import S3Options
        from tests.s3_support import KEY, REGION, SECRET

        server = request.getfixturevalue("s3_server")
        options = S3Options(endpoint_url=server.endpoint, key=KEY, secret=SECRET, region=REGION)
        return open_store(f"s3://{BUCKET}/{name}/ckpt", options=options)
    if kind == "memory":
        return open_store(f"memory://conformance/{name}/ckpt")
    raise AssertionError(f"no store for {kind}")


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path) -> Store:
    made = make_store(request.param, request, tmp_path)
    made.prepare()
    return made


# ------------------------------------------------------------------ bytes by key


def test_get_returns_what_put_stored(store: Store) -> None:
    store.put("a/b", b"value")
    assert store.get("a/b") == b"value"


def test_put_replaces_the_whole_object(store: Store) -> None:
    store.put("k", b"a longer first value")
    store.put("k", b"short")
    assert store.get("k") == b"short"


def test_missing_key_reads_as_none_and_does_not_exist(store: Store) -> None:
    assert store.get("missing/key") is None
    assert not store.exists("missing/key")
    store.put("present", b"")
    assert store.exists("present") and store.get("present") == b""


def test_get_refuses_an_object_over_its_size_cap(store: Store) -> None:
    store.put("record", b"x" * 100)
    assert store.get("record", max_bytes=100) == b"x" * 100
    with pytest.raises(StorageError, match="100|more than"):
        store.get("record", max_bytes=99)


@pytest.mark.parametrize("key", ALLOWED_KEYS)
def test_keys_with_every_allowed_character_round_trip(store: Store, key: str) -> None:
    store.put(key, key.encode())
    assert store.get(key) == key.encode()
    assert store.exists(key)
    assert store.list() == [key]


def test_put_many_stores_every_object(store: Store) -> None:
    objects = {f"objects/{i}.pt": bytes([i]) * i for i in range(20)}
    store.put_many(objects)
    assert store.list("objects") == sorted(objects)
    assert all(store.get(k) == v for k, v in objects.items())


def test_delete_removes_one_key_and_ignores_a_missing_one(store: Store) -> None:
    store.put("a", b"1")
    store.put("b", b"2")
    store.delete("a")
    store.delete("never/there")
    assert store.get("a") is None and store.get("b") == b"2"
    assert store.list() == ["b"]


# ------------------------------------------------------------------ listing and prefixes


def _fill(store: Store) -> None:
    for key in ["a/x", "a/y/z", "ab/x", "a.json", "b"]:
        store.put(key, key.encode())


def test_list_is_every_key_sorted_and_relative(store: Store) -> None:
    _fill(store)
    assert store.list() == ["a.json", "a/x", "a/y/z", "ab/x", "b"]


def test_list_under_a_prefix_is_that_directory_only(store: Store) -> None:
    _fill(store)
    assert store.list("a") == ["a/x", "a/y/z"]
    assert store.list("nothing") == []


def test_list_dir_names_what_is_directly_under(store: Store) -> None:
    _fill(store)
    assert store.list_dir() == ["a", "a.json", "ab", "b"]
    assert store.list_dir("a") == ["x", "y"]
    assert store.list_dir("nothing") == []


def test_delete_prefix_removes_only_under_its_prefix(store: Store) -> None:
    _fill(store)
    store.delete_prefix("a")
    assert store.list() == ["a.json", "ab/x", "b"]
    store.delete_prefix("never/there")
    assert store.list() == ["a.json", "ab/x", "b"]


def test_delete_prefix_of_the_root_empties_the_store(store: Store) -> None:
    _fill(store)
    store.delete_prefix("")
    assert store.list() == [] and store.list_dir() == []


def test_list_after_delete_no_longer_names_the_key(store: Store) -> None:
    _fill(store)
    store.delete("a/y/z")
    assert store.list() == ["a.json", "a/x", "ab/x", "b"]
    assert not store.exists("a/y/z")


def test_child_is_the_directory_under_this_store(store: Store) -> None:
    store.child("step1").put("zarr.json", b"{}")
    assert store.list() == ["step1/zarr.json"]
    assert store.child("step1").describe("zarr.json") == store.describe("step1/zarr.json")


# ------------------------------------------------------------------ atomicity


def test_a_reader_never_sees_part_of_an_atomic_put(store: Store) -> None:
    old, new = b"o" * 2**20, b"n" * 2**20
    store.put_atomic("record", old)
    seen: set[bytes | None] = set()
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            seen.add(store.get("record"))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(10):
            store.put_atomic("record", new if i % 2 == 0 else old)
    finally:
        done.set()
        reader.join()
    assert seen <= {old, new} and seen
    assert store.list() == ["record"]  # no temporary object is left behind


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


# ------------------------------------------------------------------ capabilities


def test_capabilities_agree_with_what_the_store_offers(store: Store) -> None:
    caps, access = store.capabilities, store.chunk_access()
    assert caps.is_local_filesystem == (store.local_path() is not None)
    assert caps.supports_rename == (store.publishing() is not None)
    assert (access.local_root is not None) <= caps.is_local_filesystem


def test_every_url_scheme_is_registered_once() -> None:
    assert {"s3", "memory"} <= set(SCHEMES)
    with pytest.raises(StorageError, match="Unsupported checkpoint location scheme 'gopher'"):
        open_store("gopher://host/ckpt")


# ------------------------------------------------------------------ publishing a save


def _small_chunks() -> ZarrSaveShardedStrategy:
    return ZarrSaveShardedStrategy(max_chunk_bytes=4096)


def _state(fill: float = 1.0) -> dict:
    # 64 chunks of 4 KiB: chunk I/O, not only small files, goes through the store
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((64, 1024), fill)),
            "b": ShardedTensor.from_rank_offsets("b", torch.arange(10, dtype=torch.float64))}


def test_save_and_load_round_trip(store: Store) -> None:
    location = Location(store)
    save(_state(), location, _small_chunks())
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 1024)),
                   "b": ShardedTensor.from_rank_offsets("b", torch.empty(10, dtype=torch.float64))}, location)
    assert torch.equal(loaded["w"], torch.ones(64, 1024))
    assert torch.equal(loaded["b"], torch.arange(10, dtype=torch.float64))
    assert len(read_commit_record(location).arrays["w"].chunk_crcs or ()) == 64


def test_save_writes_the_commit_record_last_and_publishes_a_complete_checkpoint(
    store: Store, monkeypatch
) -> None:
    written: list[str] = []
    inside = threading.local()  # a put that another logged put makes is not logged again
    kind = type(store)

    def logging(real, keys_of):
        def logged(self, *args):
            outermost = not getattr(inside, "depth", 0)
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                real(self, *args)
            finally:
                inside.depth -= 1
            if outermost:
                written.extend(keys_of(*args))

        return logged

    for name in ("put", "put_atomic"):
        monkeypatch.setattr(kind, name, logging(getattr(kind, name), lambda key, data: [key]))
    monkeypatch.setattr(kind, "put_many", logging(kind.put_many, lambda objects: list(objects)))
    location = Location(store)
    save(_state(), location, _small_chunks())
    assert written[-1] == COMMIT_RECORD and written.count(COMMIT_RECORD) == 1
    assert is_committed(location) and verify(location).ok


def test_a_save_that_fails_before_its_commit_publishes_nothing(store: Store, monkeypatch) -> None:
    def refuse(self, key: str, data: bytes) -> None:
        raise StorageError(f"injected failure writing {key}")

    monkeypatch.setattr(type(store), "put_atomic", refuse)
    location = Location(store)
    with pytest.raises(Exception, match="injected failure"):
        save(_state(), location, _small_chunks())
    monkeypatch.undo()
    assert not is_committed(location)


def test_overwrite_replaces_a_published_checkpoint_whole(store: Store) -> None:
    location = Location(store)
    save(_state(1.0), location, _small_chunks())
    save(_state(2.0), location, _small_chunks(), overwrite=True)
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 1024))}, location)
    assert torch.equal(loaded["w"], torch.full((64, 1024), 2.0)) and verify(location).ok
