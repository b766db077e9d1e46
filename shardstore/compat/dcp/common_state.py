"""The common state of a save through DCP's API: what is not an array (Python values,
small tensors) travels to the coordinator in ``WriteResult``s (``write_result``) and is
written as ``common.pt``, nested as the caller's state dict was (``nested_common``, with
DCP's flattening mappings, ``given_paths``, and the list slots it dropped,
``with_dropped_slots``).
"""

from __future__ import annotations

__all__ = [
    "RAW_DTYPES", "common_value", "given_paths", "hold_place", "nested_common", "refuse_unwritten",
    "saved_bytes", "tensor_value", "with_dropped_slots", "write_result",
]

import io
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlanner,
    WriteItem,
)
from torch.distributed.checkpoint.storage import WriteResult

from shardstore.compat.dcp.parts import CommonValue, TensorBytes, is_sharded
from shardstore.errors import CheckpointingException
from shardstore.format import (
    CommitRecord,
    StatePath,
    load_torch,
    state_paths,
)


def given_paths(metadata: Metadata) -> Any:
    """Where each saved name was in the state dict DCP was given: its planner's paths;
    where it did not flatten the state dict (``DefaultSavePlanner(flatten_state_dict=
    False)``: no planner data), each name is a key of its top level, as saved."""
    if metadata.planner_data is None:
        return {name: (name,) for name in metadata.state_dict_metadata}
    return metadata.planner_data

def refuse_unwritten(metadata: Metadata, commit: CommitRecord, common: dict[str, Any], where: str) -> None:
    """Refuses to commit a save whose DCP metadata names a value no rank wrote, neither
    an array of the plan nor a common value of the results (DCP's plan cache and the
    plan the ranks wrote by disagreeing): the checkpoint would load as damaged."""
    missing = sorted(metadata.state_dict_metadata.keys() - commit.arrays.keys() - common.keys())
    if missing:
        raise CheckpointingException(
            f"Saving {where}: DCP's metadata names {missing[:8]} ({len(missing)} in all), which no rank wrote; nothing "
            "is committed. If DCP's plan caching is on (enable_plan_caching=True), save with it off"
        )


def write_result(item: WriteItem, planner: SavePlanner, as_array: bool) -> WriteResult:
    """The WriteResult of one item: a sharded item's or a plain array's bytes were
    written (by this rank or the one the plan chose); a common value travels in it."""
    if is_sharded(item) or as_array:
        return WriteResult(index=item.index, size_in_bytes=item.tensor_storage_size() or 0, storage_data=None)
    data = planner.resolve_data(item)
    value = tensor_value(data) if isinstance(data, torch.Tensor) else data.getvalue()
    size = len(value.data) if isinstance(value, TensorBytes) else len(value)
    return WriteResult(index=item.index, size_in_bytes=size, storage_data=CommonValue(item.index.fqn, value))


RAW_DTYPES = frozenset({
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
})
"""The dtypes whose dense tensors travel as their bytes (``TensorBytes``); any other
as ``torch.save`` bytes (``saved_bytes``)."""


def tensor_value(tensor: torch.Tensor) -> bytes | TensorBytes:
    """A tensor of the common state as it travels to the coordinator: a plain dense
    tensor of ``RAW_DTYPES`` as its bytes in host memory, C order; any other (sparse,
    a subclass, another dtype) as ``saved_bytes``."""
    copy = tensor.detach()
    if type(copy) is not torch.Tensor or copy.layout != torch.strided or copy.dtype not in RAW_DTYPES:
        return saved_bytes(tensor)
    flat = copy.cpu().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
    return TensorBytes(str(copy.dtype).removeprefix("torch."), tuple(copy.shape), flat.numpy().tobytes())


