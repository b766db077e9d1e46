"""Many small tensors (issue 44.6): the per-array layout, written fast, read by key.

A checkpoint of many 1-64 KiB tensors keeps one Zarr array per key (its own
``zarr.json`` and chunk), so plain zarr-python (through the root's consolidated
metadata: one document read for every key) and TensorStore (each array's own
``zarr.json``) read each tensor by key. ``LocalStore.put_many`` makes the arrays'
directories in one pass before its threads write the files.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from zarr.storage import LocalStore as ZarrLocalStore

from shardstore import SaveOptions, ShardedTensor, StorageLayout, load, save
from shardstore.stores.local import LocalStore

ts = pytest.importorskip("tensorstore")

COUNT = 60
# the per-array layout this module is about: each tensor its own array (the default packs them)
PER_ARRAY = SaveOptions(layout=StorageLayout(pack_arrays_up_to=0))


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    sizes = torch.randint(256, 16385, (COUNT,), generator=gen).tolist()
    return {f"layer{i % 3}/t{i}": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = _tensors()
    path = tmp_path_factory.mktemp("small") / "ckpt"
    save({k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}, str(path),
         options=PER_ARRAY)
    return path, tensors


def test_small_tensors_load_back_bit_exact(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, tensors = saved
    loaded = load({k: ShardedTensor.from_rank_offsets(k, torch.empty_like(t), replica_id=0)
                   for k, t in tensors.items()}, str(path))
    assert [k for k, t in tensors.items() if not torch.equal(loaded[k], t)] == []


class _CountingStore(ZarrLocalStore):
    """zarr-python's local store, counting the metadata documents it reads."""

    documents_read: list[str]

    async def get(self, key, prototype, byte_range=None):  # noqa: ANN001, ANN201 - zarr's signature
        if key.endswith("zarr.json"):
            self.documents_read.append(key)
        return await super().get(key, prototype, byte_range)


def test_plain_zarr_opens_every_key_from_the_root_document_alone(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, tensors = saved
    store = _CountingStore(str(path), read_only=True)
    store.documents_read = []
    group = zarr.open_group(store, mode="r")
    arrays = {k: group[k] for k in tensors}  # every key, through the consolidated metadata
    assert store.documents_read == ["zarr.json"]
    for key, t in tensors.items():
        np.testing.assert_array_equal(arrays[key][...], t.numpy())


def test_tensorstore_reads_every_small_tensor_by_key(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, tensors = saved
    for key, t in tensors.items():
        array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{path}/{key}/"}}).result()
        np.testing.assert_array_equal(array.read().result(), t.numpy())


def test_put_many_makes_every_directory_before_any_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str]] = []
    real_mkdir, real_open = os.mkdir, os.open

    def mkdir(path, *args, **kwargs):  # noqa: ANN001, ANN202
        events.append(("mkdir", os.fspath(path)))
        return real_mkdir(path, *args, **kwargs)

    def open_(path, flags, *args, **kwargs):  # noqa: ANN001, ANN202
        if flags & os.O_CREAT:
            events.append(("create", os.fspath(path)))
        return real_open(path, flags, *args, **kwargs)

    files = {f"k{i}/zarr.json": b"{}" for i in range(40)} | {"g/h/zarr.json": b"{}", "g/zarr.json": b"{}"}
    (tmp_path / "root").mkdir()  # a save's staging directory exists before its writes
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)
    LocalStore(tmp_path / "root").put_many(files)
    monkeypatch.undo()
    assert len(events) == 42 + len(files)  # 42 directories (40 arrays, g, g/h), then the files
    kinds = [kind for kind, _ in events]
    assert kinds.index("create") > max(i for i, kind in enumerate(kinds) if kind == "mkdir")
    made = [p for kind, p in events if kind == "mkdir"]
    assert len(made) == len(set(made)) and made.index(str(tmp_path / "root" / "g")) < made.index(
        str(tmp_path / "root" / "g" / "h"))
    assert {rel: (tmp_path / "root" / rel).read_bytes() for rel in files} == files


def test_put_many_makes_parents_no_file_names(tmp_path: Path) -> None:
    files = {"a/b/c/zarr.json": b"1", "x/zarr.json": b"2"}
    LocalStore(tmp_path / "root").put_many(files)
    assert {rel: (tmp_path / "root" / rel).read_bytes() for rel in files} == files


def test_zip_pack_floor_is_readable_by_plain_readers(tmp_path: Path) -> None:
    """The bench's floor of a packed design (``scripts/bench.py: zip_pack_save``, issue
    44.6's measurement of one file for every array) writes what it claims: each tensor a
    Zarr v3 array inside one zip that zarr-python's ``ZipStore`` and TensorStore's
    ``zip`` kvstore read by key, and the bench's own load gives the same values."""
    from tests.script_support import load_script

    bench = load_script("bench")
    state = bench.build_tiny(5)
    path = tmp_path / "pack.zip"
    bench.zip_pack_save(state, path)
    group = zarr.open_group(zarr.storage.ZipStore(path, mode="r"), mode="r")
    loaded = bench.zip_pack_load(state, path)
    for key, (tensor, _) in state.shards.items():
        np.testing.assert_array_equal(group[key][:], tensor.numpy())
        spec_ts = {"driver": "zarr3", "kvstore": {"driver": "zip", "base": f"file://{path}"}, "path": key}
        np.testing.assert_array_equal(ts.open(spec_ts).result().read().result(), tensor.numpy())
        assert torch.equal(loaded[key], tensor)
