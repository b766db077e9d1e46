"""Invalid sharding fails on every rank before anything is written; StrictHandling
modes behave as documented (issue 3, point 6)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from shardstore import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    StrictHandling,
    load,
    save,
)
from tests.dist import run_distributed


def _bad_state_dict(rank: int, world: int, kind: str) -> dict:
    full = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    if kind == "overlap":  # both ranks claim rows 0-3 as main replica
        return {"w": ShardedTensor.from_rank_offsets("w", full[:4].clone(), (0, 0, 2))}
    if kind == "gap":  # 3 fragments declared, only 2 ranks hold one
        return {"w": ShardedTensor.from_rank_offsets("w", full[:2].clone(), (0, rank, 3))}
    if kind == "shape":  # global shapes disagree
        rows = 4 if rank == 0 else 3
        return {"w": ShardedTensor.from_rank_offsets("w", full[:rows].clone(), (0, rank, 2))}
    if kind == "dtype":  # dtypes disagree
        dtype = torch.float32 if rank == 0 else torch.float64
        return {"w": ShardedTensor.from_rank_offsets("w", full[:4].to(dtype), (0, rank, 2))}
    if kind == "bad_key":  # only rank 1 holds an invalid key
        key = "w" if rank == 0 else "../escape"
        return {"w": ShardedTensor.from_rank_offsets(key, full[:4].clone(), (0, rank, 2))}
    if kind == "flat_gap":  # two flat ranges of one (8, 5) block leave element 20 uncovered
        flat = full.flatten()
        part = slice(0, 20) if rank == 0 else slice(21, 40)
        return {"w": ShardedTensor.from_rank_offsets_flat("w", flat[part].clone(), (8, 5), flattened_range=part)}
    if kind == "mixed_flat":  # rank 0 holds rows 0-3 whole, rank 1 rows 4-7 as a flattened range
        if rank == 0:
            return {"w": ShardedTensor.from_rank_offsets("w", full[:4].clone(), (0, 0, 2))}
        return {"w": ShardedTensor.from_rank_offsets_flat("w", full[4:].flatten().clone(), (4, 5), (0, 1, 2),
                                                          flattened_range=slice(0, 20))}
    if kind == "objects_missing":  # 3 object shards declared, 2 ranks hold one each
        return {"o": ShardedObject("o", {"rank": rank}, (3,), (rank,))}
    raise ValueError(kind)


def save_invalid(rank: int, world: int, ckpt: str, kind: str) -> str:
    try:
        save(_bad_state_dict(rank, world, kind), ckpt)
    except CheckpointingException as exc:
        return str(exc)
    raise AssertionError(f"rank {rank}: invalid sharding ({kind}) was accepted")


@pytest.mark.parametrize(
    "kind, message",
    [("overlap", "overlap"), ("gap", "gap"), ("shape", "inconsistent global shape"),
     ("dtype", "inconsistent dtype"), ("bad_key", "'..' path segment"),
     ("mixed_flat", "flattened (ranks [1]) and some are not (ranks [0]): give every rank's main replica")],
)
def test_invalid_sharding_fails_on_every_rank_before_writing(ckpt_dir: Path, kind: str, message: str) -> None:
    errors = run_distributed(save_invalid, 2, str(ckpt_dir), kind)
    for error in errors:
        assert message in error, error
    assert not ckpt_dir.exists() or not any(ckpt_dir.iterdir()), "nothing may be written"


@pytest.mark.parametrize(
    "kind, phrase",
    [("overlap", "Invalid access pattern for 'w'"), ("gap", "Invalid access pattern for 'w'"),
     ("flat_gap", "Flattened ranges dont cover the whole shard ShardedTensor(key='w'"),
     ("objects_missing", "Invalid access pattern: 1 ShardedObject are missing")],
)
def test_sharding_errors_start_with_megatrons_words(ckpt_dir: Path, kind: str, phrase: str) -> None:
    """Megatron-Core's users and tests look for its phrases (issue 26.4); ours add where."""
    errors = run_distributed(save_invalid, 2, str(ckpt_dir), kind)
    for error in errors:
        assert phrase in error, error