def _rebuilt(value: TensorBytes, where: str) -> torch.Tensor:
    """The tensor of ``value`` (``tensor_value``), in memory of its own."""
    dtype = getattr(torch, value.dtype, None)
    if dtype not in RAW_DTYPES:
        raise CheckpointingException(f"Internal error: {where} received a tensor of dtype {value.dtype!r} as bytes; "
                                     "please report it")
    if not value.data:
        return torch.empty(value.shape, dtype=dtype)
    return torch.frombuffer(bytearray(value.data), dtype=torch.uint8).view(dtype).reshape(value.shape)


def saved_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor of the common state as ``torch.save`` bytes of a copy in host memory (a
    view would carry its whole storage)."""
    buffer = io.BytesIO()
    copy = tensor.detach().cpu()
    # a sparse layout has no memory format to ask for; its clone is compact
    copy = copy.clone(memory_format=torch.contiguous_format) if copy.layout == torch.strided else copy.clone()
    torch.save(copy, buffer)
    return buffer.getvalue()


def common_value(value: CommonValue, where: str) -> Any:
    """A common value as common.pt stores it: a tensor, or a Python value DCP serialized
    with ``torch.save``, read back as every common state is (``weights_only``)."""
    if isinstance(value.value, TensorBytes):
        return _rebuilt(value.value, f"{where} ({value.fqn})")
    try:
        return load_torch(value.value, f"{where} ({value.fqn})")
    except CheckpointingException as exc:
        raise CheckpointingException(
            f"Cannot store {value.fqn!r} in the common state: every load reads it with weights_only=True, "
            f"which this value does not pass. Store plain Python values, tensors and numpy arrays, or keep it "
            f"out of the checkpoint. {exc}"
        ) from exc


def nested_common(common: dict[str, Any], mappings: Any) -> dict[str, Any]:
    """The common values nested as the caller's state dict was (DCP's flattening
    mappings: fully qualified name -> path), or flat when DCP did not flatten. A list
    keeps every element in its place and its length: ``None`` where an array is (so a
    load puts the array back at its index, ``dict_utils.nest``)."""
    from torch.distributed.checkpoint._traverse import set_element

    if not isinstance(mappings, dict):
        return dict(common)
    order = {name: i for i, name in enumerate(mappings)}  # the caller's order, not the ranks'
    nested: dict[str, Any] = {}
    for name in sorted(common, key=lambda name: order.get(name, len(order))):
        set_element(nested, mappings.get(name, (name,)), common[name])
    for name, path in mappings.items():
        if name not in common:
            hold_place(nested, path)
    return nested

def hold_place(nested: dict[str, Any], path: tuple) -> None:
    """Extends the list of ``nested`` on ``path`` with ``None`` up to the element on
    ``path`` where it is shorter (an array at the end of a list keeps the list's length)."""
    node: Any = nested
    for key in path:
        if isinstance(node, list):
            if key >= len(node):
                node.extend([None] * (key + 1 - len(node)))
                return
        elif not isinstance(node, dict) or key not in node:
            return
        node = node[key]

def with_dropped_slots(planner_data: Any) -> dict[str, StatePath] | None:
    """DCP's planner paths (each saved name -> its dict keys and list indices) with a
    path for every list slot below a saved index that holds no saved path, named as DCP
    names paths; None where ``planner_data`` is no such mapping. DCP's flattening drops
    only dicts that hold nothing but empty dicts, so each such slot held one: it is
    saved as ``{}``, and a load that asks for the slot gets ``{}`` back. None also where
    such a slot's name is a saved name already (DCP cannot load that state either)."""
    if not isinstance(planner_data, dict) or not all(isinstance(path, tuple) for path in planner_data.values()):
        return None
    held: dict[tuple, set[int]] = {}
    for path in planner_data.values():
        for depth, part in enumerate(path):
            if type(part) is int:
                held.setdefault(path[:depth], set()).add(part)
    paths = dict(planner_data)
    for prefix, indices in held.items():
        for slot in set(range(max(indices))) - indices:
            paths.setdefault(".".join(map(str, (*prefix, slot))), (*prefix, slot))
    return state_paths(paths, len(paths))
