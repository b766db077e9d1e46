"""Hostile input (issue 7, points 4-6): keys that would escape the checkpoint, crafted
commit records, code-running pickles, and a full disk."""

from __future__ import annotations

import errno
import pickle
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shardstore import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    StorageLayout,
    load,
    load_tensors_metadata,
    save,
    verify,
)
from shardstore.format.records import COMMON_FILE, file_digest, is_committed, read_commit_record
from shardstore.format.records.encoding import FILE_DIGESTS, checksum
from shardstore.stores.locations import open_location
from tests.dist import run_distributed
from tests.scenarios import rewrite_record

HOSTILE_KEYS = [
    "../escape",
    "a/../../escape",
    "/etc/passwd",
    "a//b",
    "a/./b",
    "trailing/",
    "back\\slash",
    "nul\x00byte",
    "new\nline",
    "__objects__/x",
    "a/__reserved",
    "",
    "x" * 5000,
    "a/" + "y" * 300,
]


def save_with_hostile_key_on_rank_1(rank: int, world: int, root: str) -> list[str]:
    """For each hostile key: rank 1 uses it, rank 0 a good key; both must fail."""
    messages = []
    for i, bad in enumerate(HOSTILE_KEYS):
        key = bad if rank == 1 else f"good/{rank}"
        ckpt = f"{root}/{i}"
        sd = {"t": ShardedTensor.from_rank_offsets(key, torch.ones(2), replica_id=0)}
        try:
            save(sd, ckpt)
        except CheckpointingException as exc:
            messages.append(str(exc))
        else:
            raise AssertionError(f"key {bad!r} was accepted")
    return messages


def test_hostile_keys_are_rejected_on_every_rank_before_writing(tmp_path: Path) -> None:
    results = run_distributed(save_with_hostile_key_on_rank_1, 2, str(tmp_path))
    for messages in results:
        assert len(messages) == len(HOSTILE_KEYS)
        assert all("Invalid checkpoint key" in m and "rank(s) 1" in m for m in messages), messages
    assert not any(tmp_path.iterdir()), "something was written"


def test_hostile_sharded_object_key_is_rejected(ckpt_dir: Path) -> None:
    with pytest.raises(CheckpointingException, match="Invalid checkpoint key"):
        save({"o": ShardedObject("../../x", 1, (1,), (0,))}, ckpt_dir)
    assert not ckpt_dir.exists() or not any(ckpt_dir.iterdir())


# ------------------------------------------------------------- crafted commit records


def _record_edit(path: list, value) -> Callable[[dict], None]:
    """Sets ``root['attributes']['shardstore'][path...] = value``."""

    def edit(root: dict) -> None:
        node = root["attributes"]["shardstore"]
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value

    return edit


def _rename_array(new_key: str) -> Callable[[dict], None]:
    def edit(root: dict) -> None:
        arrays = root["attributes"]["shardstore"]["arrays"]
        arrays[new_key] = arrays.pop("w")

    return edit


HOSTILE_RECORDS: dict[str, Callable[[dict], None] | bytes] = {
    "not json": b"{not json",
    "nested past the JSON parser's depth": b"[" * 100_000,
    "json array": b"[1, 2, 3]",
    "not a shardstore record": b'{"zarr_format": 3, "node_type": "group", "attributes": {}}',
    "attributes not an object": b'{"zarr_format": 3, "node_type": "group", "attributes": []}',
    "format version as string": _record_edit(["format_version"], "1"),
    "format version as bool": _record_edit(["format_version"], True),  # was read as version 1, unbound
    "format version as float": _record_edit(["format_version"], 4.0),  # was read as version 4
    "future format version": _record_edit(["format_version"], 99),
    "arrays is a list": _record_edit(["arrays"], []),
    "negative shape": _record_edit(["arrays", "w", "shape"], [-4, 3]),
    "huge shape": _record_edit(["arrays", "w", "shape"], [2**40, 2**40]),
    "shape of strings": _record_edit(["arrays", "w", "shape"], ["4", "3"]),
    "shape as bools": _record_edit(["arrays", "w", "shape"], [True, True]),
    "too many dims": _record_edit(["arrays", "w", "shape"], [1] * 100),
    "unknown dtype": _record_edit(["arrays", "w", "dtype"], "complex512"),
    "dtype not a string": _record_edit(["arrays", "w", "dtype"], 7),
    "zero chunk shape": _record_edit(["arrays", "w", "chunk_shape"], [0, 3]),
    "chunk rank mismatch": _record_edit(["arrays", "w", "chunk_shape"], [4]),
    "chunk grid does not tile": _record_edit(["arrays", "w", "chunk_grid"], [5, 1]),
    "huge chunk": _record_edit(["arrays", "w", "chunk_shape"], [2**30, 2**30]),
    "array key escapes": _rename_array("../../etc/passwd"),
    "absolute array key": _rename_array("/tmp/x"),
    "object shard escapes": _record_edit(["objects"], {"o": ["../../../tmp/evil"]}),
    "objects not a list": _record_edit(["objects"], {"o": "shard"}),
    "file outside checkpoint": _record_edit(["files"], {"../../etc/passwd": "crc32c:00000000"}),
    "file checksum not a string": _record_edit(["files"], {"common.pt": 5}),
    "file digest not 32 hex digits": _record_edit([FILE_DIGESTS], {"common.pt": "crc32c:00000000"}),
    "file digest of an unlisted file": _record_edit([FILE_DIGESTS], {"other.pt": "0" * 32}),
    "chunk checksum as bool": _record_edit(["arrays", "w", "chunk_crc32c"], [True]),
    "chunk checksum negative": _record_edit(["arrays", "w", "chunk_crc32c"], [-1]),
    "chunk checksum above 32 bits": _record_edit(["arrays", "w", "chunk_crc32c"], [2**32]),
    "chunk checksum as string": _record_edit(["arrays", "w", "chunk_crc32c"], ["0"]),
    "chunk checksum as float": _record_edit(["arrays", "w", "chunk_crc32c"], [1.0]),
    "chunk checksums missing": _record_edit(["arrays", "w", "chunk_crc32c"], []),
}