def test_invalid_sharding_errors_name_the_checkpoint_and_what_to_do(tmp_path: Path) -> None:
    """A save's and a load's "Invalid global sharding" name the checkpoint and say what
    that operation must change. Before, they named only the keys (a load's planning did
    not pass the checkpoint on), and a load's said "so nobody would write it"."""
    bad, good = tmp_path / "bad", tmp_path / "good"
    with pytest.raises(CheckpointingException) as saved:
        save({"a": ShardedTensor.from_rank_offsets("a", torch.arange(4.0)),
              "b": ShardedTensor.from_rank_offsets("a", torch.arange(4.0))}, bad)
    save({"a": ShardedTensor.from_rank_offsets("a", torch.arange(4.0))}, good)
    with pytest.raises(CheckpointingException) as loaded:
        load({"a": ShardedTensor.from_rank_offsets("a", torch.zeros(4), replica_id=1)}, good)
    assert f"Invalid global sharding of {bad}" in str(saved.value)
    assert "Nothing was written" in str(saved.value) and "nonzero replica_id" in str(saved.value)
    assert f"Invalid global sharding of {good}" in str(loaded.value) and "write" not in str(loaded.value)
    assert "Nothing was read" in str(loaded.value) and "request each part with replica_id 0" in str(loaded.value)


def test_a_save_checks_the_sharding_even_when_told_not_to(tmp_path: Path) -> None:
    """Documented in docs/differences.md: ``save(validate_access_integrity=False)``
    checks anyway (Megatron-Core skips the check); the storage core relies on one
    writer per chunk."""
    with pytest.raises(CheckpointingException, match="Invalid global sharding"):
        save({"a": ShardedTensor.from_rank_offsets("a", torch.arange(4.0)),
              "b": ShardedTensor.from_rank_offsets("a", torch.arange(4.0))}, tmp_path / "c",
             validate_access_integrity=False)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


@pytest.fixture
def two_key_checkpoint(ckpt_dir: Path) -> Path:
    save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(3)),
          "b": ShardedTensor.from_rank_offsets("b", torch.zeros(2))}, ckpt_dir)
    return ckpt_dir


def _request() -> dict:
    """Asks for ``a`` (present) and ``c`` (absent: unexpected); ``b`` is not requested (missing)."""
    return {"a": ShardedTensor.from_rank_offsets("a", torch.empty(3)),
            "c": ShardedTensor.from_rank_offsets("c", torch.empty(4))}


def test_assume_ok_unexpected_lets_the_strategy_raise(two_key_checkpoint: Path) -> None:
    with pytest.raises(CheckpointingException, match=r"no tensor\(s\) \['c'\]"):
        load(_request(), two_key_checkpoint, strict=StrictHandling.ASSUME_OK_UNEXPECTED)


@pytest.mark.parametrize("strict, match", [("raise_unexpected", "Unexpected keys"), ("raise_all", "Missing keys")])
def test_raise_modes(two_key_checkpoint: Path, strict: str, match: str) -> None:
    with pytest.raises(CheckpointingException, match=match) as info:
        load(_request(), two_key_checkpoint, strict=strict)
    assert ("'b'" in str(info.value)) == (strict == "raise_all")


@pytest.mark.parametrize("strict, logs_missing", [("log_unexpected", False), ("log_all", True)])
def test_log_modes_skip_unexpected_and_warn(two_key_checkpoint: Path, caplog, strict: str, logs_missing: bool) -> None:
    with caplog.at_level(logging.WARNING, logger="shardstore"):
        loaded = load(_request(), two_key_checkpoint, strict=strict)
    assert set(loaded) == {"a"} and torch.equal(loaded["a"], torch.ones(3))
    assert "'c'" in caplog.text and ("'b'" in caplog.text) == logs_missing


@pytest.mark.parametrize("strict, missing", [("return_unexpected", set()), ("return_all", {"b"})])
def test_return_modes(two_key_checkpoint: Path, strict: str, missing: set) -> None:
    loaded, missing_keys, unexpected_keys = load(_request(), two_key_checkpoint, strict=strict)
    assert set(loaded) == {"a"}
    assert unexpected_keys == {"c"} and missing_keys == missing


def test_ignore_all_skips_silently(two_key_checkpoint: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="shardstore"):
        loaded = load(_request(), two_key_checkpoint, strict=StrictHandling.IGNORE_ALL)
    assert set(loaded) == {"a"} and caplog.text == ""


