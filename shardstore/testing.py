"""Helpers for testing shardstore and its backends: a local S3 server, and the store
conformance suite every backend passes.

``LocalS3Server`` runs moto's S3 server (a real HTTP server, not a mock of boto calls)
on 127.0.0.1 on a free port. It needs ``moto[server]`` (in shardstore's ``test``
extra). The demo, the benchmark and the test suite use it.

``StoreTests`` is what every ``shardstore.stores.base.Store`` must do, as
``zarr.testing.store.StoreTests`` is for zarr's stores: bytes by key, listing and
prefixes, atomic puts under a concurrent reader, capabilities, byte ranges of chunks
(``ChunkStore.get_range_into``, ``get_suffix``), and a save published commit record
last. A backend proves itself by subclassing it in a pytest module:

    class TestMyStore(StoreTests):
        store_type = MyStore

        @pytest.fixture
        def store(self, tmp_path) -> MyStore:
            made = MyStore(...)  # fresh and empty: each test gets its own
            made.prepare()
            return made

The class is not collected itself (its name does not start with ``Test``). Importing
this module needs neither pytest nor moto; the tests import pytest when they run.
"""

from __future__ import annotations

__all__ = ["LocalS3Server", "StoreTests", "free_port"]

import logging
import os
import socket
import threading
from types import ModuleType
from typing import Any, ClassVar

import torch

from shardstore.engine.load import load
from shardstore.engine.save import save
from shardstore.engine.zarr_strategies import ZarrSaveShardedStrategy
from shardstore.format.integrity import verify
from shardstore.format.records import COMMIT_RECORD, is_committed, read_commit_record
from shardstore.mapping import ShardedTensor
from shardstore.stores.base import ChunkStore, Location, StorageError, Store

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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalS3Server:
    """moto's S3 server on 127.0.0.1; usable as a context manager."""

    def __init__(self, key: str = "testing-key", secret: str = "testing-secret", region: str = "us-east-1") -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
        self.key, self.secret, self.region = key, secret, region
        self.port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LocalS3Server:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> LocalS3Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def create_bucket(self, name: str) -> None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.key,
                              aws_secret_access_key=self.secret, region_name=self.region)
        client.create_bucket(Bucket=name)

    def export_environment(self) -> None:
        """Points the standard AWS variables of this process (and its children) here."""
        os.environ.update(AWS_ENDPOINT_URL=self.endpoint, AWS_ACCESS_KEY_ID=self.key,
                          AWS_SECRET_ACCESS_KEY=self.secret, AWS_REGION=self.region)


def _pytest() -> ModuleType:
    """pytest, imported when a test runs, so that importing this module needs none."""
    import pytest

    return pytest


def _fill(store: Store) -> None:
    for key in ["a/x", "a/y/z", "ab/x", "a.json", "b"]:
        store.put(key, key.encode())


def _small_chunks() -> ZarrSaveShardedStrategy:
    return ZarrSaveShardedStrategy(max_chunk_bytes=4096)


def _state(fill: float = 1.0) -> dict:
    # 64 chunks of 4 KiB: chunk I/O, not only small files, goes through the store
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((64, 1024), fill)),
            "b": ShardedTensor.from_rank_offsets("b", torch.arange(10, dtype=torch.float64))}


def _ranges_of(store: Store) -> tuple[ChunkStore, bytes]:
    """The store's chunk I/O, holding ``k/obj``: 1,000 bytes, each its offset mod 251."""
    data = bytes(i % 251 for i in range(1000))
    chunks = store.chunk_store(io_concurrency=4)
    chunks.put("k/obj", [memoryview(data[:300]), memoryview(data[300:])])
    return chunks, data


