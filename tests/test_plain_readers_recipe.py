"""Plain readers open every array by following the root's recipe (issue 65.3).

Checkpoints saved at 2 ranks with packs (``pack_arrays_up_to=65536``), each array's
document per node or in the consolidated metadata only, on local disk and on S3 (the
moto server), hold float32, bfloat16 and float8 arrays, small (packed) and large (a directory),
split over the ranks and whole. ``scripts/plain_read.py``, run where shardstore cannot
be imported (``python -S``: site-packages on ``PYTHONPATH`` without its ``.pth`` files,
so neither shardstore's editable install nor its zarr data-type hook), opens each array
by following ``attributes.readers.recipe``, with zarr-python where it can and TensorStore
otherwise, and every array's bytes are the saved ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from shardstore import SaveOptions, ShardedTensor, StorageLayout, save
from shardstore.format.records import read_commit_record
from shardstore.stores.locations import open_location
from tests.dist import run_distributed
from tests.s3_support import KEY, REGION, SECRET, MotoServer, s3_options
from tests.scenarios import global_tensor, grid_shard

pytest.importorskip("tensorstore")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "plain_read.py"
BUCKET = "plain-readers-recipe"
PACK_BYTES = 65536
# key -> (shape, dtype, split over the ranks by rows or whole on each)
ARRAYS = {
    "small/split": ((8, 4), torch.float32, True),
    "small/whole": ((5, 3), torch.float32, False),
    "small/split_bf16": ((6, 4), torch.bfloat16, True),
    "small/whole_bf16": ((16,), torch.bfloat16, False),
    "large/split": ((256, 128), torch.float32, True),
    "large/whole": ((128, 256), torch.float32, False),
    "large/split_bf16": ((256, 256), torch.bfloat16, True),
    "large/whole_bf16": ((512, 128), torch.bfloat16, False),
    "small/whole_fp8": ((32,), torch.float8_e4m3fn, False),
    "large/split_fp8": ((512, 256), torch.float8_e5m2, True),
    "step": ((), torch.int64, False),
}
# zarr-python has no type for these without shardstore
TENSORSTORE_ONLY = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
PACKED = {k for k, (shape, dtype, _) in ARRAYS.items()
          if torch.empty(shape, dtype=dtype).nbytes <= PACK_BYTES}
LAYOUTS = {"per_node": "per_node", "consolidated": "consolidated_only"}


def _state(rank: int, world: int) -> dict[str, ShardedTensor]:
    state = {}
    for key, (shape, dtype, split) in ARRAYS.items():
        full = global_tensor(key, shape, dtype)
        state[key] = (grid_shard(key, full, rank, world, (0,)) if split
                      else ShardedTensor.from_rank_offsets(key, full.clone(), replica_id=rank))
    return state


def save_every_layout(rank: int, world: int, local: str, s3_url: str, endpoint: str) -> None:
    for name, where in LAYOUTS.items():
        options = SaveOptions(pack_arrays_up_to=PACK_BYTES, zarr_metadata=where)
        save(_state(rank, world), f"{local}/{name}", options=options)
        save(_state(rank, world), open_location(f"{s3_url}/{name}", options=s3_options(endpoint)), options=options)


def _expected(key: str) -> dict:
    shape, dtype, _ = ARRAYS[key]
    full = global_tensor(key, shape, dtype)
    raw = full.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "sha256": hashlib.sha256(raw).hexdigest()}


# Run with ``python -S``: shardstore must not import, nor its zarr hook have run.
PLAIN = r'''
import runpy, sys
try:
    import shardstore
except ModuleNotFoundError:
    pass
else:
    raise SystemExit(f"shardstore is importable here: {shardstore.__file__}")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
assert "shardstore._zarr_autoload" not in sys.modules
'''


def plain_read(checkpoints: list[str], endpoint: str, cwd: Path) -> dict[str, dict[str, dict]]:
    """What ``scripts/plain_read.py`` read: checkpoint -> key -> its row."""
    paths = sysconfig.get_paths()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=os.pathsep.join(dict.fromkeys([paths["purelib"], paths["platlib"]])),
               AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, AWS_DEFAULT_REGION=REGION)
    result = subprocess.run(
        [sys.executable, "-S", "-c", PLAIN, str(SCRIPT), *checkpoints, "--s3-endpoint", endpoint, "--json"],
        capture_output=True, text=True, timeout=240, env=env, cwd=cwd,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    read: dict[str, dict[str, dict]] = {url: {} for url in checkpoints}
    for line in result.stdout.splitlines():
        row = json.loads(line)
        read[row.pop("checkpoint")][row.pop("key")] = row
    return read


@pytest.fixture(scope="module")
def saved(moto_server: MotoServer, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], str]:
    """The four checkpoints (local and S3, per node and consolidated only) by name,
    and the S3 endpoint."""
    moto_server.create_bucket(BUCKET)
    local = tmp_path_factory.mktemp("recipe")
    run_distributed(save_every_layout, 2, str(local), f"s3://{BUCKET}/run", moto_server.endpoint, timeout=240)
    urls = {f"{store} {name}": (f"{local}/{name}" if store == "local" else f"s3://{BUCKET}/run/{name}")
            for store in ("local", "s3") for name in LAYOUTS}
    return urls, moto_server.endpoint


@pytest.fixture(scope="module")
def plain(saved: tuple[dict[str, str], str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    urls, endpoint = saved
    read = plain_read(list(urls.values()), endpoint, tmp_path_factory.mktemp("elsewhere"))
    return {name: read[url] for name, url in urls.items()}


@pytest.mark.parametrize("case", ["local per_node", "local consolidated", "s3 per_node", "s3 consolidated"])
def test_the_layout_is_the_one_that_needs_the_recipe(saved: tuple[dict[str, str], str], case: str) -> None:
    urls, endpoint = saved
    options = {"options": s3_options(endpoint)} if case.startswith("s3") else {}
    record = read_commit_record(open_location(urls[case], **options))
    assert {k for k, a in record.arrays.items() if a.pack is not None} == PACKED
    assert record.zarr_metadata.value == LAYOUTS[case.split()[1]]
    if case == "local consolidated":
        assert not (Path(urls[case]) / "large" / "split" / "zarr.json").exists()


@pytest.mark.parametrize("case", ["local per_node", "local consolidated", "s3 per_node", "s3 consolidated"])
def test_plain_readers_read_every_array_bit_exact_by_the_recipe(plain: dict[str, dict], case: str) -> None:
    got = plain[case]
    assert sorted(got) == sorted(ARRAYS)
    for key in ARRAYS:
        assert {k: got[key][k] for k in ("shape", "dtype", "sha256")} == _expected(key), key


@pytest.mark.parametrize("case", ["local per_node", "local consolidated", "s3 per_node", "s3 consolidated"])
def test_zarr_python_reads_what_it_can_and_tensorstore_the_rest(plain: dict[str, dict], case: str) -> None:
    """TensorStore reads bfloat16 and float8 (zarr-python has no such types) and, on S3, packed
    arrays (zarr-python's ZipStore needs a local file); zarr-python reads the others."""
    for key, (_, dtype, _) in ARRAYS.items():
        tensorstore = dtype in TENSORSTORE_ONLY or (case.startswith("s3") and key in PACKED)
        assert plain[case][key]["reader"] == ("tensorstore" if tensorstore else "zarr"), key


def test_a_checkpoint_without_a_recipe_opens_every_array_by_its_path(tmp_path: Path) -> None:
    """Per-node documents and no packs: the root has no ``readers`` attribute, and the
    reader opens each array by its path."""
    core = {k: v for k, v in ARRAYS.items() if v[1] not in TENSORSTORE_ONLY}
    save({k: ShardedTensor.from_rank_offsets(k, global_tensor(k, shape, dtype)) for k, (shape, dtype, _) in core.items()},
         tmp_path / "ckpt", layout=StorageLayout(pack_arrays_up_to=0))  # the default packs small arrays
    assert "readers" not in json.loads((tmp_path / "ckpt" / "zarr.json").read_text())["attributes"]
    got = plain_read([str(tmp_path / "ckpt")], "http://127.0.0.1:1", tmp_path)[str(tmp_path / "ckpt")]
    assert {k: {f: row[f] for f in ("shape", "dtype", "sha256")} for k, row in got.items()} == {
        k: _expected(k) for k in core}


def test_the_recipe_names_each_listing_and_stays_small_for_many_packed_arrays(tmp_path: Path) -> None:
    """Packs and consolidated-only documents at 1 rank, 300 packed arrays: the recipe
    names the three listings and is the same size as for one array."""
    state = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.ones(4, dtype=torch.bfloat16)) for i in range(300)}
    state["large"] = ShardedTensor.from_rank_offsets("large", torch.ones(256, 128))
    save(state, tmp_path / "ckpt", options=SaveOptions(pack_arrays_up_to=PACK_BYTES, zarr_metadata="consolidated_only"))
    attributes = json.loads((tmp_path / "ckpt" / "zarr.json").read_text())["attributes"]
    assert attributes["readers"]["recipe"] == {
        "version": 1,
        "sources": [
            {"listed_in": ["consolidated_metadata", "metadata"], "store": "directory", "document": "listed"},
            {"listed_in": ["attributes", "packed_arrays"], "store": "zip_pack", "document": "zarr_json"},
        ],
        "tensorstore_only_data_types": ["bfloat16"],
    }
    assert len(attributes["packed_arrays"]) == 300