def test_the_all_modes_require_global_app_metadata_as_in_megatron() -> None:
    """Megatron-Core's list includes IGNORE_ALL (shardstore's left it out); a load in
    that mode still does not look for the missing keys it would only drop."""
    modes = {m for m in StrictHandling if StrictHandling.requires_global_app_metadata(m)}
    assert modes == {StrictHandling.IGNORE_ALL, StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL,
                     StrictHandling.RETURN_ALL}
    assert {m for m in StrictHandling if StrictHandling.reports_missing_keys(m)} == modes - {StrictHandling.IGNORE_ALL}


def save_two_keys(rank: int, world: int, ckpt: str) -> None:
    save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(3), replica_id=rank),
          "b": ShardedTensor.from_rank_offsets("b", torch.zeros(2), replica_id=rank),
          "o": ShardedObject("o", rank, (world,), (rank,))}, ckpt)


def load_split_keys(rank: int, world: int, ckpt: str) -> tuple:
    key = "a" if rank == 0 else "b"
    request = {key: ShardedTensor.from_rank_offsets(key, torch.empty(3 if key == "a" else 2))}
    _, missing, unexpected = load(request, ckpt, strict="return_all")
    return sorted(missing), sorted(unexpected)


def test_missing_keys_are_global_across_ranks(ckpt_dir: Path) -> None:
    run_distributed(save_two_keys, 2, str(ckpt_dir))
    # a requested by rank 0, b by rank 1: only the sharded object 'o' is missing
    assert run_distributed(load_split_keys, 2, str(ckpt_dir)) == [(["o"], [])] * 2


def test_parse_strict_flag_rejects_unknown_values(two_key_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="raise_all"):
        load(_request(), two_key_checkpoint, strict="sometimes")


def test_megatrons_own_strict_handling_is_taken(two_key_checkpoint: Path) -> None:
    """``load(strict=...)`` takes Megatron-Core's ``StrictHandling`` as it takes its
    mapping objects (code switches by changing the ``dist_checkpointing`` import, and
    keeps ``validation.StrictHandling``'s import). Before, ``parse_strict_flag`` refused
    it with "Invalid strict flag <StrictHandling.RETURN_ALL: 'return_all'>"."""
    validation = pytest.importorskip("megatron.core.dist_checkpointing.validation", reason="megatron-core not installed")
    loaded, missing_keys, unexpected_keys = load(_request(), two_key_checkpoint,
                                                 strict=validation.StrictHandling.RETURN_ALL)
    assert set(loaded) == {"a"} and missing_keys == {"b"} and unexpected_keys == {"c"}


def load_unexpected_on_rank1(rank: int, world: int, ckpt: str) -> list[str]:
    key = "a" if rank == 0 else "nope"
    request = {key: ShardedTensor.from_rank_offsets(key, torch.empty(3), replica_id=rank)}
    _, _, unexpected = load(request, ckpt, strict="return_unexpected", validate_access_integrity=False)
    return sorted(unexpected)


def test_unexpected_keys_are_detected_on_every_rank_without_a_gather(ckpt_dir: Path) -> None:
    run_distributed(save_two_keys, 2, str(ckpt_dir))
    assert run_distributed(load_unexpected_on_rank1, 2, str(ckpt_dir)) == [[], ["nope"]]


