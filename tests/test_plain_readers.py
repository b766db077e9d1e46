"""Plain tools open shardstore checkpoints (issue 16.5, issue 27.1).

Without shardstore installed (a venv of its own, ``tests/plain_venv.py``), zarr-python,
xarray and dask open a checkpoint that holds float32, bfloat16 and float8 arrays: every
array of a Zarr core data type reads, and each bfloat16/float8 array is missing alone,
while TensorStore reads every array. Before, zarr-python parsed the consolidated
metadata of the whole checkpoint at once and one bfloat16 array there made every array
unreachable ("No Zarr data type found that matches 'bfloat16'"). With shardstore
installed, zarr-python and xarray see every array.
"""

from __future__ import annotations

import json
import os
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from shardstore import SaveOptions, ShardedObject, ShardedTensor, StorageLayout, save, verify
from shardstore._zarr_autoload import EXTENSION_METADATA
from shardstore.format.dtypes import BY_ZARR_NAME, CORE_DATA_TYPES, from_torch
from shardstore.format.records import COMMIT_RECORD
from shardstore.format.zarr_dtypes import ML_DTYPES
from tests.plain_venv import plain_python
from tests.scenarios import global_tensor, rewrite_record

xr = pytest.importorskip("xarray")

# key -> (shape, dtype): nested groups, the root, and every extension data type
ARRAYS = {
    "model/fc1": ((6, 4), torch.float32),
    "model/norm": ((4,), torch.bfloat16),
    "model/fp8/w": ((3, 2), torch.float8_e4m3fn),
    "model/fp8/grad": ((5,), torch.float8_e5m2),
    "model/fp8/scale": ((1,), torch.float32),
    "embedding": ((8, 2), torch.bfloat16),
    "step": ((), torch.int64),
}
CORE = sorted(k for k, (_, dtype) in ARRAYS.items() if dtype in (torch.float32, torch.int64))
EXTENSION = sorted(set(ARRAYS) - set(CORE))


def _tensor(key: str) -> torch.Tensor:
    shape, dtype = ARRAYS[key]
    return global_tensor(key, shape, dtype)


def _dtype(key: str) -> str:
    """The numpy name of the array's type (ml_dtypes' for bfloat16 and float8)."""
    return str(from_torch(ARRAYS[key][1]).numpy_dtype)


def _hex(t: torch.Tensor) -> str:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()


# per array: these tools open the checkpoint by path (the default packs small arrays into zips)
PER_ARRAY = SaveOptions(layout=StorageLayout(pack_arrays_up_to=0))


def _save(path: Path) -> Path:
    state = {key: ShardedTensor.from_rank_offsets(key, _tensor(key)) for key in ARRAYS}
    state["rng"] = ShardedObject("rng_state", torch.get_rng_state(), (1,), (0,))
    state["iteration"] = 1000
    save(state, path, options=PER_ARRAY)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("plain") / "ckpt")


