"""Issue 34.1 and 34.2: plain values beside DTensors survive ``dcp.save`` through
``ShardstoreWriter``, and lists that mix DTensors with other values round-trip.

34.1: a rank's first WriteResult carried both a plain value and the rank's chunk
report, and the report replaced the value: ``{"epoch": 5, "lr": 0.1, "model": ...}``
committed an empty common state at one rank, and AdamW's ``step`` was lost when the
optimizer's state came first. 34.2: ``[DTensor, 3, "x"]`` saved, but loaded back neither
through ``dcp.load`` ("Missing key lst.1") nor ``shardstore.load`` (a raw ValueError);
``shardstore.save`` of such lists failed to load back the same way.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import shardstore
from shardstore import ShardstoreReader, ShardstoreWriter
from shardstore.compat.dcp.common_state import RAW_DTYPES
from tests import fsdp_models as fm
from tests.dist import run_distributed

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")


def _dtensor(value: float, rows: int = 4) -> torch.Tensor:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    return distribute_tensor(torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + value, mesh, [Shard(0)])


def _dcp_load(request: dict, ckpt: str) -> dict:
    import torch.distributed.checkpoint as dcp

    dcp.load(request, storage_reader=ShardstoreReader(ckpt))
    return request


def plain_values_beside_dtensors(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"epoch": 5, "lr": 0.1, "model": {"w": _dtensor(1.0), "b": _dtensor(2.0, rows=2)}}
    dcp.save(state, storage_writer=ShardstoreWriter(f"{root}/values"))
    assert shardstore.load_common_state_dict(f"{root}/values") == {"epoch": 5, "lr": 0.1}
    for load in (_dcp_load, lambda request, ckpt: shardstore.load(request, ckpt)):
        request = {"epoch": 0, "lr": 0.0, "model": {"w": _dtensor(-9.0), "b": _dtensor(-9.0, rows=2)}}
        loaded = load(request, f"{root}/values")
        assert loaded["epoch"] == 5 and loaded["lr"] == 0.1, loaded
        assert torch.equal(loaded["model"]["w"].full_tensor(), state["model"]["w"].full_tensor())

    # FSDP2 + AdamW with the optimizer's state first: each parameter's ``step`` comes
    # before its DTensors, so plain values are the first items of every rank's plan
    model, optimizer = fm.build(world)
    fm.train_step(model, optimizer, 0)
    full = fm.state_dict(model, optimizer)
    optim_first = {"optim": full["optim"], "model": full["model"]}
    saved = fm.full_values(optim_first)
    dcp.save(optim_first, storage_writer=ShardstoreWriter(f"{root}/adamw"))
    steps = shardstore.load_common_state_dict(f"{root}/adamw")["optim"]["state"]
    assert {key: float(value["step"]) for key, value in steps.items()} == {
        key: 1.0 for key in saved["optim"]["state"]
    }, steps
    fresh, fresh_optimizer = fm.build(world, seed=7)
    fm.train_step(fresh, fresh_optimizer, 5)
    request = fm.state_dict(fresh, fresh_optimizer)
    loaded = _dcp_load({"optim": request["optim"], "model": request["model"]}, f"{root}/adamw")
    fm.assert_same(fm.full_values(loaded), saved)


@pytest.mark.parametrize("world", [1, 2])
def test_plain_values_beside_dtensors_are_committed(tmp_path: Path, world: int) -> None:
    run_distributed(plain_values_beside_dtensors, world, str(tmp_path))


MIXED = {
    "dtensor, int, str": (lambda: [_dtensor(1.0), 3, "x"], lambda: [_dtensor(0.0), 0, ""]),
    "dtensor, None, dtensor": (lambda: [_dtensor(1.0), None, _dtensor(2.0)], lambda: [_dtensor(0.0), None, _dtensor(0.0)]),
    "dtensor, tensor": (lambda: [_dtensor(1.0), torch.ones(3)], lambda: [_dtensor(0.0), torch.zeros(3)]),
    "int, dtensor": (lambda: [7, _dtensor(1.0)], lambda: [0, _dtensor(0.0)]),
    "dict with a dtensor, str": (lambda: [{"w": _dtensor(1.0)}, "y"], lambda: [{"w": _dtensor(0.0)}, ""]),
}


def mixed_lists_round_trip(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    for i, (name, (build, empty)) in enumerate(MIXED.items()):
        state = {"lst": build(), "n": 1}
        expected = fm.full_values(state)
        saves = {
            "dcp.save": lambda ckpt, s=state: dcp.save(s, storage_writer=ShardstoreWriter(ckpt)),
            "shardstore.save": lambda ckpt, s=state: shardstore.save(s, ckpt),
        }
        for way, save in saves.items():
            ckpt = f"{root}/{i}-{way}"
            save(ckpt)
            loads = {"dcp.load": _dcp_load, "shardstore.load": lambda request, c: shardstore.load(request, c)}
            for load_way, load in loads.items():
                loaded = load({"lst": empty(), "n": 0}, ckpt)
                fm.assert_same(fm.full_values(loaded), expected, f"{name}: {way} -> {load_way}")


@pytest.mark.parametrize("world", [1, 2])
def test_lists_mixing_dtensors_and_other_values_round_trip(tmp_path: Path, world: int) -> None:
    run_distributed(mixed_lists_round_trip, world, str(tmp_path))


def test_common_state_keeps_each_list_element_at_its_index(tmp_path: Path) -> None:
    """What other readers of common.pt see: ``None`` where a sharded value is, the same
    for both ways of saving."""
    from shardstore import ShardedTensor

    shardstore.save({"lst": [ShardedTensor.from_rank_offsets("t", torch.ones(2)), 3, "x"]}, tmp_path / "a")
    assert shardstore.load_common_state_dict(tmp_path / "a") == {"lst": [None, 3, "x"]}
    loaded = shardstore.load({"lst": [ShardedTensor.from_rank_offsets("t", torch.zeros(2)), 0, ""]}, tmp_path / "a")
    assert loaded["lst"][1:] == [3, "x"] and torch.equal(loaded["lst"][0], torch.ones(2))


def test_nested_lists_and_dicts_keep_their_places(tmp_path: Path) -> None:
    """An element with nothing but sharded values inside (a dict, a list) holds its
    place too; a load request in the same shape gets everything back where it was."""
    from shardstore import ShardedTensor

    def state(fill: float) -> dict:
        def st(key: str) -> ShardedTensor:
            return ShardedTensor.from_rank_offsets(key, torch.full((2,), fill))

        return {"lst": [[st("a"), 3], st("b"), {"w": st("c")}, {"w": st("d"), "n": 4}, "z"]}

    shardstore.save(state(1.0), tmp_path / "ckpt")
    assert shardstore.load_common_state_dict(tmp_path / "ckpt") == {"lst": [[None, 3], None, None, {"n": 4}, "z"]}
    loaded = shardstore.load(state(0.0), tmp_path / "ckpt")["lst"]
    assert loaded[0][1] == 3 and loaded[3]["n"] == 4 and loaded[4] == "z", loaded
    for tensor in (loaded[0][0], loaded[1], loaded[2]["w"], loaded[3]["w"]):
        assert torch.equal(tensor, torch.ones(2)), loaded


# dtypes torch saves but whose tensors plain pickling (DCP's gather of the write results) cannot load back
UNPICKLABLE_DTYPES = [torch.complex32, torch.float8_e8m0fnu, torch.float8_e4m3fnuz, torch.float4_e2m1fn_x2]


def _bits(dtype: torch.dtype, fill: int) -> torch.Tensor:
    return torch.full((8,), fill, dtype=torch.int32).view(torch.uint8).view(dtype)


def common_tensors_of_any_dtype(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    state = {f"t{i}": _bits(dtype, 0x3C + i) for i, dtype in enumerate(UNPICKLABLE_DTYPES)}
    dcp.save({**state, "epoch": 3}, storage_writer=ShardstoreWriter(f"{root}/ckpt"))
    request = {key: torch.zeros_like(value) for key, value in state.items()}
    loaded = _dcp_load({**request, "epoch": 0}, f"{root}/ckpt")
    assert loaded["epoch"] == 3
    for key, value in state.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key].view(torch.uint8), value.view(torch.uint8))


@pytest.mark.parametrize("world", [1, 2])
def test_common_tensors_of_dtypes_pickle_cannot_carry_are_saved(tmp_path: Path, world: int) -> None:
    """A plain tensor of the common state (one of a dtype shardstore stores in no array:
    complex32, float8_e8m0fnu, the fnuz float8s, float4) travels to the coordinator in
    its WriteResult. It went pickled, and torch's pickling of such tensors does not load
    back: with a process group (torchrun, even at one rank) the coordinator failed in
    DCP's gather with a bare ``AttributeError: type object 'torch.storage.UntypedStorage'
    has no attribute 'dtype'`` (the other ranks waiting for it), where DCP's own
    ``FileSystemWriter`` saves them."""
    run_distributed(common_tensors_of_any_dtype, world, str(tmp_path))


def sparse_common_tensor(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    # dense, 64 MiB of float32: far above the bytes that make a plain tensor an array
    sparse = torch.sparse_coo_tensor([[0, 2], [1, 3]], [1.5, -2.0], (4096, 4096))
    dcp.save({"mask": sparse, "w": _dtensor(1.0)}, storage_writer=ShardstoreWriter(f"{root}/ckpt"))
    common = shardstore.load_common_state_dict(f"{root}/ckpt")
    assert common["mask"].is_sparse and torch.equal(common["mask"].to_dense(), sparse.to_dense())


def test_a_sparse_tensor_of_the_common_state_is_saved(tmp_path: Path) -> None:
    """A sparse tensor is no array, whatever its dense size: it goes to the common state,
    copied to host memory first (a clone asking for a memory format was refused for
    sparse layouts; a large one was planned as an array, whose staging failed)."""
    run_distributed(sparse_common_tensor, 2, str(tmp_path))


@pytest.mark.parametrize("dtype", sorted(RAW_DTYPES, key=str))
def test_a_common_tensor_travels_as_its_bytes_and_comes_back_equal(dtype: torch.dtype) -> None:
    """A plain dense tensor of the common state goes to the coordinator as its bytes,
    dtype and shape (no torch.save/torch.load per tensor), through pickling as DCP's
    gather does, and comes back bit-equal, in memory of its own: 0-d, empty,
    non-contiguous and conjugated views too."""
    import pickle

    from shardstore.compat.dcp.common_state import common_value, tensor_value
    from shardstore.compat.dcp.parts import CommonValue, TensorBytes

    base = torch.arange(24, dtype=torch.float64).reshape(4, 6).to(dtype)
    cases = [base, base.t(), base[1], base[0, 0], base[:0], base[::2, 1::3]]
    if dtype.is_complex:
        cases.append((base * (1 + 2j)).conj())
    for tensor in cases:
        value = tensor_value(tensor)
        assert isinstance(value, TensorBytes), (dtype, tensor.shape)
        back = common_value(pickle.loads(pickle.dumps(CommonValue("t", value))), "checkpoint")
        assert back.dtype == dtype and back.shape == tensor.shape and back.is_contiguous()
        assert torch.equal(back.resolve_conj(), tensor.resolve_conj())
        assert back.data_ptr() != tensor.data_ptr() or tensor.numel() == 0


def test_a_common_tensor_of_another_kind_travels_saved() -> None:
    """Dtypes outside ``RAW_DTYPES``, sparse tensors and subclasses still travel as
    ``torch.save`` bytes (the path tested with DCP above)."""
    from shardstore.compat.dcp.common_state import tensor_value

    assert isinstance(tensor_value(torch.zeros(4, dtype=torch.float8_e4m3fn)), bytes)
    assert isinstance(tensor_value(torch.zeros(4).to_sparse()), bytes)
    assert isinstance(tensor_value(torch.nn.Parameter(torch.zeros(4))), type(tensor_value(torch.zeros(4))))