def test_a_chunk_divisor_is_found_in_milliseconds_for_any_length() -> None:
    """Issue 41.7: the chunk search scanned every candidate up to sqrt(n), minutes for a
    crafted 2**62; it finds the same divisors as the full scan, within bounded trials."""
    import math
    import time

    from shardstore.planning.layout import largest_divisor_at_most

    def full_scan(n: int, limit: int) -> int:
        return max(d for k in range(1, math.isqrt(n) + 1) if n % k == 0 for d in (k, n // k) if d <= limit)

    for n in (1, 2, 12, 97, 360, 4096 * 3, 50257, 65536 * 7):
        for limit in (1, 5, 64, 1000, 10**6):
            assert largest_divisor_at_most(n, limit) == full_scan(n, limit), (n, limit)
    start = time.perf_counter()
    assert largest_divisor_at_most(2**62, 2**20) == 2**20
    assert largest_divisor_at_most(2**61 - 1, 2**24) == 1  # a prime: no divisor below the limit
    assert time.perf_counter() - start < 1.0


def test_an_empty_array_no_reader_could_address_is_refused_naming_it(tmp_path) -> None:
    import torch

    from shardstore import CheckpointingException, ShardedTensor, save

    huge = torch.empty((0, 2**62))
    with pytest.raises(CheckpointingException, match="'w': global shape .* no reader can address"):
        save({"w": ShardedTensor.from_rank_offsets("w", huge)}, tmp_path / "c")


def test_a_block_of_the_whole_shape_held_at_an_offset_is_refused() -> None:
    """One rank's block as large as the global tensor, at a nonzero offset, lies outside
    it: the check of a tensor held whole by one rank looks at the offset too."""
    from shardstore import CheckpointingException
    from shardstore.planning.checks import check_layout
    from shardstore.planning.layout import GatheredShards, ShardRecord

    shard = ShardRecord("w", 0, 0, "float32", (4, 2), (1, 0), (4, 2), None, True)
    with pytest.raises(CheckpointingException, match="'w': rank 0's shard at offset \\(1, 0\\).*lies outside"):
        check_layout(GatheredShards.from_gathered([([shard], [])]))


@pytest.mark.parametrize("sparse", [False, True], ids=["grid", "sparse"])
@pytest.mark.parametrize("seed", range(3))
def test_the_coverage_check_agrees_with_counting_every_element(seed: int, sparse: bool, monkeypatch) -> None:
    """The coverage check counts main replicas per cell of the blocks' grid at numpy's
    speed (a difference array); random blocks in 0 to 3 dimensions, some tiling, some
    not, against a count of every element: valid exactly where every element is covered
    once, and otherwise it names a gap or an overlap, whichever the count shows.
    ``sparse``: as where the grid has too many cells to count (an overlap is then named
    before a gap)."""
    import random

    import numpy as np

    from shardstore import CheckpointingException
    from shardstore.planning.checks import check_layout
    from shardstore.planning.layout import GatheredShards, ShardRecord

    if sparse:
        monkeypatch.setattr("shardstore.planning.checks.MAX_COVERAGE_CELLS", 0)
    rng = random.Random(seed)
    seen = {"valid": 0, "gap": 0, "overlap": 0}
    for _ in range(400):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 3)))
        halves = [rng.randint(0, n) for n in shape]
        shards, counts = [], np.zeros(shape, dtype=np.int64)
        for index in range(rng.randint(1, 6)):
            if rng.random() < 0.6:  # one quadrant of a grid cut at ``halves``
                upper = [rng.random() < 0.5 for _ in shape]
                offset = tuple(h if u else 0 for h, u in zip(halves, upper))
                block = tuple(n - h if u else h for n, h, u in zip(shape, halves, upper))
            else:
                offset = tuple(rng.randint(0, n - 1) for n in shape)
                block = tuple(rng.randint(1, n - o) for n, o in zip(shape, offset))
            main = rng.random() < 0.85
            shards.append(ShardRecord("w", index, index, "float32", shape, offset, block, None, main))
            if main:
                counts[tuple(slice(o, o + b) for o, b in zip(offset, block))] += 1
        layout = GatheredShards.from_gathered([([s], []) for s in shards])
        if not any(s.main for s in shards):
            continue
        if (counts == 1).all():
            check_layout(layout)
            seen["valid"] += 1
            continue
        kind = "gap" if (counts == 0).any() else "overlap"
        if sparse and shape and (counts > 1).any():
            kind = "overlap"
        with pytest.raises(CheckpointingException, match=f"\\({kind}\\)"):
            check_layout(layout)
        seen[kind] += 1
    assert all(seen.values()), seen


def _staggered_rows(rows: int, moved: int | None = None) -> list:
    """Two blocks per row of a ``[rows, rows + 1]`` tensor, split after column ``r + 1``
    in row ``r``: a grid of about ``rows**2`` cells. ``moved``: that row's second block
    one column to the left, overlapping the first by one element and leaving the last
    column uncovered, the volume unchanged."""
    from shardstore.planning.layout import ShardRecord

    shape, shards = (rows, rows + 1), []
    for r in range(rows):
        cut = r + 1
        second = cut - 1 if r == moved else cut
        for i, (offset, block) in enumerate((((r, 0), (1, cut)), ((r, second), (1, rows + 1 - cut)))):
            shards.append(ShardRecord("w", 2 * r + i, 2 * r + i, "float32", shape, offset, block, None, True))
    return shards


