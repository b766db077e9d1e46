"""The storage layouts tested together (issue 65.5): an all-pairs set of cases over
layouts, sync and async saves, local, memory and S3 stores, the doors a save comes by
(``shardstore.save``, the checkpoint manager, DCP's ``dcp.save`` with
``ShardstoreWriter``, Megatron-Core's ``dist_checkpointing.save`` after
``shardstore.megatron.install``) and reuse from the previous step.

Every case saves at 2 ranks (the memory store, private to its process, at 1), then
loads at 3 ranks and at 1, bit-exact, passes ``verify``, and is read whole by plain
zarr-python and TensorStore in a process without shardstore (``scripts/plain_read.py``,
following the root's recipe). The cases run in three process groups (save at 2, load at
3, load at 1), each case in a checkpoint of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import shardstore
from shardstore import ShardedTensor, StorageLayout
from shardstore.stores.locations import open_location
from tests.dist import run_distributed
from tests.s3_support import s3_options
from tests.test_plain_readers_recipe import plain_read

LAYOUTS = {
    "default": None,
    "per_array": StorageLayout(pack_arrays_up_to=0, zarr_metadata="per_node"),
    "sharded": StorageLayout(shard_bytes=256 * 1024),
    "all": StorageLayout(shard_bytes=256 * 1024, pack_arrays_up_to=64 * 1024, zarr_metadata="consolidated_only"),
    "consolidated": StorageLayout(pack_arrays_up_to=0, zarr_metadata="consolidated_only"),
}
# (name, split axis or None for replicated, shape, dtype): shapes divide by 2 and 3 ranks
ARRAYS = (
    ("big", 0, (768, 256), torch.float32),
    ("small", 0, (48, 16), torch.float32),
    ("norm", None, (96,), torch.float32),
    ("bf16", 0, (96, 64), torch.bfloat16),
    ("tp", 1, (48, 96), torch.float32),
)


@dataclass(frozen=True)
class Case:
    layout: str
    mode: str  # "sync" or "async"
    store: str  # "local", "s3" or "memory"
    door: str  # "save", "manager", "dcp" or "megatron"
    reuse: bool  # a second step, reusing from the first

    @property
    def name(self) -> str:
        return f"{self.layout}-{self.mode}-{self.store}-{self.door}-{'reuse' if self.reuse else 'fresh'}"

    @property
    def save_world(self) -> int:
        return 1 if self.store == "memory" else 2


# All pairs of the five factors, by hand (memory: shardstore.save only; Megatron: local).
CASES = tuple(Case(*c) for c in (
    ("default", "sync", "local", "save", False), ("default", "async", "s3", "manager", True),
    ("default", "sync", "local", "dcp", True), ("default", "async", "local", "megatron", False),
    ("default", "sync", "memory", "save", True), ("default", "sync", "s3", "save", False),
    ("per_array", "async", "local", "save", True), ("per_array", "sync", "s3", "dcp", False),
    ("per_array", "sync", "local", "manager", False), ("per_array", "async", "local", "megatron", True),
    ("per_array", "sync", "memory", "save", False),
    ("sharded", "sync", "local", "save", True), ("sharded", "async", "local", "dcp", False),
    ("sharded", "sync", "s3", "save", False), ("sharded", "async", "local", "manager", True),
    ("sharded", "sync", "local", "megatron", True),
    ("all", "async", "local", "save", False), ("all", "sync", "s3", "manager", False),
    ("all", "async", "s3", "dcp", True), ("all", "sync", "local", "megatron", False),
    ("all", "async", "memory", "save", True),
    ("consolidated", "sync", "local", "save", False), ("consolidated", "async", "s3", "save", True),
    ("consolidated", "sync", "local", "dcp", True), ("consolidated", "async", "local", "manager", False),
    ("consolidated", "sync", "local", "megatron", True),
))


def global_value(key: str, step: int) -> torch.Tensor:
    """The global tensor ``key`` holds after ``step`` (step 2 changes half of ``big``)."""
    _, _, shape, dtype = next(a for a in ARRAYS if a[0] == key)
    gen = torch.Generator().manual_seed(sum(map(ord, key)))
    value = torch.randn(shape, generator=gen).to(dtype)
    if key == "big" and step == 2:
        value[: shape[0] // 2] += 1
    return value


def _local(key: str, rank: int, world: int, step: int | None) -> torch.Tensor:
    axis = next(a[1] for a in ARRAYS if a[0] == key)
    value = global_value(key, step or 1)
    part = value if axis is None else value.chunk(world, axis)[rank]
    return torch.empty_like(part) if step is None else part.clone()


def sharded_state(rank: int, world: int, step: int | None, cls: Any = ShardedTensor) -> dict[str, Any]:
    """The state as ShardedTensors of ``cls`` (shardstore's or Megatron-Core's); ``step``
    None: empty targets to load into."""
    state = {}
    for key, axis, _, _ in ARRAYS:
        local = _local(key, rank, world, step)
        if axis is None:
            state[key] = cls.from_rank_offsets(key, local, replica_id=rank)
        else:
            state[key] = cls.from_rank_offsets(key, local, (axis, rank, world))
    return state


def dtensor_state(world: int, step: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {key: distribute_tensor(global_value(key, step), mesh, [Replicate() if axis is None else Shard(axis)])
            for key, axis, _, _ in ARRAYS}


def target(case: Case, root: str, endpoint: str, step: int) -> Any:
    """Where ``case`` saves ``step``: a path, or an opened S3 / memory location."""
    if case.store == "s3":
        return open_location(f"s3://matrix/{case.name}/step{step}", options=s3_options(endpoint))
    if case.store == "memory":
        return f"memory://matrix/{case.name}/step{step}"
    return os.path.join(root, case.name, f"step{step}")


def manager_root(case: Case, root: str, endpoint: str) -> Any:
    if case.store == "s3":
        return open_location(f"s3://matrix/{case.name}/manager", options=s3_options(endpoint))
    return os.path.join(root, case.name, "manager")


def _finish(request: Any) -> None:
    from shardstore.strategies.async_utils import AsyncCallsQueue

    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()


def save_case(case: Case, rank: int, world: int, root: str, endpoint: str) -> Any:
    """Saves ``case``'s steps through its door; returns where the last step is."""
    layout = LAYOUTS[case.layout]
    steps = (1, 2) if case.reuse else (1,)
    asynchronous = case.mode == "async"
    if case.door == "manager":
        from shardstore import CheckpointManager, CheckpointManagerOptions

        manager = CheckpointManager(manager_root(case, root, endpoint),
                                    CheckpointManagerOptions(async_save=asynchronous, reuse_unchanged=case.reuse))
        for step in steps:
            manager.save(step, sharded_state(rank, world, step), force=True, layout=layout)
        manager.wait_until_finished()
        where = manager.location(steps[-1])
        manager.close()
        return where
    for step in steps:
        where = target(case, root, endpoint, step)
        previous = target(case, root, endpoint, step - 1) if step > 1 else None
        if case.door == "save":
            request = shardstore.save(sharded_state(rank, world, step), where, reuse_from=previous, layout=layout,
                                      async_sharded_save=asynchronous)
            if request is not None:
                _finish(request)
        elif case.door == "dcp":
            import torch.distributed.checkpoint as dcp

            from shardstore import ShardstoreWriter

            writer = ShardstoreWriter(where, reuse_from=previous, layout=layout)
            if asynchronous:
                dcp.async_save(dtensor_state(world, step), storage_writer=writer).result()
            else:
                dcp.save(dtensor_state(world, step), storage_writer=writer)
        else:
            where = _megatron_save(case, rank, world, where, step, asynchronous)
    return where


