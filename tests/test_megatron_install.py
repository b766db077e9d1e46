"""Issue 31.2: ``shardstore.megatron.install()`` puts shardstore behind Megatron-Core's own
``dist_checkpointing`` module functions, the way Megatron-LM's training loop calls them.

Megatron-Core 0.17 on replaces any foreign save strategy with its torch_dist one, and
0.19 has no strategy bases to subclass: the module attributes are the door every
version keeps. The calls below copy ``megatron/training/checkpointing.py`` of
core_v0.19.0 (``dist_checkpointing.save(state_dict, name, strategy, async_sharded_save=,
validate_access_integrity=, preprocess_common_before_consistancy_check=,
content_metadata=, async_strategy=, verify_integrity=)``, then ``load_common_state_dict``,
``check_is_distributed_checkpoint``, ``load(..., strict=, verify_integrity=)`` and
``load_content_metadata``) with 0.16.1 installed: keywords 0.16.1's own ``save`` does
not take, so the call succeeding shows it reached shardstore's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing.strategies.fully_parallel", reason="megatron-core not installed")

import shardstore.megatron as shardstore_megatron  # noqa: E402
from shardstore import CheckpointingException, StorageLayout, load_plain_tensors, verify  # noqa: E402
from shardstore.compat.megatron import entry_points  # noqa: E402  (its own names, beyond the public ones)
from shardstore.format.records import read_commit_record  # noqa: E402
from shardstore.stores.locations import open_location  # noqa: E402

# the tests read per-array files (zarr.json, chunk files, hard links of reuse): nothing packed
PER_ARRAY = StorageLayout(pack_arrays_up_to=0)
from tests.dist import run_distributed  # noqa: E402
from tests.scenarios import assert_bits_equal  # noqa: E402
from tests.test_megatron_objects import FC1, LAYERS, QKV, megatron_state_dict  # noqa: E402


def _megatrons_load_takes(keyword: str) -> bool:
    """Whether the installed Megatron-Core's own ``load`` has ``keyword`` (these tests run
    against 0.16.1 here, and against 0.17 to 0.19 by scripts/megatron_versions.sh)."""
    import inspect

    from megatron.core.dist_checkpointing import serialization

    return keyword in inspect.signature(serialization.load).parameters

CONTENT = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False}


def _strategies(fully_parallel: bool):
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )

    save_strategy, load_strategy = TorchDistSaveShardedStrategy("torch_dist", 1), TorchDistLoadShardedStrategy()
    if fully_parallel:
        group = torch.distributed.group.WORLD
        save_strategy = FullyParallelSaveStrategyWrapper(save_strategy, group, True)
        load_strategy = FullyParallelLoadStrategyWrapper(load_strategy, group)
    return save_strategy, load_strategy


def _training_loop_save(ckpt: str, save_strategy, async_save: bool = False):
    """Megatron-LM's save_checkpoint: rank 0 creates the directory, then every rank calls
    ``dist_checkpointing.save`` by module attribute with 0.19's keywords."""
    from megatron.core import dist_checkpointing

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if rank == 0:
        Path(ckpt).mkdir(parents=True, exist_ok=True)  # ensure_directory_exists
    torch.distributed.barrier()
    return dist_checkpointing.save(
        megatron_state_dict(rank, world, empty=False), ckpt, save_strategy,
        async_sharded_save=async_save, validate_access_integrity=True,
        preprocess_common_before_consistancy_check=lambda common: {k: v for k, v in common.items() if k != "rng"},
        content_metadata=dict(CONTENT), async_strategy="mcore", verify_integrity=True,
    )


def _training_loop_load(ckpt: str, load_strategy, verify_integrity: bool = True) -> None:
    """Megatron-LM's _load_base_checkpoint and load_checkpoint, by module attribute."""
    from megatron.core import dist_checkpointing

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    assert dist_checkpointing.check_is_distributed_checkpoint(ckpt)
    common = dist_checkpointing.load_common_state_dict(ckpt)
    assert common["iteration"] == 100, common
    assert dist_checkpointing.load_content_metadata(preloaded_state_dict=common) == CONTENT
    assert dist_checkpointing.load_content_metadata(ckpt) == CONTENT
    loaded = dist_checkpointing.load(
        megatron_state_dict(rank, world, empty=True), ckpt, load_strategy,
        validate_access_integrity=True, strict="assume_ok_unexpected", verify_integrity=verify_integrity,
    )
    for layer in range(LAYERS):
        assert_bits_equal(loaded["model"]["layers"][f"{layer}.fc1"], FC1[layer].chunk(world, 0)[rank], "fc1")
    assert_bits_equal(loaded["model"]["qkv"], QKV.chunk(world, 0)[rank], "qkv")
    assert loaded["rng"] == {"rank": rank} and loaded["iteration"] == 100