# an array's own zarr.json and chunk files, and records of format 1 (which never packed)
PER_ARRAY = StorageLayout(pack_arrays_up_to=0)


def _saved(ckpt: Path, layout: StorageLayout | None = None) -> None:
    save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(12.0).reshape(4, 3)), "step": 1}, ckpt,
         layout=layout)


@pytest.mark.parametrize("name", sorted(HOSTILE_RECORDS))
def test_crafted_commit_record_gives_a_clear_error(ckpt_dir: Path, name: str) -> None:
    _saved(ckpt_dir)
    root_path = ckpt_dir / "zarr.json"
    edit = HOSTILE_RECORDS[name]
    if isinstance(edit, bytes):
        root_path.write_bytes(edit)
    else:
        rewrite_record(ckpt_dir, edit)
    start = time.monotonic()
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 3))}
    with pytest.raises(CheckpointingException):
        load(request, ckpt_dir)
    with pytest.raises(CheckpointingException):
        load_tensors_metadata(ckpt_dir)
    assert not verify(ckpt_dir).ok
    assert time.monotonic() - start < 10, "took too long: a huge allocation or a hang"


@pytest.mark.parametrize("rel", ["w/zarr.json", "metadata.json"])
def test_json_nested_past_the_parsers_depth_is_a_clear_error(ckpt_dir: Path, rel: str) -> None:
    """An array's ``zarr.json`` (which ``verify`` reads) or, in a directory without a
    commit record, ``metadata.json`` (which a load looks at to say what is there) nested
    past the JSON parser's depth is a problem ``verify`` reports and a
    ``CheckpointingException`` naming the checkpoint. Before, the parser's
    ``RecursionError`` escaped as a bare traceback (as it did from a root ``zarr.json``
    so nested, ``HOSTILE_RECORDS``)."""
    _saved(ckpt_dir, PER_ARRAY)
    if rel == "metadata.json":
        (ckpt_dir / "zarr.json").unlink()
    (ckpt_dir / rel).write_bytes(b"[" * 100_000)
    report = verify(ckpt_dir)
    assert not report.ok and str(ckpt_dir) in str(report)
    if rel == "metadata.json":  # a load never reads an array's zarr.json
        with pytest.raises(CheckpointingException, match=str(ckpt_dir)):
            load_tensors_metadata(ckpt_dir)


