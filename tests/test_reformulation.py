"""Megatron-Core's N-D flattened-tensor reformulation API on shardstore (issue 26.2).

Written from Megatron-Core's documented behaviour (``strategies.resharding``,
``strategies.torch.get_reformulation_metadata`` and ``load_tensors_metadata``): a
distributed-optimizer state saved as flattened ranges of the blocks of one TP x PP grid
(DP ranks cut each block, off the even split), then loaded under another grid through
``get_reformulation_metadata`` -> ``apply_nd_flattened_tensors_reformulation`` ->
``load`` -> ``restore_nd_flattened_tensors_formulation``, bit for bit.
"""

from __future__ import annotations

import math
import time
import warnings
from itertools import product
from pathlib import Path

import pytest
import torch

from shardstore import ShardedTensor, load, load_plain_tensors, load_tensors_metadata, save
from shardstore.core import CheckpointingException
from shardstore.format.records import read_commit_record
from shardstore.stores.locations import open_location
from shardstore.strategies.resharding import (
    TensorReformulationMetadata,
    apply_nd_flattened_tensors_reformulation,
    get_reformulation_metadata,
    is_nd_flattened_tensor,
    nd_flattened_tensor_reformulated_global_shape,
    restore_nd_flattened_tensors_formulation,
)
from tests.dist import run_distributed
from tests.fixtures.legacy.make_megatron014 import TORCH_DIST as MEGATRON_014_TORCH_DIST
from tests.scenarios import assert_bits_equal, global_tensor, rewrite_record

SHAPE = (8, 5, 40)  # TP splits axis 0, PP axis 2, as in Megatron's own resharding tests
FLAT, UNFLAT = "optimizer/exp_avg", "model/weight"


def _coords(rank: int, tp: int, pp: int, dp: int) -> tuple[int, int, int]:
    """``(tp_rank, dp_rank, pp_rank)`` of ``rank``, TP fastest, then DP, then PP."""
    return rank % tp, rank // tp % dp, rank // (tp * dp)


