"""Every key check happens before the first byte is written (issue 23, item 6).

Keys that name the format's own files (``zarr.json``, ``metadata.json``, ``common.pt``,
``.``-prefixed names of the save machinery), and keys whose files would have names or
paths too long for the target (a file system's NAME_MAX and PATH_MAX, S3's 1024-byte
object keys), of ShardedTensors, ShardedObjects and their shards: the ``save`` call
itself refuses them (an async save's too), on every rank, naming the checkpoint, the
key, why and what to do, and nothing is written. Reading keeps accepting what older
versions wrote.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from shardstore import (
    CheckpointingException,
    SaveOptions,
    ShardedObject,
    ShardedTensor,
    StorageLayout,
    load,
    save,
    verify,
)
from shardstore.format.records import check_key
from shardstore.format.records.names import check_storable_key
from shardstore.stores.base import NameLimits
from shardstore.stores.locations import open_location
from shardstore.stores.s3 import S3Options
from tests.dist import run_distributed
from tests.s3_support import KEY, REGION, SECRET, MotoServer
from tests.scenarios import rewrite_record

# A shard's file is __objects__/<key>/shard_<offset>_<shape>.pt: with 62 axes its name
# is 4 * 62 + 5 = 253 bytes (allowed as a key segment), 256 with ".pt" (over NAME_MAX).
SHARD_AXES = 62
# 1,023 characters (the key-length bound), 4,047 bytes: over PATH_MAX with any directory
PATH_MAX_KEY = "/".join(["\U0001f600" * 63] * 16)


@dataclass(frozen=True)
class BadKey:
    """A key the save must refuse.

    Attributes:
        name: the test id.
        key: the key of the tensor or object saved.
        named: the key the error must name (a shard's unique key for ``shard``).
        reason: a regular expression the error's reason must match.
        kind: ``tensor``, ``object`` (the ShardedObject's key) or ``shard`` (its shard's file).
    """

    name: str
    key: str
    reason: str
    kind: str = "tensor"

    @property
    def named(self) -> str:
        return self.state_dict()["x"].unique_key if self.kind == "shard" else self.key

    def state_dict(self) -> dict:
        if self.kind == "tensor":
            return {"x": ShardedTensor.from_rank_offsets(self.key, torch.ones(3), replica_id=0)}
        axes = SHARD_AXES if self.kind == "shard" else 1
        return {"x": ShardedObject(self.key, {"state": 1}, (1,) * axes, (0,) * axes)}


BAD_KEYS = [
    BadKey("commit record", "zarr.json", "metadata document of every Zarr group and array"),
    BadKey("group metadata", "g/zarr.json", "metadata document of every Zarr group and array"),
    BadKey("inside the commit record", "zarr.json/w", "metadata document of every Zarr group and array"),
    BadKey("backend metadata", "metadata.json", "the checkpoint's own file"),
    BadKey("common state", "common.pt", "the checkpoint's own file"),
    BadKey("pack file", "packs/0-0.zip", "packed small arrays"),
    BadKey("inside a pack file", "packs/3-12.zip/w", "packed small arrays"),
    BadKey("save marker", ".shardstore-save.json", "starting with '.'"),
    BadKey("hidden segment", "a/.w", "starting with '.'"),
    BadKey("segment over 255 bytes", "a/" + "é" * 200, "400 bytes"),
    BadKey("path over PATH_MAX", PATH_MAX_KEY, "PATH_MAX"),
    BadKey("object key reserved", "common.pt", "the checkpoint's own file", kind="object"),
    BadKey("object key hidden", "rng/.state", "starting with '.'", kind="object"),
    BadKey("object key over 255 bytes", "rng/" + "é" * 130, "260 bytes", kind="object"),
    BadKey("shard file over NAME_MAX", "rng", r"name of 256 bytes", kind="shard"),
]


def _refusal(sd: dict, ckpt: str, asynchronous: bool) -> str:
    """The message of the save's refusal; fails the test if the save call accepted it
    (running the accepted request, as a trainer would, to leave nothing running)."""
    try:
        request = save(sd, ckpt, async_sharded_save=asynchronous)
    except CheckpointingException as exc:
        return str(exc)
    if request is not None:
        with contextlib.suppress(CheckpointingException):
            request.execute_sync()
    raise AssertionError("the save call accepted the key")


def _assert_nothing_written(parent: Path) -> None:
    """No checkpoint directory with content, and no staging directory next to it."""
    left = sorted(p.name for p in parent.iterdir())
    assert left == [] or (left == ["ckpt"] and not any((parent / "ckpt").iterdir())), left


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("bad", BAD_KEYS, ids=[b.name for b in BAD_KEYS])
def test_bad_key_is_refused_by_the_save_call_before_anything_is_written(
    tmp_path: Path, bad: BadKey, asynchronous: bool
) -> None:
    ckpt = tmp_path / "ckpt"
    message = _refusal(bad.state_dict(), str(ckpt), asynchronous)
    assert f"Invalid checkpoint key {bad.named!r}" in message, message
    assert str(ckpt) in message, message
    assert re.search(bad.reason, message), message
    assert "rename the key" in message or "shorten the key" in message, message
    _assert_nothing_written(tmp_path)


def save_bad_key_on_rank_1(rank: int, world: int, ckpt: str, asynchronous: bool) -> str:
    key = "zarr.json" if rank == 1 else "w"
    sd = {"t": ShardedTensor.from_rank_offsets(key, torch.ones(2), replica_id=0)}
    return _refusal(sd, ckpt, asynchronous)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_bad_key_on_one_rank_is_refused_on_every_rank(tmp_path: Path, asynchronous: bool) -> None:
    messages = run_distributed(save_bad_key_on_rank_1, 2, str(tmp_path / "ckpt"), asynchronous, timeout=90)
    for message in messages:
        assert "Invalid checkpoint key 'zarr.json'" in message and "rank(s) 1" in message, message
    _assert_nothing_written(tmp_path)


# --------------------------------------------- the other save paths check the target too
# Each refuses, before it writes an array, a key whose files would be longer than the
# local file system's PATH_MAX (or a shard file longer than its NAME_MAX): the format's
# own limits alone let these through to fail at the write with raw errno text.


def _assert_refused_as_too_long(message: str, ckpt: Path, key: str = PATH_MAX_KEY, limit: str = "PATH_MAX") -> None:
    assert f"Invalid checkpoint key {key!r} in {ckpt}" in message, message
    assert limit in message and "shorten the key" in message, message


def _files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


def _tensors_with_a_key_too_long(cls: type, rank: int = 0) -> dict:
    """A key that fits, then one whose files do not (sorted after it: written first)."""
    return {"w": cls.from_rank_offsets("w", torch.ones(4), replica_id=rank),
            "long": cls.from_rank_offsets(PATH_MAX_KEY, torch.ones(2), replica_id=rank)}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["save", "async_save"])
def test_strategy_used_directly_refuses_a_key_too_long_for_the_target_before_writing(
    tmp_path: Path, asynchronous: bool
) -> None:
    """``ZarrSaveShardedStrategy`` called without ``shardstore.save`` (an in-place save):
    ``async_save`` refuses at the call, not in its request."""
    from shardstore.strategies.zarr import ZarrSaveShardedStrategy

    strategy, ckpt = ZarrSaveShardedStrategy(), tmp_path / "ckpt"
    with pytest.raises(CheckpointingException) as refused:
        if asynchronous:
            strategy.async_save(_tensors_with_a_key_too_long(ShardedTensor), ckpt)
        else:
            strategy.save(_tensors_with_a_key_too_long(ShardedTensor), ckpt)
    _assert_refused_as_too_long(str(refused.value), ckpt)
    assert _files_under(tmp_path) == []


def megatron_save_with_a_key_too_long(rank: int, world: int, ckpt: str, asynchronous: bool) -> str:
    """Megatron's own ``dist_checkpointing.save`` with shardstore's plug-in; the refusal."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor as MegatronShardedTensor

    from shardstore.tools.megatron_strategy import ShardstoreSaveShardedStrategy

    if rank == 0:
        Path(ckpt).mkdir()  # Megatron's save expects the directory to exist
    torch.distributed.barrier()
    sd = {**_tensors_with_a_key_too_long(MegatronShardedTensor, rank), "iteration": 1}
    try:
        request = dist_checkpointing.save(sd, ckpt, sharded_strategy=ShardstoreSaveShardedStrategy(),
                                          async_sharded_save=asynchronous)
    except CheckpointingException as exc:
        return str(exc)
    if request is not None:  # run what was accepted, as a trainer would
        with contextlib.suppress(Exception):
            request.execute_sync()
    return "the save call accepted the key"


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_megatron_plugin_refuses_a_key_too_long_for_the_target_before_writing_an_array(
    tmp_path: Path, asynchronous: bool
) -> None:
    """Megatron writes its own ``common.pt`` before the plug-in runs; no array of ours
    may be written, on any rank."""
    pytest.importorskip("megatron.core.dist_checkpointing", reason="megatron-core not installed")
    ckpt = tmp_path / "ckpt"
    for message in run_distributed(megatron_save_with_a_key_too_long, 2, str(ckpt), asynchronous, timeout=120):
        _assert_refused_as_too_long(message, ckpt)
    assert set(_files_under(tmp_path)) <= {"ckpt/common.pt"}, _files_under(tmp_path)


def test_convert_refuses_a_key_too_long_for_the_target_before_writing(tmp_path: Path) -> None:
    """``shardstore convert`` of a DCP checkpoint (``convert.from_other_format``, through
    ``CheckpointWriter.write_array``): nothing is left at or next to the target."""
    import torch.distributed.checkpoint as dcp

    from shardstore.tools.convert import from_other_format

    source, ckpt = tmp_path / "dcp", tmp_path / "out"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.ones(4), PATH_MAX_KEY: torch.ones(2)}, checkpoint_id=source)
    with pytest.raises(CheckpointingException) as refused:
        from_other_format(source, ckpt)
    _assert_refused_as_too_long(str(refused.value), ckpt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp"]


def test_writer_refuses_a_shard_file_too_long_for_the_target_before_committing(tmp_path: Path) -> None:
    """``CheckpointWriter.commit``'s sharded objects: refused before the common state or
    any shard is written."""
    from shardstore.tools.array_writer import CheckpointWriter

    shard = ShardedObject("rng", {"state": 1}, (1,) * SHARD_AXES, (0,) * SHARD_AXES).unique_key
    ckpt = tmp_path / "ckpt"
    with CheckpointWriter(ckpt) as writer:
        writer.write_array("w", torch.ones(4))
        with pytest.raises(CheckpointingException) as refused:
            writer.commit(common_state={"iteration": 1}, objects={shard: {"state": 1}})
        staged = _files_under(tmp_path)  # the staging directory, before the writer abandons it
        writer.abandon()
    _assert_refused_as_too_long(str(refused.value), ckpt, shard, "name of 256 bytes")
    assert not [f for f in staged if "common.pt" in f or "__objects__" in f], staged
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ S3

BUCKET = "keys"


@pytest.fixture(scope="module")
def s3_endpoint(moto_server: MotoServer) -> str:
    moto_server.create_bucket(BUCKET)
    return moto_server.endpoint


def test_key_over_the_s3_object_key_limit_is_refused_before_anything_is_written(s3_endpoint: str) -> None:
    """Four 250-byte segments: every segment is a valid name, but ``<prefix>/<key>/zarr.json``
    is longer than the 1,024 bytes an S3 object key may have."""
    options = S3Options(endpoint_url=s3_endpoint, key=KEY, secret=SECRET, region=REGION)
    url = f"s3://{BUCKET}/run/iter_0000100"
    location = open_location(url, options=options)
    key = "/".join(["k" * 250] * 4)
    sd = {"t": ShardedTensor.from_rank_offsets(key, torch.ones(2), replica_id=0)}
    with pytest.raises(CheckpointingException) as refused:
        save(sd, location)
    message = str(refused.value)
    assert f"Invalid checkpoint key {key!r} in {url}" in message and "1024" in message, message
    assert "shorten the key" in message, message
    assert location.store.fs.find(f"{BUCKET}/run") == [], "something was written"


# ------------------------------------------------------------------ reading stays


def test_reading_accepts_what_writing_refuses() -> None:
    """Records written by older versions hold keys refused now (on S3, where no file
    collides, ``common.pt`` or ``.w`` committed fine): reading checks only that a key
    stays inside the checkpoint."""
    for key in ("zarr.json/w", "common.pt", ".w", "a/" + "é" * 200):
        check_key(key)
        with pytest.raises(CheckpointingException, match="Invalid checkpoint key"):
            check_key(key, "ckpt", storage=NameLimits())


@pytest.mark.parametrize("key", ["zarr.json/w", "common.pt", "a/.w", "a/" + "\u00e9" * 200, PATH_MAX_KEY, "fits"])
def test_the_target_check_of_a_checked_key_words_what_the_whole_check_does(key: str) -> None:
    """The coordinator checks against the target only what ``check_key`` adds for it
    (each rank checked its keys' own form): the same refusal, in the same words."""
    limits, files = NameLimits(255, 4000, "PATH_MAX"), (f"{key}/zarr.json", f"{key}/c.0")
    check_key(key)
    try:
        check_key(key, "ckpt", limits, files)
    except CheckpointingException as whole:
        with pytest.raises(CheckpointingException) as alone:
            check_storable_key(key, "ckpt", limits, files)
        assert str(alone.value) == str(whole)
    else:
        check_storable_key(key, "ckpt", limits, files)


def test_checkpoint_holding_a_key_refused_now_still_loads(tmp_path: Path) -> None:
    """A checkpoint an older version wrote with the key ``.w``: load and verify read it."""
    ckpt = tmp_path / "ckpt"
    # per array: the older version's layout, a directory per array that the test renames
    save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0), replica_id=0)}, ckpt,
         options=SaveOptions(layout=StorageLayout(pack_arrays_up_to=0)))
    shutil.move(ckpt / "w", ckpt / ".w")


    def rename(root: dict) -> None:
        record = root["attributes"]["shardstore"]
        record["arrays"][".w"] = record["arrays"].pop("w")
        consolidated = root["consolidated_metadata"]["metadata"]
        consolidated[".w"] = consolidated.pop("w")

    rewrite_record(ckpt, rename)
    loaded = load({"w": ShardedTensor.from_rank_offsets(".w", torch.empty(4), replica_id=0)}, ckpt)
    assert torch.equal(loaded["w"], torch.arange(4.0))
    assert verify(ckpt).ok


