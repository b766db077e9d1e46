"""Issue 15: the GPU path. CUDA tensors on NCCL (world 1: NCCL refuses two ranks on one
GPU) and on gloo groups of 2 ranks sharing a GPU: sync save and load into CUDA targets
bit-exact (bf16, fp32, fp8), async saves whose finalize runs its collective on the
group's device with the tensors overwritten right after ``save`` returned (on the
default stream and on a side stream), flattened ranges and fully-parallel loads, and
Zarr-sharded saves (blocks gathered to a shard's writer through ``Group.exchange``, a
block of 1 MiB as a message of its own) followed by an async incremental one, and a
load reading each chunk once whose blocks cross the chunks' edges.

Every scenario runs twice: on CUDA (marked ``gpu``, skipped where CUDA is absent, as in
CI; ``pytest -m gpu`` on a GPU machine) and on CPU with gloo, which checks the
scenario itself on every machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardstore import SaveOptions, ShardedTensor, StorageLayout, load, save
from shardstore.strategies.async_utils import AsyncCallsQueue
from shardstore.strategies.zarr import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy
from tests.dist import run_distributed

_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
_gpu = [pytest.mark.gpu, _cuda]
PLACES = [  # (world, device, backend): NCCL at world 1 only, two ranks share one GPU through gloo
    pytest.param(1, "cuda", "nccl", marks=_gpu, id="1-cuda-nccl"),
    pytest.param(2, "cuda", "gloo", marks=_gpu, id="2-cuda-gloo"),
    pytest.param(1, "cpu", "gloo", id="1-cpu-gloo"),
    pytest.param(2, "cpu", "gloo", id="2-cpu-gloo"),
]
DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)

# linked shard files and named chunk files: the arrays' own directories, never packed
PER_ARRAY = StorageLayout(pack_arrays_up_to=0)


def _full(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Deterministic global values of ``key`` (on the CPU)."""
    generator = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(shape, generator=generator).to(dtype)


def _state(rank: int, world: int, device: str, empty: bool) -> dict:
    """Each dtype's (16, 8) tensor split along axis 0 over the ranks, plus a flattened
    range (distributed optimizer) of a (6, 4) tensor cut at element 10."""
    state = {}
    for dtype in DTYPES:
        key = f"w_{str(dtype).split('.')[-1]}"
        part = _full(key, (16, 8), dtype).chunk(world)[rank].to(device)
        state[key] = ShardedTensor.from_rank_offsets(key, torch.empty_like(part) if empty else part, (0, rank, world))
    cuts = [0, 10, 24] if world == 2 else [0, 24]
    flat = _full("flat", (6, 4), torch.float32).flatten()[cuts[rank]:cuts[rank + 1]].to(device)
    state["flat"] = ShardedTensor.from_rank_offsets_flat(
        "flat", torch.empty_like(flat) if empty else flat, (6, 4), flattened_range=slice(cuts[rank], cuts[rank + 1]))
    return state


def _check(loaded: dict, rank: int, world: int, device: str) -> None:
    expected = _state(rank, world, "cpu", empty=False)
    for key, want in expected.items():
        got = loaded[key]
        assert got.device.type == device, (key, got.device)
        assert got.dtype == want.data.dtype and torch.equal(
            got.cpu().view(torch.uint8), want.data.view(torch.uint8)), key


def _as_model_has_it(t: torch.Tensor) -> torch.Tensor:
    """float32 as a model's parameter (requires grad: autograd refuses in-place writes
    into it unless detached), other dtypes as plain tensors (buffers)."""
    return torch.nn.Parameter(t) if t.dtype == torch.float32 else t


