"""Packed small arrays (issue 44.6, format version 8): ``SaveOptions(pack_arrays_up_to=...)``
puts each small array whose chunks one rank writes into that rank's stored zip,
``packs/<rank>-<n>.zip``, which is a Zarr v3 hierarchy that zarr-python's ``ZipStore``
and TensorStore's ``zip`` kvstore read by key; shardstore reads each packed chunk at
the offset its commit record gives, checked like any chunk."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from shardstore import CheckpointingException, ShardedTensor, StorageLayout, load, save, verify
from shardstore.format import features
from shardstore.format.commit import SaveOptions
from shardstore.format.features import FORMAT_VERSION
from shardstore.format.records import commit_record, read_commit_record
from shardstore.serialization import load_plain_tensors, remove_sharded_tensors
from shardstore.stores.base import Location
from shardstore.stores.locations import open_location
from tests.dist import run_distributed
from tests.scenarios import rewrite_record

ts = pytest.importorskip("tensorstore")

PACK = SaveOptions(pack_arrays_up_to=64 * 1024)
BIG = (64, 512)  # 128 KiB of float32: above the bound, a directory of its own


def _tensors(seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {f"layer{i % 3}/t{i}": torch.randn(64 + 37 * i, generator=gen) for i in range(12)}
    tensors["norm"] = torch.randn(7, 5, generator=gen)
    tensors["emb_bf16"] = torch.randn(33, 8, generator=gen).to(torch.bfloat16)
    tensors["scalar"] = torch.tensor(2.5)
    tensors["big"] = torch.randn(*BIG, generator=gen)
    return tensors


def _sd(tensors: dict[str, torch.Tensor], empty: bool = False) -> dict[str, ShardedTensor]:
    return {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(t) if empty else t, replica_id=0)
            for k, t in tensors.items()}


def _check_loads(path: Path | str | Location, tensors: dict[str, torch.Tensor]) -> None:
    loaded = load(_sd(tensors, empty=True), str(path) if isinstance(path, Path) else path)
    assert [k for k, t in tensors.items() if not torch.equal(loaded[k], t)] == []


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = _tensors()
    path = tmp_path_factory.mktemp("packed") / "ckpt"
    save(_sd(tensors), str(path), options=PACK)
    return path, tensors


def test_a_packed_save_loads_back_bit_exact(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, tensors = saved
    _check_loads(path, tensors)
    plain = load_plain_tensors(str(path))
    assert [k for k, t in tensors.items() if not torch.equal(plain[k], t)] == []


def test_small_arrays_go_into_one_pack_and_large_ones_stay_arrays(saved: tuple[Path, dict]) -> None:
    path, tensors = saved
    record = read_commit_record(open_location(path))
    assert (record.format_version, record.requires) == (FORMAT_VERSION, ("packs",))
    assert list(record.packs) == ["packs/0-0.zip"]
    assert record.packs["packs/0-0.zip"] == (path / "packs" / "0-0.zip").stat().st_size
    packed = {k for k, a in record.arrays.items() if a.pack is not None}
    assert packed == set(tensors) - {"big"}
    assert (path / "big" / "c.0.0").is_file()
    for key in packed:  # no directory, no file of its own
        assert not (path / key).exists(), key
    for key in packed:  # every chunk's bytes at its recorded offset, as the record binds them
        array = record.arrays[key]
        with open(path / array.pack, "rb") as f:
            f.seek(array.chunk_offsets[0])
            data = f.read(array.nbytes)
        assert data == tensors[key].reshape(-1).view(torch.uint8).numpy().tobytes(), key


def test_plain_zarr_and_tensorstore_read_a_packed_key_from_its_pack(saved: tuple[Path, dict]) -> None:
    path, tensors = saved
    pack = path / "packs" / "0-0.zip"
    group = zarr.open_group(zarr.storage.ZipStore(pack, mode="r"), mode="r")
    for key in ("layer1/t4", "norm", "scalar"):
        np.testing.assert_array_equal(group[key][...], tensors[key].numpy())
    for key in ("layer2/t5", "norm", "emb_bf16"):
        spec = {"driver": "zarr3", "kvstore": {"driver": "zip", "base": f"file://{pack}"}, "path": key}
        got = ts.open(spec).result().read().result()
        expected = tensors[key].view(torch.int16).numpy() if key == "emb_bf16" else tensors[key].numpy()
        np.testing.assert_array_equal(got.view(np.int16) if key == "emb_bf16" else got, expected)


def test_the_directory_lists_no_packed_array_and_says_where_they_are(saved: tuple[Path, dict]) -> None:
    """Plain zarr opening the checkpoint's directory would read a packed array's missing
    chunks as zeros: packed arrays are not in its consolidated metadata; the root's
    attributes name each one's pack and say how to open it."""
    path, tensors = saved
    group = zarr.open_group(str(path), mode="r")
    assert "big" in group and "layer1/t4" not in group and "norm" not in group
    root = json.loads((path / "zarr.json").read_bytes())
    assert root["attributes"]["packed_arrays"]["layer1/t4"] == "packs/0-0.zip"
    assert set(root["attributes"]["packed_arrays"]) == set(tensors) - {"big"}
    assert "ZipStore" in root["attributes"]["readers"]["packed_arrays_note"]


