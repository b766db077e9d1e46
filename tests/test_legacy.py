"""Issue 17.4/17.5: checkpoints other tools wrote: Megatron-Core 0.16.1's torch_dist
(with an irregular distributed-optimizer buffer and ShardedObjects), plain PyTorch DCP
(DTensor shards), and Megatron-Core 0.14.0's zarr and torch_dist (flattened ranges,
stored "reformulated" by torch_dist), all committed fixtures
(tests/fixtures/legacy/make.py, make_megatron014.py), read without running their
pickles and converted into shardstore checkpoints that load at other world sizes
bit-exact."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from shardstore import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    load,
    load_common_state_dict,
    load_plain_tensors,
    load_tensors_metadata,
    verify,
)
from shardstore.other_formats.dcp import DcpCheckpoint
from shardstore.tools.cli import main
from shardstore.tools.convert import from_other_format
from tests.dist import run_distributed
from tests.fixtures.legacy.make import DCP, MEGATRON, expected
from tests.fixtures.legacy.make_megatron014 import TORCH_DIST as MEGATRON_014_TORCH_DIST
from tests.fixtures.legacy.make_megatron014 import ZARR as MEGATRON_014_ZARR
from tests.scenarios import assert_bits_equal


def test_megatron_torch_dist_converts_bit_exact(tmp_path: Path) -> None:
    assert from_other_format(MEGATRON, tmp_path / "ckpt") == 3
    assert verify(tmp_path / "ckpt").ok
    plain = load_plain_tensors(tmp_path / "ckpt")
    for key in ("decoder/fc1", "embedding/word", "optimizer/exp_avg"):
        assert_bits_equal(plain[key], expected()[key], key)
    common = load_common_state_dict(tmp_path / "ckpt")
    assert common["iteration"] == 7 and common["args"] == {"lr": 0.5, "tp": 2}
    objects = load({"rng": [ShardedObject("rng_state", None, (2,), (r,)) for r in range(2)]}, tmp_path / "ckpt")
    assert objects["rng"] == [{"seed": 1234, "rank": 0}, {"seed": 1235, "rank": 1}]


def _load_resharded(rank: int, world: int, ckpt: str) -> None:
    full = expected()
    rows = full["decoder/fc1"].chunk(world)[rank]
    cuts = [0, 5, 24]  # another irregular cut of the optimizer buffer
    buffer = full["optimizer/exp_avg"][cuts[rank]:cuts[rank + 1]]
    request = {
        "fc1": ShardedTensor.from_rank_offsets("decoder/fc1", torch.empty_like(rows), (0, rank, world)),
        "exp_avg": ShardedTensor("optimizer/exp_avg", torch.empty_like(buffer), buffer.dtype, buffer.shape, (24,),
                                 (cuts[rank],), None),
    }
    loaded = load(request, ckpt)
    assert_bits_equal(loaded["fc1"], rows)
    assert_bits_equal(loaded["exp_avg"], buffer)


def test_converted_megatron_checkpoint_loads_at_another_layout(tmp_path: Path) -> None:
    from_other_format(MEGATRON, tmp_path / "ckpt")
    run_distributed(_load_resharded, 2, str(tmp_path / "ckpt"))


def test_plain_dcp_converts_with_its_flattened_names(tmp_path: Path) -> None:
    source = DcpCheckpoint(DCP)
    assert source.kind == "dcp"
    assert len(source.tensors["model.fc1"].chunks) == 2  # the DTensor's two shards
    from_other_format(DCP, tmp_path / "ckpt")
    plain = load_plain_tensors(tmp_path / "ckpt")
    assert_bits_equal(plain["model.fc1"], expected()["decoder/fc1"])
    assert_bits_equal(plain["model.emb"], expected()["embedding/word"])
    assert plain["step"].shape == () and plain["step"].item() == 7
    assert plain["epoch"] == 3  # a plain value: the common state


def test_the_command_converts_a_megatron_checkpoint_and_verifies_it(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["--no-progress", "convert", str(MEGATRON), str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    assert "wrote 3 arrays" in result.stdout and "verified" in result.stdout


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_metadata_is_refused_without_running_it(tmp_path: Path) -> None:
    source = tmp_path / "evil"
    shutil.copytree(MEGATRON, source)
    marker = tmp_path / "pwned"
    (source / ".metadata").write_bytes(pickle.dumps({"x": _RunsCode(str(marker))}))
    with pytest.raises(CheckpointingException, match="refusing to load posix.system"):
        from_other_format(source, tmp_path / "ckpt")
    assert not marker.exists()
    assert not (tmp_path / "ckpt").exists()


def test_a_truncated_data_file_names_the_file_and_key(tmp_path: Path) -> None:
    source = tmp_path / "cut"
    shutil.copytree(MEGATRON, source)
    data = source / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointingException, match="__1_0.distcp.*lies outside"):
        from_other_format(source, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()  # nothing that looks complete


def test_saving_into_a_megatron_checkpoint_still_refuses(tmp_path: Path) -> None:
    from shardstore import save

    target = tmp_path / "megatron"
    shutil.copytree(MEGATRON, target)
    with pytest.raises(CheckpointingException, match="torch_dist"):
        save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, target, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == sorted(p.name for p in MEGATRON.iterdir())


# ------------------------------------------- issue 17.4: loading them as they are


def _load_megatron_directly(rank: int, world: int, ckpt: str) -> None:
    full = expected()
    rows = full["decoder/fc1"].chunk(world)[rank]
    cuts = [0, 20, 24] if world == 2 else [0, 24]
    buffer = full["optimizer/exp_avg"][cuts[rank]:cuts[rank + 1]]
    request = {
        "fc1": ShardedTensor.from_rank_offsets("decoder/fc1", torch.empty_like(rows), (0, rank, world)),
        "emb": ShardedTensor.from_rank_offsets("embedding/word", torch.empty(5, 4, dtype=torch.bfloat16),
                                               replica_id=rank),
        "exp_avg": ShardedTensor("optimizer/exp_avg", torch.empty_like(buffer), buffer.dtype, buffer.shape, (24,),
                                 (cuts[rank],), None),
        # the saving job's per-rank objects: each asked for once (both by a single rank)
        "rng": [ShardedObject("rng_state", None, (2,), (r,)) for r in range(2) if world == 1 or r == rank],
    }
    loaded = load(request, ckpt)
    assert_bits_equal(loaded["fc1"], rows)
    assert_bits_equal(loaded["emb"], full["embedding/word"])
    assert_bits_equal(loaded["exp_avg"], buffer)
    assert loaded["rng"] == [{"seed": 1234 + r, "rank": r} for r in range(2) if world == 1 or r == rank]
    assert loaded["iteration"] == 7
    if "0.14.0" in ckpt:  # its 2-D flattened optimizer state, asked for at another flat cut
        cut = [0, 30, 48] if world == 2 else [0, 48]
        flat = full["decoder/fc1"].flatten().neg()[cut[rank]:cut[rank + 1]]
        again = load({"s": ShardedTensor.from_rank_offsets_flat(
            "optimizer/fc1_exp_avg", torch.empty_like(flat), (8, 6), flattened_range=slice(cut[rank], cut[rank + 1]))},
            ckpt)
        assert_bits_equal(again["s"], flat)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("source", [MEGATRON, MEGATRON_014_ZARR, MEGATRON_014_TORCH_DIST], ids=lambda p: p.name)
def test_megatron_checkpoints_load_directly_at_other_layouts(world: int, source: Path) -> None:
    """Saved at TP 2 with a 13 + 11 optimizer cut; loaded at 1 rank, and at 2 ranks with
    a 20 + 4 cut, without conversion (the fixture is only read)."""
    run_distributed(_load_megatron_directly, world, str(source))


@pytest.mark.parametrize("source", [MEGATRON_014_ZARR, MEGATRON_014_TORCH_DIST], ids=lambda p: p.name)
def test_megatron_014_checkpoints_convert_bit_exact(tmp_path: Path, source: Path) -> None:
    # flattened ranges report their original global shape, as Megatron's own query does
    assert load_tensors_metadata(source)["optimizer/fc1_exp_avg"].global_shape == (8, 6)
    result = CliRunner().invoke(main, ["--no-progress", "convert", str(source), str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    assert "wrote 4 arrays" in result.stdout and "verified" in result.stdout
    plain = load_plain_tensors(tmp_path / "ckpt")
    for key in ("decoder/fc1", "embedding/word", "optimizer/exp_avg"):
        assert_bits_equal(plain[key], expected()[key], key)
    assert_bits_equal(plain["optimizer/fc1_exp_avg"], -expected()["decoder/fc1"])
    assert load_common_state_dict(tmp_path / "ckpt") == {"iteration": 7, "args": {"lr": 0.5, "tp": 2}}
    objects = load({"rng": [ShardedObject("rng_state", None, (2,), (r,)) for r in range(2)]}, tmp_path / "ckpt")
    assert objects["rng"] == [{"seed": 1234, "rank": 0}, {"seed": 1235, "rank": 1}]


def _zarr_copy(tmp_path: Path) -> Path:
    source = tmp_path / "zarr"
    shutil.copytree(MEGATRON_014_ZARR, source)
    return source


def test_a_megatron_zarr_chunk_of_the_wrong_size_is_named(tmp_path: Path) -> None:
    source = _zarr_copy(tmp_path)
    (source / "decoder/fc1/1.0").write_bytes(b"\0" * 95)
    with pytest.raises(CheckpointingException, match=r"chunk 'decoder/fc1/1.0' of 'decoder/fc1' holds 95 bytes"):
        load_plain_tensors(source)


def test_a_missing_megatron_zarr_chunk_is_an_error_not_zeros(tmp_path: Path) -> None:
    source = _zarr_copy(tmp_path)
    (source / "decoder/fc1/0.0").unlink()
    with pytest.raises(CheckpointingException, match=r"chunk 'decoder/fc1/0.0' of 'decoder/fc1' is missing"):
        load_plain_tensors(source)


def test_a_megatron_zarr_chunk_linked_out_of_the_checkpoint_is_refused(tmp_path: Path) -> None:
    source = _zarr_copy(tmp_path)
    outside = tmp_path / "secret"
    outside.write_bytes(b"\1" * 96)
    (source / "decoder/fc1/0.0").unlink()
    (source / "decoder/fc1/0.0").symlink_to(outside)
    with pytest.raises(CheckpointingException, match="refusing to read a chunk of 'decoder/fc1'"):
        load_plain_tensors(source)


def test_a_compressed_zarr_v2_array_is_refused_clearly(tmp_path: Path) -> None:
    source = _zarr_copy(tmp_path)
    zarray = source / "decoder/fc1/.zarray"
    zarray.write_text(zarray.read_text().replace('"compressor": null', '"compressor": {"id": "blosc"}'))
    with pytest.raises(CheckpointingException, match=r"compressor .*blosc.* is not supported"):
        load_tensors_metadata(source)


def test_saving_into_a_megatron_zarr_checkpoint_refuses_and_keeps_it(tmp_path: Path) -> None:
    from shardstore import save

    target = _zarr_copy(tmp_path)
    before = sorted(str(p.relative_to(target)) for p in target.rglob("*"))
    with pytest.raises(CheckpointingException, match="Megatron-Core zarr checkpoint"):
        save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, target, overwrite=True)
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == before


def test_queries_read_dcp_and_torch_dist_checkpoints() -> None:
    from shardstore import load_sharded_metadata, load_tensors_metadata

    tensors = load_tensors_metadata(MEGATRON)
    assert tensors["optimizer/exp_avg"].global_shape == (24,)
    assert tensors["embedding/word"].dtype == torch.bfloat16
    assert sorted(k for k in load_sharded_metadata(MEGATRON) if "shard" in k) == [
        "rng_state/shard_0_2", "rng_state/shard_1_2"]
    assert load_common_state_dict(MEGATRON) == {"iteration": 7, "args": {"lr": 0.5, "tp": 2}}
    plain = load_plain_tensors(DCP)
    assert_bits_equal(plain["model.fc1"], expected()["decoder/fc1"])
    assert plain["epoch"] == 3


@pytest.mark.parametrize("source", [MEGATRON, MEGATRON_014_ZARR], ids=lambda p: p.name)
def test_verify_of_another_tools_checkpoint_says_to_convert(source: Path) -> None:
    report = verify(source)
    assert not report.ok and "shardstore convert" in report.problems[0].message


@pytest.mark.parametrize("source, kind, arrays", [
    (MEGATRON_014_ZARR, "zarr", 4), (MEGATRON_014_TORCH_DIST, "torch_dist", 4), (DCP, "dcp", 2)],
    ids=lambda v: getattr(v, "name", str(v)))
def test_inspect_lists_another_tools_checkpoint(source: Path, kind: str, arrays: int) -> None:
    import json

    result = CliRunner().invoke(main, ["--no-progress", "inspect", "--json", str(source)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["kind"] == kind and len(summary["arrays"]) == arrays
    by_key = {a["key"]: a for a in summary["arrays"]}
    if kind != "dcp":
        assert by_key["optimizer/exp_avg"]["shape"] == [24] and by_key["embedding/word"]["dtype"] == "bfloat16"
        assert summary["objects"] == {"rng_state": ["rng_state/shard_0_2", "rng_state/shard_1_2"]}
        assert summary["common_keys"] == ["args", "iteration"]
    else:  # a plain DCP save's 0-dim tensor is a value of its common state, as a shardstore save keeps it
        assert summary["common_keys"] == ["epoch", "step"]
    text = CliRunner().invoke(main, ["--no-progress", "inspect", str(source)]).stdout
    assert "written by another tool" in text


def test_a_zarray_claiming_a_huge_array_is_refused_before_allocating(tmp_path: Path) -> None:
    """A hostile .zarray: shape and chunk of 2^40 elements over a 96-byte chunk file."""
    import json

    source = _zarr_copy(tmp_path)
    zarray = source / "decoder/fc1/.zarray"
    meta = json.loads(zarray.read_text())
    meta.update(shape=[2**40, 6], chunks=[2**40, 6])
    zarray.write_text(json.dumps(meta))
    with pytest.raises(CheckpointingException, match=r"chunk 'decoder/fc1/0.0' of 'decoder/fc1' holds 96 bytes"):
        load_plain_tensors(source)


def test_dcp_metadata_claiming_a_huge_tensor_is_refused_before_allocating(tmp_path: Path) -> None:
    """A hostile .metadata (pickled with DCP's own classes): a tensor of 2^40 x 6 floats
    whose chunk is a few hundred bytes of the data file."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    source = tmp_path / "bomb"
    shutil.copytree(MEGATRON, source)
    metadata = pickle.loads((source / ".metadata").read_bytes())  # the test's own fixture: trusted here
    entry = metadata.state_dict_metadata["decoder/fc1"]
    entry.size = torch.Size([2**40, 6])
    entry.chunks[0] = ChunkStorageMetadata(entry.chunks[0].offsets, torch.Size([2**40 - 4, 6]))
    (source / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointingException, match=r"'decoder/fc1' hold fewer bytes than"):
        load_plain_tensors(source)


def test_diff_compares_across_formats(tmp_path: Path) -> None:
    """The two readers agree: Megatron 0.14's zarr and torch_dist saves of the same state
    are identical to each other and to the zarr one's conversion; 0.16.1's lacks one
    tensor."""
    from shardstore.tools.inspection import diff_checkpoints

    from_other_format(MEGATRON_014_ZARR, tmp_path / "converted")
    assert diff_checkpoints(MEGATRON_014_ZARR, MEGATRON_014_TORCH_DIST).identical
    assert diff_checkpoints(MEGATRON_014_TORCH_DIST, tmp_path / "converted").identical
    result = CliRunner().invoke(main, ["--no-progress", "diff", str(MEGATRON_014_ZARR), str(MEGATRON)])
    assert result.exit_code == 1 and "optimizer/fc1_exp_avg" in result.stdout


def test_foreign_metadata_linked_out_of_the_checkpoint_is_refused(tmp_path: Path) -> None:
    """A .metadata that is a symbolic link (here to a large file outside) is not read."""
    source = tmp_path / "linked"
    shutil.copytree(MEGATRON, source)
    outside = tmp_path / "elsewhere.metadata"
    outside.write_bytes((source / ".metadata").read_bytes())
    (source / ".metadata").unlink()
    (source / ".metadata").symlink_to(outside)
    with pytest.raises(CheckpointingException, match="refusing to read the metadata"):
        load_plain_tensors(source)


# ------------------------------------------- what Megatron-Core's code passes in


def _trusted_zarr_copy(tmp_path: Path) -> Path:
    """The 0.14 zarr fixture whose ``common.pt`` and object shard hold a
    ``fractions.Fraction``: outside the safe load's allow-list (as Megatron-LM's ``args``
    with its enums are), loadable only by the documented opt-in."""
    import fractions

    source = _zarr_copy(tmp_path)
    common = torch.load(source / "common.pt", weights_only=True)
    torch.save({**common, "ratio": fractions.Fraction(1, 3)}, source / "common.pt")
    torch.save({"seed": 1234, "rank": 0, "ratio": fractions.Fraction(2, 3)}, source / "rng_state/shard_0_2.pt")
    return source


def test_the_unsafe_pickle_opt_in_loads_another_tools_checkpoint(tmp_path: Path) -> None:
    """The refusal of a Megatron checkpoint's pickle says to load with
    ``common_strategy=TorchCommonLoadStrategy(allow_unsafe_pickle=True)``. Before, doing
    so failed with "has no commit record. Load it with shardstore.load" (it was
    shardstore.load), and ``OtherFormatLoadCommonStrategy(allow_unsafe_pickle=True)``
    ignored the flag and refused the pickle again."""
    import fractions

    from shardstore.engine.other_formats import OtherFormatLoadCommonStrategy
    from shardstore.strategies.common import TorchCommonLoadStrategy

    source = _trusted_zarr_copy(tmp_path)
    request = {"rng": [ShardedObject("rng_state", None, (2,), (r,)) for r in range(2)],
               "fc1": ShardedTensor.from_rank_offsets("decoder/fc1", torch.empty(8, 6))}
    with pytest.raises(CheckpointingException, match="allow_unsafe_pickle=True"):
        load(request, source)
    for strategy in (TorchCommonLoadStrategy(allow_unsafe_pickle=True),
                     OtherFormatLoadCommonStrategy(allow_unsafe_pickle=True)):
        assert load_common_state_dict(source, strategy)["ratio"] == fractions.Fraction(1, 3)
        loaded = load(request, source, common_strategy=strategy)
        assert loaded["ratio"] == fractions.Fraction(1, 3) and loaded["iteration"] == 7
        assert loaded["rng"][0]["ratio"] == fractions.Fraction(2, 3) and loaded["rng"][1]["seed"] == 1235
        assert_bits_equal(loaded["fc1"], expected()["decoder/fc1"])


@pytest.mark.parametrize("source", [MEGATRON, MEGATRON_014_ZARR], ids=lambda p: p.name)
def test_megatrons_own_load_strategy_reads_its_checkpoints(source: Path) -> None:
    """Code written for Megatron-Core passes ``TorchDistLoadShardedStrategy()`` (shardstore's
    ``strategies.torch`` name for it), alone or fully-parallel-wrapped, to ``load`` and
    ``load_tensors_metadata`` of a torch_dist checkpoint. Before, shardstore's own
    strategy behind that name demanded a commit record and refused the checkpoint,
    telling the caller to "Load it with shardstore.load", which it was doing."""
    from shardstore.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from shardstore.strategies.torch import TorchDistLoadShardedStrategy

    for strategy in (TorchDistLoadShardedStrategy(), FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())):
        assert load_tensors_metadata(source, strategy)["decoder/fc1"].global_shape == (8, 6)
        request = {"fc1": ShardedTensor.from_rank_offsets("decoder/fc1", torch.empty(8, 6)),
                   "rng": [ShardedObject("rng_state", None, (2,), (r,)) for r in range(2)]}
        loaded = load(request, source, strategy)
        assert_bits_equal(loaded["fc1"], expected()["decoder/fc1"])
        assert loaded["rng"][1] == {"seed": 1235, "rank": 1} and loaded["iteration"] == 7


def test_the_lossy_cast_opt_in_loads_another_tools_checkpoint() -> None:
    """A request in another dtype that would change values is refused, naming
    ``ZarrLoadShardedStrategy(allow_lossy_casts=True)`` as the way to convert anyway.
    Before, passing it to a load of a Megatron checkpoint gave the same refusal again:
    the reader of other formats had no such option."""
    from shardstore.strategies.zarr import ZarrLoadShardedStrategy

    def request() -> dict:
        return {"fc1": ShardedTensor.from_rank_offsets("decoder/fc1", torch.empty(8, 6, dtype=torch.int64))}

    with pytest.raises(CheckpointingException, match=r"allow_lossy_casts=True"):
        load(request(), MEGATRON)
    loaded = load(request(), MEGATRON, ZarrLoadShardedStrategy(allow_lossy_casts=True))
    assert_bits_equal(loaded["fc1"], expected()["decoder/fc1"].to(torch.int64))
