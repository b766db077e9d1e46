"""Issue 17.1: irregular grids (``axis_fragmentations=None``), as Megatron-Core 0.16's
distributed optimizer builds them: 1-D buffers cut at arbitrary offsets. Saved with
Megatron's own ShardedTensor class, resharded to other irregular cuts and to regular
layouts and back, bit-exact; chunks straddling a cut are assembled by exchange."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from shardstore import CheckpointingException, ShardedTensor, load, load_plain_tensors, save, verify
from shardstore.inputs.irregular import contiguous_range
from shardstore.strategies.zarr import ZarrSaveShardedStrategy
from tests.dist import run_distributed
from tests.scenarios import assert_bits_equal, global_tensor

mapping = pytest.importorskip("megatron.core.dist_checkpointing.mapping")

BUFFERS = {"optimizer/exp_avg": torch.float32, "optimizer/param": torch.bfloat16}
NUMEL = 24
MATRIX_KEY, MATRIX_SHAPE = "optimizer/rows", (6, 4)


def _full(key: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return global_tensor(key, (NUMEL,), dtype)


def _buffer_shard(key: str, full: torch.Tensor, start: int, stop: int, empty: bool, megatron: bool) -> object:
    """What Megatron 0.16's ``sharded_param_state_dp_reshardable`` builds for one rank
    (with Megatron's class, or shardstore's: importing megatron costs each worker seconds)."""
    data = full[start:stop].clone()
    if empty:
        data = torch.empty_like(data)
    cls = mapping.ShardedTensor if megatron else ShardedTensor
    return cls(key, data, data.dtype, data.shape, (full.numel(),), (start,), axis_fragmentations=None,
               flattened_range=None, allow_shape_mismatch=False, replica_id=(0, 0, 0))


def _irregular_sd(rank: int, cuts: list[int], empty: bool = False, megatron: bool = False) -> dict:
    sd = {k: _buffer_shard(k, _full(k, dtype), cuts[rank], cuts[rank + 1], empty, megatron)
          for k, dtype in BUFFERS.items()}
    rows = [0, 2, 6] if len(cuts) == 3 else [round(i * 6 / (len(cuts) - 1)) for i in range(len(cuts))]
    matrix = global_tensor(MATRIX_KEY, MATRIX_SHAPE, torch.float32)[rows[rank]:rows[rank + 1]].clone()
    sd["rows"] = ShardedTensor(MATRIX_KEY, torch.empty_like(matrix) if empty else matrix, torch.float32,
                               tuple(matrix.shape), MATRIX_SHAPE, (rows[rank], 0), None)
    return sd


def _check_irregular(loaded: dict, rank: int, cuts: list[int]) -> None:
    expected = _irregular_sd(rank, cuts)
    for key in BUFFERS:
        assert_bits_equal(loaded[key], expected[key].data, key)
    assert_bits_equal(loaded["rows"], expected["rows"].data, "rows")


def save_irregular(rank: int, world: int, ckpt: str, cuts: list[int], max_chunk_bytes: int) -> None:
    save(_irregular_sd(rank, cuts, megatron=True), ckpt, ZarrSaveShardedStrategy(max_chunk_bytes=max_chunk_bytes))


def load_irregular(rank: int, world: int, ckpt: str, cuts: list[int]) -> None:
    _check_irregular(load(_irregular_sd(rank, cuts, empty=True), ckpt), rank, cuts)


def load_regular(rank: int, world: int, ckpt: str) -> None:
    request = {k: ShardedTensor.from_rank_offsets(k, torch.empty(NUMEL // world, dtype=dtype), (0, rank, world))
               for k, dtype in BUFFERS.items()}
    loaded = load(request, ckpt)
    for key, dtype in BUFFERS.items():
        assert_bits_equal(loaded[key], _full(key, dtype).chunk(world)[rank], key)


def save_regular(rank: int, world: int, ckpt: str) -> None:
    sd = {k: ShardedTensor.from_rank_offsets(k, _full(k, dtype).chunk(world)[rank].clone(), (0, rank, world))
          for k, dtype in BUFFERS.items()}
    rows = global_tensor(MATRIX_KEY, MATRIX_SHAPE, torch.float32)
    sd["rows"] = ShardedTensor.from_rank_offsets(MATRIX_KEY, rows.clone(), replica_id=rank)
    save(sd, ckpt)


def test_irregular_save_reloads_bit_exact_under_other_cuts_and_regular_layouts(tmp_path: Path) -> None:
    """16-byte chunks, so cuts fall inside chunks (the default bound gives these small
    buffers one chunk, assembled whole by exchange: the plug-in test in
    test_megatron_objects.py saves that way)."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(save_irregular, 2, ckpt, [0, 13, 24], 16)
    assert verify(ckpt).ok
    plain = load_plain_tensors(ckpt)
    for key, dtype in BUFFERS.items():
        assert_bits_equal(plain[key], _full(key, dtype), key)
    assert_bits_equal(plain[MATRIX_KEY], global_tensor(MATRIX_KEY, MATRIX_SHAPE, torch.float32))
    run_distributed(load_irregular, 2, ckpt, [0, 13, 24])
    run_distributed(load_irregular, 3, ckpt, [0, 5, 15, 24])
    run_distributed(load_regular, 4, ckpt)