def _megatron_save(case: Case, rank: int, world: int, where: str, step: int, asynchronous: bool) -> str:
    from megatron.core import dist_checkpointing

    if rank == 0:
        Path(where).mkdir(parents=True, exist_ok=True)  # as Megatron-LM's training loop
    torch.distributed.barrier()
    state = sharded_state(rank, world, step, cls=dist_checkpointing.ShardedTensor)
    request = dist_checkpointing.save(state, where, async_sharded_save=asynchronous)
    if request is not None:  # Megatron's own queue; on a CPU torch its device is a stand-in
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *a, **k: None
        queue = AsyncCallsQueue()
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    return where


def save_all(rank: int, world: int, root: str, endpoint: str, cases: tuple[Case, ...]) -> dict[str, str]:
    import shardstore.megatron as shardstore_megatron

    wheres = {}
    for case in cases:
        if case.door == "megatron":
            shardstore_megatron.install(layout=LAYOUTS[case.layout], reuse_previous=case.reuse)
        try:
            where = save_case(case, rank, world, root, endpoint)
        finally:
            if case.door == "megatron":
                shardstore_megatron.uninstall()
        wheres[case.name] = where.describe() if hasattr(where, "describe") else str(where)
    return wheres


def _opened(case: Case, where: str, endpoint: str) -> Any:
    return open_location(where, options=s3_options(endpoint)) if case.store == "s3" else where