def test_a_gap_and_an_overlap_of_one_size_are_found_on_a_grid_too_large_to_count() -> None:
    """4,100 rows cut at a different column each: 16.8 million grid cells, more than
    the count allocates (``MAX_COVERAGE_CELLS``). Their volumes add up either way; the
    blocks that overlap are found, and the tiling passes."""
    from shardstore import CheckpointingException
    from shardstore.planning import checks
    from shardstore.planning.checks import check_layout
    from shardstore.planning.layout import GatheredShards

    rows = 4100
    assert rows * (rows + 1) > checks.MAX_COVERAGE_CELLS
    check_layout(GatheredShards.from_gathered([([s], []) for s in _staggered_rows(rows)]))
    moved = GatheredShards.from_gathered([([s], []) for s in _staggered_rows(rows, moved=2000)])
    with pytest.raises(CheckpointingException, match="'w': the region starting at \\(2000, 2000\\) .*\\(overlap\\)"):
        check_layout(moved)


def test_past_the_pair_budget_only_the_volume_is_checked_and_a_warning_says_so(monkeypatch, caplog) -> None:
    from shardstore import CheckpointingException
    from shardstore.planning import checks
    from shardstore.planning.checks import check_layout
    from shardstore.planning.layout import GatheredShards

    monkeypatch.setattr(checks, "MAX_COVERAGE_CELLS", 0)
    monkeypatch.setattr(checks, "MAX_OVERLAP_PAIRS", 0)
    with caplog.at_level("WARNING", logger="shardstore.planning.checks"):
        check_layout(GatheredShards.from_gathered([([s], []) for s in _staggered_rows(6, moved=3)]))
    assert "too irregular to check for overlaps" in caplog.text and "'w'" in caplog.text, caplog.text
    short = _staggered_rows(6)[:-1]
    with pytest.raises(CheckpointingException, match="cover 41 of the 42 elements .* 1 are not covered .*\\(gap\\)"):
        check_layout(GatheredShards.from_gathered([([s], []) for s in short]))


@pytest.mark.parametrize(("offset", "block", "message"), [
    ((2**63 - 1,), (1,), "offset \\(9223372036854775807,\\) with shape \\(1,\\) lies outside the global shape"),
    ((2**64,), (1,), "offset \\(18446744073709551616,\\) with shape \\(1,\\) lies outside the global shape"),
    ((4,), (-4,), "offset \\(4,\\) with shape \\(-4,\\) has a negative extent"),
    ((0, 5), (2, 9), "has offset \\(0, 5\\) and shape \\(2, 9\\), not one entry per axis of the global shape"),
])
def test_a_crafted_shard_is_refused_naming_it(offset: tuple, block: tuple, message: str) -> None:
    """Records made by hand, not by ShardedTensor (which checks its own): numbers past
    64 bits, an end that would wrap around, a negative extent, the wrong number of axes.
    The check runs on 64-bit arrays; none of these slips through or crashes it."""
    from shardstore import CheckpointingException
    from shardstore.planning.checks import check_layout
    from shardstore.planning.layout import GatheredShards, ShardRecord

    whole = [ShardRecord("w", rank, 0, "float32", (4,), (0,), (4,), None, True) for rank in range(2)]
    crafted = ShardRecord("w", 2, 0, "float32", (4,), offset, block, None, True)
    with pytest.raises(CheckpointingException, match=f"'w': rank 2's shard .*{message}"):
        check_layout(GatheredShards.from_gathered([([s], []) for s in (*whole, crafted)]))


def test_a_block_of_no_elements_held_by_two_ranks_is_written_by_one() -> None:
    """A zero-size tensor split over two ranks: both blocks are empty at offset 0, so
    both are main replicas of one block, and a fully parallel save picks one writer."""
    from shardstore.planning.layout import GatheredShards, ShardRecord, balance_writers

    layout = GatheredShards.from_gathered(
        [([ShardRecord("w", rank, 0, "float32", (0,), (0,), (0,), None, True)], []) for rank in range(2)])
    assert [s.main for s in balance_writers(layout).tensors["w"]] == [True, False]


