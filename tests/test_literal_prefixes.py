"""Keys and prefixes are literal on every store (issue 34.3).

fsspec's ``rm``, ``glob`` and ``expand_path`` expand glob characters: ``rm("bkt/run[1]",
recursive=True)`` deletes ``bkt/run1``. A save with ``overwrite=True`` into ``run[1]``,
``run?`` or ``run*`` must leave ``run1``, ``runA`` and ``run_x`` alone, and so must
``remove_sharded_tensors`` with such a key prefix: on local disk, S3 and ``memory://``.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from shardstore import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    load,
    remove_sharded_tensors,
    save,
    verify,
)
from shardstore.stores.base import StorageError
from shardstore.stores.locations import open_location, open_store

BACKENDS = ["local", pytest.param("s3", marks=pytest.mark.integration), "memory"]  # s3: the session's server
BUCKET = "literal"
# (the checkpoint saved with glob characters, the one its pattern would match)
NEIGHBOURS = [("run[1]", "run1"), ("run?", "runA"), ("run*", "run_x")]
# Keys and prefixes whose characters URLs, S3 and fsspec treat specially (escapes, fragments,
# queries, non-ASCII, quotes): each stays one literal name.
ODD_KEYS = ["sp ace/w", "pct%20/w", "pct%2Fslash", "hash#x", "q?x=1", "ünï/ç😀", "plus+amp&eq=", "br[1]*", "tilde~'quote\""]
ODD_PREFIXES = ["sp ace/ck pt", "pct%41/ckpt%2F", "hash#/c?k=1", "ünï/😀", "glob[ab]*/c"]


@pytest.fixture(scope="module")
def s3_server(moto_server: object) -> object:
    moto_server.create_bucket(BUCKET)
    return moto_server


@pytest.fixture(params=BACKENDS)
def root(request: pytest.FixtureRequest, tmp_path, monkeypatch) -> str:
    """A fresh directory (or prefix) that checkpoints are saved under, by URL."""
    name = uuid.uuid4().hex
    if request.param == "local":
        return str(tmp_path / name)
    if request.param == "memory":
        return f"memory://literal/{name}"
    server = request.getfixturevalue("s3_server")
    for variable, value in (("AWS_ENDPOINT_URL", server.endpoint), ("AWS_ACCESS_KEY_ID", server.key),
                            ("AWS_SECRET_ACCESS_KEY", server.secret), ("AWS_REGION", server.region)):
        monkeypatch.setenv(variable, value)
    return f"s3://{BUCKET}/{name}"


def _state(fill: float, keys: tuple[str, ...] = ("w",)) -> dict:
    return {k: ShardedTensor.from_rank_offsets(k, torch.full((4, 3), fill)) for k in keys}


def _loads(where: str, fill: float, keys: tuple[str, ...] = ("w",)) -> None:
    loaded = load({k: ShardedTensor.from_rank_offsets(k, torch.empty(4, 3)) for k in keys}, where)
    for k in keys:
        assert torch.equal(loaded[k], torch.full((4, 3), fill)), k
    assert verify(where).ok


@pytest.mark.parametrize(("pattern", "neighbour"), NEIGHBOURS)
def test_overwriting_a_checkpoint_named_like_a_glob_leaves_the_matching_one_alone(
    root: str, pattern: str, neighbour: str
) -> None:
    save(_state(1.0), f"{root}/{neighbour}")
    save(_state(2.0), f"{root}/{pattern}")
    save(_state(3.0), f"{root}/{pattern}", overwrite=True)
    _loads(f"{root}/{neighbour}", 1.0)
    _loads(f"{root}/{pattern}", 3.0)


@pytest.mark.parametrize(("pattern", "neighbour"), NEIGHBOURS)
def test_removing_tensors_by_a_glob_like_prefix_removes_only_those(root: str, pattern: str, neighbour: str) -> None:
    where = f"{root}/ckpt"
    save(_state(5.0, (pattern, neighbour)), where)
    remove_sharded_tensors(where, pattern)
    _loads(where, 5.0, (neighbour,))


def test_store_operations_take_glob_characters_literally(root: str) -> None:
    store = open_store(f"{root}/store")
    store.prepare()
    for key in ("a1/x", "aA/x", "a_x/x", "a[1]/x", "a?/x", "a*/x"):
        store.put(key, key.encode())
    assert store.list("a[1]") == ["a[1]/x"] and store.list("a?") == ["a?/x"] and store.list("a*") == ["a*/x"]
    assert not store.exists("a[1]/y") and store.exists("a?/x")
    for prefix in ("a[1]", "a?", "a*"):
        store.delete_prefix(prefix)
    assert store.list() == ["a1/x", "aA/x", "a_x/x"]
    store.delete("a?/x")
    assert store.list() == ["a1/x", "aA/x", "a_x/x"]


def test_s3_refuses_paths_that_s3fs_reads_as_object_versions(s3_server) -> None:
    from shardstore.stores.s3 import S3Options

    options = S3Options(endpoint_url=s3_server.endpoint, key=s3_server.key, secret=s3_server.secret)
    with pytest.raises(StorageError, match=r"versionId.*rename the key or prefix"):
        open_store(f"s3://{BUCKET}/run?versionId=3", options=options)
    store = open_store(f"s3://{BUCKET}/{uuid.uuid4().hex}", options=options)
    store.put("w", b"kept")
    with pytest.raises(StorageError, match=r"w\?versionId=1"):
        store.put("w?versionId=1", b"would replace w")
    with pytest.raises(StorageError, match="versionId"):
        store.delete_prefix("w?versionId=1")
    assert store.get("w") == b"kept"


def test_removing_every_tensor_of_a_group_removes_the_group(root: str) -> None:
    where = f"{root}/ckpt"
    save(_state(6.0, ("g1/a", "g1/sub/b", "g2/c", "g10/d")), where)
    remove_sharded_tensors(where, "g1/")
    assert [f for f in open_store(where).list() if f.startswith("g1/")] == []
    _loads(where, 6.0, ("g2/c", "g10/d"))


def test_s3_reports_the_keys_a_batch_delete_could_not_remove(s3_server, monkeypatch) -> None:
    from shardstore.stores.s3 import S3Options

    options = S3Options(endpoint_url=s3_server.endpoint, key=s3_server.key, secret=s3_server.secret)
    store = open_store(f"s3://{BUCKET}/{uuid.uuid4().hex}", options=options)
    store.put("a/x", b"x")
    denied = {"Errors": [{"Key": store._key("a/x"), "Code": "AccessDenied", "Message": "Access Denied"}]}
    monkeypatch.setattr(store.fs, "call_s3", lambda *args, **kwargs: denied)
    with pytest.raises(StorageError, match=r"Cannot remove 1 objects .*a/x \(AccessDenied"):
        store.delete_prefix("a")


@pytest.mark.parametrize("key", ODD_KEYS)
def test_keys_with_odd_characters_round_trip_and_verify(root: str, key: str) -> None:
    where = f"{root}/ckpt"
    value = torch.arange(12.0).reshape(4, 3)
    save({"t": ShardedTensor.from_rank_offsets(key, value),
          "o": ShardedObject(key + "_obj", {"v": 7}, (1,), (0,), replica_id=0)}, where)
    loaded = load({"t": ShardedTensor.from_rank_offsets(key, torch.empty(4, 3)),
                   "o": ShardedObject(key + "_obj", None, (1,), (0,), replica_id=0)}, where)
    assert torch.equal(loaded["t"], value) and loaded["o"] == {"v": 7}
    assert verify(where).ok, str(verify(where))


@pytest.mark.parametrize("prefix", ODD_PREFIXES)
def test_overwriting_under_an_odd_prefix_leaves_a_prefix_that_starts_with_it_alone(root: str, prefix: str) -> None:
    where, neighbour = f"{root}/{prefix}", f"{root}/{prefix}0"
    save(_state(5.0), neighbour)
    save(_state(1.0), where)
    save(_state(2.0), where, overwrite=True)
    _loads(where, 2.0)
    _loads(neighbour, 5.0)


def test_a_save_refuses_a_key_s3_reads_as_an_object_version_before_writing(s3_server) -> None:
    """``S3Store._key`` refuses keys holding ``?versionId=``; the save's key check
    refuses them too, naming the key, before anything is written, whatever the layout:
    a packed array's key, or one whose chunks TensorStore writes (the default on S3, with
    no ``zarr.json`` per array), reaches no ``S3Store._key`` during the save, yet names
    objects that s3fs cannot list, copy or delete."""
    from shardstore.stores.s3 import S3Options

    options = S3Options(endpoint_url=s3_server.endpoint, key=s3_server.key, secret=s3_server.secret)
    top = uuid.uuid4().hex
    location = open_location(f"s3://{BUCKET}/{top}/ckpt", options=options)
    with pytest.raises(CheckpointingException, match=r"w\?versionId=1"):
        save({"t": ShardedTensor.from_rank_offsets("w?versionId=1", torch.ones(3))}, location)
    location.store.fs.invalidate_cache()
    assert location.store.fs.find(f"{BUCKET}/{top}") == [], "something was written"