def test_regular_save_reloads_under_irregular_cuts(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    run_distributed(save_regular, 4, ckpt)
    run_distributed(load_irregular, 2, ckpt, [0, 13, 24])


def test_straddling_chunks_are_written_once(tmp_path: Path) -> None:
    """16-byte chunks of a 24-element float32 buffer: 6 chunks, the one holding the cut
    at 13 ([12, 16)) assembled by exchange; every chunk file exists exactly once."""
    ckpt = tmp_path / "ckpt"
    run_distributed(save_irregular, 2, str(ckpt), [0, 13, 24], 16)
    chunks = sorted(p.name for p in (ckpt / "optimizer" / "exp_avg").glob("c.*"))
    assert chunks == [f"c.{i}" for i in range(6)]


def test_an_irregular_cut_along_an_inner_axis_is_refused_naming_the_key(ckpt_dir: Path) -> None:
    data = torch.ones(4, 3)  # columns [1, 4) of a (4, 5) tensor: not contiguous in C order
    shard = ShardedTensor("model/odd", data, torch.float32, (4, 3), (4, 5), (0, 1), None)
    with pytest.raises(CheckpointingException, match="model/odd.*not contiguous"):
        save({"odd": shard}, ckpt_dir)
    assert not ckpt_dir.exists()


@pytest.mark.parametrize(
    ("offset", "extent", "shape", "expected"),
    [
        ((13,), (11,), (24,), range(13, 24)),
        ((2, 0), (4, 4), (6, 4), range(8, 24)),
        ((0, 3, 0), (1, 2, 5), (2, 8, 5), range(15, 25)),
        ((1, 2, 0), (1, 1, 3), (2, 8, 5), range(50, 53)),  # a part of one row
        ((0, 1), (4, 3), (4, 5), None),
        ((0, 0), (0, 5), (4, 5), range(0, 0)),
    ],
)
def test_contiguous_ranges(offset, extent, shape, expected) -> None:
    result = contiguous_range(offset, extent, shape)
    assert result == expected
    if result is not None and math.prod(extent):
        grid = torch.arange(math.prod(shape)).reshape(shape)
        box = grid[tuple(slice(o, o + e) for o, e in zip(offset, extent))]
        assert box.flatten().tolist() == list(result)


def _irregular_rows(shape: tuple[int, int], cut: int, data: torch.Tensor | None = None, **kwargs) -> dict:
    """A ``shape`` matrix cut irregularly after row ``cut``: rows before and after it."""
    rows, cols = shape
    parts = {"a": (0, cut), "b": (cut, rows)}
    return {
        name: ShardedTensor("w", torch.zeros(stop - start, cols) if data is None else data[start:stop].clone(),
                            torch.float32, (stop - start, cols), shape, (start, 0), None, **kwargs)
        for name, (start, stop) in parts.items()
    }


@pytest.mark.parametrize(("shape", "cut"), [((4, 8), 1), ((5, 6), 3), ((3, 6), 2), ((3, 4), 1)])
def test_an_irregular_request_with_allow_shape_mismatch_loads_padded_or_truncated(
    tmp_path: Path, shape: tuple[int, int], cut: int,
) -> None:
    """Irregular shards are stored as flat ranges of the global shape
    (``inputs.irregular``), and ``allow_shape_mismatch`` travels with them: a request of
    another global shape gets the stored values where both shapes have them and zeros
    elsewhere, as a regular one does. Before, the flag was dropped and the load failed,
    telling the caller to set the flag it had set."""
    stored = torch.arange(24.0).reshape(4, 6)
    save(_irregular_rows((4, 6), 1, stored), tmp_path / "ckpt")
    loaded = load(_irregular_rows(shape, cut, allow_shape_mismatch=True), tmp_path / "ckpt")
    expected = torch.zeros(shape)
    rows, cols = min(4, shape[0]), min(6, shape[1])
    expected[:rows, :cols] = stored[:rows, :cols]
    assert torch.equal(torch.cat([loaded["a"], loaded["b"]]), expected)
    with pytest.raises(CheckpointingException, match="stored with global shape \\(4, 6\\).*set allow_shape_mismatch"):
        load(_irregular_rows(shape, cut), tmp_path / "ckpt")



def _empty_rows(shape: tuple[int, ...], cuts: list[int]) -> dict:
    """Shards of a zero-element ``shape`` cut irregularly along its first axis at ``cuts``."""
    return {
        f"part{i}": ShardedTensor("w", torch.zeros(stop - start, *shape[1:]), torch.float32,
                                  (stop - start, *shape[1:]), shape, (start,) + (0,) * (len(shape) - 1), None)
        for i, (start, stop) in enumerate(zip(cuts, cuts[1:]))
    }


@pytest.mark.parametrize(("shape", "cuts"), [((0,), [0, 0]), ((4, 0), [0, 1, 4]), ((0, 6), [0, 0, 0])])
def test_an_irregular_tensor_with_no_elements_round_trips(
    tmp_path: Path, shape: tuple[int, ...], cuts: list[int],
) -> None:
    """A zero-element global tensor cut irregularly is stored and loaded back, as a
    regular one is. Before, each shard became a flattened range of length 0, which a
    save leaves out as a rank holding none of the tensor: the save committed without
    the array, and the load failed saying the checkpoint has no tensor 'w'."""
    save(_empty_rows(shape, cuts), tmp_path / "ckpt")
    assert verify(tmp_path / "ckpt").ok
    assert load_plain_tensors(tmp_path / "ckpt")["w"].shape == shape
    loaded = load(_empty_rows(shape, cuts), tmp_path / "ckpt")
    assert {name: tuple(t.shape) for name, t in loaded.items()} == {
        name: t.local_shape for name, t in _empty_rows(shape, cuts).items()
    }
