"""Array metadata in the root's consolidated metadata only (issue 44.3 and 44.6).

``SaveOptions(zarr_metadata="consolidated_only")`` writes no ``zarr.json`` per array or
group: the root's consolidated metadata holds every document (format version 6). What a
plain reader pays: zarr-python opens every key through ``zarr.open_group`` and reads its
data; TensorStore reads an array given its document from the root with
``assume_metadata=True``, and finds nothing by path alone. Every shardstore reader works
on such a checkpoint, and a shardstore that reads up to version 5 refuses it by its version.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from shardstore import (
    ShardedObject,
    ShardedTensor,
    load,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
    verify,
)
from shardstore.errors import CheckpointingException
from shardstore.format import features
from shardstore.format.commit import SaveOptions
from shardstore.format.dtypes import from_torch
from shardstore.format.features import FORMAT_VERSION, ZarrMetadata
from shardstore.format.records import COMMIT_RECORD, ZARR_JSON
from shardstore.strategies.zarr import ZarrSaveShardedStrategy, _load_from_array
from tests import forked_python
from tests.plain_venv import plain_python
from tests.scenarios import global_tensor, rewrite_record

ts = pytest.importorskip("tensorstore")

# per array (no packs): the subject is where each array's own document and chunks go
CONSOLIDATED = SaveOptions(zarr_metadata="consolidated_only", pack_arrays_up_to=0)
PER_NODE = SaveOptions(zarr_metadata="per_node", pack_arrays_up_to=0)
ARRAYS = {
    "model/fc1": ((6, 4), torch.float32),
    "model/norm": ((4,), torch.bfloat16),
    "layer0/w": ((8, 3), torch.float16),
    "step": ((), torch.int64),
}
CORE = sorted(k for k, (_, dtype) in ARRAYS.items() if dtype is not torch.bfloat16)


def _tensors() -> dict[str, torch.Tensor]:
    return {key: global_tensor(key, shape, dtype) for key, (shape, dtype) in ARRAYS.items()}


def _bytes(t: torch.Tensor | np.ndarray) -> bytes:
    """Bit patterns (NaNs included) in C order."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).tobytes()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _all_loaded(loaded: dict) -> bool:
    return all(_bytes(loaded[k]) == _bytes(t) for k, t in _tensors().items())


def _state(empty: bool = False) -> dict:
    state: dict = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(t) if empty else t)
                   for k, t in _tensors().items()}
    state["rng"] = ShardedObject("rng_state", torch.arange(3), (1,), (0,))
    return state


def _save(path: Path, options: SaveOptions = CONSOLIDATED, **kwargs) -> Path:
    save(_state(), str(path), options=options, **kwargs)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("consolidated") / "ckpt")


def _root(path: Path) -> dict:
    return json.loads((path / COMMIT_RECORD).read_bytes())


def _documents(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob(ZARR_JSON))


def test_only_the_root_zarr_json_is_written(checkpoint: Path) -> None:
    assert _documents(checkpoint) == [COMMIT_RECORD]
    assert sorted(os.listdir(checkpoint / "model" / "fc1")) == ["c.0.0"]


def test_the_record_names_the_layout_and_requires_its_feature(checkpoint: Path) -> None:
    record = _root(checkpoint)["attributes"]["shardstore"]
    assert (record["format_version"], record["requires"]) == (FORMAT_VERSION, ["consolidated_only"])
    assert record["zarr_metadata"] == "consolidated_only"


