"""scripts/simulate_scale.py (issue 44 item 2, issue 65 item 2): its quick run plans every
layout with the real planner and the layout shardstore chooses, and counts the files
from the planned records, exactly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests import forked_python

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "simulate_scale.py"
MiB = 2**20


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], dict]:
    """The figures of ``--quick``, by (layout, ranks)."""
    out = tmp_path_factory.mktemp("simulate") / "figures.json"
    result = forked_python.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    return {(f["layout"], f["ranks"]): f for f in json.loads(out.read_text())}


def test_default_layout_files_within_the_bound_where_it_shards(quick: dict) -> None:
    """At 32 ranks the default layout gathers FSDP2's small blocks into shards: the
    files (and S3 objects) of every door stay within bytes / 64 MiB + 2 x arrays +
    ranks, counted from the planned records."""
    f = quick[("FSDP2 Llama-tiny", 32)]
    assert f["target_files"] == -(-f["checkpoint_bytes"] // (64 * MiB)) + 2 * f["arrays"] + f["ranks"]
    assert f["files"] == f["data_files"] + f["packs"] + f["documents"] + 3
    assert f["sharded_arrays"] + f["packed_arrays"] > 0
    assert max(f["door_files"].values()) == f["most_files"] <= f["target_files"]
    assert f["s3_objects"] <= f["target_files"]
    assert {where.split(", ")[0] for where in f["layouts"]} == {
        "shardstore.save", "megatron install()", "dcp.save(ShardstoreWriter)"}


def test_distributed_optimizer_layout_plans_and_exchanges(quick: dict) -> None:
    """The Megatron layout passes the real global checks (every element covered once),
    its flattened fragments straddle chunks, and its DP replicas share their reads."""
    f = quick[("Megatron GPT-tiny", 8)]
    assert f["arrays"] == (12 + 3) * 4  # 12 layer parameters, embedding, final norm x2; params + 3 states
    assert f["straddle_bytes"] > 0
    assert f["load_exchange_bytes"] > 0
    assert f["record_bytes"] > 0 and f["record_parse_s"] >= 0
    assert f["files"] == f["data_files"] + f["packs"] + f["documents"] + 3


@pytest.fixture(scope="module")
def simulate_scale():
    """The script as a module."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import simulate_scale
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return simulate_scale


def test_full_layouts_have_the_issue_shapes(simulate_scale) -> None:
    """Llama-70B with AdamW is about 2,200 arrays (the step is common state); the Megatron
    layout is TP 8 x PP 8 x DP 16."""
    assert len(simulate_scale.FsdpLlama(512).arrays()) == 2169
    assert simulate_scale.MegatronGpt().world == 1024


def test_s3_fit_recovers_requests_per_chunk_array_rank(simulate_scale) -> None:
    """The fit of the S3 calibration finds each method's requests per chunk, array, rank
    and operation, and says whether it predicts the held-out layout."""
    def counts(chunks: int, arrays: int, ranks: int) -> dict[str, int]:
        return {"PUT": chunks + arrays + 4, "GET": 3 * ranks + 1}

    layouts = [(2, 2, 1), (4, 4, 1), (8, 2, 1), (4, 2, 2), (12, 3, 2), (20, 5, 2)]
    rows = [((c, a, r, 1), counts(c, a, r)) for c, a, r in layouts]
    costs = simulate_scale.fit_costs({"save": rows, "load": rows}, "check")
    assert costs.save["PUT"] == (1.0, 1.0, 0.0, 4.0)
    assert costs.save["GET"] == (0.0, 0.0, 3.0, 1.0)
    assert costs.requests("load", 1000, 10, 100) == {"PUT": 1014, "GET": 301}
    assert "save: measured 36, fitted 36" in costs.check  # 29 PUTs, 7 GETs


def test_files_follow_the_layout_given(simulate_scale) -> None:
    """Per array at 8 ranks: a chunk file per rank's block of every array, a zarr.json per
    array, the record, metadata.json and common.pt. Packs of arrays <= 64 KiB: the 27
    small arrays (norms, k and v projections, with their moments) gathered whole into a
    pack per rank, without their documents; consolidated only: no documents at all."""
    from shardstore import StorageLayout

    model = simulate_scale.layouts(quick=True)[0]
    arrays = (2 * 9 + 3) * 3  # 2 layers of 9 parameters, embedding, norm, head; each with 2 moments
    per_array = StorageLayout(pack_arrays_up_to=0, zarr_metadata="per_node", shard_bytes=None)
    f = simulate_scale.simulate(model, 10**7, None, layout=per_array)
    assert (f.arrays, f.chunks, f.files, f.directories) == (arrays, arrays * 8, arrays * 8 + arrays + 3, arrays + 1)
    packed = StorageLayout(pack_arrays_up_to=64 << 10, zarr_metadata="per_node", shard_bytes=None)
    f = simulate_scale.simulate(model, 10**7, None, layout=packed)
    assert (f.packed_arrays, f.packs, f.documents) == (27, 8, arrays - 27)
    assert f.files == (arrays - 27) * 8 + 8 + (arrays - 27) + 3
    f = simulate_scale.simulate(model, 10**7, None, layout=StorageLayout(
        pack_arrays_up_to=64 << 10, zarr_metadata="consolidated_only", shard_bytes=None))
    assert (f.documents, f.files) == (0, (arrays - 27) * 8 + 8 + 3)


def test_sharded_plan_counts_shard_fsdp_arrays_into_one_file_each() -> None:
    """scripts/sharded_plan_counts.py with the real planner: FSDP2's tiny layout at 8
    ranks, 63 arrays of one small block per rank, goes from 504 data files to 63."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "sharded_plan_counts.py"
    spec = importlib.util.spec_from_file_location("sharded_plan_counts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.sim.layouts(quick=True)[0]
    plain, sharded = module.counts(model, None), module.counts(model, 64 << 20)
    assert (plain["data_files"], sharded["data_files"], sharded["sharded"]) == (504, 63, 63)
    assert sharded["writers"] == model.world and plain["moved"] == 0 < sharded["moved"]


def test_whole_tensor_loads_read_each_chunk_once_with_read_shards_once() -> None:
    """scripts/whole_tensor_loads.py: a whole-tensor checkpoint of the tiny FSDP2 layout
    loaded at 8 ranks reads 8x the bytes asked for when each rank reads its own rows,
    and each chunk once with ``read_shards_once``."""
    import importlib.util

    from shardstore.planning.plans import plan_save
    from shardstore.strategies.zarr import ZarrLoadShardedStrategy

    path = Path(__file__).resolve().parent.parent / "scripts" / "whole_tensor_loads.py"
    spec = importlib.util.spec_from_file_location("whole_tensor_loads", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.sim.layouts(quick=True)[0]
    record = plan_save(module._layout(module.sim.FsdpLlama(1, **module._shape_of(model))), 64 << 20, True)[0].commit
    layout = module._layout(model)
    chunks = sum(a.nbytes for a in record.arrays.values())
    each, once = (module.bytes_read(layout, record, ZarrLoadShardedStrategy(read_shards_once=o).plan_load(layout, record))
                  for o in (False, True))
    assert sum(each) == model.world * chunks and sum(once) == chunks, (sum(each), sum(once), chunks)