def test_convert_checks_every_key_before_it_begins_the_save(tmp_path: Path, monkeypatch) -> None:
    """The bad key is the last array the conversion would reach: it is refused before
    the first array (and before the staging directory) is written."""
    import torch.distributed.checkpoint as dcp

    import shardstore.execution.pipeline
    from shardstore.tools.convert import from_other_format

    source, ckpt = tmp_path / "dcp", tmp_path / "out"
    last = "zz/zarr.json"  # the format's own name, reached last
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"a": torch.ones(4), last: torch.ones(2)}, checkpoint_id=source)
    begun = []
    monkeypatch.setattr(shardstore.execution.pipeline, "begin_save", lambda *a, **k: begun.append(a) or pytest.fail("began"))
    with pytest.raises(CheckpointingException) as refused:
        from_other_format(source, ckpt)
    assert f"Invalid checkpoint key {last!r} in {ckpt}" in str(refused.value)
    assert begun == [] and sorted(p.name for p in tmp_path.iterdir()) == ["dcp"]


def test_a_symlinked_target_is_measured_by_its_real_path(tmp_path: Path) -> None:
    """The save writes under the resolved path: a key that fits behind the short link
    but not behind the long real path is refused before anything is written, not met
    with a raw ENAMETOOLONG."""
    real = tmp_path
    for _ in range(14):  # a real path of about 3,560 bytes
        real = real / ("d" * 250)
    real.mkdir(parents=True)
    link = tmp_path / "short"
    link.symlink_to(real)
    key = "/".join(["k" * 200] * 4)  # ~800 bytes: fits behind the link, not behind the real path
    with pytest.raises(CheckpointingException, match="PATH_MAX") as refused:
        save({"w": ShardedTensor.from_rank_offsets(key, torch.ones(2))}, link / "ckpt")
    assert "shorten the key" in str(refused.value)
    assert not (real / "ckpt").exists() and [p.name for p in real.iterdir()] == []