# What a user without shardstore runs; prints one JSON document of what each tool got.
PLAIN_READER = r'''
import importlib.util, json, sys, warnings
root = sys.argv[1]
out = {"shardstore_importable": importlib.util.find_spec("shardstore") is not None}

def error(action):
    try:
        action()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None

import numpy as np
import zarr
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    group = zarr.open_group(root, mode="r")
    members = dict(group.members(max_depth=None))
out["zarr_warnings"] = [str(w.message) for w in caught]
out["zarr_arrays"] = {k: [str(a.dtype), np.asarray(a[...]).tobytes().hex()]
                      for k, a in sorted(members.items()) if isinstance(a, zarr.Array)}
out["zarr_groups"] = sorted(k for k, a in members.items() if isinstance(a, zarr.Group))
out["zarr_root_attrs"] = {k: v for k, v in group.attrs.asdict().items() if k != "shardstore"}
out["zarr_getitem"] = {k: error(lambda k=k: group[k][...]) for k in sys.argv[2:]}
out["zarr_open_array"] = {k: error(lambda k=k: zarr.open_array(f"{root}/{k}", mode="r")) for k in sys.argv[2:]}

import xarray as xr
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = xr.open_zarr(root, group="model")
    tree = xr.open_datatree(root, engine="zarr")
out["xarray_warnings"] = [str(w.message) for w in caught]
out["xarray_model"] = {k: [str(v.dtype), np.asarray(v.values).tobytes().hex()] for k, v in model.data_vars.items()}
out["xarray_tree"] = {node.path: sorted(node.data_vars) for node in tree.subtree}

import dask.array as da
out["dask_fc1"] = np.asarray(da.from_zarr(root, component="model/fc1").compute()).tobytes().hex()
out["dask_norm"] = error(lambda: da.from_zarr(root, component="model/norm"))

import tensorstore as ts
out["tensorstore"] = {}
for key in sys.argv[2:] + ["model/fc1"]:
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{root}/{key}/"}}
    array = ts.open(spec, open=True).result()
    out["tensorstore"][key] = [str(array.dtype.numpy_dtype), array.read().result().tobytes().hex()]
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def plain(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What the plain tools got, run in a venv without shardstore."""
    python = plain_python()
    if isinstance(python, str):
        pytest.skip(python)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # conftest adds the repo
    cwd = tmp_path_factory.mktemp("elsewhere")  # not the repository, whose shardstore/ would import
    result = subprocess.run([str(python), "-c", PLAIN_READER, str(checkpoint), *EXTENSION],
                            capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_plain_venv_has_no_shardstore(plain: dict) -> None:
    assert plain["shardstore_importable"] is False


def test_zarr_opens_the_checkpoint_and_reads_every_core_array_exactly(plain: dict) -> None:
    assert sorted(plain["zarr_arrays"]) == CORE
    for key in CORE:
        assert plain["zarr_arrays"][key] == [_dtype(key), _hex(_tensor(key))], key
    assert plain["zarr_groups"] == ["model", "model/fp8"]


def test_zarr_opens_the_checkpoint_without_warnings(plain: dict) -> None:
    """Before, it warned that common.pt, metadata.json and __objects__ are not Zarr nodes."""
    assert plain["zarr_warnings"] == []


def test_each_extension_array_is_missing_alone_and_says_its_data_type(plain: dict) -> None:
    for key in EXTENSION:
        assert plain["zarr_getitem"][key] == f"KeyError: \"'{key}' not found in consolidated metadata.\""
        assert plain["zarr_open_array"][key] == f"ValueError: No Zarr data type found that matches '{_dtype(key)}'"


def test_the_root_group_tells_a_plain_reader_what_the_missing_arrays_are_and_what_opens_them(plain: dict) -> None:
    """Issue 33.4: zarr's KeyError names nothing a user can act on (and a file format cannot
    change it); the root group's ``readers`` attribute, which plain zarr-python reads,
    names every array it cannot open, its data type, and what reads it."""
    readers = plain["zarr_root_attrs"]["readers"]
    assert readers["arrays_needing_shardstore_or_tensorstore"] == {key: _dtype(key) for key in EXTENSION}
    for words in ("not found in consolidated metadata", "pip install . in a clone", "tensorstore.open"):
        assert words in readers["note"], words


def test_a_checkpoint_of_core_types_only_has_no_readers_note(tmp_path: Path) -> None:
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, tmp_path / "ckpt", options=PER_ARRAY)
    assert "readers" not in json.loads((tmp_path / "ckpt" / "zarr.json").read_text())["attributes"]


def test_a_default_checkpoint_of_core_types_notes_where_its_packed_arrays_are_and_how(tmp_path: Path) -> None:
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, tmp_path / "ckpt")
    readers = json.loads((tmp_path / "ckpt" / "zarr.json").read_text())["attributes"]["readers"]
    assert sorted(readers) == ["packed_arrays_note", "recipe"] and "zarr.storage.ZipStore" in readers["packed_arrays_note"]
    assert "zip_pack" in [s["store"] for s in readers["recipe"]["sources"]]


def test_xarray_opens_groups_and_the_tree_with_every_core_array(plain: dict) -> None:
    assert plain["xarray_model"] == {"fc1": ["float32", _hex(_tensor("model/fc1"))]}
    assert plain["xarray_tree"] == {"/": ["step"], "/model": ["fc1"], "/model/fp8": ["scale"]}
    assert plain["xarray_warnings"] == []


def test_dask_reads_a_core_array_and_refuses_a_bfloat16_one_alone(plain: dict) -> None:
    assert plain["dask_fc1"] == _hex(_tensor("model/fc1"))
    assert plain["dask_norm"] == "ValueError: No Zarr data type found that matches 'bfloat16'"


def test_tensorstore_reads_every_array_bit_for_bit(plain: dict) -> None:
    for key in [*EXTENSION, "model/fc1"]:
        assert plain["tensorstore"][key] == [_dtype(key), _hex(_tensor(key))], key


# ------------------------------------------------ with shardstore installed (this venv)


def test_with_shardstore_installed_zarr_lists_and_reads_every_array(checkpoint: Path) -> None:
    group = zarr.open_group(checkpoint, mode="r")
    arrays = {k: a for k, a in group.members(max_depth=None) if isinstance(a, zarr.Array)}
    assert sorted(arrays) == sorted(ARRAYS)
    for key, array in arrays.items():
        assert np.asarray(array[...]).tobytes().hex() == _hex(_tensor(key)), key


def test_with_shardstore_installed_xarray_opens_a_group_with_its_bfloat16_array(checkpoint: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = xr.open_zarr(checkpoint, group="model")
    assert dict(ds.sizes) == {"fc1.0": 6, "fc1.1": 4, "norm.0": 4}  # names unique per array
    assert np.array_equal(ds["fc1"].values, _tensor("model/fc1").numpy())
    assert ds["norm"].values.view(np.int16).tobytes() == _tensor("model/norm").view(torch.int16).numpy().tobytes()


# ------------------------------------------------ the format: where each array is listed


def test_consolidated_metadata_lists_extension_arrays_beside_zarrs_own_listing(checkpoint: Path) -> None:
    consolidated = json.loads((checkpoint / COMMIT_RECORD).read_bytes())["consolidated_metadata"]
    assert consolidated["must_understand"] is False
    assert sorted(k for k, v in consolidated["metadata"].items() if v["node_type"] == "array") == CORE
    assert sorted(consolidated[EXTENSION_METADATA]) == EXTENSION
    # each array's own zarr.json names the type as TensorStore writes it, for every reader
    assert json.loads((checkpoint / "model/norm/zarr.json").read_text())["data_type"] == "bfloat16"


def test_a_checkpoint_of_core_types_only_has_no_extension_listing(tmp_path: Path) -> None:
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, tmp_path / "ckpt")
    assert EXTENSION_METADATA not in json.loads((tmp_path / "ckpt" / COMMIT_RECORD).read_bytes())["consolidated_metadata"]


def test_core_data_types_are_every_type_but_the_ones_shardstore_teaches_zarr() -> None:
    taught = {t._zarr_v3_name for t in ML_DTYPES}
    assert set(BY_ZARR_NAME) == CORE_DATA_TYPES | taught and not CORE_DATA_TYPES & taught


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return _save(tmp_path / "ckpt")


def _problems(checkpoint: Path) -> dict[str, str]:
    return {f"{p.key} [{p.part}]": p.message for p in verify(checkpoint).problems}


def test_verify_accepts_the_listing_of_checkpoints_saved_before_the_split(saved: Path) -> None:
    """Those listed every array in zarr's ``metadata``: what their save wrote."""
    def unsplit(root: dict) -> None:
        consolidated = root["consolidated_metadata"]
        consolidated["metadata"].update(consolidated.pop(EXTENSION_METADATA))

    rewrite_record(saved, unsplit)
    assert _problems(saved) == {}


def test_verify_flags_an_extension_array_missing_from_the_listing(saved: Path) -> None:
    rewrite_record(saved, lambda root: root["consolidated_metadata"][EXTENSION_METADATA].pop("model/norm"))
    assert list(_problems(saved)) == ["zarr.json [consolidated model/norm]"]


def test_verify_flags_an_extension_array_listed_with_another_data_type(saved: Path) -> None:
    rewrite_record(saved, lambda root: root["consolidated_metadata"][EXTENSION_METADATA]["model/norm"]
                   .update(data_type="float16"))
    problems = _problems(saved)
    assert list(problems) == ["zarr.json [consolidated model/norm]"]
    assert "data_type: 'float16' where the record says 'bfloat16'" in problems["zarr.json [consolidated model/norm]"]


def test_verify_flags_a_core_array_moved_where_plain_zarr_does_not_look(saved: Path) -> None:
    def move(root: dict) -> None:
        consolidated = root["consolidated_metadata"]
        consolidated[EXTENSION_METADATA]["model/fc1"] = consolidated["metadata"].pop("model/fc1")

    rewrite_record(saved, move)
    problems = _problems(saved)
    assert list(problems) == ["zarr.json [consolidated model/fc1]"]
    assert "extension data types" in problems["zarr.json [consolidated model/fc1]"]