def training_loop(rank: int, world: int, ckpt: str, fully_parallel: bool) -> None:
    shardstore_megatron.install(layout=PER_ARRAY)
    save_strategy, load_strategy = _strategies(fully_parallel)
    assert _training_loop_save(ckpt, save_strategy) is None
    _training_loop_load(ckpt, load_strategy)
    shardstore_megatron.uninstall()


@pytest.mark.parametrize("fully_parallel", [False, True], ids=["torch_dist", "fully_parallel"])
def test_megatron_lm_training_loop_calls_write_and_read_shardstore(tmp_path: Path, fully_parallel: bool) -> None:
    ckpt = tmp_path / "iter_0000100"
    run_distributed(training_loop, 2, str(ckpt), fully_parallel)
    assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "shardstore"
    assert verify(ckpt).ok and (ckpt / "decoder/layers/fc1/zarr.json").exists()
    assert_bits_equal(load_plain_tensors(ckpt)["decoder/layers/fc1"], FC1)


def load_only(rank: int, world: int, ckpt: str, verify_integrity: bool) -> None:
    shardstore_megatron.install(layout=PER_ARRAY)
    _training_loop_load(ckpt, _strategies(False)[1], verify_integrity)


def async_training_loop(rank: int, world: int, ckpt: str) -> None:
    """Megatron-LM's async save: the request goes to Megatron's own AsyncCallsQueue (a
    forked writer), finalize functions added by the training loop run after the commit.
    Megatron's queue puts a tensor on ``torch.cuda.current_device()``: on a CPU torch
    that is a stand-in, "cpu"."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    shardstore_megatron.install(layout=PER_ARRAY)
    request = _training_loop_save(ckpt, _strategies(True)[0], async_save=True)
    finalized = []
    request.add_finalize_fn(lambda: finalized.append(verify(ckpt).ok))  # iter_finalize_fn
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    assert finalized == [True], finalized
    _training_loop_load(ckpt, _strategies(True)[1])


def test_megatron_async_save_through_the_module_functions(tmp_path: Path) -> None:
    ckpt = tmp_path / "iter_0000100"
    run_distributed(async_training_loop, 2, str(ckpt), timeout=240)
    assert verify(ckpt).ok and not list(ckpt.glob(".shardstore-written-*"))


def modelopt_training_loop(rank: int, world: int, ckpt: str, async_save: bool) -> None:
    """Megatron-LM with ModelOpt: once ``dist_checkpointing.save`` returns (an async
    save still in flight, a synchronous one committed), ModelOpt's
    ``save_sharded_modelopt_state`` writes ``modelopt_run_config.yaml`` and saves
    ``modelopt_state/`` (itself a ``dist_checkpointing.save``) into the same iteration
    directory. Megatron-LM then loads with ``verify_integrity``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    shardstore_megatron.install(layout=PER_ARRAY)
    request = _training_loop_save(ckpt, _strategies(False)[0], async_save=async_save)
    if rank == 0:
        Path(ckpt, "modelopt_run_config.yaml").write_text("nvidia_modelopt_version: 0.0\n")
        Path(ckpt, "modelopt_state").mkdir()
    torch.distributed.barrier()
    modelopt_state = {"modelopt_version": "0.0", "extra": ShardedObject("extra", {"r": rank}, (world,), (rank,))}
    dist_checkpointing.save(modelopt_state, f"{ckpt}/modelopt_state")
    if async_save:
        queue = AsyncCallsQueue()
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    _training_loop_load(ckpt, _strategies(False)[1], verify_integrity=True)
    assert dist_checkpointing.load_common_state_dict(f"{ckpt}/modelopt_state")["modelopt_version"] == "0.0"


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_megatron_lm_with_modelopt_state_loads_with_verify_integrity(tmp_path: Path, async_save: bool) -> None:
    """Before, ``verify`` counted ModelOpt's files as damage (the record does not vouch
    for them) and every such checkpoint was refused by ``load(verify_integrity=True)``.
    Written while an async save runs, the record names them (``beside``); written after a
    synchronous save committed, ``verify`` lists them, and a load, which never reads
    them, is not refused for them."""
    ckpt = tmp_path / "iter_0000100"
    run_distributed(modelopt_training_loop, 2, str(ckpt), async_save, timeout=240)
    report = verify(ckpt)
    theirs = report.not_ours if async_save else report.unlisted
    assert {rel.split("/")[0] for rel in theirs} == {"modelopt_run_config.yaml", "modelopt_state"}
    assert report.ok == async_save, str(report)
    assert verify(ckpt / "modelopt_state").ok