@pytest.mark.parametrize("inner", ["sub", "w/inner", "a/b/c"])
def test_a_save_inside_a_committed_checkpoint_is_refused_naming_it(tmp_path: Path, inner: str) -> None:
    """Before, ``save`` into ``ckpt/sub`` (or into an array's directory of ``ckpt``)
    committed a second checkpoint inside the first, whose record lists none of its
    files: ``verify ckpt`` then reported every one of them as unlisted (exit status 1)
    and a save replacing ``ckpt`` refused to delete them."""
    ckpt = tmp_path / "ckpt"
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, ckpt)
    with pytest.raises(CheckpointingException) as refused:
        save({"x": ShardedTensor.from_rank_offsets("x", torch.ones(2))}, ckpt / inner)
    message = str(refused.value)
    assert f"{ckpt / inner}" in message and f"inside the committed checkpoint {ckpt}" in message, message
    assert "outside it" in message and "shared_directory=True" in message, message
    assert not (ckpt / inner).exists() and verify(ckpt).ok


def test_a_save_inside_a_committed_checkpoint_on_an_object_store_is_refused() -> None:
    """As on disk, for a prefix inside a committed one (``memory://``, as on S3)."""
    outer = "memory://inside-committed/ckpt"
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, outer)
    with pytest.raises(CheckpointingException, match=f"inside the committed checkpoint {outer}"):
        save({"x": ShardedTensor.from_rank_offsets("x", torch.ones(2))}, f"{outer}/sub")
    assert verify(outer).ok