class StoreTests:
    """The conformance suite of ``Store``; subclass it once per backend (module docstring).

    A subclass gives ``store_type`` (the ``Store`` subclass under test) and a pytest
    fixture ``store`` returning a fresh, empty store of that type on which ``prepare()``
    has been called. Every test here then runs on it.
    """

    store_type: ClassVar[type[Store]]

    def pytest_generate_tests(self, metafunc: Any) -> None:
        """Runs the key round trip once per allowed key (pytest calls this hook on a
        test class; a decorator would need pytest at import)."""
        if "key" in metafunc.fixturenames:
            metafunc.parametrize("key", ALLOWED_KEYS)

    def test_the_store_is_fresh_and_of_its_declared_type(self, store: Store) -> None:
        assert isinstance(store, self.store_type), f"{type(store).__name__} is not a {self.store_type.__name__}"
        assert store.list() == [], f"the store fixture gave a store holding {store.list()[:5]}"

    # -------------------------------------------------------------- bytes by key

    def test_get_returns_what_put_stored(self, store: Store) -> None:
        store.put("a/b", b"value")
        assert store.get("a/b") == b"value"

    def test_put_replaces_the_whole_object(self, store: Store) -> None:
        store.put("k", b"a longer first value")
        store.put("k", b"short")
        assert store.get("k") == b"short"

    def test_missing_key_reads_as_none_and_does_not_exist(self, store: Store) -> None:
        assert store.get("missing/key") is None
        assert not store.exists("missing/key")
        store.put("present", b"")
        assert store.exists("present") and store.get("present") == b""

    def test_get_refuses_an_object_over_its_size_cap(self, store: Store) -> None:
        store.put("record", b"x" * 100)
        assert store.get("record", max_bytes=100) == b"x" * 100
        with _pytest().raises(StorageError, match="100|more than"):
            store.get("record", max_bytes=99)

    def test_keys_with_every_allowed_character_round_trip(self, store: Store, key: str) -> None:
        store.put(key, key.encode())
        assert store.get(key) == key.encode()
        assert store.exists(key)
        assert store.list() == [key]

    def test_put_many_stores_every_object(self, store: Store) -> None:
        objects = {f"objects/{i}.pt": bytes([i]) * i for i in range(20)}
        store.put_many(objects)
        assert store.list("objects") == sorted(objects)
        assert all(store.get(k) == v for k, v in objects.items())

    def test_delete_removes_one_key_and_ignores_a_missing_one(self, store: Store) -> None:
        store.put("a", b"1")
        store.put("b", b"2")
        store.delete("a")
        store.delete("never/there")
        assert store.get("a") is None and store.get("b") == b"2"
        assert store.list() == ["b"]

    def test_size_is_the_objects_length_and_none_when_missing(self, store: Store) -> None:
        store.put("a/b", b"x" * 300)
        assert store.size("a/b") == 300 and store.size("a/missing") is None

    # -------------------------------------------------------------- byte ranges of chunks

    def test_a_chunk_range_reads_any_span_of_the_object(self, store: Store) -> None:
        chunks, data = _ranges_of(store)
        for offset, lengths in [(0, [len(data)]), (0, [100, 1, 899]), (37, [10, 400]), (999, [1]), (500, [500])]:
            views = [memoryview(bytearray(n)) for n in lengths]
            chunks.get_range_into("k/obj", offset, views)
            assert b"".join(views) == data[offset : offset + sum(lengths)], (offset, lengths)

    def test_a_folded_chunk_range_hands_the_fold_every_byte_in_order(self, store: Store) -> None:
        chunks, data = _ranges_of(store)
        seen: list[bytes] = []
        views = [memoryview(bytearray(n)) for n in (100, 1, 400)]
        chunks.get_range_into_folded("k/obj", 37, views, lambda piece: seen.append(bytes(piece)))
        assert b"".join(views) == b"".join(seen) == data[37:538]

    def test_a_chunk_suffix_is_the_last_bytes_and_the_size(self, store: Store) -> None:
        chunks, data = _ranges_of(store)
        assert chunks.get_suffix("k/obj", 20) == (data[-20:], len(data))
        assert chunks.get_suffix("k/obj", len(data)) == (data, len(data))
        assert chunks.get_suffix("k/obj", 5000) == (data, len(data))  # longer than the object: all of it
        assert chunks.get_suffix("k/obj", 0) == (b"", len(data))
        assert chunks.get_suffix("k/missing", 20) is None

    def test_a_chunk_range_past_the_end_is_refused_naming_the_object(self, store: Store) -> None:
        chunks, data = _ranges_of(store)
        for offset, n in [(990, 11), (1000, 1), (5000, 4)]:
            with _pytest().raises(StorageError, match=r"k/obj"):
                chunks.get_range_into("k/obj", offset, [memoryview(bytearray(n))])
        with _pytest().raises(StorageError, match=r"k/missing"):
            chunks.get_range_into("k/missing", 0, [memoryview(bytearray(4))])

    def test_an_empty_chunk_range_reads_nothing(self, store: Store) -> None:
        chunks, _ = _ranges_of(store)
        views = [memoryview(bytearray(0)), memoryview(bytearray(0))]
        chunks.get_range_into("k/obj", 1000, views)
        chunks.get_range_into("k/obj", 0, [])
        assert [v.nbytes for v in views] == [0, 0]

    # -------------------------------------------------------------- listing and prefixes

    def test_list_is_every_key_sorted_and_relative(self, store: Store) -> None:
        _fill(store)
        assert store.list() == ["a.json", "a/x", "a/y/z", "ab/x", "b"]

    def test_list_sizes_names_every_key_with_its_length(self, store: Store) -> None:
        _fill(store)
        assert store.list_sizes() == {key: len(key) for key in store.list()}
        assert store.list_sizes("a") == {"a/x": 3, "a/y/z": 5}
        assert store.list_sizes("nothing") == {}

    def test_list_under_a_prefix_is_that_directory_only(self, store: Store) -> None:
        _fill(store)
        assert store.list("a") == ["a/x", "a/y/z"]
        assert store.list("nothing") == []

    def test_list_dir_names_what_is_directly_under(self, store: Store) -> None:
        _fill(store)
        assert store.list_dir() == ["a", "a.json", "ab", "b"]
        assert store.list_dir("a") == ["x", "y"]
        assert store.list_dir("nothing") == []

    def test_delete_prefix_removes_only_under_its_prefix(self, store: Store) -> None:
        _fill(store)
        store.delete_prefix("a")
        assert store.list() == ["a.json", "ab/x", "b"]
        store.delete_prefix("never/there")
        assert store.list() == ["a.json", "ab/x", "b"]

    def test_delete_prefix_leaves_the_names_it_is_told_to_keep(self, store: Store) -> None:
        _fill(store)
        store.delete_prefix("", keep=["a.json"])
        assert store.list() == ["a.json"]
        _fill(store)
        store.delete_prefix("a", keep=["x"])
        assert store.list() == ["a.json", "a/x", "ab/x", "b"]

    def test_delete_prefix_of_the_root_empties_the_store(self, store: Store) -> None:
        _fill(store)
        store.delete_prefix("")
        assert store.list() == [] and store.list_dir() == []

    def test_list_after_delete_no_longer_names_the_key(self, store: Store) -> None:
        _fill(store)
        store.delete("a/y/z")
        assert store.list() == ["a.json", "a/x", "ab/x", "b"]
        assert not store.exists("a/y/z")

    def test_child_is_the_directory_under_this_store(self, store: Store) -> None:
        store.child("step1").put("zarr.json", b"{}")
        assert store.list() == ["step1/zarr.json"]
        assert store.child("step1").describe("zarr.json") == store.describe("step1/zarr.json")

    # -------------------------------------------------------------- atomicity

    def test_a_reader_never_sees_part_of_an_atomic_put(self, store: Store) -> None:
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

    # -------------------------------------------------------------- capabilities

    def test_capabilities_agree_with_what_the_store_offers(self, store: Store) -> None:
        caps, access = store.capabilities, store.chunk_access()
        assert caps.is_local_filesystem == (store.local_path() is not None)
        assert caps.supports_rename == (store.publishing() is not None)
        assert (access.local_root is not None) <= caps.is_local_filesystem

    # -------------------------------------------------------------- publishing a save

    def test_save_and_load_round_trip(self, store: Store) -> None:
        location = Location(store)
        save(_state(), location, _small_chunks())
        loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 1024)),
                       "b": ShardedTensor.from_rank_offsets("b", torch.empty(10, dtype=torch.float64))}, location)
        assert torch.equal(loaded["w"], torch.ones(64, 1024))
        assert torch.equal(loaded["b"], torch.arange(10, dtype=torch.float64))
        assert len(read_commit_record(location).arrays["w"].chunk_crcs or ()) == 64

    def test_save_writes_the_commit_record_last_and_publishes_a_complete_checkpoint(
        self, store: Store, monkeypatch: Any
    ) -> None:
        written: list[str] = []
        inside = threading.local()  # a put that another logged put makes is not logged again
        kind = type(store)

        def logged_by(real, keys_of):
            def logged(self, *args):
                outermost = not getattr(inside, "depth", 0)
                inside.depth = getattr(inside, "depth", 0) + 1
                try:
                    result = real(self, *args)
                finally:
                    inside.depth -= 1
                if outermost:
                    written.extend(keys_of(*args))
                return result

            return logged

        for name in ("put", "put_atomic"):
            monkeypatch.setattr(kind, name, logged_by(getattr(kind, name), lambda key, data: [key]))
        for name in ("put_many", "put_new"):
            monkeypatch.setattr(kind, name, logged_by(getattr(kind, name), lambda objects: list(objects)))
        conditional = store.conditional_writes()
        if conditional is not None:  # an in-place save's claim, then the commit record that replaces it
            monkeypatch.setattr(type(conditional), "_put",
                                logged_by(type(conditional)._put, lambda key, data, version: [key]))
        location = Location(store)
        save(_state(), location, _small_chunks())
        claims = 0 if store.capabilities.supports_rename else 1
        assert written[-1] == COMMIT_RECORD and written.count(COMMIT_RECORD) == 1 + claims
        assert claims == 0 or written[0] == COMMIT_RECORD, "the claim comes before any other write"
        assert is_committed(location) and verify(location).ok

    def test_a_save_that_fails_before_its_commit_publishes_nothing(self, store: Store, monkeypatch: Any) -> None:
        def refuse(self, key: str, data: bytes) -> None:
            raise StorageError(f"injected failure writing {key}")

        monkeypatch.setattr(type(store), "put_atomic", refuse)
        conditional = store.conditional_writes()
        if conditional is not None:  # the commit record of an in-place save

            def refuse_record(self, key: str, data: bytes, version: str | None) -> str:
                if key == COMMIT_RECORD:
                    raise StorageError(f"injected failure writing {key}")
                return real_put(self, key, data, version)

            real_put = type(conditional)._put
            monkeypatch.setattr(type(conditional), "_put", refuse_record)
        location = Location(store)
        with _pytest().raises(Exception, match="injected failure"):
            save(_state(), location, _small_chunks())
        monkeypatch.undo()
        assert not is_committed(location)

    def test_overwrite_replaces_a_published_checkpoint_whole(self, store: Store) -> None:
        location = Location(store)
        save(_state(1.0), location, _small_chunks())
        save(_state(2.0), location, _small_chunks(), overwrite=True)
        loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 1024))}, location)
        assert torch.equal(loaded["w"], torch.full((64, 1024), 2.0)) and verify(location).ok