def save_and_load(rank: int, world: int, ckpt: str, device: str) -> None:
    save(_state(rank, world, device, empty=False), ckpt)
    load_world = world  # the same ranks, another layout: the whole tensors on every rank
    for staging_bytes in (None, 1024):  # default; 1 KiB: a wave per tensor, both pinned slabs reused
        request = {key: ShardedTensor.from_rank_offsets(key, _as_model_has_it(torch.empty(16, 8, dtype=t.dtype,
                                                                                          device=device)),
                                                        replica_id=rank)
                   for key, t in _state(rank, world, device, empty=True).items() if key != "flat"}
        strategy = ZarrLoadShardedStrategy(**({} if staging_bytes is None else {"load_staging_bytes": staging_bytes}))
        loaded = load(request, ckpt, strategy)
        for dtype in DTYPES:
            key = f"w_{str(dtype).split('.')[-1]}"
            assert loaded[key] is request[key].data, f"{key}: not filled in place"
            assert loaded[key].device.type == device
            assert torch.equal(loaded[key].cpu().view(torch.uint8), _full(key, (16, 8), dtype).view(torch.uint8)), key
    _check(load(_state(rank, load_world, device, empty=True), ckpt), rank, load_world, device)


def async_save_then_overwrite(rank: int, world: int, ckpt: str, device: str) -> None:
    """The caller changes its tensors right after ``save`` returns, on the default stream
    and on a side stream; the checkpoint holds the values at the call."""
    state = _state(rank, world, device, empty=False)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(save(state, ckpt, async_sharded_save=True))
    side = torch.cuda.Stream() if device == "cuda" else None
    for i, t in enumerate(state.values()):
        if side is not None and i % 2:
            with torch.cuda.stream(side):
                t.data.zero_()
        else:
            t.data.zero_()
    queue.close()  # waits, then finalizes: a collective on the group's device
    _check(load(_state(rank, world, device, empty=True), ckpt), rank, world, device)


def _big(rank: int, world: int, device: str, step: int) -> ShardedTensor:
    """A (512, 1024) float32 array split over the ranks: 1 MiB blocks at 2 ranks, sent
    to the shard's writer as messages of their own (``OWN_MESSAGE_BYTES``)."""
    part = (_full("big", (512, 1024), torch.float32) + step).chunk(world)[rank].to(device)
    return ShardedTensor.from_rank_offsets("big", part, (0, rank, world))


def sharded_then_incremental(rank: int, world: int, ckpt: str, device: str) -> None:
    """A sync save with every array in Zarr shards (the ranks' blocks gathered to each
    shard's writer), then an async save reusing it in which only ``big`` changed, with
    the tensors overwritten right after ``save`` returned. Both load bit-exact."""
    first, second = f"{ckpt}/first", f"{ckpt}/second"
    state = {**_state(rank, world, device, empty=False), "big": _big(rank, world, device, step=0)}
    save(state, first, ZarrSaveShardedStrategy(shard_bytes=8 * 2**20, layout=PER_ARRAY))
    state = {**_state(rank, world, device, empty=False), "big": _big(rank, world, device, step=1)}
    queue = AsyncCallsQueue()
    queue.schedule_async_request(save(state, second, ZarrSaveShardedStrategy(shard_bytes=8 * 2**20, layout=PER_ARRAY),
                                      async_sharded_save=True, reuse_from=first))
    for t in state.values():
        t.data.zero_()
    queue.close()
    if rank == 0:  # the unchanged arrays' shards are the first checkpoint's files, linked
        linked = {p.relative_to(second).parts[0] for p in Path(second).rglob("*")
                  if p.is_file() and p.stat().st_nlink == 2}
        assert linked == {k for k in state if k != "big"}, linked
    for where, step in ((first, 0), (second, 1)):
        request = {**_state(rank, world, device, empty=True), "big": _big(rank, world, device, step=0)}
        request["big"].data.zero_()
        loaded = load(request, where)
        _check({k: v for k, v in loaded.items() if k != "big"}, rank, world, device)
        want = _big(rank, world, "cpu", step=step).data
        assert loaded["big"].device.type == device and torch.equal(loaded["big"].cpu(), want), (where, "big")