def _dp_cut(volume: int, dp_rank: int, dp: int) -> slice:
    """DP rank ``dp_rank``'s range of a block of ``volume`` elements: even cuts shifted
    by the rank, so no cut falls on a row boundary and ranges differ in length."""
    cuts = [0] + [min(volume, volume * r // dp + r) for r in range(1, dp)] + [volume]
    return slice(cuts[dp_rank], cuts[dp_rank + 1])


def _state(rank: int, layout: tuple[int, int, int], empty: bool = False) -> dict:
    """A model weight split TP x PP (replicated over DP) and its optimizer state as the
    DP ranks' flattened ranges of the same block."""
    tp, pp, dp = layout
    tp_rank, dp_rank, pp_rank = _coords(rank, tp, pp, dp)
    full_flat = global_tensor(FLAT, SHAPE, torch.float32)
    full_unflat = global_tensor(UNFLAT, SHAPE, torch.float32)
    block = full_flat.chunk(tp, 0)[tp_rank].chunk(pp, 2)[pp_rank]
    weight = full_unflat.chunk(tp, 0)[tp_rank].chunk(pp, 2)[pp_rank].clone()
    cut = _dp_cut(block.numel(), dp_rank, dp)
    flat = block.flatten()[cut].clone()
    if empty:
        flat, weight = torch.empty_like(flat), torch.empty_like(weight)
    return {
        "weight": ShardedTensor.from_rank_offsets(UNFLAT, weight, (0, tp_rank, tp), (2, pp_rank, pp),
                                                  replica_id=dp_rank),
        "exp_avg": ShardedTensor.from_rank_offsets_flat(FLAT, flat, tuple(block.shape), (0, tp_rank, tp),
                                                        (2, pp_rank, pp), flattened_range=cut),
    }


def _expected(rank: int, layout: tuple[int, int, int]) -> dict:
    return {k: v.data for k, v in _state(rank, layout).items()}


def _saved_blocks_overlapping(rank: int, saved: tuple[int, int, int], wanted: tuple[int, int, int]) -> set:
    """``(offset, block shape)`` of every saved block that the requested block of
    ``rank`` overlaps, by brute-force box intersection."""
    tp, pp, dp = wanted
    tp_rank, _, pp_rank = _coords(rank, tp, pp, dp)
    want = [(tp_rank * SHAPE[0] // tp, (tp_rank + 1) * SHAPE[0] // tp), (0, SHAPE[1]),
            (pp_rank * SHAPE[2] // pp, (pp_rank + 1) * SHAPE[2] // pp)]
    block = (SHAPE[0] // saved[0], SHAPE[1], SHAPE[2] // saved[1])
    found = set()
    for index in product(*(range(n // b) for n, b in zip(SHAPE, block))):
        offset = tuple(i * b for i, b in zip(index, block))
        if all(o < hi and o + b > lo for o, b, (lo, hi) in zip(offset, block, want)):
            found.add((offset, block))
    return found


def save_state(rank: int, world: int, ckpt: str, layout: tuple[int, int, int]) -> None:
    assert math.prod(layout) == world
    save(_state(rank, layout), ckpt)


def load_reformulated(rank: int, world: int, ckpt: str, saved: tuple[int, int, int],
                      wanted: tuple[int, int, int]) -> None:
    request = _state(rank, wanted, empty=True)
    metadata = get_reformulation_metadata(request, ckpt)
    saved_block = (SHAPE[0] // saved[0], SHAPE[1], SHAPE[2] // saved[1])
    assert set(metadata) == {FLAT}  # only flattened tensors have any
    assert metadata[FLAT] == TensorReformulationMetadata(SHAPE, (saved[0], 1, saved[1], math.prod(saved_block)))

    reformulated, restore = apply_nd_flattened_tensors_reformulation(request, metadata)
    assert isinstance(reformulated["weight"], ShardedTensor)  # not flattened: untouched
    assert isinstance(reformulated["exp_avg"], dict)
    assert set(reformulated["exp_avg"]) == _saved_blocks_overlapping(rank, saved, wanted), f"rank {rank}"
    for (offset, block), sh_ten in reformulated["exp_avg"].items():
        assert (sh_ten.global_offset, sh_ten.local_shape, sh_ten.data) == (offset, block, None)
        assert sh_ten.flattened_range == slice(0, math.prod(block))  # the whole saved block

    loaded = load(reformulated, ckpt, validate_access_integrity=False)
    loaded = restore_nd_flattened_tensors_formulation(loaded, restore)
    expected = _expected(rank, wanted)
    assert set(loaded) == {"weight", "exp_avg"}
    for key in loaded:
        assert_bits_equal(loaded[key], expected[key], f"rank {rank} {key}")


def load_directly(rank: int, world: int, ckpt: str, wanted: tuple[int, int, int]) -> None:
    loaded = load(_state(rank, wanted, empty=True), ckpt)
    for key, value in _expected(rank, wanted).items():
        assert_bits_equal(loaded[key], value, f"rank {rank} {key}")


# (TP, PP, DP) at save -> at load
LAYOUT_CHANGES = [
    ((2, 1, 1), (1, 1, 2)),  # TP 2 -> DP 2: each rank's range spans both saved blocks
    ((1, 1, 2), (2, 1, 1)),  # DP 2 -> TP 2: each rank's block is half of the one saved block
    ((2, 2, 1), (1, 2, 2)),  # TP 2 x PP 2 -> PP 2 x DP 2, at 4 ranks
]


@pytest.mark.parametrize("saved, wanted", LAYOUT_CHANGES, ids=lambda lay: "tp{}pp{}dp{}".format(*lay))
def test_reformulated_load_under_another_grid_is_bit_exact(ckpt_dir: Path, saved, wanted) -> None:
    run_distributed(save_state, math.prod(saved), str(ckpt_dir), saved)
    run_distributed(load_reformulated, math.prod(wanted), str(ckpt_dir), saved, wanted)
    # shardstore's own load reshards the flattened ranges without the reformulation
    run_distributed(load_directly, math.prod(wanted), str(ckpt_dir), wanted)


def test_the_record_keeps_the_block_shape_of_flattened_ranges_only(ckpt_dir: Path) -> None:
    run_distributed(save_state, 2, str(ckpt_dir), (2, 1, 1))
    arrays = read_commit_record(open_location(ckpt_dir)).arrays
    assert arrays[FLAT].flattened_block == (4, 5, 40)
    assert arrays[UNFLAT].flattened_block is None


def save_irregular(rank: int, world: int, ckpt: str) -> None:
    """Megatron 0.16's distributed-optimizer buffer: a 1-D tensor cut 13 + 11 on no grid,
    and a 2-D one cut after row 3, neither a flattened range of the caller's."""
    rows = (0, 3, 8)[rank : rank + 2]
    full = global_tensor("buffer2d", (8, 6), torch.float32)
    state = {
        "b1": ShardedTensor("buffer", global_tensor("buffer", (24,), torch.float32)[(0, 13, 24)[rank]:(0, 13, 24)[rank + 1]],
                            torch.float32, ((13, 11)[rank],), (24,), ((0, 13)[rank],), None),
        "b2": ShardedTensor("buffer2d", full[rows[0]:rows[1]].clone(), torch.float32, (rows[1] - rows[0], 6), (8, 6),
                            (rows[0], 0), None),
    }
    save(state, ckpt)


def test_irregular_cuts_are_not_recorded_as_flattened_ranges(ckpt_dir: Path) -> None:
    run_distributed(save_irregular, 2, str(ckpt_dir))
    arrays = read_commit_record(open_location(ckpt_dir)).arrays
    assert arrays["buffer"].flattened_block is None and arrays["buffer2d"].flattened_block is None
    meta = load_tensors_metadata(ckpt_dir)
    assert meta["buffer2d"].flattened_range is None and meta["buffer2d"].local_shape == (8, 6)
    assert_bits_equal(load_plain_tensors(ckpt_dir)["buffer2d"], global_tensor("buffer2d", (8, 6), torch.float32))


def load_same_grid(rank: int, world: int, ckpt: str, layout: tuple[int, int, int]) -> None:
    request = _state(rank, layout, empty=True)
    original = request["exp_avg"]
    metadata = get_reformulation_metadata(request, ckpt)
    assert metadata[FLAT].ckpt_reform_global_shape == nd_flattened_tensor_reformulated_global_shape(original)
    reformulated, restore = apply_nd_flattened_tensors_reformulation(request, metadata)
    assert reformulated["exp_avg"] is original and restore == {}
    loaded = restore_nd_flattened_tensors_formulation(load(reformulated, ckpt), restore)
    assert_bits_equal(loaded["exp_avg"], _expected(rank, layout)["exp_avg"], f"rank {rank}")


def test_a_tensor_requested_with_the_saved_grid_is_left_as_it_is(ckpt_dir: Path) -> None:
    run_distributed(save_state, 2, str(ckpt_dir), (2, 1, 1))
    run_distributed(load_same_grid, 2, str(ckpt_dir), (2, 1, 1))


def test_a_tensor_saved_whole_needs_no_reformulation(ckpt_dir: Path) -> None:
    """Saved from whole blocks, requested as flattened ranges: no saved block grid to
    follow, so the metadata names the request's own formulation and the load reads the
    request's range from the stored global tensor."""
    full = global_tensor(FLAT, SHAPE, torch.float32)
    save({"exp_avg": ShardedTensor.from_rank_offsets(FLAT, full.clone())}, ckpt_dir)
    request = {"exp_avg": ShardedTensor.from_rank_offsets_flat(
        FLAT, torch.empty(300), (4, 5, 40), (0, 1, 2), flattened_range=slice(100, 400))}
    metadata = get_reformulation_metadata(request, ckpt_dir)
    assert metadata[FLAT] == TensorReformulationMetadata(SHAPE, (2, 1, 1, 800))
    reformulated, restore = apply_nd_flattened_tensors_reformulation(request, metadata)
    assert isinstance(reformulated["exp_avg"], ShardedTensor)
    loaded = load(reformulated, ckpt_dir, validate_access_integrity=False)  # one range of the tensor only
    loaded = restore_nd_flattened_tensors_formulation(loaded, restore)
    assert_bits_equal(loaded["exp_avg"], full[4:].flatten()[100:400])


def test_a_flattened_tensor_the_checkpoint_lacks(ckpt_dir: Path) -> None:
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, ckpt_dir)
    nd = {"x": ShardedTensor.from_rank_offsets_flat("absent", torch.ones(3), (2, 3), flattened_range=slice(0, 3))}
    with pytest.raises(CheckpointingException, match="Cannot find global shape metadata for N-D flattened tensor"):
        get_reformulation_metadata(nd, ckpt_dir)
    with pytest.raises(CheckpointingException, match="Missing reformulation metadata"):
        apply_nd_flattened_tensors_reformulation(nd, {})
    one_d = {"x": ShardedTensor.from_rank_offsets_flat("absent", torch.ones(3), (6,), flattened_range=slice(0, 3))}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert get_reformulation_metadata(one_d, ckpt_dir) == {}
    assert any("holds no tensor 'absent'" in str(w.message) for w in caught)
    assert apply_nd_flattened_tensors_reformulation(one_d, {})[0]["x"] is one_d["x"]


def load_tensors_metadata_as_megatron(rank: int, world: int, ckpt: str) -> None:
    meta = load_tensors_metadata(ckpt)
    assert is_nd_flattened_tensor(meta[FLAT]) and not is_nd_flattened_tensor(meta[UNFLAT])
    assert meta[FLAT].flattened_range == slice(0, math.prod(SHAPE))
    for attr in ("local_shape", "global_shape", "global_offset", "dtype"):
        assert getattr(meta[FLAT], attr) == getattr(meta[UNFLAT], attr), attr
    for sh_ten in meta.values():
        sh_ten.replica_id = rank  # every rank reads it all
    loaded = load(meta, ckpt)
    assert_bits_equal(loaded[FLAT], global_tensor(FLAT, SHAPE, torch.float32).flatten())
    assert_bits_equal(loaded[UNFLAT], global_tensor(UNFLAT, SHAPE, torch.float32))


def test_load_tensors_metadata_describes_a_flattened_tensor_as_flat(ckpt_dir: Path) -> None:
    run_distributed(save_state, 4, str(ckpt_dir), (2, 1, 2))
    run_distributed(load_tensors_metadata_as_megatron, 2, str(ckpt_dir))
    # the plain whole tensors keep their N-D shape (Megatron's give this one 1-D)
    assert_bits_equal(load_plain_tensors(ckpt_dir)[FLAT], global_tensor(FLAT, SHAPE, torch.float32))


def test_megatron_014_torch_dist_reformulated_tensors() -> None:
    """Megatron-Core 0.14's torch_dist stored its flattened ranges reformulated, one
    block of (8, 6) and one of (24,): the metadata is read from its mcore_data."""
    request = {
        "fc1": ShardedTensor.from_rank_offsets_flat("optimizer/fc1_exp_avg", torch.empty(24), (4, 6), (0, 1, 2),
                                                    flattened_range=slice(0, 24)),
        "buf": ShardedTensor.from_rank_offsets_flat("optimizer/exp_avg", torch.empty(5), (24,),
                                                    flattened_range=slice(3, 8)),
    }
    metadata = get_reformulation_metadata(request, MEGATRON_014_TORCH_DIST)
    assert metadata == {
        "optimizer/fc1_exp_avg": TensorReformulationMetadata((8, 6), (1, 1, 48)),
        "optimizer/exp_avg": TensorReformulationMetadata((24,), (1, 24)),
    }
    reformulated, restore = apply_nd_flattened_tensors_reformulation(request, metadata)
    assert set(reformulated["fc1"]) == {((0, 0), (8, 6))}
    loaded = load(reformulated, MEGATRON_014_TORCH_DIST, validate_access_integrity=False)  # parts only
    loaded = restore_nd_flattened_tensors_formulation(loaded, restore)
    whole = load_plain_tensors(MEGATRON_014_TORCH_DIST)
    assert_bits_equal(loaded["fc1"], whole["optimizer/fc1_exp_avg"][4:].flatten())
    assert_bits_equal(loaded["buf"], whole["optimizer/exp_avg"][3:8])
    meta = load_tensors_metadata(MEGATRON_014_TORCH_DIST)
    assert meta["optimizer/fc1_exp_avg"].flattened_range == slice(0, 48)
    assert meta["optimizer/fc1_exp_avg"].local_shape == (8, 6)
    assert meta["decoder/fc1"].flattened_range is None


def test_megatrons_import_path_of_get_reformulation_metadata() -> None:
    from shardstore.strategies.torch import get_reformulation_metadata as from_torch_module

    assert from_torch_module is get_reformulation_metadata


def test_a_forged_flattened_block_is_refused_in_seconds(tmp_path: Path) -> None:
    """Issue 41.7c: a block of one element on a 1024 x 1024 array would make a load's
    reformulation build a request per element (a million: minutes); the record is
    refused as it is read, since no save writes a block smaller than its chunks."""
    n = 1024
    request = {"x": ShardedTensor.from_rank_offsets_flat("x", torch.zeros(n * n), (n, n), flattened_range=slice(0, n * n))}
    save(request, tmp_path)
    rewrite_record(tmp_path, lambda doc: doc["attributes"]["shardstore"]["arrays"]["x"].update(flattened_block=[1, 1]))
    started = time.monotonic()
    with pytest.raises(CheckpointingException, match=r"'x' names a flattened block \(1, 1\) smaller than its chunks"):
        get_reformulation_metadata(request, tmp_path)
    assert time.monotonic() - started < 5


def _flat_blocks(key: str, shape: tuple[int, int], blocks: int, data: torch.Tensor | None = None) -> list:
    """``blocks`` row blocks of a ``shape`` tensor, each one whole flattened range (with
    ``allow_shape_mismatch``), on one rank; their data ``data``'s, else zeros."""
    rows = shape[0] // blocks
    return [
        ShardedTensor.from_rank_offsets_flat(
            key, (data[i * rows:(i + 1) * rows] if data is not None else torch.zeros(rows, shape[1])).flatten().clone(),
            (rows, shape[1]), (0, i, blocks), flattened_range=slice(0, rows * shape[1]), allow_shape_mismatch=True,
        )
        for i in range(blocks)
    ]


def test_a_reformulated_request_of_another_global_shape_loads_padded_as_a_plain_load(tmp_path: Path) -> None:
    """A flattened tensor saved as 2 row blocks of an (8, 3) tensor, requested with
    ``allow_shape_mismatch`` as 2 row blocks of a (12, 3) one (a padded vocabulary)
    through the reformulation API: each block comes back as a plain load gives it, the
    stored rows then zeros. Before, the saved blocks a request overlaps were found from
    the two grids' fractions of different shapes (block 0, rows 0-6, missed saved rows
    4-5) and the rest was left as ``torch.empty`` memory: rows 4-5 and 8-11 garbage."""
    stored = global_tensor(FLAT, (8, 3), torch.float32)
    save({"s": _flat_blocks(FLAT, (8, 3), 2, stored)}, tmp_path / "ckpt")
    expected = torch.zeros(12, 3)
    expected[:8] = stored
    plain = load({"s": _flat_blocks(FLAT, (12, 3), 2)}, tmp_path / "ckpt")["s"]
    request = {"s": _flat_blocks(FLAT, (12, 3), 2)}
    request, restore = apply_nd_flattened_tensors_reformulation(request, get_reformulation_metadata(request, tmp_path / "ckpt"))
    loaded = restore_nd_flattened_tensors_formulation(load(request, tmp_path / "ckpt", validate_access_integrity=False), restore)["s"]
    for i in range(2):
        assert_bits_equal(plain[i], expected[6 * i:6 * (i + 1)].flatten(), f"plain block {i}")
        assert_bits_equal(loaded[i], expected[6 * i:6 * (i + 1)].flatten(), f"reformulated block {i}")