def modelopt_training_loop_restarted(rank: int, world: int, ckpt: str, async_save: bool) -> str:
    """``modelopt_training_loop`` saves iteration 100 with ModelOpt's files in it; the job
    is then restarted from an older iteration (preempted before the tracker file named
    100, --ckpt-step, a rollback) and reaches 100 again: Megatron-LM saves into the same
    ``iter_0000100``, which Megatron's own save overwrites."""
    from megatron.core import dist_checkpointing

    try:
        modelopt_training_loop(rank, world, ckpt, async_save)
        theirs = {p: p.read_bytes() for p in sorted(Path(ckpt).rglob("*")) if p.is_file()
                  and p.relative_to(ckpt).parts[0] in ("modelopt_run_config.yaml", "modelopt_state")}
        torch.distributed.barrier()
        _training_loop_save(ckpt, _strategies(False)[0])
        _training_loop_load(ckpt, _strategies(False)[1], verify_integrity=True)
        assert {p: p.read_bytes() for p in theirs} == theirs, "ModelOpt's files changed"
        assert dist_checkpointing.load_common_state_dict(f"{ckpt}/modelopt_state")["modelopt_version"] == "0.0"
        return "saved"
    finally:
        shardstore_megatron.uninstall()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_megatron_lm_with_modelopt_can_save_an_iteration_again(tmp_path: Path, async_save: bool) -> None:
    """Before, the second save of iter_0000100 failed on every rank ("Refusing to replace
    the checkpoint ...: it also holds files its save did not write
    (modelopt_run_config.yaml, modelopt_state/...)"): a Megatron-LM job with ModelOpt
    died each time it reached that iteration again. Now only the checkpoint's own
    entries are replaced; ModelOpt's stay, byte for byte, named in the new record."""
    ckpt = tmp_path / "iter_0000100"
    assert run_distributed(modelopt_training_loop_restarted, 2, str(ckpt), async_save, timeout=240) == ["saved"] * 2
    assert set(read_commit_record(open_location(ckpt)).beside) == {"modelopt_run_config.yaml", "modelopt_state"}
    assert verify(ckpt).ok and [p.name for p in tmp_path.iterdir()] == ["iter_0000100"]


def test_megatrons_verify_integrity_still_refuses_a_damaged_chunk_beside_other_programs_files(tmp_path: Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    ckpt = tmp_path / "iter_0000001"
    shardstore_megatron.install(layout=PER_ARRAY)
    try:
        dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(64, 64))}, str(ckpt))
        (ckpt / "modelopt_run_config.yaml").write_text("a: 1")
        request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 64))}
        loaded = dist_checkpointing.load(request, str(ckpt), verify_integrity=True)
        assert torch.equal(loaded["w"], torch.ones(64, 64))
        chunk = next(p for p in (ckpt / "w").rglob("*") if p.is_file() and p.name != "zarr.json")
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0xFF
        chunk.write_bytes(bytes(data))
        request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 64))}
        with pytest.raises(CheckpointingException, match=r"(?s)checkpoint .*iter_0000001: .*1 problem\(s\):\n  w \[c") as raised:
            dist_checkpointing.load(request, str(ckpt), verify_integrity=True)
        assert "modelopt_run_config.yaml" not in str(raised.value)
    finally:
        shardstore_megatron.uninstall()


def persistent_worker_loop(rank: int, world: int, root: str) -> None:
    """Megatron-LM with ``--use-persistent-ckpt-worker``: one spawned worker per rank
    takes every async request, pickled. Before, shardstore's request could not be
    pickled: the worker dropped it and the queue waited forever."""
    import os

    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    stand_in = str(Path(__file__).parent / "fixtures" / "cuda_stand_in")
    os.environ["PYTHONPATH"] = os.pathsep.join([stand_in, os.environ.get("PYTHONPATH", "")])
    shardstore_megatron.install(layout=PER_ARRAY)
    queue = AsyncCallsQueue(persistent=True)
    try:
        for step in (100, 200):
            request = _training_loop_save(f"{root}/iter_{step:07d}", _strategies(False)[0], async_save=True)
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
            assert verify(f"{root}/iter_{step:07d}").ok
            _training_loop_load(f"{root}/iter_{step:07d}", _strategies(False)[1])
    finally:
        queue.close()


