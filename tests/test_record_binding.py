"""Issue 23.4: the commit record binds every byte a reader uses, and ``verify`` checks
exactly what ``load`` and a plain reader (zarr-python, TensorStore) would read.

Each damage below passed ``verify`` on the previous main: an array's ``zarr.json``
edited to another dtype of the same size (plain readers then read garbage while ``load``
returns the right values), the consolidated metadata edited, a ``common.pt`` copied in
from another checkpoint where the record lists none, a file added beside the chunks,
and a record changed in a way that still parses (it had no checksum of its own).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shardstore import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    StorageLayout,
    load,
    save,
    verify,
)
from shardstore.format.features import FORMAT_VERSION
from shardstore.format.records import COMMIT_RECORD, read_commit_record
from shardstore.format.records.encoding import FILE_DIGESTS, RECORD_DIGEST
from shardstore.stores.base import Location
from shardstore.stores.locations import open_location
from shardstore.stores.s3 import S3Options
from tests.s3_support import KEY, REGION, SECRET, MotoServer
from tests.scenarios import rewrite_record

W = torch.arange(12.0).reshape(4, 3)
# these tests edit each array's own Zarr document: packed arrays have none
PER_ARRAY = StorageLayout(pack_arrays_up_to=0, zarr_metadata="per_node")


def _state() -> dict:
    return {
        "layers/w": ShardedTensor.from_rank_offsets("layers/w", W.clone()),
        "rng": ShardedObject("rng", {"seed": 7}, (1,), (0,)),
        "step": 3,
    }


def _request() -> dict:
    return {"layers/w": ShardedTensor.from_rank_offsets("layers/w", torch.empty(4, 3))}


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    save(_state(), tmp_path / "ckpt", layout=PER_ARRAY)
    return tmp_path / "ckpt"


def _problems(checkpoint: Path | Location) -> dict[str, str]:
    report = verify(checkpoint)
    return {f"{p.key} [{p.part}]": p.message for p in report.problems}


def test_an_untouched_checkpoint_verifies_with_every_document_checked(saved: Path) -> None:
    report = verify(saved)
    assert report.ok, str(report)
    # metadata.json, common.pt, the object; layers/w's and the group layers' zarr.json
    assert report.files_checked == 5


def test_an_array_document_edited_to_another_dtype_of_the_same_size_is_flagged(saved: Path) -> None:
    document = saved / "layers" / "w" / "zarr.json"
    node = json.loads(document.read_text())
    node["data_type"] = "int32"  # same size as float32: a plain reader reads garbage, no error
    document.write_text(json.dumps(node))
    problems = _problems(saved)
    assert list(problems) == ["layers/w/zarr.json [metadata]"], problems
    assert "data_type: 'int32' where the record says 'float32'" in problems["layers/w/zarr.json [metadata]"]
    assert "zarr-python and TensorStore would read" in problems["layers/w/zarr.json [metadata]"]
    assert torch.equal(load(_request(), saved)["layers/w"], W)  # load reads the record, not the document


def test_a_group_document_turned_into_an_array_is_flagged(saved: Path) -> None:
    (saved / "layers" / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "array"}))
    assert "layers/zarr.json [metadata]" in _problems(saved)


def test_a_missing_array_document_is_flagged(saved: Path) -> None:
    (saved / "layers" / "w" / "zarr.json").unlink()
    assert _problems(saved) == {"layers/w/zarr.json [metadata]": "missing"}


def test_consolidated_metadata_edited_by_hand_fails_the_records_digest(saved: Path) -> None:
    path = saved / COMMIT_RECORD
    path.write_bytes(path.read_bytes().replace(b'"data_type":"float32"', b'"data_type":"int32"', 1))
    with pytest.raises(CheckpointingException, match="commit record is damaged or was edited"):
        load(_request(), saved)
    assert list(_problems(saved)) == ["zarr.json [file]"]


def test_consolidated_metadata_edited_and_resealed_is_flagged_by_verify(saved: Path) -> None:
    """Someone who knows the format reseals the record: the consolidated metadata is
    still compared with what the record implies."""
    rewrite_record(saved, lambda root: root["consolidated_metadata"]["metadata"]["layers/w"].update(data_type="int32"))
    problems = _problems(saved)
    assert list(problems) == ["zarr.json [consolidated layers/w]"], problems
    assert "data_type: 'int32'" in problems["zarr.json [consolidated layers/w]"]


def test_a_node_only_the_consolidated_metadata_lists_is_flagged(saved: Path) -> None:
    def add(root: dict) -> None:
        root["consolidated_metadata"]["metadata"]["ghost"] = {"zarr_format": 3, "node_type": "group", "attributes": {}}

    rewrite_record(saved, add)
    assert "zarr.json [consolidated ghost]" in _problems(saved)


@pytest.mark.parametrize("change", [(b'"world_size":1', b'"world_size":2'), (b'"created":1', b'"created":2')])
def test_a_record_changed_so_that_it_still_parses_is_refused_everywhere(saved: Path, change: tuple) -> None:
    path = saved / COMMIT_RECORD
    data = path.read_bytes()
    assert data.count(change[0]) == 1
    path.write_bytes(data.replace(*change))
    with pytest.raises(CheckpointingException, match="commit record is damaged or was edited"):
        load(_request(), saved)
    with pytest.raises(CheckpointingException, match="commit record is damaged"):
        read_commit_record(open_location(saved))
    assert not verify(saved).ok


def test_the_record_carries_its_digest_first(saved: Path) -> None:
    record = json.loads((saved / COMMIT_RECORD).read_bytes())["attributes"]["shardstore"]
    assert next(iter(record)) == RECORD_DIGEST and record["format_version"] == FORMAT_VERSION >= 4
    assert record[RECORD_DIGEST].startswith("crc32c:") and record[RECORD_DIGEST] != "crc32c:00000000"


def test_a_digest_removed_from_a_version_4_record_is_refused(saved: Path) -> None:
    def strip(root: dict) -> None:
        del root["attributes"]["shardstore"][RECORD_DIGEST]

    rewrite_record(saved, strip)
    with pytest.raises(CheckpointingException, match="record_digest None is missing"):
        load(_request(), saved)


def test_a_version_3_record_without_digest_still_loads_and_verifies(saved: Path) -> None:
    def as_version_3(root: dict) -> None:
        record = root["attributes"]["shardstore"]
        record["format_version"] = 3
        del record[RECORD_DIGEST]

    rewrite_record(saved, as_version_3)
    assert torch.equal(load(_request(), saved)["layers/w"], W)
    assert verify(saved).ok


def test_a_common_state_copied_in_where_the_record_lists_none_is_flagged(tmp_path: Path) -> None:
    """A record without common.pt (one older versions or another writer left)."""
    save(_state(), tmp_path / "bare")
    save(_state(), tmp_path / "other")
    (tmp_path / "bare" / "common.pt").unlink()
    def without_common(root: dict) -> None:
        root["attributes"]["shardstore"]["files"].pop("common.pt")
        root["attributes"]["shardstore"][FILE_DIGESTS].pop("common.pt")

    rewrite_record(tmp_path / "bare", without_common)
    assert verify(tmp_path / "bare").ok
    shutil.copy(tmp_path / "other" / "common.pt", tmp_path / "bare" / "common.pt")
    problems = _problems(tmp_path / "bare")
    assert list(problems) == ["common.pt [file]"], problems
    assert "not listed by the commit record" in problems["common.pt [file]"]


@pytest.mark.parametrize("extra", ["layers/w/c.9.9", "layers/w/c.0.0.bak", "notes.txt", "__objects__/rng/shard_9_9.pt",
                                   "layers/x/zarr.json"])
def test_files_the_record_does_not_list_are_flagged(saved: Path, extra: str) -> None:
    (saved / extra).parent.mkdir(parents=True, exist_ok=True)
    (saved / extra).write_bytes(b"not ours")
    assert list(_problems(saved)) == [f"{extra} [file]"]


def test_a_symbolic_link_inside_the_checkpoint_is_flagged_not_followed(saved: Path, tmp_path: Path) -> None:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("x")
    (saved / "link").symlink_to(tmp_path / "outside")
    assert list(_problems(saved)) == ["link [file]"]


# ------------------------------------------------------------------ S3


@pytest.fixture(scope="module")
def s3(moto_server: MotoServer) -> tuple[MotoServer, S3Options]:
    moto_server.create_bucket("binding")
    return moto_server, S3Options(endpoint_url=moto_server.endpoint, key=KEY, secret=SECRET, region=REGION)


def test_on_s3_documents_and_unlisted_objects_are_flagged(s3: tuple[MotoServer, S3Options]) -> None:
    _, options = s3
    location = open_location("s3://binding/run/iter_0000001", options=options)
    save(_state(), location, layout=PER_ARRAY)
    assert verify(location).ok
    node = json.loads(location.read_bytes("layers/w/zarr.json"))
    node["data_type"] = "int32"
    location.write_bytes("layers/w/zarr.json", json.dumps(node).encode())
    location.write_bytes("layers/w/c.7.7", b"not ours")
    problems = _problems(location)
    assert sorted(problems) == ["layers/w/c.7.7 [file]", "layers/w/zarr.json [metadata]"], problems
    assert location.list_files() == sorted(location.list_files())
    assert {"zarr.json", "layers/w/c.0.0", "common.pt"} <= set(location.list_files())


def test_a_format_3_record_flags_only_unlisted_files_a_load_would_read(saved: Path) -> None:
    """Before format 4 the caller of an in-place save (Megatron's own save) wrote object
    shards the record never listed: those are not flagged; a common.pt is."""
    def as_version_3(root: dict) -> None:
        record = root["attributes"]["shardstore"]
        record["format_version"] = 3
        del record[RECORD_DIGEST]

    rewrite_record(saved, as_version_3)
    (saved / "rng_state").mkdir()
    (saved / "rng_state" / "shard_0_2.pt").write_bytes(b"megatron's own object shard")
    assert verify(saved).ok
    (saved / "__objects__" / "rng" / "shard_9_9.pt").write_bytes(b"not ours")
    assert list(_problems(saved)) == ["__objects__/rng/shard_9_9.pt [file]"]


def test_an_in_place_save_adopts_only_paths_its_record_can_hold(tmp_path: Path, caplog) -> None:
    """The caller's files are listed when the record's reader accepts their paths; others
    are left out with a warning, and the checkpoint stays loadable."""
    from shardstore.core import CheckpointingConfig, save_config
    from shardstore.strategies.common import TorchCommonSaveStrategy
    from shardstore.strategies.zarr import SHARDSTORE_BACKEND, ZARR_VERSION, ZarrSaveShardedStrategy

    target = tmp_path / "ckpt"
    (target / "rng_state").mkdir(parents=True)
    (target / "rng_state" / "shard_0_1.pt").write_bytes(b"the caller's shard")
    (target / "__pycache__").mkdir()
    (target / "__pycache__" / "x.pyc").write_bytes(b"stray")
    # what Megatron's own save writes before it calls the strategy
    save_config(CheckpointingConfig(SHARDSTORE_BACKEND, ZARR_VERSION, "torch", 1), str(target))
    TorchCommonSaveStrategy().save_common({"iteration": 1}, str(target))
    ZarrSaveShardedStrategy().save({"layers/w": ShardedTensor.from_rank_offsets("layers/w", W.clone())}, target)
    record = read_commit_record(open_location(target))
    assert record.external_files == {"rng_state/shard_0_1.pt": record.external_files["rng_state/shard_0_1.pt"]}
    assert "Not listing" in caplog.text and "__pycache__/x.pyc" in caplog.text
    assert torch.equal(load(_request(), target)["layers/w"], W)
    assert list(_problems(target)) == ["__pycache__/x.pyc [file]"]


@pytest.mark.parametrize(
    "beside, words",
    [(["layers"], "one of the checkpoint's own entries"), (["__objects__"], "one of the checkpoint's own entries"),
     (["common.pt"], "one of the checkpoint's own entries"), (["metadata.json"], "one of the checkpoint's own"),
     (["a/b"], "not a top-level name"), ("modelopt_state", "top-level names"), ([".."], "'..' path segment")],
)
def test_a_record_that_names_its_own_entries_as_another_programs_is_refused(
    saved: Path, beside: object, words: str
) -> None:
    """``beside`` (the entries another program put into a shared directory before the
    commit) keeps ``verify`` from flagging files under them: a record naming the save's
    own arrays or objects, or the format's names (``common.pt``: one copied in would pass
    verify while every load refused it), would hide a file added there."""
    rewrite_record(saved, lambda root: root["attributes"]["shardstore"].update(beside=beside))
    with pytest.raises(CheckpointingException, match=words):
        read_commit_record(open_location(saved))