def test_other_readers_of_json_nested_past_the_parsers_depth_give_clear_errors(tmp_path: Path) -> None:
    """The other JSON documents read from a checkpoint or model directory, nested past
    the parser's depth: a root's step with such a ``zarr.json`` is damage to report, and
    a consolidated-only root, a Hugging Face index, a safetensors header and a Megatron
    zarr ``.zarray`` raise ``CheckpointingException`` naming the file. Before, each let
    the parser's ``RecursionError`` escape as a bare traceback."""
    from shardstore.engine.zarr_strategies import consolidated_document
    from shardstore.other_formats.megatron_zarr import MegatronZarrCheckpoint
    from shardstore.other_formats.model_files import _read_index
    from shardstore.other_formats.safetensors import map_safetensors
    from shardstore.stores.locations import open_location
    from shardstore.tools.root_verify import holds_commit_record

    deep = b"[" * 100_000
    (tmp_path / "zarr.json").write_bytes(deep)
    assert holds_commit_record(open_location(tmp_path))
    with pytest.raises(CheckpointingException, match="zarr.json"):
        consolidated_document(open_location(tmp_path), "w")
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(deep)
    with pytest.raises(CheckpointingException, match="index"):
        _read_index(index, tmp_path)
    header = tmp_path / "model.safetensors"
    header.write_bytes(len(deep).to_bytes(8, "little") + deep)
    with pytest.raises(CheckpointingException, match="model.safetensors"):
        map_safetensors(header)
    megatron = tmp_path / "megatron"
    (megatron / "w").mkdir(parents=True)
    (megatron / "w" / ".zarray").write_bytes(deep)
    (megatron / "metadata.json").write_text('{"sharded_backend": "zarr", "sharded_backend_version": 1, '
                                            '"common_backend": "torch", "common_backend_version": 1}')
    with pytest.raises(CheckpointingException, match=".zarray"):
        MegatronZarrCheckpoint(megatron).tensors["w"]


@pytest.mark.parametrize("version", [1, 4])
@pytest.mark.parametrize("created", [10**400, float("inf"), float("nan")], ids=["10**400", "inf", "nan"])
def test_a_creation_time_no_float_holds_reads_as_unknown(ckpt_dir: Path, version: int, created: float) -> None:
    """``created`` is informational: a value of a wrong type reads as 0.0 (unknown), and
    so does one no finite float holds. Before, an integer past a float's range raised a
    bare ``OverflowError`` from every read of the record, and in a version 1 record
    (whose save id is made from it) so did ``Infinity``, and ``NaN`` a ``ValueError``."""

    def edit(root: dict) -> None:
        record = root["attributes"]["shardstore"]
        record["created"] = created
        if version == 1:
            record["format_version"] = 1
            del record["record_digest"], record["save_id"], record["arrays"]["w"]["chunk_crc32c"]

    _saved(ckpt_dir, PER_ARRAY)
    rewrite_record(ckpt_dir, edit)
    assert set(load_tensors_metadata(ckpt_dir)) == {"w"}
    record = read_commit_record(open_location(ckpt_dir))
    assert record.created == 0.0 and (version > 1 or record.save_id == "legacy0")


# ------------------------------------------------------------- pickles that run code


class _RunsCode:
    def __reduce__(self):
        return (shutil.rmtree, ("/nonexistent-shardstore-test",))


def test_code_running_pickle_in_common_state_is_refused(ckpt_dir: Path) -> None:
    _saved(ckpt_dir)
    payload = pickle.dumps({"step": _RunsCode()}, protocol=2)
    (ckpt_dir / COMMON_FILE).write_bytes(payload)
    # the attacker also fixes the checksum in the record: the pickle guard must still hold
    def vouch_for_payload(root: dict) -> None:
        root["attributes"]["shardstore"]["files"][COMMON_FILE] = checksum(payload)
        root["attributes"]["shardstore"][FILE_DIGESTS][COMMON_FILE] = file_digest(payload)

    rewrite_record(ckpt_dir, vouch_for_payload)
    with pytest.raises(CheckpointingException, match="allow_unsafe_pickle"):
        load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 3))}, ckpt_dir)


# ------------------------------------------------------------- disk full


def full_disk_on_rank_1(rank: int, world: int, ckpt: str) -> str:
    from shardstore.format import chunks as chunk_io

    if rank == 1:
        def no_space(self, data):
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        chunk_io.ChunkFile.write = no_space
    try:
        # the failure is injected into chunk file writes, which packed arrays do not use
        save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(8, 4), (0, rank, world))}, ckpt,
             layout=PER_ARRAY)
    except CheckpointingException as exc:
        return str(exc)
    raise AssertionError("save succeeded on a full disk")


def test_enospc_from_a_write_fails_every_rank_without_commit(ckpt_dir: Path) -> None:
    for message in run_distributed(full_disk_on_rank_1, 2, str(ckpt_dir)):
        assert "No space left on device" in message and "rank(s) 1" in message, message
    assert not is_committed(open_location(ckpt_dir))


def test_real_full_disk_fails_without_commit(tiny_tmpfs: Path) -> None:
    ckpt = tiny_tmpfs / "ckpt"
    with pytest.raises(CheckpointingException, match="No space left on device"):
        save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(1024, 1024))}, ckpt)  # 4 MiB > 1 MiB
    assert not is_committed(open_location(ckpt))
