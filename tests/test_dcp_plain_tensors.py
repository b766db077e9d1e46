"""Issue 31.3: every plain ``torch.Tensor`` of a ``dcp.save`` through ``ShardstoreWriter``
is an array of its own (at least ``min_array_bytes``; smaller ones stay in common.pt),
written by one of the ranks that hold it, balanced by bytes; ``ShardstoreReader`` fills
the caller's tensors in place. Issue 32.3: ``ShardstoreWriter(reuse_from=...)`` shares
the chunks that did not change.

Before, ``dcp.save(model.state_dict(), ...)`` of a plain model pickled every tensor into
common.pt: no array, no chunk checksum, nothing for plain zarr or TensorStore.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import shardstore
from shardstore import ShardstoreReader, ShardstoreWriter, StorageLayout
from shardstore.inputs.plain_tensors import (
    HeldTensor,
    assign_writers,
    checkpointable_tensor_protocol,
)
from tests import fsdp_models as fm
from tests.dist import run_distributed

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

# tests of chunk files, per-array documents and hard links: each array a directory of its own
PER_ARRAY = StorageLayout(pack_arrays_up_to=0)


def _model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A plain model (big and small tensors, a bfloat16 buffer) and its Adam, one step
    taken (a batch that depends only on the seed). Two processes may still differ in
    the last bits (``_replicated``)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 48), nn.LayerNorm(48), nn.Linear(48, 16))
    model.register_buffer("table", torch.randn(40, 16).to(torch.bfloat16))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 64)).pow(2).sum().backward()
    optimizer.step()
    return model, optimizer


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _tensors(state: Any, path: tuple = ()) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` by its fully qualified name."""
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _tensors(value, (*path, key)).items()}
    if isinstance(state, list):
        return {k: v for i, value in enumerate(state) for k, v in _tensors(value, (*path, i)).items()}
    return {".".join(map(str, path)): state} if isinstance(state, torch.Tensor) else {}


def _expected_arrays(state: dict) -> set[str]:
    return {key for key, t in _tensors(state).items() if t.ndim and t.nbytes >= 1024}


def _read_by_tensorstore(ckpt: Path, key: str) -> np.ndarray:
    import tensorstore as ts

    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{ckpt}/{key}/"}}).result().read().result()