def read_once_across_chunk_edges(rank: int, world: int, ckpt: str, device: str) -> None:
    """A whole tensor saved in chunks of 16 rows (every rank a replica), loaded with
    ``read_shards_once`` in blocks of ``48 / world`` rows, which cross the chunks' edges:
    split there, each piece read by its chunk's reader and landing in its rows of the
    request's tensor on the device (a reader's own piece of a chunk it also reads for
    others comes with that read, through host memory)."""
    full = _full("w", (48, 8), torch.float32)
    save({"w": ShardedTensor.from_rank_offsets("w", full.to(device), replica_id=rank)}, ckpt,
         ZarrSaveShardedStrategy(max_chunk_bytes=16 * 8 * 4, layout=PER_ARRAY))
    if rank == 0:
        assert sorted(p.name for p in Path(ckpt, "w").iterdir() if p.name != "zarr.json") == ["c.0.0", "c.1.0", "c.2.0"]
    target = torch.zeros(48 // world, 8, device=device)
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", target, (0, rank, world))}, ckpt,
                  ZarrLoadShardedStrategy(read_shards_once=True))
    assert loaded["w"] is target and torch.equal(target.cpu(), full.chunk(world)[rank])


def packed_sync_and_async(rank: int, world: int, ckpt: str, device: str) -> None:
    """Every array packed into its writer's zip (``pack_arrays_up_to``), sync and then
    async with the tensors overwritten right after ``save`` returned; both load
    bit-exact on the device, and the second one from another layout (whole tensors)."""
    options = SaveOptions(pack_arrays_up_to=1 << 20)
    first, second = f"{ckpt}/sync", f"{ckpt}/async"
    save(_state(rank, world, device, empty=False), first, options=options)
    state = _state(rank, world, device, empty=False)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(save(state, second, async_sharded_save=True, options=options))
    for t in state.values():
        t.data.zero_()
    queue.close()
    if rank == 0:
        assert sorted(p.name for p in Path(second, "packs").iterdir()), "nothing packed"
    _check(load(_state(rank, world, device, empty=True), first), rank, world, device)
    request = {key: ShardedTensor.from_rank_offsets(key, torch.zeros(16, 8, dtype=t.dtype, device=device),
                                                    replica_id=rank)
               for key, t in _state(rank, world, device, empty=True).items() if key != "flat"}
    loaded = load(request, second)
    for key, got in loaded.items():
        want = _full(key, (16, 8), got.dtype)
        assert got.device.type == device and torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), key


@pytest.mark.parametrize("world, device, backend", PLACES)
@pytest.mark.parametrize("scenario", [save_and_load, async_save_then_overwrite, sharded_then_incremental,
                                      read_once_across_chunk_edges, packed_sync_and_async], ids=lambda f: f.__name__)
def test_cuda_tensors(ckpt_dir: Path, scenario, world: int, device: str, backend: str) -> None:
    run_distributed(scenario, world, str(ckpt_dir), device, backend=backend)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=_gpu), "cpu"])
def test_a_tensor_changed_during_a_sync_save_fails_it_on_the_device(tmp_path: Path, monkeypatch, device: str) -> None:
    """``execution.changes``: a sync save streams CUDA tensors through pinned buffers
    while it writes; one changed in place meanwhile (its version counter moves when the
    op is enqueued) fails the save, committing nothing. An async save copies first: a
    change after it returns is the caller's."""
    from shardstore import CheckpointingException
    from shardstore.execution import save as rank_save

    w = torch.arange(1 << 16, dtype=torch.float32, device=device)
    real = rank_save.stage_save

    def stage_save(*args, **kwargs):  # the change lands after the staging, before the writes end
        staged = real(*args, **kwargs)
        w.add_(1)
        return staged

    monkeypatch.setattr(rank_save, "stage_save", stage_save)
    with pytest.raises(CheckpointingException, match=r"tensor 'w' changed in place"):
        save({"w": ShardedTensor.from_rank_offsets("w", w)}, str(tmp_path / "sync"))
    assert not (tmp_path / "sync").exists()
    monkeypatch.undo()
    expected = w.clone()
    request = save({"w": ShardedTensor.from_rank_offsets("w", w)}, str(tmp_path / "async"), async_sharded_save=True)
    w.add_(1)
    request.execute_sync()
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty_like(w))}, str(tmp_path / "async"))
    assert torch.equal(loaded["w"], expected)