def test_verify_passes_and_checks_the_packs_zip_directory(saved: tuple[Path, dict]) -> None:
    report = verify(saved[0])
    assert report.ok, report
    assert report.chunks_checked == len(saved[1])


def test_a_packed_load_opens_each_pack_once_and_closes_it(saved, monkeypatch) -> None:  # noqa: ANN001
    """Issue 44.6: a load reads a pack's chunks through one descriptor, not one open (and
    ``fstat``) of the pack per chunk, and closes it at the end."""
    path, tensors = saved
    from shardstore.stores import local

    opened: list[str] = []
    real = local.open_regular

    def counting(name: str) -> int | None:
        opened.append(name)
        return real(name)

    monkeypatch.setattr(local, "open_regular", counting)
    before = len(os.listdir("/proc/self/fd"))
    _check_loads(path, tensors)
    assert len(os.listdir("/proc/self/fd")) == before
    packs = [name for name in opened if "/packs/" in str(name)]
    assert len(packs) == 1, packs


def _flip_packed_bit(path: Path, key: str, at: int, mask: int) -> None:
    """Flips the bits ``mask`` of the byte ``at`` into the first chunk of the packed
    array ``key``, in its pack."""
    array = read_commit_record(open_location(path)).arrays[key]
    with open(path / array.pack, "r+b") as f:
        f.seek(array.chunk_offsets[0] + at)
        byte = f.read(1)
        f.seek(array.chunk_offsets[0] + at)
        f.write(bytes([byte[0] ^ mask]))


def test_a_packed_load_that_fails_closes_the_pack_and_names_the_chunk(tmp_path: Path) -> None:
    tensors = _tensors()
    path = tmp_path / "ckpt"
    save(_sd(tensors), str(path), options=PACK)
    _flip_packed_bit(path, "layer2/t5", at=3, mask=0x01)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(CheckpointingException, match=r"layer2/t5.*crc32c mismatch"):
        load(_sd({k: t for k, t in tensors.items() if k != "big"}, empty=True), str(path))
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_flipped_byte_in_a_pack_is_reported_by_array_and_chunk(tmp_path: Path) -> None:
    tensors = _tensors()
    path = tmp_path / "ckpt"
    save(_sd(tensors), str(path), options=PACK)
    _flip_packed_bit(path, "layer1/t7", at=9, mask=0x10)
    report = verify(path)
    assert not report.ok
    assert {(p.key, p.part) for p in report.problems} == {("layer1/t7", "c.0")}
    assert any("crc32c" in p.message for p in report.problems)
    with pytest.raises(CheckpointingException, match=r"layer1/t7.*crc32c mismatch"):
        load(_sd({"layer1/t7": tensors["layer1/t7"]}, empty=True), str(path))


def _local_header_at(data: bytes, name: str) -> int:
    """Where the local header of member ``name`` starts in the zip ``data``."""
    entry = zipfile.ZipFile(io.BytesIO(data)).getinfo(name)
    return entry.header_offset


@pytest.mark.parametrize("field,at,value", [("name", 30, ord("q")), ("flags", 6, 0x01), ("method", 8, 8),
                                            ("size", 18, 0x7F), ("crc", 14, 0x55)])