def test_an_offset_that_is_no_integer_is_refused_naming_the_tensor(tmp_path) -> None:
    """A float offset would be truncated by the checks' 64-bit arrays: refused when the
    ShardedTensor is made, and where the rank makes its record. numpy's integers are
    integers."""
    import numpy as np

    from shardstore import CheckpointingException, ShardedTensor, save
    from shardstore.planning.layout import ShardRecord

    data = torch.ones(2, 3)
    with pytest.raises(CheckpointingException, match="'w': global offset \\(2.0, 0\\) holds a value that is not"):
        ShardedTensor("w", data, data.dtype, (2, 3), (4, 3), (2.0, 0), None)
    floating = ShardedTensor("w", data, data.dtype, (2, 3), (4, 3), (2, 0), (2, 1))
    floating.global_offset = (2.0, 0)  # changed after its checks: refused where the rank makes its record
    with pytest.raises(CheckpointingException, match="'w': its global offset \\(2.0, 0\\) holds a value that is not"):
        save({"w": floating}, tmp_path / "c")
    numpy = ShardedTensor("w", data, data.dtype, (2, 3), (np.int64(4), 3), (np.int64(2), 0), None)
    record = ShardRecord.from_sharded_tensor(numpy, 0, 0)
    assert record.offset == (2, 0) and all(type(n) is int for n in (*record.offset, *record.global_shape))


def test_a_negative_global_extent_is_refused_naming_it() -> None:
    from shardstore import CheckpointingException
    from shardstore.planning.checks import check_layout
    from shardstore.planning.layout import GatheredShards, ShardRecord

    crafted = ShardRecord("w", 0, 0, "float32", (-2, 0), (0, 0), (2**63 - 1, 0), None, True)
    with pytest.raises(CheckpointingException, match="'w': rank 0's global shape \\(-2, 0\\) has a negative extent"):
        check_layout(GatheredShards.from_gathered([([crafted], [])]))


def test_the_coverage_of_a_tensor_of_many_axes_is_counted_within_the_cell_bound() -> None:
    """A tensor of 16 axes cut in two along each: 65,536 cells, whose difference array
    would hold 3**16 values (43 million); the check counts block by block instead,
    exactly and in about the old time."""
    import time

    from shardstore import CheckpointingException
    from shardstore.planning.checks import check_layout
    from shardstore.planning.layout import GatheredShards, ShardRecord

    shape = (2,) * 16
    corner = ShardRecord("w", 0, 0, "int8", shape, (0,) * 16, (1,) * 16, None, True)
    whole = ShardRecord("w", 1, 0, "int8", shape, (0,) * 16, shape, None, True)
    start = time.perf_counter()
    with pytest.raises(CheckpointingException, match="starting at \\(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "
                                                     "0\\) is covered by more than one main replica"):
        check_layout(GatheredShards.from_gathered([([corner], []), ([whole], [])]))
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize(("offset", "shape"), [((5,), (2,)), ((0, 0), (2,)), ((-1,), (2,))])
def test_a_sharded_object_whose_offset_lies_outside_its_shape_is_refused(tmp_path, offset, shape) -> None:
    """An offset changed after the ShardedObject's own checks (code that reuses its
    objects, as it may a ShardedTensor's): the shards were only counted, so shards at
    offsets 0 and 5 of a shape of 2 passed as two of two, the save committed without
    shard 1 and ``verify`` called it sound; the load failed on the missing shard."""
    first, second = ShardedObject("o", "zero", (2,), (0,)), ShardedObject("o", "one", (2,), (1,))
    second.global_offset, second.global_shape = offset, shape
    with pytest.raises(CheckpointingException, match=(
            f"ShardedObject 'o': rank 0's shard at offset {re.escape(str(offset))} lies outside its global shape")):
        save({"a": first, "b": second}, tmp_path / "c")
    assert not (tmp_path / "c" / "zarr.json").exists()


def _fake_tensor() -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.ones(3, 4)


def _with_data_swapped(data: torch.Tensor) -> ShardedTensor:
    """A ShardedTensor whose data was swapped after it was made (a nested tensor has no
    shape, so none can be made of one)."""
    sharded = ShardedTensor.from_rank_offsets("w", torch.ones(2))
    sharded.data = data
    return sharded