def _assert_bits(array: np.ndarray, tensor: torch.Tensor, what: str) -> None:
    expected = tensor.view(torch.int16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()
    assert array.shape == expected.shape and array.tobytes() == expected.tobytes(), what


def _load_in_place_and_compare(ckpt: Path | str, saved: dict, seed: int) -> None:
    """dcp.load into a fresh model's and optimizer's state fills their own tensors,
    bit-exact; shardstore.load returns the same values."""
    import torch.distributed.checkpoint as dcp

    request = _state(*_model_and_optimizer(seed))
    targets = _tensors(request)
    dcp.load(request, storage_reader=ShardstoreReader(ckpt))
    for key, tensor in _tensors(request).items():
        assert tensor is targets[key], f"{key}: not filled in place"
    fm.assert_same(fm.full_values(request), saved)
    loaded = shardstore.load(_state(*_model_and_optimizer(seed)), ckpt)
    fm.assert_same(fm.full_values(loaded), saved)


def test_plain_tensors_are_arrays_that_other_readers_open(tmp_path: Path) -> None:
    """One process, no process group: a model plus Adam state."""
    import torch.distributed.checkpoint as dcp
    import zarr

    state = _state(*_model_and_optimizer(0))
    saved = fm.full_values(state)
    ckpt = tmp_path / "ckpt"
    dcp.save(state, storage_writer=ShardstoreWriter(ckpt, max_chunk_bytes=4096, layout=PER_ARRAY))

    arrays = _expected_arrays(state)
    assert {"model.0.weight", "model.table", "optim.state.0.weight.exp_avg"} <= arrays
    assert set(shardstore.load_tensors_metadata(ckpt)) == arrays
    common = _tensors(shardstore.load_common_state_dict(ckpt))
    assert set(common) == set(_tensors(state)) - arrays and "optim.state.0.weight.step" in common, sorted(common)
    assert shardstore.verify(ckpt).ok
    record = json.loads((ckpt / "model.0.weight" / "zarr.json").read_text())
    assert record["chunk_grid"]["configuration"]["chunk_shape"][0] < 48, "4 KiB chunks: several of them"

    tensors = _tensors(saved)
    group = zarr.open_group(str(ckpt), mode="r")
    for key in sorted(arrays):
        _assert_bits(_read_by_tensorstore(ckpt, key), tensors[key], f"{key} by TensorStore")
        if tensors[key].dtype != torch.bfloat16:  # zarr-python has no bfloat16 of its own
            _assert_bits(group[key][...], tensors[key], f"{key} by zarr-python")
    _load_in_place_and_compare(ckpt, saved, seed=5)


def _replicated(state: dict) -> dict:
    """``state`` with rank 0's values on every rank, as DDP makes them (it broadcasts
    rank 0's parameters): the same computation on two processes need not give the same
    bits (MKL's results may depend on the memory's alignment), and a replicated tensor
    saved by one rank is compared with every rank's own."""
    for tensor in _tensors(state).values():
        torch.distributed.broadcast(tensor.detach(), src=0)
    return state


def save_replicated_at_two_ranks(rank: int, world: int, root: str) -> dict[str, list[str]]:
    """Saved twice: with DCP's default planner, and with one whose deduplication gives
    every replicated item to rank 0 (the writer still spreads the arrays, so rank 1
    writes tensors its own plan does not hold); then by ``dcp.async_save``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    written: list[str] = []
    original = ShardstoreWriter._write_shards

    def recording(self, part, planner, location):
        written.extend(item.index.fqn for item in part.items)
        return original(self, part, planner, location)

    ShardstoreWriter._write_shards = recording
    state = _replicated(_state(*_model_and_optimizer(0)))
    by_planner = {}
    for name, planner in (("default", None), ("lowest rank", DefaultSavePlanner(dedup_save_to_lowest_rank=True))):
        written.clear()
        dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/{name}"), planner=planner)
        by_planner[name] = list(written)
        _load_in_place_and_compare(f"{root}/{name}", fm.full_values(state), seed=rank + 5)
    ShardstoreWriter._write_shards = original
    background = torch.distributed.new_group(backend="gloo")
    future = dcp.async_save(state, storage_writer=ShardstoreWriter(f"{root}/async"), process_group=background)
    future.result()
    _load_in_place_and_compare(f"{root}/async", fm.full_values(state), seed=rank + 5)
    return by_planner


def test_replicated_plain_tensors_are_written_once_balanced_over_the_ranks(tmp_path: Path) -> None:
    results = run_distributed(save_replicated_at_two_ranks, 2, str(tmp_path))
    state = _state(*_model_and_optimizer(0))
    sizes = {key: t.nbytes for key, t in _tensors(state).items()}
    for name in ("default", "lowest rank"):
        by_rank = [result[name] for result in results]
        written = [key for keys in by_rank for key in keys]
        assert sorted(written) == sorted(_expected_arrays(state)), f"{name}: every array once, by one rank"
        loads = [sum(sizes[key] for key in keys) for keys in by_rank]
        assert abs(loads[0] - loads[1]) <= max(sizes[key] for key in written), (name, loads)
        assert shardstore.verify(tmp_path / name).ok


def test_the_threshold_decides_between_an_array_and_the_common_state(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"below": torch.ones(255), "at": torch.ones(256), "scalar": torch.tensor(3.0), "empty": torch.ones(0, 4)}
    dcp.save(state, storage_writer=ShardstoreWriter(tmp_path / "default"))
    assert set(shardstore.load_tensors_metadata(tmp_path / "default")) == {"at"}
    assert set(shardstore.load_common_state_dict(tmp_path / "default")) == {"below", "scalar", "empty"}
    dcp.save(state, storage_writer=ShardstoreWriter(tmp_path / "all", min_array_bytes=0))
    assert set(shardstore.load_tensors_metadata(tmp_path / "all")) == {"below", "at"}
    request = {"below": torch.zeros(255), "at": torch.zeros(256), "scalar": torch.tensor(0.0), "empty": torch.ones(0, 4)}
    dcp.load(request, storage_reader=ShardstoreReader(tmp_path / "all"))
    fm.assert_same(request, state)


def save_divergent_replicas(rank: int, world: int, root: str) -> str:
    """Both ranks hold "w", as float32 (1 KiB: an array) on rank 0 and int8 (256 B: the
    common state) on rank 1, as per-rank state saved under one name would be."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    w = torch.ones(16, 16, dtype=torch.float32 if rank == 0 else torch.int8)
    with pytest.raises(CheckpointException, match=r"ranks hold 'w' with different shapes or dtypes \(rank\(s\) \[0\]: "
                       r"torch.float32 \[16, 16\]; rank\(s\) \[1\]: torch.int8"):  # DCP wraps ours
        dcp.save({"w": w, "other": torch.full((32, 32), 7.0)}, storage_writer=ShardstoreWriter(root))
    return "refused"


def test_a_tensor_ranks_hold_with_different_dtypes_is_refused_not_committed_unloadable(tmp_path: Path) -> None:
    """Before, the save committed and every later load failed ("'w' names both an array
    and a value of the common state"), while verify found nothing wrong."""
    assert run_distributed(save_divergent_replicas, 2, str(tmp_path / "ckpt")) == ["refused", "refused"]
    assert not (tmp_path / "ckpt" / "zarr.json").exists()


def test_conjugate_and_negative_views_are_saved_and_loaded_by_value(tmp_path: Path) -> None:
    """A view whose conjugate or negative bit is set has no memory holding its values:
    before, both the save and a load into such a view failed in numpy()."""
    import torch.distributed.checkpoint as dcp

    c = torch.complex(torch.randn(32, 32), torch.randn(32, 32))
    state = {"conj": c.conj(), "neg": c._neg_view()}
    dcp.save(state, storage_writer=ShardstoreWriter(tmp_path / "ckpt"))
    assert set(shardstore.load_tensors_metadata(tmp_path / "ckpt")) == {"conj", "neg"}
    plain = {"conj": torch.zeros(32, 32, dtype=torch.complex64), "neg": torch.zeros(32, 32, dtype=torch.complex64)}
    dcp.load(plain, storage_reader=ShardstoreReader(tmp_path / "ckpt"))
    assert torch.equal(plain["conj"], c.conj().resolve_conj()) and torch.equal(plain["neg"], -c)
    into_views = {"conj": torch.zeros(32, 32, dtype=torch.complex64).conj(), "neg": torch.zeros(32, 32, dtype=torch.complex64)}
    dcp.load(into_views, storage_reader=ShardstoreReader(tmp_path / "ckpt"))
    assert into_views["conj"].is_conj() and torch.equal(into_views["conj"].resolve_conj(), c.conj().resolve_conj())


def test_writers_are_the_holders_balanced_by_bytes() -> None:
    held = [[HeldTensor("a", 100), HeldTensor("b", 60), HeldTensor("c", 50)],
            [HeldTensor("a", 100), HeldTensor("b", 60), HeldTensor("c", 50), HeldTensor("d", 10)],
            [HeldTensor("e", 5)]]
    # largest first to the least loaded holder: rank 1 already writes 40 sharded bytes, a 100/100 tie
    # goes to rank 0, "d" has one holder, rank 2 holds only "e"
    assert assign_writers(held, [0, 40, 0]) == {"a": 0, "b": 1, "c": 0, "d": 1, "e": 2}
    assert assign_writers([[HeldTensor("x", 8)], [HeldTensor("x", 8)]], [0, 0]) == {"x": 0}, "ties: lowest rank"


def _checkpointable(local: torch.Tensor, global_shape: tuple, global_offsets: tuple, local_offsets: tuple,
                    local_sizes: tuple) -> torch.Tensor:
    """A plain tensor carrying torch 2.14's CheckpointableTensor fields."""
    local.global_shape, local.global_offsets = global_shape, global_offsets
    local.local_offsets, local.local_sizes = local_offsets, local_sizes
    return local


def _two_shards_in_one_buffer(fill: torch.Tensor) -> torch.Tensor:
    """One local (6, 4) buffer holding two shards of a (6, 4) global tensor, swapped:
    local rows 0-2 are global rows 3-5 and local rows 3-5 global rows 0-2."""
    return _checkpointable(fill, (6, 4), ((3, 0), (0, 0)), ((0, 0), (3, 0)), ((3, 4), (3, 4)))


@pytest.mark.skipif(checkpointable_tensor_protocol() is None, reason="torch < 2.14 has no CheckpointableTensor protocol")
def test_checkpointable_tensors_are_shards_of_their_global_array(tmp_path: Path) -> None:
    """Run with torch 2.14.1 (the protocol's first release): the shards land at their
    global offsets, plain zarr readers see the global array, and ``dcp.load`` fills a
    checkpointable tensor of the same description in place."""
    import torch.distributed.checkpoint as dcp

    local = torch.arange(24.0).reshape(6, 4)
    dcp.save({"w": _two_shards_in_one_buffer(local.clone())}, storage_writer=ShardstoreWriter(tmp_path / "ckpt"))
    assert shardstore.load_tensors_metadata(tmp_path / "ckpt")["w"].global_shape == (6, 4)
    expected = torch.cat([local[3:], local[:3]])
    assert torch.equal(shardstore.load_plain_tensors(tmp_path / "ckpt")["w"], expected)
    request = {"w": _two_shards_in_one_buffer(torch.zeros(6, 4))}
    dcp.load(request, storage_reader=ShardstoreReader(tmp_path / "ckpt"))
    assert torch.equal(request["w"], local)


def save_checkpointable_halves(rank: int, world: int, ckpt: str) -> None:
    import torch.distributed.checkpoint as dcp

    half = torch.arange(12.0).reshape(3, 4) + 12 * rank
    dcp.save({"w": _checkpointable(half, (6, 4), ((3 * rank, 0),), ((0, 0),), ((3, 4),))},
             storage_writer=ShardstoreWriter(ckpt))


@pytest.mark.skipif(checkpointable_tensor_protocol() is None, reason="torch < 2.14 has no CheckpointableTensor protocol")
def test_checkpointable_tensors_of_two_ranks_form_one_array(tmp_path: Path) -> None:
    run_distributed(save_checkpointable_halves, 2, str(tmp_path / "ckpt"))
    assert torch.equal(shardstore.load_plain_tensors(tmp_path / "ckpt")["w"], torch.arange(24.0).reshape(6, 4))
    assert shardstore.verify(tmp_path / "ckpt").ok


def test_reuse_from_shares_what_did_not_change(tmp_path: Path) -> None:
    """Step 2 changes one tensor: the others' chunks are hard links to step 1's; each
    checkpoint stands alone (step 1 deleted, step 2 still loads and verifies)."""
    import shutil

    import torch.distributed.checkpoint as dcp

    model, optimizer = _model_and_optimizer(0)
    dcp.save(_state(model, optimizer), storage_writer=ShardstoreWriter(tmp_path / "step1", layout=PER_ARRAY))
    with torch.no_grad():
        model[2].weight.add_(1.0)
    state = _state(model, optimizer)
    saved = fm.full_values(state)
    dcp.save(state, storage_writer=ShardstoreWriter(tmp_path / "step2", reuse_from=tmp_path / "step1",
                                                        layout=PER_ARRAY))

    step2 = {str(p.relative_to(tmp_path / "step2")): p for p in (tmp_path / "step2").glob("*/c.*")}
    shared = {name for name, p in step2.items() if p.stat().st_nlink == 2}
    changed = {name for name in step2 if name.startswith("model.2.weight/")}
    assert changed and shared == set(step2) - changed, (sorted(shared), sorted(changed))
    new_bytes = sum(p.stat().st_size for p in (tmp_path / "step2").rglob("*") if p.is_file() and p.stat().st_nlink == 1)
    assert new_bytes < model[2].weight.nbytes + 64 * 1024, new_bytes  # the changed tensor plus small files
    record = json.loads((tmp_path / "step2" / "zarr.json").read_text())["attributes"]["shardstore"]
    assert record["reused_from"]["chunks"] == len(shared), record["reused_from"]
    shutil.rmtree(tmp_path / "step1")
    assert shardstore.verify(tmp_path / "step2").ok
    _load_in_place_and_compare(tmp_path / "step2", saved, seed=5)


def test_a_planner_that_drops_the_writers_plan_data_loses_no_tensor(tmp_path: Path) -> None:
    """A custom planner may rebuild the plans without what ``prepare_local_plan`` put in
    them: the plain tensors left in the plans are still arrays, none is dropped."""
    import dataclasses

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    class Rebuilding(DefaultSavePlanner):
        def create_global_plan(self, all_plans):
            plans, metadata = super().create_global_plan(all_plans)
            return [dataclasses.replace(plan, storage_data=None) for plan in plans], metadata

    state = {"w": torch.arange(512.0), "b": torch.ones(3)}
    dcp.save(state, storage_writer=ShardstoreWriter(tmp_path / "ckpt"), planner=Rebuilding())
    assert set(shardstore.load_tensors_metadata(tmp_path / "ckpt")) == {"w"}
    request = {"w": torch.zeros(512), "b": torch.zeros(3)}
    dcp.load(request, storage_reader=ShardstoreReader(tmp_path / "ckpt"))
    fm.assert_same(request, state)


def test_shardstore_load_of_a_dcp_checkpoint_fills_the_requests_plain_tensors(tmp_path: Path) -> None:
    """``shardstore.load(model.state_dict() + Adam, dir)`` of a checkpoint DCP's own
    ``FileSystemWriter`` saved (one process: every tensor plain) gives every tensor,
    as from the same state saved through ``ShardstoreWriter``. It
    returned the request without them: a plain tensor was read from an array only in
    a shardstore checkpoint (its record's arrays), so here every non-scalar tensor was
    dropped silently (``model`` came back empty; only AdamW's 0-dim ``step`` remained)."""
    import torch.distributed.checkpoint as dcp

    state = _state(*_model_and_optimizer(0))
    saved = fm.full_values(state)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp"))
    loaded = shardstore.load(_state(*_model_and_optimizer(5)), tmp_path / "dcp")
    fm.assert_same(fm.full_values(loaded), saved)


def test_shardstore_load_fills_plain_tensors_in_place_in_any_dtype_or_layout(tmp_path: Path) -> None:
    """``shardstore.load`` reads an array into the request's plain tensor in place, as
    ``dcp.load`` fills it and as DTensors are filled. A tensor of another dtype than the
    stored one (a float64 or bfloat16 model loading a float32 checkpoint) or one that is
    not contiguous (a transposed view) got a new tensor in the result while the request's
    own tensor kept its old values: a caller relying on in place (``dcp.load``'s way) ran
    on with an unloaded model."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(512.0).reshape(16, 32), "v": torch.arange(512.0).reshape(32, 16) - 7}
    dcp.save(state, storage_writer=ShardstoreWriter(tmp_path / "ckpt"))
    request = {"w": torch.zeros(16, 32, dtype=torch.float64), "v": torch.zeros(16, 32).t()}
    loaded = shardstore.load(request, tmp_path / "ckpt")
    assert loaded["w"] is request["w"] and loaded["v"] is request["v"], "the request's tensors are returned"
    assert torch.equal(request["w"], state["w"].double())
    assert torch.equal(request["v"], state["v"])