def test_a_damaged_local_header_is_reported(tmp_path: Path, field: str, at: int, value: int) -> None:
    """A member's local header that disagrees with its central directory entry: before,
    verify said "no problems" while zarr's ZipStore refused the member (another name:
    "File name in directory ... and header ... differ") and TensorStore's zip kvstore
    refused it (an encryption flag, a deflate method)."""
    path = tmp_path / "ckpt"
    save(_sd(_tensors()), str(path), options=PACK)
    pack = path / "packs" / "0-0.zip"
    data = bytearray(pack.read_bytes())
    header = _local_header_at(bytes(data), "norm/c.0.0")
    data[header + at] ^= value
    pack.write_bytes(bytes(data))
    report = verify(path)
    assert [(p.key, p.part) for p in report.problems] == [("norm", "c.0.0")], report
    assert "local header" in report.problems[0].message


def test_a_zip_directory_entry_claiming_a_huge_member_is_reported_before_allocating(tmp_path: Path) -> None:
    """A central directory entry whose sizes claim more bytes than the pack holds (here
    256 MiB; up to 4 GiB fit the fields): before, verify allocated (and zeroed) a buffer
    of that size to read the member into, then found the read past the pack's end
    (DESIGN.md: untrusted sizes never drive allocations)."""
    import tracemalloc

    path = tmp_path / "ckpt"
    save(_sd(_tensors()), str(path), options=PACK)
    pack = path / "packs" / "0-0.zip"
    data = bytearray(pack.read_bytes())
    end = data.rfind(b"PK\x05\x06")
    directory = int.from_bytes(data[end + 16 : end + 20], "little")
    entry = data.find(b"norm/c.0.0", directory) - 46  # its central directory header, before the name
    data[entry + 20 : entry + 28] = struct.pack("<II", 256 << 20, 256 << 20)  # compressed and uncompressed sizes
    pack.write_bytes(bytes(data))
    tracemalloc.start()
    try:
        report = verify(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(p.key, p.part) for p in report.problems] == [("norm", "c.0.0")], report
    assert peak < 32 << 20, f"verify allocated {peak} bytes"


def test_a_gap_before_the_zip_end_record_is_reported(tmp_path: Path) -> None:
    """Bytes between the central directory and its end record (the pack's size edited in
    the record to match): zipfile then takes the gap for data prepended to the zip and
    reads every member that many bytes later than its directory says, so plain readers
    read other bytes than verify checked. Before, verify said "no problems"."""
    from tests.scenarios import rewrite_record

    path = tmp_path / "ckpt"
    save(_sd(_tensors()), str(path), options=PACK)
    pack = path / "packs" / "0-0.zip"
    data = bytearray(pack.read_bytes())
    end = data.rfind(b"PK\x05\x06")
    data[end:end] = bytes(8)
    pack.write_bytes(bytes(data))
    rewrite_record(path, lambda root: root["attributes"]["shardstore"]["packs"].update({"packs/0-0.zip": len(data)}))
    with pytest.raises(zipfile.BadZipFile):  # what a plain reader makes of it
        with zipfile.ZipFile(pack) as zipped:
            zipped.read("norm/c.0.0")
    report = verify(path)
    assert [(p.key, p.part) for p in report.problems] == [("packs/0-0.zip", "pack")], report
    assert "end record" in report.problems[0].message


def test_a_zip_directory_holding_more_entries_than_its_end_record_counts_is_reported(tmp_path: Path) -> None:
    """The central directory's end record counting one entry fewer than it holds
    (zipfile reads entries up to the directory's size, so it lists a member verify
    never saw): before, verify said "no problems"."""
    path = tmp_path / "ckpt"
    save(_sd(_tensors()), str(path), options=PACK)
    pack = path / "packs" / "0-0.zip"
    data = bytearray(pack.read_bytes())
    end = data.rfind(b"PK\x05\x06")
    for at in (end + 8, end + 10):  # the entries on this disk, and in all
        data[at : at + 2] = (int.from_bytes(data[at : at + 2], "little") - 1).to_bytes(2, "little")
    pack.write_bytes(bytes(data))
    report = verify(path)
    assert [(p.key, p.part) for p in report.problems] == [("packs/0-0.zip", "pack")], report
    assert "past its" in report.problems[0].message