def test_shardstores_errors_are_megatrons_too(tmp_path: Path) -> None:
    """Megatron-LM code (and Megatron's own tests: test_load_error_msg,
    test_tensor_shape_mismatch) catch Megatron's CheckpointingException: through the
    installed functions shardstore's errors are both libraries' (before, neither
    ``except`` of Megatron's caught them)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException as MegatronsException
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    ckpt = str(tmp_path / "iter_0000001")
    shardstore_megatron.install(layout=PER_ARRAY)
    try:
        dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 4))}, ckpt)
        with pytest.raises(MegatronsException, match="global shape") as raised:
            dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 3))}, ckpt)
        assert isinstance(raised.value, CheckpointingException)  # shardstore's too
        with pytest.raises(MegatronsException, match="different_key"):
            dist_checkpointing.load_tensors_metadata(ckpt)["w"]  # a query works
            dist_checkpointing.load({"different_key": ShardedTensor.from_rank_offsets("different_key", torch.ones(1))},
                                    ckpt, strict="raise_all")
    finally:
        shardstore_megatron.uninstall()


def test_load_content_metadata_without_a_checkpoint_is_megatrons_value_error() -> None:
    """Through ``install()``, ``load_content_metadata()`` with neither a directory nor a
    loaded state dict raised a bare ``TypeError`` from opening the path None; Megatron's
    own function refuses it with a ``ValueError`` saying what to pass."""
    from megatron.core import dist_checkpointing

    shardstore_megatron.install(layout=PER_ARRAY)
    try:
        with pytest.raises(ValueError, match="cannot be None"):
            dist_checkpointing.load_content_metadata()
    finally:
        shardstore_megatron.uninstall()


def test_an_error_raised_through_megatrons_door_can_be_pickled(tmp_path: Path) -> None:
    """The class that is both libraries' exception was named
    ``shardstore.megatron.CheckpointingException``, where shardstore.errors' class is
    bound: ``pickle`` could not find it, so such an error could not cross a process
    boundary (a ``ProcessPoolExecutor``, a multiprocessing queue)."""
    import pickle

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    ckpt = str(tmp_path / "iter_0000001")
    shardstore_megatron.install(layout=PER_ARRAY)
    try:
        dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 4))}, ckpt)
        with pytest.raises(Exception, match="global shape") as raised:
            dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 3))}, ckpt)
    finally:
        shardstore_megatron.uninstall()
    again = pickle.loads(pickle.dumps(raised.value))
    assert type(again) is type(raised.value) is entry_points.MegatronCheckpointingException
    assert str(again) == str(raised.value)


def failing_async_save(rank: int, world: int, ckpt: str) -> None:
    from megatron.core.dist_checkpointing.core import CheckpointingException as MegatronsException
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    import shardstore.compat.megatron.strategies.forked_writes as forked_writes

    def disk_full(*args, **kwargs) -> None:
        raise OSError(28, "No space left on device")

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    shardstore_megatron.install(layout=PER_ARRAY)
    request = _training_loop_save(ckpt, _strategies(False)[0], async_save=True)
    forked_writes.write_staged = disk_full  # the forked writer inherits it
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(request)
        with pytest.raises(MegatronsException, match="background write of rank .* into .*iter_0000100 failed: OSError.*No space left") as raised:
            queue.maybe_finalize_async_calls(blocking=True)
        assert isinstance(raised.value, CheckpointingException)
    finally:
        queue.close()


def test_an_async_saves_background_failure_is_megatrons_exception_too(tmp_path: Path) -> None:
    """Raised by Megatron's queue at finalization: before, shardstore's class only, which
    Megatron-LM's ``except CheckpointingException`` did not catch."""
    ckpt = tmp_path / "iter_0000100"
    run_distributed(failing_async_save, 2, str(ckpt), timeout=240)
    assert not (ckpt / "zarr.json").exists()


def test_megatrons_persistent_checkpoint_worker_writes_and_reuses(tmp_path: Path) -> None:
    run_distributed(persistent_worker_loop, 2, str(tmp_path), timeout=240)
    reused = read_commit_record(open_location(tmp_path / "iter_0000200")).reused_from
    first = read_commit_record(open_location(tmp_path / "iter_0000100"))
    assert reused and reused.save_id == first.save_id and reused.chunks, reused  # written by the worker