def test_a_save_inside_a_committed_checkpoint_on_s3_is_refused(s3_endpoint: str) -> None:
    """On S3 each enclosing prefix's ``zarr.json`` is read (one GET each) through the
    target's own file system."""
    options = S3Options(endpoint_url=s3_endpoint, key=KEY, secret=SECRET, region=REGION)
    outer = f"s3://{BUCKET}/inside/iter_0000100"
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, open_location(outer, options=options))
    inner = open_location(f"{outer}/sub", options=options)
    with pytest.raises(CheckpointingException, match=f"inside the committed checkpoint {outer}"):
        save({"x": ShardedTensor.from_rank_offsets("x", torch.ones(2))}, inner)
    assert inner.store.fs.find(f"{BUCKET}/inside/iter_0000100/sub") == [], "something was written"


def test_a_shared_directory_save_inside_a_committed_checkpoint_is_kept(tmp_path: Path) -> None:
    """Megatron-LM's ModelOpt saves ``iter_N/modelopt_state`` into a committed
    iteration through Megatron's door (``shared_directory=True``): still saved, and
    ``verify`` of the iteration lists its files apart."""
    ckpt = tmp_path / "iter_0000100"
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, ckpt)
    save({"x": ShardedTensor.from_rank_offsets("x", torch.ones(2))}, ckpt / "modelopt_state", shared_directory=True)
    assert verify(ckpt / "modelopt_state").ok
    assert {rel.split("/")[0] for rel in verify(ckpt).unlisted} == {"modelopt_state"}


def test_a_plan_whose_keys_hold_a_text_a_store_refuses_is_made_anew_for_it() -> None:
    """A cached plan is reused for a target whose limits admit its names: not for S3 where
    a key holds ``?versionId=`` (the full check then names the key)."""
    from shardstore.planning.checks import admits_names, local_records, name_lengths_needed
    from shardstore.planning.layout import GatheredShards
    from shardstore.stores.base import OBJECT_VERSION_TEXT

    tensors = [ShardedTensor.from_rank_offsets(f"w{OBJECT_VERSION_TEXT}1", torch.ones(2))]
    needed = name_lengths_needed(GatheredShards.from_gathered([local_records(tensors, [], 0)]))
    s3_like = NameLimits(None, 1000, "S3's keys", ((OBJECT_VERSION_TEXT, "an object version"),))
    assert not admits_names(s3_like, needed) and admits_names(NameLimits(None, 1000), needed)