def load_all(rank: int, world: int, endpoint: str, cases: tuple[Case, ...], wheres: dict[str, str]) -> list[str]:
    """Loads every case at this world size, bit-exact, and verifies it (rank 0)."""
    checked = []
    for case in cases:
        where = _opened(case, wheres[case.name], endpoint)
        step = 2 if case.reuse else 1
        loaded = shardstore.load(sharded_state(rank, world, None), where)
        for key, _, _, _ in ARRAYS:
            expected = _local(key, rank, world, step)
            assert torch.equal(loaded[key].view(torch.uint8) if expected.dtype == torch.bfloat16 else loaded[key],
                               expected.view(torch.uint8) if expected.dtype == torch.bfloat16 else expected), (
                f"{case.name}: {key} at {world} ranks")
        if rank == 0:
            report = shardstore.verify(where)
            assert report.ok, f"{case.name}: {report}"
        checked.append(case.name)
    return checked


@pytest.fixture(scope="module")
def bucket(moto_server: Any) -> str:
    moto_server.create_bucket("matrix")
    return moto_server.endpoint


def test_every_case_loads_bit_exact_at_3_and_1_ranks_verifies_and_reads_plainly(tmp_path: Path, bucket: str) -> None:
    shared = tuple(c for c in CASES if c.save_world == 2)
    alone = tuple(c for c in CASES if c.save_world == 1)
    wheres = run_distributed(save_all, 2, str(tmp_path), bucket, shared, timeout=280)[0]
    assert run_distributed(load_all, 3, bucket, shared, wheres, timeout=200)[0] == [c.name for c in shared]
    assert run_distributed(_save_and_load_alone, 1, str(tmp_path), bucket, shared, alone, wheres,
                           timeout=200)[0] == [c.name for c in (*shared, *alone)]
    plainly = plain_read([wheres[c.name] for c in shared], bucket, tmp_path)
    for case in shared:
        read = plainly[wheres[case.name]]
        assert sorted(read) == sorted(a[0] for a in ARRAYS), (case.name, sorted(read))
        step = 2 if case.reuse else 1
        for key, _, _, _ in ARRAYS:
            expected = global_value(key, step)
            assert read[key]["shape"] == list(expected.shape), (case.name, key)
            assert read[key]["sha256"] == _digest(expected), (case.name, key)


def _digest(tensor: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _save_and_load_alone(rank: int, world: int, root: str, endpoint: str, shared: tuple[Case, ...],
                         alone: tuple[Case, ...], wheres: dict[str, str]) -> list[str]:
    """At 1 rank: the 2-rank cases loaded, then the memory store's cases saved and loaded
    (a memory store lives in its process)."""
    checked = load_all(rank, world, endpoint, shared, wheres)
    mine = save_all(rank, world, root, endpoint, alone)
    return checked + load_all(rank, world, endpoint, alone, mine)