def megatron_own_save(rank: int, world: int, ckpt: str) -> None:
    """Megatron's torch_dist save, before any install (its CUDA synchronisation is a
    no-op, its current device "cpu", on a CPU torch)."""
    from megatron.core import dist_checkpointing

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    if rank == 0:
        Path(ckpt).mkdir()
    torch.distributed.barrier()
    dist_checkpointing.save(megatron_state_dict(rank, world, empty=False), ckpt,
                            content_metadata=dict(CONTENT))


def test_megatrons_own_torch_dist_checkpoints_still_load(tmp_path: Path) -> None:
    """A torch_dist checkpoint from before the switch loads through the installed
    functions (Megatron's own code underneath), as does a new shardstore one beside it."""
    ckpt = tmp_path / "iter_0000050"
    run_distributed(megatron_own_save, 2, str(ckpt))
    assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    run_distributed(load_only, 2, str(ckpt), False)
    errors = run_distributed(refused_keyword, 1, str(ckpt))
    if _megatrons_load_takes("verify_integrity"):
        assert "Integrity manifest not found" in errors[0], errors
    else:
        assert "this version's takes no verify_integrity" in errors[0], errors


def megatron_defaults_on_both_formats(rank: int, world: int, ckpt: str, ours: str) -> None:
    """What Megatron's own code calls with its defaults: ``load`` without ``strict`` and
    ``load_plain_tensors`` of a torch_dist checkpoint (Megatron's own underneath: a
    ``strict=None`` passed down was refused by its ``load``), and the metadata queries
    of a shardstore checkpoint given Megatron's own load strategies (which name no
    backend: handed to shardstore, they met a location and raised a bare TypeError)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import common as megatrons_common
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    shardstore_megatron.install(layout=PER_ARRAY)
    try:
        loaded = dist_checkpointing.load(megatron_state_dict(rank, world, empty=True), ckpt)
        assert_bits_equal(loaded["model"]["layers"]["1.fc1"], FC1[1].chunk(world, 0)[rank])
        assert_bits_equal(dist_checkpointing.load_plain_tensors(ckpt)["decoder/layers/fc1"], FC1)
        dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}, ours)
        queries = [dist_checkpointing.load_tensors_metadata(ours, TorchDistLoadShardedStrategy())]
        if hasattr(megatrons_common, "TorchCommonLoadStrategy"):  # Megatron-Core 0.17 removed the common strategies
            queries.append(serialization.load_sharded_metadata(ours, None, megatrons_common.TorchCommonLoadStrategy()))
        for metadata in queries:
            assert metadata["w"].global_shape == (8,), metadata
    finally:
        shardstore_megatron.uninstall()


def test_megatrons_own_defaults_and_strategies_pass_through(tmp_path: Path) -> None:
    ckpt = tmp_path / "iter_0000050"
    run_distributed(megatron_own_save, 1, str(ckpt))
    run_distributed(megatron_defaults_on_both_formats, 1, str(ckpt), str(tmp_path / "iter_0000060"))


def test_a_fully_parallel_wrapper_around_the_plugin_keeps_the_plugins_strategy() -> None:
    """``--ckpt-fully-parallel-save`` wraps whatever save strategy it is given, the
    plug-in's too: its own ``ZarrSaveShardedStrategy`` (``shard_bytes``, ...) is found
    through both wrappers, not replaced by a default one. Load likewise. The plug-in is
    for Megatron-Core 0.16 and earlier (docs/guide/megatron.md)."""
    from megatron.core.dist_checkpointing.strategies import common

    if not hasattr(common, "TorchCommonSaveStrategy"):
        pytest.skip("the strategy plug-in is for Megatron-Core 0.16 and earlier")
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )

    from shardstore.tools.megatron_strategy import (
        ShardstoreLoadShardedStrategy,
        ShardstoreSaveShardedStrategy,
    )

    shardstore_megatron.install(shard_bytes=4096)
    try:
        plugin = ShardstoreSaveShardedStrategy(shard_bytes=None)
        wrapped = FullyParallelSaveStrategyWrapper(plugin, None, True)
        assert shardstore_megatron.strategy_for_save(wrapped) is plugin.base_strategy
        assert plugin.base_strategy.shard_bytes is None
        loader = ShardstoreLoadShardedStrategy()
        assert entry_points._strategy_for_load(FullyParallelLoadStrategyWrapper(loader, None)) is (
            loader.base_strategy
        )
    finally:
        shardstore_megatron.uninstall()


def refused_keyword(rank: int, world: int, ckpt: str) -> str:
    """``verify_integrity``, asked of a checkpoint only Megatron's own code reads: refused
    by name where the installed Megatron-Core's ``load`` lacks it (before 0.17), handed to
    Megatron's own ``load`` where it has it (which then asks for its integrity manifest)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import (
        CheckpointingException as MegatronCheckpointingException,
    )

    shardstore_megatron.install(layout=PER_ARRAY)
    try:
        dist_checkpointing.load(megatron_state_dict(rank, world, empty=True), ckpt, verify_integrity=True)
    except (TypeError, MegatronCheckpointingException) as exc:
        return str(exc)
    finally:
        shardstore_megatron.uninstall()
    return "loaded"


