"""Deterministic global tensors and the shard layouts tests save and load with.

Every rank computes the same global tensor from its key, so a rank can build its
shard and check what it loaded without any data exchange.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardstore import ShardedTensor
from shardstore.format.records import COMMIT_RECORD
from shardstore.format.records.encoding import RECORD_DIGEST, UNSEALED_DIGEST, seal_record


def global_tensor(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random bits for ``key`` (all bit patterns, NaNs included, for float types)."""
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool().reshape(shape)
    if dtype.is_floating_point or dtype in (torch.uint8, torch.int8):
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
        return raw.view(dtype).reshape(shape)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**62)), min(info.max, 2**62), (n,), dtype=torch.int64, generator=gen).to(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A view for bit-exact comparison (NaN-safe, works for float8)."""
    t = t.contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    size = t.element_size()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(bits(actual), bits(expected)), f"{what}: values differ"


def grid_coords(rank: int, world: int, n_axes: int) -> list[tuple[int, int]]:
    """Splits ``world`` over ``n_axes`` axes (as evenly as possible, earlier axes first)
    and returns ``(index, count)`` per axis for ``rank`` (C order)."""
    counts = [1] * n_axes
    remaining, axis = world, 0
    while remaining > 1:
        counts[axis % n_axes] *= 2
        remaining //= 2
        axis += 1
    coords, r = [], rank
    for c in reversed(counts):
        coords.append((r % c, c))
        r //= c
    return list(reversed(coords))


def grid_shard(key: str, full: torch.Tensor, rank: int, world: int, axes: tuple[int, ...], empty: bool = False,
               **kwargs) -> ShardedTensor:
    """This rank's block of ``full`` on a grid of ``world`` blocks over ``axes``."""
    local = full
    rank_offsets = []
    for axis, (idx, count) in zip(axes, grid_coords(rank, world, len(axes))):
        local = local.chunk(count, axis)[idx]
        if count > 1:
            rank_offsets.append((axis, idx, count))
    local = torch.empty_like(local) if empty else local.clone()
    return ShardedTensor.from_rank_offsets(key, local, *rank_offsets, **kwargs)


def expected_block(full: torch.Tensor, sh: ShardedTensor) -> torch.Tensor:
    return full[sh.global_slice()]


def rewrite_record(checkpoint: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Applies ``edit`` to the root ``zarr.json`` document and writes it back resealed,
    as someone who knows the format would: the record's own checks beyond its digest
    then see the edit (a version 4 record edited by hand fails its digest first)."""
    path = Path(checkpoint) / COMMIT_RECORD
    root = json.loads(path.read_bytes())
    edit(root)
    record = root.get("attributes", {}).get("shardstore") if isinstance(root, dict) else None
    if isinstance(record, dict) and RECORD_DIGEST in record:
        record[RECORD_DIGEST] = UNSEALED_DIGEST
        path.write_bytes(seal_record(json.dumps(root, separators=(",", ":")).encode()))
    else:
        path.write_text(json.dumps(root))