def test_the_default_on_a_file_system_packs_the_small_arrays_with_their_documents(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt", SaveOptions())
    # the arrays live in the pack (documents and chunks); the groups keep their documents
    assert _documents(path) == sorted([COMMIT_RECORD, "layer0/zarr.json", "model/zarr.json"])
    assert os.listdir(path / "packs") == ["0-0.zip"] and not (path / "model" / "fc1").exists()
    record = _root(path)["attributes"]["shardstore"]
    assert record["requires"] == ["packs"] and "zarr_metadata" not in record
    assert (record["layout"]["pack_arrays_up_to"], record["layout"]["zarr_metadata"]) == (256 * 1024, "per_node")


def test_per_node_writes_every_node_document_and_requires_nothing(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt", PER_NODE)
    assert _documents(path) == sorted([COMMIT_RECORD, "layer0/zarr.json", "model/zarr.json",
                                       *(f"{k}/zarr.json" for k in ARRAYS)])
    record = _root(path)["attributes"]["shardstore"]
    assert record["requires"] == [] and "zarr_metadata" not in record


def test_load_metadata_and_verify_read_it(checkpoint: Path) -> None:
    loaded = load(_state(empty=True), str(checkpoint))
    assert _all_loaded(loaded)
    assert sorted(load_tensors_metadata(str(checkpoint))) == sorted(ARRAYS)
    report = verify(str(checkpoint))
    assert report.ok and report.chunks_checked == len(ARRAYS), report


def test_verify_flags_an_array_document_added_after_the_commit(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt")
    (path / "step" / ZARR_JSON).write_text("{}")
    assert [p.key for p in verify(str(path)).problems] == [f"step/{ZARR_JSON}"]


def test_the_seeds_single_array_reader_takes_the_document_from_the_root(checkpoint: Path) -> None:
    t = _tensors()["layer0/w"]
    request = ShardedTensor.from_rank_offsets("layer0/w", torch.empty_like(t))
    assert _bytes(_load_from_array(request, checkpoint)) == _bytes(t)


def test_a_save_reusing_from_it_shares_its_chunks_either_way(checkpoint: Path, tmp_path: Path) -> None:
    for name, options in (("again", CONSOLIDATED), ("per-node", PER_NODE)):
        path = tmp_path / name
        save(_state(), str(path), options=SaveOptions(reuse_from=str(checkpoint), layout=options.layout))
        assert _root(path)["attributes"]["shardstore"]["reused_from"]["chunks"] == len(ARRAYS)
        assert verify(str(path)).ok


def test_sharded_arrays_keep_no_document_either(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    rows = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    state = {"w": ShardedTensor.from_rank_offsets("w", rows)}
    save(state, str(path), ZarrSaveShardedStrategy(shard_bytes=1 << 20), options=CONSOLIDATED)
    assert _documents(path) == [COMMIT_RECORD]
    assert torch.equal(load({"w": ShardedTensor.from_rank_offsets("w", torch.empty_like(rows))}, str(path))["w"], rows)


def test_inspect_and_convert_read_it(checkpoint: Path, tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "shardstore.tools.cli"]
    shown = forked_python.run([*cli, "inspect", str(checkpoint)], timeout=120)
    assert shown.returncode == 0 and f"format {FORMAT_VERSION}" in shown.stdout and "model/norm" in shown.stdout, shown
    out = tmp_path / "model.pt"
    made = forked_python.run([*cli, "convert", str(checkpoint), str(out)], timeout=120)
    assert made.returncode == 0, made.stderr
    converted = torch.load(out, weights_only=True)
    flat = {}
    stack = [("", converted)]
    while stack:  # the converted state dict may nest keys with '/' as dicts
        prefix, value = stack.pop()
        if isinstance(value, dict):
            stack += [(f"{prefix}{k}/", v) for k, v in value.items()]
        else:
            flat[prefix[:-1]] = value
    assert _all_loaded(flat)


def test_dcp_reader_loads_it(checkpoint: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from shardstore import ShardstoreReader

    request = {k: torch.zeros_like(t) for k, t in _tensors().items()}
    dcp.load(request, storage_reader=ShardstoreReader(str(checkpoint)), no_dist=True)
    assert _all_loaded(request)


def test_removing_arrays_keeps_it_consistent(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt")
    remove_sharded_tensors(str(path), "model/")
    assert sorted(load_tensors_metadata(str(path))) == ["layer0/w", "step"]
    assert not (path / "model").exists() and verify(str(path)).ok
    assert _root(path)["attributes"]["shardstore"]["zarr_metadata"] == "consolidated_only"


def test_an_async_save_writes_no_document_either(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save(_state(), str(path), async_sharded_save=True, options=CONSOLIDATED).execute_sync()
    assert _documents(path) == [COMMIT_RECORD]
    assert _all_loaded(load(_state(empty=True), str(path)))


# ------------------------------------------------------------ older readers, records


def test_a_shardstore_without_the_feature_refuses_it_by_its_name(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(features, "FEATURES", tuple(f for f in features.FEATURES if f.name != "consolidated_only"))
    with pytest.raises(CheckpointingException, match=r"requires feature 'consolidated_only'.*upgrade shardstore"):
        load(_state(empty=True), str(checkpoint))


@pytest.mark.parametrize(("version", "value"), [(5, "consolidated_only"), (6, None), (6, "elsewhere")])
def test_a_record_whose_zarr_metadata_does_not_fit_its_version_is_refused(
    tmp_path: Path, version: int, value: str | None
) -> None:
    path = _save(tmp_path / "ckpt")

    def edit(root: dict) -> None:
        record = root["attributes"]["shardstore"]
        record["format_version"] = version
        record.pop("zarr_metadata")
        record.pop("requires")
        if value is not None:
            record["zarr_metadata"] = value

    rewrite_record(path, edit)
    with pytest.raises(CheckpointingException, match="malformed zarr_metadata|uses feature 'consolidated_only'"):
        load(_state(empty=True), str(path))


def test_an_unknown_zarr_metadata_option_fails_before_the_save() -> None:
    with pytest.raises(ValueError, match="zarr_metadata must be one of"):
        SaveOptions(zarr_metadata="per_array")
    assert SaveOptions(zarr_metadata="consolidated_only").zarr_metadata is ZarrMetadata.CONSOLIDATED_ONLY


# ------------------------------------------------------------ plain readers


def test_zarr_open_group_reads_every_array_from_the_root_document(checkpoint: Path) -> None:
    group = zarr.open_group(str(checkpoint), mode="r")
    for key, t in _tensors().items():  # zarr here has shardstore's hook: bfloat16 too
        got = np.asarray(group[key][...])
        assert got.dtype == from_torch(t.dtype).numpy_dtype and _bytes(got) == _bytes(t), key


def test_zarr_open_array_by_path_finds_nothing(checkpoint: Path) -> None:
    with pytest.raises(FileNotFoundError):
        zarr.open_array(str(checkpoint / "model" / "fc1"), mode="r")


def _tensorstore_open(checkpoint: Path, key: str):
    """The recipe of docs/guide/plain-readers.md: the array's document from the root."""
    consolidated = json.loads((checkpoint / "zarr.json").read_bytes())["consolidated_metadata"]
    document = {**consolidated["metadata"], **consolidated.get("shardstore_extension_dtype_metadata", {})}[key]
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{checkpoint}/{key}/"}, "metadata": document}
    return ts.open(spec, open=True, assume_metadata=True).result()


def test_tensorstore_reads_every_array_given_its_document_from_the_root(checkpoint: Path) -> None:
    for key, t in _tensors().items():
        assert _bytes(_tensorstore_open(checkpoint, key).read().result()) == _bytes(t), key


def test_tensorstore_by_path_alone_finds_no_array(checkpoint: Path) -> None:
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{checkpoint}/model/fc1/"}}
    with pytest.raises(ValueError, match="NOT_FOUND"):
        ts.open(spec, open=True).result()


PLAIN_ZARR = r'''
import json, sys, numpy as np, zarr
group = zarr.open_group(sys.argv[1], mode="r")
print(json.dumps({k: np.asarray(group[k][...]).tobytes().hex() for k in sys.argv[2:]}))
'''


def test_zarr_without_shardstore_reads_every_core_array(checkpoint: Path, tmp_path: Path) -> None:
    python = plain_python()
    if isinstance(python, str):
        pytest.skip(python)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(python), "-c", PLAIN_ZARR, str(checkpoint), *CORE], capture_output=True,
                            text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout.strip().splitlines()[-1])
    tensors = _tensors()
    assert got == {k: _bytes(tensors[k]).hex() for k in CORE}


# ------------------------------------------------------------ S3: one object fewer per array


def test_on_s3_it_saves_one_put_fewer_per_array(moto_server) -> None:
    from shardstore.stores.locations import open_location
    from shardstore.stores.s3 import S3Options
    from tests.s3_support import KEY, REGION, SECRET, Faults, FaultyProxy

    moto_server.create_bucket("consolidated")
    proxy = FaultyProxy(moto_server.port, Faults()).start()
    try:
        puts = {}
        for name, options in (("per-node", PER_NODE), ("consolidated", CONSOLIDATED)):
            location = open_location(f"s3://consolidated/{name}", options=S3Options(
                endpoint_url=proxy.endpoint, key=KEY, secret=SECRET, region=REGION))
            before = len(proxy.seen)
            save(_state(), location, options=options)
            puts[name] = Counter(method for method, _ in proxy.seen[before:])["PUT"]
            loaded = load(_state(empty=True), location)
            assert _all_loaded(loaded)
            assert verify(location).ok
    finally:
        proxy.stop()
    groups = 2  # model/, layer0/
    assert puts["per-node"] - puts["consolidated"] == len(ARRAYS) + groups, puts


def save_with_the_option_on_rank_1_only(rank: int, world: int, root: str) -> None:
    import logging

    blocks = {f"p{i}": ShardedTensor.from_rank_offsets(f"p{i}", torch.full((2, 4), float(rank + i)), (0, rank, world))
              for i in range(4)}  # each rank writes the zarr.json of some arrays
    options = CONSOLIDATED if rank == 1 else PER_NODE
    records = []

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("shardstore").addHandler(Seen(logging.WARNING))
    save(blocks, root, options=options)
    if rank == 1:
        assert any("writing as the coordinator decided" in m for m in records), records


def test_ranks_given_different_options_write_as_the_coordinator_decided(tmp_path: Path) -> None:
    from tests.dist import run_distributed

    run_distributed(save_with_the_option_on_rank_1_only, 2, str(tmp_path / "ckpt"))
    assert _documents(tmp_path / "ckpt") == sorted(["zarr.json"] + [f"p{i}/zarr.json" for i in range(4)])
    assert verify(tmp_path / "ckpt").ok


def test_the_manager_takes_save_options_and_still_reuses_unchanged_chunks(tmp_path: Path) -> None:
    from shardstore.format.records import read_commit_record
    from shardstore.stores.locations import open_location
    from shardstore.tools.manager import CheckpointManager

    manager = CheckpointManager(tmp_path)
    for step in range(2):
        manager.save(step, _state(), options=CONSOLIDATED)
    manager.close()
    record = read_commit_record(open_location(manager.location(1).local_path()))
    assert record.reused_from is not None and record.reused_from.chunks == len(ARRAYS)
    assert _documents(manager.location(1).local_path()) == [ZARR_JSON]


def test_removing_arrays_leaves_a_group_document_the_save_never_wrote(tmp_path: Path) -> None:
    """A consolidated-only save writes no group document; one found there is another
    program's, and removing the group's arrays leaves it."""
    path = _save(tmp_path / "ckpt")
    (path / "model" / ZARR_JSON).write_text(json.dumps({"zarr_format": 3, "node_type": "group"}))
    remove_sharded_tensors(str(path), "model/")
    assert sorted(load_tensors_metadata(str(path))) == ["layer0/w", "step"]
    assert (path / "model" / ZARR_JSON).exists()
    assert sorted(p.name for p in (path / "model").iterdir()) == [ZARR_JSON]


def test_a_per_array_document_deleted_from_a_per_node_checkpoint_is_not_papered_over(tmp_path: Path) -> None:
    """A missing per-array document where the save kept one per array is damage that
    ``verify`` names. The seed's single-array reader of a committed checkpoint reads
    through the commit record, as ``load`` does (neither reads an array's document;
    every chunk is checked against the record), so its values are still the saved ones.
    (Until the load review's 79823ae it opened the array by its document and refused.)"""
    path = _save(tmp_path / "ckpt", PER_NODE)
    (path / "layer0" / "w" / ZARR_JSON).unlink()
    report = verify(path)
    assert not report.ok and any(p.key == f"layer0/w/{ZARR_JSON}" for p in report.problems), report
    request = ShardedTensor.from_rank_offsets("layer0/w", torch.zeros(8, 3, dtype=torch.float16))
    assert _bytes(_load_from_array(request, path)) == _bytes(_tensors()["layer0/w"])


def test_a_version_6_record_that_says_per_node_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt")

    def edit(root: dict) -> None:
        record = root["attributes"]["shardstore"]
        record.update(format_version=6, zarr_metadata="per_node")
        record.pop("requires")

    rewrite_record(path, edit)
    with pytest.raises(CheckpointingException, match="malformed zarr_metadata 'per_node' in a version 6"):
        load_tensors_metadata(str(path))


def test_xarray_opens_its_groups_from_the_consolidated_metadata(checkpoint: Path) -> None:
    xr = pytest.importorskip("xarray")
    model = xr.open_zarr(str(checkpoint), group="model")
    assert _bytes(model["fc1"].values) == _bytes(_tensors()["model/fc1"])
    assert "step" in xr.open_zarr(str(checkpoint)).variables
    assert "model" in xr.open_datatree(str(checkpoint), engine="zarr").children