def incremental(rank: int, world: int, root: str) -> None:
    shardstore_megatron.install(layout=PER_ARRAY)
    for step in (100, 200):
        _training_loop_save(f"{root}/iter_{step:07d}", _strategies(False)[0])


def test_a_training_loop_save_reuses_the_previous_iteration(tmp_path: Path) -> None:
    """Issue 32.3 through Megatron's door: iter_0000200 shares every unchanged chunk with
    iter_0000100 (hard links) and stands alone once iter_0000100 is deleted."""
    import shutil

    run_distributed(incremental, 2, str(tmp_path))
    first, second = tmp_path / "iter_0000100", tmp_path / "iter_0000200"
    reused = read_commit_record(open_location(second)).reused_from
    assert reused and reused.save_id == read_commit_record(open_location(first)).save_id and reused.chunks, reused
    chunk = next(p for p in (second / "decoder/layers/fc1").rglob("*") if p.is_file() and p.name != "zarr.json")
    assert chunk.stat().st_nlink == 2, chunk
    shutil.rmtree(first)
    assert verify(second).ok
    assert_bits_equal(load_plain_tensors(second)["decoder/layers/fc1"], FC1)


def incremental_after_rot(rank: int, world: int, root: str) -> None:
    """iter_100 saved, one byte of one of its chunks flipped in place (bit rot: the inode
    stays), then iter_200 and iter_300 saved with install()'s default reuse."""
    shardstore_megatron.install(layout=PER_ARRAY)
    _training_loop_save(f"{root}/iter_{100:07d}", _strategies(False)[0])
    if rank == 0:
        fc1 = Path(root) / "iter_0000100" / "decoder/layers/fc1"
        chunk = next(p for p in sorted(fc1.rglob("*")) if p.is_file() and p.name != "zarr.json")
        with open(chunk, "r+b") as f:
            f.seek(3)
            byte = f.read(1)
            f.seek(3)
            f.write(bytes([byte[0] ^ 0x10]))
    torch.distributed.barrier()
    for step in (200, 300):
        _training_loop_save(f"{root}/iter_{step:07d}", _strategies(False)[0])


def test_a_rotted_iteration_costs_only_itself_under_the_default_reuse(tmp_path: Path) -> None:
    """Issue 41.1 through Megatron's door: after iter_100 rotted, iter_200 and iter_300
    are exact (the rotted chunk is written, not linked) and verify names iter_100 alone."""
    from shardstore.tools.root_verify import verify_root

    run_distributed(incremental_after_rot, 2, str(tmp_path))
    for step in (200, 300):
        ckpt = tmp_path / f"iter_{step:07d}"
        assert verify(ckpt).ok, step
        assert_bits_equal(load_plain_tensors(ckpt)["decoder/layers/fc1"], FC1)
    damage = verify_root(tmp_path).damage
    assert [d.checkpoints for d in damage] == [("iter_0000100",)], damage


def test_previous_checkpoint_is_the_newest_older_committed_iteration(tmp_path: Path) -> None:
    from shardstore import ShardedTensor, save

    for name in ("iter_0000030", "iter_0000040", "iter_0000050", "other"):
        (tmp_path / name).mkdir()
    (tmp_path / "iter_0000030" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')  # not ours
    assert shardstore_megatron.previous_checkpoint(tmp_path / "iter_0000040") is None
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, tmp_path / "iter_0000010")
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, tmp_path / "iter_0000060")
    assert shardstore_megatron.previous_checkpoint(tmp_path / "iter_0000040") == tmp_path / "iter_0000010"
    assert shardstore_megatron.previous_checkpoint(tmp_path / "latest") is None
    assert shardstore_megatron.previous_checkpoint("s3://bucket/iter_0000040") is None