def test_an_unlisted_pack_is_flagged(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save(_sd(_tensors()), str(path), options=PACK)
    shutil.copy(path / "packs" / "0-0.zip", path / "packs" / "0-1.zip")
    report = verify(path)
    assert [p.key for p in report.problems] == ["packs/0-1.zip"]
    assert report.unlisted == ["packs/0-1.zip"]


def test_a_pack_of_another_size_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save(_sd(_tensors()), str(path), options=PACK)
    with open(path / "packs" / "0-0.zip", "ab") as f:
        f.write(b"more")
    report = verify(path)
    assert [(p.key, p.part) for p in report.problems] == [("packs/0-0.zip", "pack")]
    assert "where the commit record gives" in report.problems[0].message


def test_a_record_pointing_at_another_member_fails_load_and_verify(tmp_path: Path) -> None:
    """Two arrays of one shape whose recorded offsets are swapped: each offset is inside
    the pack and holds a well-formed chunk, but not the one the record binds, and not
    the one plain readers read for the key."""
    path = tmp_path / "ckpt"
    tensors = {"a": torch.arange(10.0), "b": torch.arange(10.0) + 100}
    save(_sd(tensors), str(path), options=PACK)

    def swap(root: dict) -> None:
        arrays = root["attributes"]["shardstore"]["arrays"]
        arrays["a"]["chunk_offsets"], arrays["b"]["chunk_offsets"] = arrays["b"]["chunk_offsets"], arrays["a"]["chunk_offsets"]

    rewrite_record(path, swap)
    with pytest.raises(CheckpointingException, match=r"not the .* the commit record keeps"):
        load(_sd(tensors, empty=True), str(path))
    report = verify(path)
    messages = {(p.key, p.part): p.message for p in report.problems if "starts at byte" in p.message}
    assert set(messages) == {("a", "c.0"), ("b", "c.0")}, report


def test_diff_and_inspect_read_packed_arrays(saved: tuple[Path, dict], tmp_path: Path) -> None:
    from shardstore.tools.inspection import describe_checkpoint, diff_checkpoints

    path, tensors = saved
    unpacked = tmp_path / "unpacked"
    save(_sd(tensors), str(unpacked))
    assert diff_checkpoints(path, unpacked).identical
    changed = tmp_path / "changed"
    save(_sd({**tensors, "norm": tensors["norm"] + 1}), str(changed), options=PACK)
    difference = diff_checkpoints(path, changed)
    assert [a.key for a in difference.arrays if not a.identical] == ["norm"]
    assert {a.key for a in describe_checkpoint(path).arrays} == set(tensors)


def test_a_reader_without_packs_refuses_a_packed_checkpoint_by_the_feature_s_name(
    saved: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(features, "FEATURES", tuple(f for f in features.FEATURES if f.name != "packs"))
    commit_record._LAST_PARSED[0] = None
    with pytest.raises(CheckpointingException, match=r"requires feature 'packs'.*upgrade shardstore"):
        load(_sd(saved[1], empty=True), str(saved[0]))


def test_by_default_small_arrays_are_packed_and_with_zero_nothing_is(tmp_path: Path) -> None:
    save(_sd(_tensors()), str(tmp_path / "default"))
    record = read_commit_record(open_location(tmp_path / "default"))
    assert record.packs and record.requires == ("packs",)
    assert record.layout["pack_arrays_up_to"] == 256 * 1024
    path = tmp_path / "unpacked"
    save(_sd(_tensors()), str(path), options=SaveOptions(pack_arrays_up_to=0))
    record = read_commit_record(open_location(path))
    assert not record.packs and record.requires == ()
    assert not (path / "packs").exists()


@pytest.mark.parametrize("edit", ["unlisted", "past_end", "old_version", "unused"])
def test_a_record_whose_packs_do_not_add_up_is_refused(tmp_path: Path, edit: str) -> None:
    path = tmp_path / "ckpt"
    tensors = _tensors()
    save(_sd(tensors), str(path), options=PACK)

    def change(root: dict) -> None:
        record = root["attributes"]["shardstore"]
        if edit == "unlisted":
            record["arrays"]["norm"]["pack"] = "packs/0-9.zip"
        elif edit == "past_end":
            record["arrays"]["norm"]["chunk_offsets"] = [record["packs"]["packs/0-0.zip"] - 10]
        elif edit == "old_version":
            record["format_version"] = 7
        else:
            record["packs"]["packs/1-0.zip"] = 100

    rewrite_record(path, change)
    with pytest.raises(CheckpointingException, match=r"pack|version 8"):
        load(_sd(tensors, empty=True), str(path))


def test_the_option_refuses_a_negative_bound() -> None:
    with pytest.raises(ValueError, match="pack_arrays_up_to"):
        SaveOptions(pack_arrays_up_to=-1)


def test_removing_some_packed_tensors_writes_their_pack_anew_without_them(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    tensors = _tensors()
    save(_sd(tensors), str(path), options=PACK)
    remove_sharded_tensors(str(path), "layer1/")
    kept = {k: t for k, t in tensors.items() if not k.startswith("layer1/")}
    assert sorted(os.listdir(path / "packs")) == ["0-1.zip"]  # the old pack went with the removed arrays
    with zipfile.ZipFile(path / "packs" / "0-1.zip") as pack:
        assert not any(name.startswith("layer1/") for name in pack.namelist())
        assert "layer0/t0/zarr.json" in pack.namelist()
    _check_loads(path, kept)
    assert verify(path).ok, str(verify(path))
    remove_sharded_tensors(str(path), "")  # every array: the pack goes too
    assert not (path / "packs").exists() or os.listdir(path / "packs") == []
    assert verify(path).ok


def test_a_removal_cut_short_after_writing_the_new_pack_leaves_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shardstore.format import removal

    path = tmp_path / "ckpt"
    tensors = _tensors()
    save(_sd(tensors), str(path), options=PACK)

    def killed(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(removal, "write_commit_record", killed)
    with pytest.raises(KeyboardInterrupt):
        remove_sharded_tensors(str(path), "layer1/")
    assert (path / "packs" / "0-1.zip").exists()
    monkeypatch.undo()
    remove_sharded_tensors(str(path), "nothing/")  # finishes the removal cut short: the new pack goes
    assert sorted(os.listdir(path / "packs")) == ["0-0.zip"]
    _check_loads(path, tensors)
    assert verify(path).ok, str(verify(path))


def test_removing_an_array_named_packs_keeps_the_packs_in_its_directory(tmp_path: Path) -> None:
    """An unpacked array keyed ``packs`` shares its directory with the packs of the save:
    removing it took them too, and the packed arrays that stay failed to load."""
    path = tmp_path / "ckpt"
    tensors = {"packs": torch.randn(*BIG), "norm": torch.randn(7, 5)}
    save(_sd(tensors), str(path), options=PACK)
    assert read_commit_record(open_location(path)).arrays["norm"].pack == "packs/0-0.zip"
    remove_sharded_tensors(str(path), "packs")
    assert verify(path).ok
    _check_loads(path, {"norm": tensors["norm"]})


@pytest.mark.parametrize("cap", [None, 8 * 1024])
def test_an_async_save_packs_and_changes_after_it_returns_do_not_reach_the_pack(tmp_path: Path, cap: int | None) -> None:
    """An async save packs from its host snapshot; with a staging bound, the arrays
    written early in waves stay directories of their own (``packed_keys``)."""
    from shardstore.strategies.async_utils import AsyncCallsQueue
    from shardstore.strategies.zarr import ZarrSaveShardedStrategy

    tensors = _tensors()
    originals = {k: t.clone() for k, t in tensors.items()}
    path = tmp_path / "ckpt"
    queue = AsyncCallsQueue()
    request = save(_sd(tensors), str(path), ZarrSaveShardedStrategy(max_staging_bytes=cap), async_sharded_save=True,
                   options=PACK)
    for t in tensors.values():
        t.fill_(-7)
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    _check_loads(path, originals)
    record = read_commit_record(open_location(path))
    if cap is None:  # nothing written early: every small array packed
        assert set(record.packed_arrays) == set(tensors) - {"big"}
    assert verify(path).ok


# ------------------------------------------------------------ incremental saves


def test_an_incremental_packed_save_shares_nothing_and_loads_right(tmp_path: Path) -> None:
    tensors = _tensors()
    save(_sd(tensors), str(tmp_path / "s1"), options=PACK)
    changed = {**tensors, "norm": tensors["norm"] + 1}
    save(_sd(changed), str(tmp_path / "s2"), options=SaveOptions(pack_arrays_up_to=64 * 1024,
                                                                 reuse_from=str(tmp_path / "s1")))
    record = read_commit_record(open_location(tmp_path / "s2"))
    assert record.reused_from is not None and record.reused_from.chunks == 1  # only "big", unpacked
    assert (tmp_path / "s2" / "packs" / "0-0.zip").stat().st_nlink == 1
    shutil.rmtree(tmp_path / "s1")
    _check_loads(tmp_path / "s2", changed)
    assert verify(tmp_path / "s2").ok


def test_a_save_reusing_from_a_packed_base_writes_its_arrays_anew(tmp_path: Path) -> None:
    tensors = _tensors()
    save(_sd(tensors), str(tmp_path / "s1"), options=PACK)
    save(_sd(tensors), str(tmp_path / "s2"), reuse_from=str(tmp_path / "s1"), layout=StorageLayout(pack_arrays_up_to=0))
    record = read_commit_record(open_location(tmp_path / "s2"))
    assert not record.packs
    assert record.reused_from is not None and record.reused_from.chunks == 1  # "big" only
    _check_loads(tmp_path / "s2", tensors)
    assert verify(tmp_path / "s2").ok


def test_a_packed_save_reusing_from_an_unpacked_base_packs_anew(tmp_path: Path) -> None:
    tensors = _tensors()
    save(_sd(tensors), str(tmp_path / "s1"), layout=StorageLayout(pack_arrays_up_to=0))
    save(_sd(tensors), str(tmp_path / "s2"), options=SaveOptions(pack_arrays_up_to=64 * 1024,
                                                                 reuse_from=str(tmp_path / "s1")))
    record = read_commit_record(open_location(tmp_path / "s2"))
    assert record.reused_from is not None and record.reused_from.chunks == 1
    assert len(record.packed_arrays) == len(tensors) - 1
    _check_loads(tmp_path / "s2", tensors)


# ------------------------------------------------------------ several ranks


def _own(rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11 + rank)
    return {f"rank{rank}/w{i}": torch.randn(100 + i, generator=gen) for i in range(5)}


def _split(rank: int, world: int, empty: bool) -> dict[str, ShardedTensor]:
    """What every rank saves: its own small arrays, replicated ones, and one split
    between the ranks (packed too: gathered whole to one writer)."""
    sd = {}
    for r in range(world):
        if r == rank:
            sd.update({k: ShardedTensor.from_rank_offsets(k, torch.empty_like(t) if empty else t)
                       for k, t in _own(r).items()})
    replicated = _tensors()
    sd.update({k: ShardedTensor.from_rank_offsets(k, torch.empty_like(t) if empty else t, replica_id=rank)
               for k, t in replicated.items()})
    whole = torch.arange(64.0 * world).reshape(8 * world, 8)
    part = whole[8 * rank : 8 * (rank + 1)]
    sd["split"] = ShardedTensor.from_rank_offsets("split", torch.empty_like(part) if empty else part.clone(),
                                                  (0, rank, world))
    return sd


def _save_two(rank: int, world: int, path: str) -> None:
    save(_split(rank, world, empty=False), path, options=PACK)


def _load_at(rank: int, world: int, path: str, saved_world: int) -> None:
    """Loads every tensor at this layout: each small array split along its first axis
    between the ranks where it can be, the rest whole."""
    tensors = {**_tensors(), **{k: t for r in range(saved_world) for k, t in _own(r).items()}}
    sd = {}
    for key, t in tensors.items():
        if t.ndim and t.shape[0] % world == 0:
            n = t.shape[0] // world
            sd[key] = ShardedTensor.from_rank_offsets(key, torch.empty_like(t[n * rank : n * (rank + 1)]),
                                                      (0, rank, world), replica_id=0)
        else:
            sd[key] = ShardedTensor.from_rank_offsets(key, torch.empty_like(t), replica_id=rank)
    loaded = load(sd, path)
    for key, t in tensors.items():
        if t.ndim and t.shape[0] % world == 0:
            n = t.shape[0] // world
            t = t[n * rank : n * (rank + 1)]
        assert torch.equal(loaded[key], t), key


def test_two_ranks_pack_their_own_arrays_and_load_at_other_layouts(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(_save_two, 2, path)
    record = read_commit_record(open_location(path))
    assert sorted(record.packs) == ["packs/0-0.zip", "packs/1-0.zip"]
    for rank in (0, 1):  # its own arrays, and the replicated ones the plan gave it to write
        assert set(_own(rank)) <= {k for k, a in record.arrays.items() if a.pack == f"packs/{rank}-0.zip"}
    assert set(record.packed_arrays) == set(_tensors()) - {"big"} | set(_own(0)) | set(_own(1)) | {"split"}
    assert record.arrays["split"].chunk_shape == record.arrays["split"].shape and record.arrays["big"].pack is None
    assert verify(path).ok
    _load_at(0, 1, path, 2)
    run_distributed(_load_at, 2, path, 2)


# ------------------------------------------------------------ object stores


@pytest.fixture(scope="module")
def s3(moto_server):  # noqa: ANN001, ANN201 - tests.s3_support's server
    moto_server.create_bucket("packed")
    return moto_server


def test_a_packed_save_to_s3_writes_each_pack_as_one_object(s3) -> None:  # noqa: ANN001
    from tests.s3_support import s3_options

    options = s3_options(s3.endpoint)
    location = open_location("s3://packed/ckpt", options=options)
    tensors = _tensors()
    save(_sd(tensors), location, options=PACK)
    record = read_commit_record(location)
    assert list(record.packs) == ["packs/0-0.zip"]
    sizes = location.store.list_sizes()
    assert sizes["packs/0-0.zip"] == record.packs["packs/0-0.zip"]
    assert not [rel for rel in sizes if any(rel.startswith(f"{k}/") for k in record.packed_arrays)]  # none of theirs
    _check_loads(location, tensors)
    report = verify(location)
    assert report.ok, report


def test_an_array_of_several_chunks_is_packed_whole_with_each_chunks_offset(tmp_path: Path) -> None:
    """Chunks of 16 KiB (``max_chunk_bytes``): the 128 KiB array "big" is 8 chunks, all
    in the pack, each at its own offset, read back by shardstore and by plain zarr."""
    from shardstore.strategies.zarr import ZarrSaveShardedStrategy

    tensors = _tensors()
    path = tmp_path / "ckpt"
    save(_sd(tensors), str(path), ZarrSaveShardedStrategy(max_chunk_bytes=16 * 1024),
         options=SaveOptions(pack_arrays_up_to=256 * 1024))
    big = read_commit_record(open_location(path)).arrays["big"]
    assert big.pack == "packs/0-0.zip" and big.chunk_count > 1
    assert len(set(big.chunk_offsets)) == big.chunk_count
    _check_loads(path, tensors)
    group = zarr.open_group(zarr.storage.ZipStore(path / big.pack, mode="r"), mode="r")
    np.testing.assert_array_equal(group["big"][...], tensors["big"].numpy())
    assert verify(path).ok


def test_an_array_of_more_chunks_than_a_pack_holds_stays_a_directory(tmp_path: Path) -> None:
    """An array under the bound but of more chunks than a zip without zip64 holds
    (65,600 chunks of one byte): before, the save failed with a bare
    ``struct.error: ushort format requires 0 <= number <= 65535`` from the zip's end
    record. It is now left a directory of its own, and the small ones packed."""
    from shardstore.strategies.zarr import ZarrSaveShardedStrategy

    tensors = {"many": torch.arange(65_600, dtype=torch.int8), "small": torch.randn(3)}
    path = tmp_path / "ckpt"
    save(_sd(tensors), str(path), ZarrSaveShardedStrategy(max_chunk_bytes=1),
         options=SaveOptions(pack_arrays_up_to=1 << 20))
    record = read_commit_record(open_location(path))
    assert record.arrays["many"].pack is None and record.arrays["many"].chunk_count == 65_600
    assert record.arrays["small"].pack == "packs/0-0.zip"
    _check_loads(path, tensors)


def test_the_zarr_modules_open_by_path_reads_a_packed_array_from_its_pack(saved: tuple[Path, dict]) -> None:
    """``_open_zarr_array_verbose`` (Megatron-Core's zarr API: a key's path) on a packed
    array: before, it failed with "Metadata at .../norm/zarr.json does not exist" and
    advice about consolidated_only saves, which did not apply. It now opens the array
    read-only from its pack, and refuses a mode that writes by naming the pack."""
    from shardstore.strategies.zarr import _open_zarr_array_verbose

    path, tensors = saved
    array = _open_zarr_array_verbose(f"{path}/norm", "r")
    np.testing.assert_array_equal(array.read().result(), tensors["norm"].numpy())
    with pytest.raises(CheckpointingException, match=r"packed into packs/0-0.zip .*read-only"):
        _open_zarr_array_verbose(f"{path}/norm", "r+")


def test_a_pack_whose_directory_offset_spells_the_end_signature_passes(tmp_path: Path) -> None:
    """A zip whose central directory starts at byte 0x06054B50 (100,993,872): its
    offset's bytes in the end record spell the end record's signature. Before, verify
    took them for the end record and reported the pack "not a zip" (zipfile reads it);
    it now finds the record as zipfile does. (A sparse file: no data of that size.)"""
    from shardstore.format.chunks import chunk_store_for
    from shardstore.format.packs import check_pack

    cd_offset = 0x06054B50
    name = b"zarr.json"  # one entry, its local header at 0 (zeros): only the directory matters here
    entry = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0x800, 0, 0, 33, 0, 0, 0, len(name), 0, 0, 0, 0,
                        0, 0) + name
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(entry), cd_offset, 0)
    pack = tmp_path / "packs" / "0-0.zip"
    pack.parent.mkdir()
    with open(pack, "wb") as f:
        f.seek(cd_offset)
        f.write(entry + end)
    store = chunk_store_for(open_location(tmp_path), 1)
    problems = check_pack(store, "packs/0-0.zip", pack.stat().st_size, [])
    assert [part for _, part, _ in problems] == ["zarr.json"], problems  # its (absent) local header, not "not a zip"


def test_small_packed_chunks_are_encoded_on_one_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Encoding a packed chunk does no I/O: where chunks are small, threads only contend
    for the GIL (issue 44.6: 10,000 chunks of 1-64 KiB took 0.36 s on 8 threads, 0.20 s on one)."""
    from shardstore.execution import save as save_module

    asked: list[int | None] = []
    run_writes = save_module.run_writes

    def spy(jobs: list, threads: int | None = None, share: object = None) -> list:
        if jobs and all(type(file.store).__name__ == "PackCollector" for file, _ in jobs):
            asked.append(threads)
        return run_writes(jobs, threads, share)

    monkeypatch.setattr(save_module, "run_writes", spy)
    tensors = _tensors()
    save(_sd(tensors), str(tmp_path / "ckpt"), options=PACK)
    assert asked == [1]
    _check_loads(tmp_path / "ckpt", tensors)


def test_the_zip_crc32_is_zlibs_taken_piece_by_piece() -> None:
    """The packs' CRC-32 (ISA-L's where ``isal`` is installed: about 20x zlib 1.2's on
    32 KiB here) is zlib's, chained over a member's pieces as ``PackCollector.put`` does."""
    import zlib

    from shardstore.format import packs

    data = np.random.default_rng(5).bytes(70_001)
    assert packs.zip_crc32(data) == zlib.crc32(data)
    assert packs.zip_crc32(data[1000:], packs.zip_crc32(data[:1000])) == zlib.crc32(data)
    assert packs.zip_crc32(b"") == 0
    isal_zlib = pytest.importorskip("isal.isal_zlib")
    assert packs.zip_crc32 is isal_zlib.crc32


def test_pack_runs_join_neighbours_within_the_gap_and_the_size_bound() -> None:
    from shardstore.format.packs import PACK_RUN_BYTES, PACK_RUN_GAP, pack_runs

    far = 110 + 2 * PACK_RUN_GAP + 1
    spans = [(far, 100), (0, 100), (100 + PACK_RUN_GAP, 10), (far + 200, PACK_RUN_BYTES), (far + 200, 10)]
    assert pack_runs(spans) == [
        (0, 110 + PACK_RUN_GAP, [1, 2]),  # a gap of at most PACK_RUN_GAP joins; one more byte does not
        (far, far + 100, [0]),  # no run passes PACK_RUN_BYTES
        (far + 200, far + 200 + PACK_RUN_BYTES, [3, 4]),  # one chunk read by two jobs
    ]
    assert pack_runs([]) == []


def test_threads_follow_the_cpus_this_process_may_use_not_the_machine(tmp_path: Path, monkeypatch) -> None:
    """A job scheduler or a container's cpuset narrows a process's CPUs below
    ``os.cpu_count()``: the packed chunks' encoding threads and TensorStore's copy
    threads follow the affinity mask (before: the machine's count)."""
    from shardstore.engine.zarr_strategies import tensorstore_context
    from shardstore.execution import save as rank_save
    from shardstore.stores.base import usable_cpus

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert usable_cpus() == 1
    large = [(None, np.zeros(1 << 20, dtype=np.uint8))] * 4  # 1 MiB each: above the one-thread size
    assert rank_save._encoding_threads(large, 8) == 1
    location = open_location(tmp_path / "ckpt")
    assert tensorstore_context(location).spec.to_json()["data_copy_concurrency"]["limit"] == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    assert rank_save._encoding_threads(large, 8) == 6