UNSTORABLE_DATA = {
    "sparse_coo": (lambda: ShardedTensor.from_rank_offsets("w", torch.eye(3).to_sparse()), "sparse_coo.*to_dense"),
    "sparse_csr": (lambda: ShardedTensor.from_rank_offsets("w", torch.eye(3).to_sparse_csr()), "sparse_csr.*to_dense"),
    "meta": (lambda: ShardedTensor.from_rank_offsets("w", torch.empty(3, device="meta")), "meta device.*materialize"),
    "fake": (lambda: ShardedTensor.from_rank_offsets("w", _fake_tensor()), "FakeTensor.*real tensors"),
    "nested": (lambda: _with_data_swapped(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])),
               "nested tensor.*unbind"),
    "complex32": (lambda: ShardedTensor.from_rank_offsets("w", torch.ones(3, dtype=torch.complex32)),
                  "dtype torch.complex32 is not supported.*cast"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", list(UNSTORABLE_DATA))
def test_data_no_array_can_hold_is_refused_naming_the_key_before_writing(tmp_path: Path, kind: str) -> None:
    """Before, sparse and meta tensors failed while staging with torch's own words
    ("unsupported memory format option Contiguous", "Sparse CSR tensors do not have
    is_contiguous", "Cannot copy out of meta tensor"), a FakeTensor with a bare
    RuntimeError (".numpy() is not supported for tensor subclasses") from the middle of
    the write, a nested tensor with "NestedTensorImpl doesn't support sizes", and an
    unsupported dtype without the key: none said which tensor, or what to do."""
    build, reason = UNSTORABLE_DATA[kind]
    ckpt = tmp_path / "c"
    with pytest.raises(CheckpointingException) as failure:
        save({"layer": build()}, ckpt)
    message = str(failure.value)
    assert "ShardedTensor 'w'" in message and str(ckpt) in message, message
    assert re.search(reason, message), message
    assert not ckpt.exists() or not any(ckpt.iterdir())


def _split_rows(key: str, t: torch.Tensor, replica_id, flattened_range) -> dict:
    """A ShardedTensorFactory's build: the tensor as two halves under keys of its own."""
    return {"top": ShardedTensor.from_rank_offsets(f"{key}/top", t[:2], replica_id=replica_id),
            "bottom": ShardedTensor.from_rank_offsets(f"{key}/bottom", t[2:], replica_id=replica_id)}


def _join_rows(loaded: dict) -> torch.Tensor:
    return torch.cat([loaded["top"], loaded["bottom"]])


@pytest.mark.parametrize("strict", ["log_unexpected", "return_all", "ignore_all"])
def test_a_non_strict_load_skips_a_factory_whose_tensors_the_checkpoint_lacks(ckpt_dir: Path, strict: str) -> None:
    """A non-strict load drops the requested keys the checkpoint lacks; where those are
    all the tensors a ShardedTensorFactory builds, there is nothing to merge and the
    factory is skipped like a plain ShardedTensor of such a key, its siblings loaded.
    Before, its merge ran on what was not loaded: in a list a bare ``TypeError`` from
    the merge function given None, in a dict an error that the containers do not
    match the checkpoint's common state."""
    from shardstore import ShardedTensorFactory

    save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(3)),
          "layers": [5, ShardedTensor.from_rank_offsets("old", torch.ones(4, 2))]}, ckpt_dir)

    def factory() -> ShardedTensorFactory:
        return ShardedTensorFactory("new", torch.zeros(4, 2), _split_rows, _join_rows)

    request = {"a": ShardedTensor.from_rank_offsets("a", torch.empty(3)), "fused": factory(), "layers": [5, factory()]}
    result = load(request, ckpt_dir, strict=strict)
    loaded = result[0] if isinstance(result, tuple) else result
    assert torch.equal(loaded["a"], torch.ones(3)) and "fused" not in loaded and loaded["layers"] == [5, None]
    if strict == "return_all":
        assert result[1:] == ({"old"}, {"new/top", "new/bottom"})


