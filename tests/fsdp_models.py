"""Small real FSDP2 (``fully_shard``) and FSDP x TP models with AdamW on gloo CPU ranks,
for the DTensor and DCP-storage tests: what torchtitan-style trainers hand a checkpoint.

Sizes are chosen so that shards come out uneven and, at 4 ranks, empty: ``Linear(12,
10)`` has 10 rows (3+3+3+1 over 4 ranks, 5+5 over 2), ``Linear(10, 5)`` 5 rows
(2+2+1+0 over 4). The 2-D mesh puts ``ColwiseParallel`` on the first layer, whose
parameters FSDP then shards with ``_StridedShard``, and ``RowwiseParallel`` on the last
(``Shard(0), Shard(1)`` weights, a ``Shard(0), Replicate()`` bias).
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

IN, HIDDEN, OUT = 12, 10, 5


def build(world: int, mesh_shape: tuple[int, ...] | None = None, seed: int = 0) -> tuple[nn.Module, Any]:
    """A ``fully_shard`` model and its AdamW over all ``world`` ranks: a 1-D FSDP mesh,
    or a ``(dp, tp)`` mesh with tensor parallelism when ``mesh_shape`` has two dims.
    ``seed`` sets the initial weights (a fresh model to load into uses another)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
    mesh_shape = mesh_shape or (world,)
    if len(mesh_shape) == 2:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fsdp_mesh = mesh["dp"]
    else:
        fsdp_mesh = init_device_mesh("cpu", mesh_shape)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, optimizer


def train_step(model: nn.Module, optimizer: Any, step: int) -> None:
    """One AdamW step on a batch that depends only on ``step`` (the same on every rank
    and at every world size, so runs at different layouts take the same step)."""
    generator = torch.Generator().manual_seed(1000 + step)
    batch = torch.randn(4, IN, generator=generator)
    optimizer.zero_grad()
    model(batch).pow(2).sum().backward()
    optimizer.step()


def state_dict(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` from ``get_state_dict``: DTensors, ``step``
    tensors, param groups."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def apply(model: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
    """Puts a loaded state back into the model and optimizer (``set_state_dict``)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full_values(state: Any) -> Any:
    """The state with every DTensor gathered whole (collective: every rank calls it),
    tensors as CPU copies: comparable across layouts and picklable."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: full_values(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(full_values(v) for v in state)
    if isinstance(state, DTensor):
        return state.full_tensor().detach().cpu().clone()
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()
    return state


def to_bytes(state: Any) -> bytes:
    """``state`` as bytes, to hand between processes: tensors sent through a
    multiprocessing queue travel as shared memory that dies with their process."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Bit-exact equality of two nested states (tensors by their bytes and dtype)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