def test_previous_checkpoint_skips_a_newer_iteration_whose_record_is_damaged(tmp_path: Path) -> None:
    """The reuse base is the newest older iteration whose commit record reads and checks.
    Before, a newer sibling whose ``zarr.json`` was damaged (it exists, so it looked
    committed) was chosen over the good one before it; the save then could not read
    that base and wrote every chunk again (full write instead of an incremental one)."""
    from shardstore import ShardedTensor, save

    for name in ("iter_0000010", "iter_0000020"):  # per array: packed arrays are never reused
        save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(64))}, tmp_path / name, layout=PER_ARRAY)
    (tmp_path / "iter_0000020" / "zarr.json").write_text("{not json")
    base = shardstore_megatron.previous_checkpoint(tmp_path / "iter_0000030")
    assert base == tmp_path / "iter_0000010"
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(64))}, tmp_path / "iter_0000030", reuse_from=base,
         layout=PER_ARRAY)
    reused = read_commit_record(open_location(tmp_path / "iter_0000030")).reused_from
    assert reused is not None and reused.chunks == 1


def damaged_load(rank: int, world: int, ckpt: str) -> str:
    from megatron.core import dist_checkpointing

    shardstore_megatron.install(layout=PER_ARRAY)
    try:
        dist_checkpointing.load(megatron_state_dict(rank, world, empty=True), ckpt, None, verify_integrity=True)
    except CheckpointingException as exc:
        return str(exc)
    return "loaded"


def test_verify_integrity_on_load_checks_every_chunk_on_every_rank(tmp_path: Path) -> None:
    ckpt = tmp_path / "iter_0000100"
    run_distributed(training_loop, 2, str(ckpt), False)
    chunk = next(p for p in (ckpt / "decoder/final_norm").rglob("*") if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))
    errors = run_distributed(damaged_load, 2, str(ckpt))
    assert all("Verifying checkpoint" in e and "decoder/final_norm" in e for e in errors), errors


def test_install_is_idempotent_and_uninstall_restores_megatrons_functions() -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import core, serialization

    modules = (dist_checkpointing, serialization, core)
    before = {(m, name): getattr(m, name) for m in modules for name in shardstore_megatron.ENTRY_POINTS
              if hasattr(m, name)}
    assert {name for _, name in before} == set(shardstore_megatron.ENTRY_POINTS)
    shardstore_megatron.install(layout=PER_ARRAY)
    try:
        shardstore_megatron.install(layout=PER_ARRAY)  # twice: the originals stay the originals
        assert shardstore_megatron.is_installed()
        assert dist_checkpointing.save is shardstore_megatron.save is serialization.save
        assert core.check_is_distributed_checkpoint is shardstore_megatron.check_is_distributed_checkpoint
        assert all(getattr(m, name) is not original for (m, name), original in before.items())
        assert serialization.load_sharded_metadata.__name__ == "load_sharded_metadata"
    finally:
        shardstore_megatron.uninstall()
    shardstore_megatron.uninstall()
    assert not shardstore_megatron.is_installed()
    assert {(m, name): getattr(m, name) for m, name in before} == before


def test_an_empty_directory_is_not_a_distributed_checkpoint(tmp_path: Path) -> None:
    """Megatron's message, as before (Megatron's test_load_error_msg)."""
    from megatron.core import dist_checkpointing

    shardstore_megatron.install(layout=PER_ARRAY)
    try:
        assert not dist_checkpointing.check_is_distributed_checkpoint(tmp_path)
        with pytest.raises(Exception, match="is not a distributed checkpoint"):
            dist_checkpointing.load_common_state_dict(str(tmp_path))
    finally:
        shardstore_megatron.uninstall()


def test_a_directory_holding_another_tools_files_is_not_overwritten(tmp_path: Path) -> None:
    """Megatron's save overwrites whatever is there; through install() an interrupted
    torch_dist save's files are not ours to delete: the save fails, naming them."""
    from megatron.core import dist_checkpointing

    from shardstore import ShardedTensor

    ckpt = tmp_path / "iter_0000100"
    ckpt.mkdir()
    (ckpt / "__0_0.distcp").write_bytes(b"torch_dist leftovers")
    shardstore_megatron.install(layout=PER_ARRAY)
    try:
        with pytest.raises(CheckpointingException, match="__0_0.distcp"):
            dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, str(ckpt))
    finally:
        shardstore_megatron.uninstall()
    assert (ckpt / "__0_0.distcp").read_bytes() == b"torch_dist leftovers"