@pytest.mark.parametrize("storage", ["save", "load"])
def test_overlapping_dtensor_copies_are_refused_saying_what_a_dtensor_user_can_change(storage: str) -> None:
    """TP + DDP at 4 ranks where the two DP groups hold one DTensor with other
    placements (rows on one ``mesh["tp"]``, columns on the other): the blocks overlap
    without being equal, so they are no replicas (``GatheredShards.from_gathered``) and
    the save (or a load's request) is refused. The error told the user only to "give
    the duplicates a nonzero replica_id", which a DTensor's user cannot set (its
    replica ids come from its placements); it now names the DTensor and what to
    change."""
    from shardstore.planning.checks import FORMAT_NAME_LIMITS, check_layout
    from shardstore.planning.layout import GatheredShards, ShardRecord

    blocks = [((0, 0), (4, 8)), ((4, 0), (4, 8)), ((0, 0), (8, 4)), ((0, 4), (8, 4))]  # Shard(0), then Shard(1)
    records = [ShardRecord("model.w", rank, 0, "float32", (8, 8), offset, block, None, True, mesh_replica=True)
               for rank, (offset, block) in enumerate(blocks)]
    with pytest.raises(CheckpointingException) as raised:
        check_layout(GatheredShards.from_gathered([([r], []) for r in records]),
                     FORMAT_NAME_LIMITS if storage == "save" else None)
    message = str(raised.value)
    assert "more than one main replica (overlap)" in message
    assert "DTensors here: 'model.w'" in message and "same global shape, dtype and placements" in message, message


@pytest.mark.parametrize("kind", ["overlap", "objects_missing"])
def test_megatrons_own_mapping_objects_are_validated_not_skipped(kind: str) -> None:
    """``validation.determine_global_metadata`` and ``validate_sharding_integrity`` (the
    names code written for Megatron-Core calls) take Megatron-Core's own mapping objects
    as ``save`` and ``load`` do. Before, they kept only shardstore's classes: Megatron's
    ShardedTensors and ShardedObjects were dropped, and an overlapping or incomplete
    sharding passed the check that Megatron-Core's own raises on."""
    mapping = pytest.importorskip("megatron.core.dist_checkpointing.mapping", reason="megatron-core not installed")
    from shardstore.validation import determine_global_metadata, validate_sharding_integrity

    rows = torch.arange(4.0)
    if kind == "overlap":  # two shards, each claiming the first half as main replica
        state_dict = {name: mapping.ShardedTensor.from_rank_offsets("w", rows[:2].clone(), (0, 0, 2))
                      for name in ("w0", "w1")}
        phrase = "Invalid access pattern for 'w'"
    else:  # one of two object shards
        state_dict = {"o": mapping.ShardedObject("o", {"step": 1}, (2,), (0,))}
        phrase = "1 ShardedObject are missing"
    local, global_metadata = determine_global_metadata(state_dict)
    assert [item.key for item in local] == [item.key for item in state_dict.values()]
    with pytest.raises(CheckpointingException, match=phrase):
        validate_sharding_integrity(global_metadata)
    with pytest.raises(CheckpointingException, match=phrase):  # Megatron's own global metadata, as given
        validate_sharding_integrity([[item.without_data() for item in state_dict.values()]])


@pytest.mark.parametrize("blocks, tiled", [
    ([((0, 0), (3, 4)), ((3, 0), (3, 4))], True),  # Shard(0) over two ranks
    ([((0, 2), (6, 2)), ((0, 0), (6, 2))], True),  # the last axis, out of order
    ([((0, 0), (6, 4))], True),  # whole, alone
    ([((0, 0), (3, 4)), ((4, 0), (2, 4))], False),  # a gap
    ([((0, 0), (4, 4)), ((3, 0), (3, 4))], False),  # an overlap
    ([((0, 0), (3, 4)), ((3, 0), (4, 4))], False),  # past the end
    ([((0, 0), (6, 4)), ((0, 0), (6, 4))], False),  # whole, twice
    ([((0, 0), (3, 2)), ((3, 0), (3, 2)), ((0, 2), (6, 2))], False),  # two axes split: the general count decides
    ([((0, 0), (3, 4)), ((3, 0), (-1, 4)), ((2, 0), (4, 4))], False),  # a negative extent
])
def test_the_one_axis_fast_path_accepts_only_exact_tilings(blocks: list, tiled: bool) -> None:
    from shardstore.planning.checks import _tile_one_axis

    offsets, extents = [o for o, _ in blocks], [e for _, e in blocks]
    assert _tile_one_axis(offsets, extents, (6, 4)) is tiled
