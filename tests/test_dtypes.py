"""Every supported dtype round-trips bit-exact; plain zarr and TensorStore read
bfloat16 and float8 without shardstore (issue 3, point 4)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from shardstore import SaveOptions, ShardedTensor, StorageLayout, load, save
from tests.dist import run_distributed
from tests.scenarios import assert_bits_equal, bits, global_tensor, grid_shard

DTYPES = [
    torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
]
SHAPE = (6, 10)


def _key(dtype: torch.dtype) -> str:
    return "dtypes/" + str(dtype).removeprefix("torch.")


def save_all_dtypes(rank: int, world: int, ckpt: str) -> None:
    # per array: the plain readers below open each array by its path (the default packs them)
    save({_key(d): grid_shard(_key(d), global_tensor(_key(d), SHAPE, d), rank, world, (0,)) for d in DTYPES}, ckpt,
         options=SaveOptions(layout=StorageLayout(pack_arrays_up_to=0)))


def load_all_dtypes(rank: int, world: int, ckpt: str) -> None:
    request = {_key(d): ShardedTensor.from_rank_offsets(_key(d), torch.empty(SHAPE, dtype=d)) for d in DTYPES}
    loaded = load(request, ckpt)
    for d in DTYPES:
        assert_bits_equal(loaded[_key(d)], global_tensor(_key(d), SHAPE, d), _key(d))


def test_all_dtypes_round_trip_bit_exact(ckpt_dir: Path) -> None:
    run_distributed(save_all_dtypes, 2, str(ckpt_dir))
    run_distributed(load_all_dtypes, 1, str(ckpt_dir))


PLAIN_READER = r"""
import json, sys
import numpy as np, tensorstore as ts, zarr
ckpt, keys = sys.argv[1], json.loads(sys.argv[2])
out = {}
for key in keys:
    z = zarr.open_array(f"{ckpt}/{key}", mode="r")[:]
    t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{ckpt}/{key}/"}}).result().read().result()
    out[key] = {"zarr": z.view(np.uint8).tobytes().hex(), "ts": t.view(np.uint8).tobytes().hex(),
                "zarr_dtype": str(z.dtype), "shape": list(z.shape)}
out["imported"] = sorted(m for m in ("torch", "shardstore.engine.save") if m in sys.modules)
print(json.dumps(out))
"""


def test_plain_zarr_and_tensorstore_read_bfloat16_and_float8_without_shardstore(ckpt_dir: Path) -> None:
    run_distributed(save_all_dtypes, 2, str(ckpt_dir))
    keys = [_key(d) for d in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)]
    proc = subprocess.run([sys.executable, "-c", PLAIN_READER, str(ckpt_dir), json.dumps(keys)],
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["imported"] == [], "the reader must not import torch or shardstore's API"
    for d, key in zip((torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2), keys):
        expected = bits(global_tensor(key, SHAPE, d)).numpy().view("uint8").tobytes().hex()
        assert result[key]["zarr"] == expected, key
        assert result[key]["ts"] == expected, key
        assert result[key]["zarr_dtype"] == str(d).removeprefix("torch."), key
        assert result[key]["shape"] == list(SHAPE)


def test_conjugate_and_negative_views_are_saved_and_loaded_by_value(ckpt_dir: Path) -> None:
    """A conjugate or negative view only flags its values over memory that holds others:
    before, ``save`` of one and a load into one both failed in numpy()."""
    c = torch.complex(torch.randn(8, 8), torch.randn(8, 8))
    save({"conj": ShardedTensor.from_rank_offsets("conj", c.conj()),
          "neg": ShardedTensor.from_rank_offsets("neg", c._neg_view())}, ckpt_dir)
    plain = load({k: ShardedTensor.from_rank_offsets(k, torch.zeros(8, 8, dtype=torch.complex64))
                  for k in ("conj", "neg")}, ckpt_dir)
    assert torch.equal(plain["conj"], c.conj().resolve_conj()) and torch.equal(plain["neg"], -c)
    views = load({"conj": ShardedTensor.from_rank_offsets("conj", torch.zeros(8, 8, dtype=torch.complex64).conj())},
                 ckpt_dir)
    assert torch.equal(views["conj"].resolve_conj(), c.conj().resolve_conj())