def test_through_megatron_save_and_load_log_at_debug_as_megatrons_own_strategies(tmp_path: Path, caplog) -> None:
    """Megatron-LM prints its own line per checkpoint, and Megatron's tests
    (test_exact_load_handling) assert that a load logs nothing at INFO; shardstore's own
    API keeps its INFO line."""
    import logging

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from shardstore import load, save

    ckpt = str(tmp_path / "iter_0000001")
    shardstore_megatron.install(layout=PER_ARRAY)
    try:
        with caplog.at_level(logging.DEBUG, logger="shardstore"):
            dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 4))}, ckpt)
            dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(2, 4))}, ckpt)
    finally:
        shardstore_megatron.uninstall()
    lines = [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records if r.name == "shardstore"]
    assert (logging.DEBUG, f"save {ckpt}") in lines and (logging.DEBUG, f"load {ckpt}") in lines
    assert not [r for r in caplog.records if r.levelno >= logging.INFO and r.name == "shardstore"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardstore"):
        save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 4))}, tmp_path / "direct")
        load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(2, 4))}, tmp_path / "direct")
    assert [r.getMessage().split(":")[0] for r in caplog.records if r.name == "shardstore"] == [
        f"save {tmp_path / 'direct'}", f"load {tmp_path / 'direct'}"
    ]


def consolidated_only_save(rank: int, world: int, ckpt: str) -> None:
    shardstore_megatron.install(zarr_metadata="consolidated_only")
    try:
        _training_loop_save(ckpt, _strategies(False)[0])
    finally:
        shardstore_megatron.uninstall()


def test_install_passes_consolidated_only_metadata_on(tmp_path: Path) -> None:
    ckpt = tmp_path / "iter_0000100"
    run_distributed(consolidated_only_save, 2, str(ckpt))
    assert sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("zarr.json")) == ["zarr.json"]
    assert read_commit_record(open_location(ckpt)).requires == ("consolidated_only", "packs")  # small arrays packed by default
    assert verify(ckpt).ok
    assert_bits_equal(load_plain_tensors(ckpt)["decoder/layers/fc1"], FC1)
    with pytest.raises(ValueError, match="zarr_metadata must be one of"):
        shardstore_megatron.install(zarr_metadata="elsewhere")


def test_a_strategy_named_by_a_tuple_reaches_shardstores_queries(tmp_path: Path) -> None:
    """Megatron-Core's queries take a load strategy as a ``(backend, version)`` tuple too;
    through install() ``("torch_dist", 1)`` means shardstore's strategy for a shardstore
    checkpoint, as ``load`` treats it. Before, the tuple reached shardstore's query as
    it was: a bare AttributeError, then (tuples resolved) the torch_dist reader
    refusing the 'shardstore' backend."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization

    from shardstore import ShardedTensor

    ckpt = tmp_path / "iter_0000100"
    shardstore_megatron.install(layout=PER_ARRAY)
    try:
        dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, str(ckpt))
        assert dist_checkpointing.load_tensors_metadata(str(ckpt), ("torch_dist", 1))["w"].global_shape == (4,)
        assert "w" in serialization.load_sharded_metadata(str(ckpt), ("torch_dist", 1), ("torch", 1))
    finally:
        shardstore_megatron.uninstall()


def test_megatron_lms_default_load_strategy_of_a_shardstore_checkpoint(tmp_path: Path) -> None:
    """Megatron-LM's _load_global_dist_base_checkpoint (and NeMo's, Megatron-Bridge's) asks
    Megatron-Core for the checkpoint's default load strategy before it loads:
    ``get_default_load_sharded_strategy(checkpoint_name)``, imported by name from
    ``serialization`` (so install() cannot replace it), wrapped for
    ``--ckpt-fully-parallel-load``, then passed to ``dist_checkpointing.load``. Before,
    Megatron's registry knew no strategy for the 'shardstore' backend, so resuming from
    a shardstore checkpoint failed there: "Cannot find a default strategy for:
    ('load_sharded', 'shardstore', 1)". uninstall() takes the registration back.
    Megatron-Core 0.17 and later have no registry: their function returns a torch_dist
    strategy whatever the checkpoint, which the installed load takes as its own."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
    )

    try:
        from megatron.core.dist_checkpointing.strategies.base import default_strategies
    except ImportError:  # 0.17 and later
        default_strategies = None

    ckpt = str(tmp_path / "iter_0000100")
    shardstore_megatron.install(layout=PER_ARRAY)
    try:
        dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}, ckpt)
        load_strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(ckpt))
        loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8))}, ckpt,
                                         load_strategy, strict="assume_ok_unexpected")
        assert torch.equal(loaded["w"], torch.arange(8.0))
    finally:
        shardstore_megatron.uninstall()
    assert default_strategies is None or ("shardstore", 1) not in default_strategies["load_sharded"]
