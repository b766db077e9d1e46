"""Issue 13: nothing lost, nothing silently wrong, nothing hangs.

Each test here failed on the code before the fix it pins (the 0-d read into a detached
scalar, the lossy cast, the array/group clash, ...); the S3 variants live in
``test_s3.py`` next to their server.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardstore import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    load,
    load_plain_tensors,
    save,
    verify,
)
from shardstore.strategies.zarr import ZarrLoadShardedStrategy
from tests.dist import run_distributed
from tests.scenarios import assert_bits_equal, global_tensor

DTYPES = [
    torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
]


def _scalar_key(dtype: torch.dtype) -> str:
    return "scalars/" + str(dtype).removeprefix("torch.")


def _scalar(dtype: torch.dtype) -> torch.Tensor:
    """A 0-d tensor whose value no uninitialised buffer is likely to hold."""
    return global_tensor(_scalar_key(dtype), (1,), dtype).reshape(())


def _scalars(empty: bool, replica: int = 0) -> dict:
    return {
        _scalar_key(d): ShardedTensor.from_rank_offsets(
            _scalar_key(d), torch.zeros((), dtype=d) if empty else _scalar(d), replica_id=replica
        )
        for d in DTYPES
    }


def save_scalars(rank: int, world: int, ckpt: str) -> None:
    sd = _scalars(empty=False, replica=rank)
    sd["step"] = ShardedTensor.from_rank_offsets("optimizer/step", torch.tensor(1000), replica_id=rank)
    save(sd, ckpt)


def load_scalars(rank: int, world: int, ckpt: str) -> None:
    loaded = load(_scalars(empty=True, replica=rank), ckpt)
    for d in DTYPES:
        assert_bits_equal(loaded[_scalar_key(d)], _scalar(d), _scalar_key(d))


@pytest.mark.parametrize("world", [1, 2])
def test_zero_dim_tensors_round_trip_every_dtype(ckpt_dir: Path, world: int) -> None:
    run_distributed(save_scalars, world, str(ckpt_dir))
    run_distributed(load_scalars, world, str(ckpt_dir))
    run_distributed(load_scalars, 3 - world, str(ckpt_dir))
    plain = load_plain_tensors(ckpt_dir)
    assert plain["optimizer/step"].item() == 1000
    for d in DTYPES:
        assert_bits_equal(plain[_scalar_key(d)], _scalar(d), _scalar_key(d))
    assert verify(ckpt_dir).ok


# ------------------------------------------------------------------ lossy casts


def _one(key: str, value: torch.Tensor) -> dict:
    return {key: ShardedTensor.from_rank_offsets(key, value)}


@pytest.mark.parametrize("requested", [torch.int64, torch.float16, torch.bool, torch.bfloat16, torch.float8_e4m3fn])
def test_lossy_cast_on_load_is_refused_naming_the_key(ckpt_dir: Path, requested: torch.dtype) -> None:
    save(_one("w", torch.tensor([0.5, 1e6, -3.25])), ckpt_dir)
    with pytest.raises(CheckpointingException, match=r"'w'.*float32.*" + str(requested).removeprefix("torch.")):
        load(_one("w", torch.empty(3, dtype=requested)), ckpt_dir)
    lossy = ZarrLoadShardedStrategy(allow_lossy_casts=True)
    loaded = load(_one("w", torch.empty(3, dtype=requested)), ckpt_dir, sharded_strategy=lossy)
    assert loaded["w"].dtype == requested  # asked for explicitly: converted


def test_exact_conversions_still_load(ckpt_dir: Path) -> None:
    save({**_one("h", torch.tensor([1.5, -2.0], dtype=torch.float16)),
          **_one("i", torch.tensor([7, -9], dtype=torch.int32))}, ckpt_dir)
    loaded = load({**_one("h", torch.empty(2, dtype=torch.float32)),
                   **_one("i", torch.empty(2, dtype=torch.int64))}, ckpt_dir)
    assert loaded["h"].tolist() == [1.5, -2.0] and loaded["h"].dtype == torch.float32
    assert loaded["i"].tolist() == [7, -9] and loaded["i"].dtype == torch.int64


# ------------------------------------------------------- array / group clashes


def save_clashing_keys(rank: int, world: int, ckpt: str, keys: tuple[str, str], kind: str) -> str:
    first, second = keys
    sd = {"a": ShardedTensor.from_rank_offsets(first, torch.ones(4), replica_id=rank)}
    if kind == "tensor":
        sd["b"] = ShardedTensor.from_rank_offsets(second, torch.ones(2), replica_id=rank)
    else:
        sd["b"] = ShardedObject(second, {"rank": rank}, (world,), (rank,))
    try:
        save(sd, ckpt)
    except CheckpointingException as exc:
        return str(exc)
    raise AssertionError("a save with clashing keys returned normally")


@pytest.mark.parametrize("keys, kind", [(("a", "a/b"), "tensor"), (("s/c", "s"), "tensor"),
                                        (("x", "x/y"), "object"), (("same", "same"), "object")])
def test_keys_that_clash_as_array_and_group_are_refused_on_every_rank(
    ckpt_dir: Path, keys: tuple[str, str], kind: str
) -> None:
    messages = run_distributed(save_clashing_keys, 2, str(ckpt_dir), keys, kind)
    for message in messages:
        assert "Invalid global sharding" in message and repr(keys[0] if kind == "tensor" else keys[1])[1:-1] in message
    assert not ckpt_dir.exists() or not any(ckpt_dir.iterdir()), "nothing may be written"
