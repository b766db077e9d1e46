"""What a load does to a region read from storage before handing it back: the shape
check (or padding, ``allow_shape_mismatch``), the flattened range, the dtype (exact
conversions of the values read only, unless lossy ones are allowed) and the device. Shared by shardstore's
own format (``execution.load``) and the readers of other tools' checkpoints
(``engine.other_formats``).
"""

from __future__ import annotations

__all__ = ["flatten_range", "local_part", "pad_to_expected_shape", "place_loaded", "postprocess_loaded", "result_device"]

import math

import torch

from shardstore.errors import CheckpointingException
from shardstore.format.dtypes import cast_checked
from shardstore.mapping import ShardedTensor
from shardstore.planning.layout import Region, region_shape


def local_part(region: Region, prepend_axis_num: int) -> tuple[int, ...]:
    """The shape of what ``region`` (read for a request) holds of the request's local
    tensor: the region without its prepended axes. A region that lies past the stored
    array along a prepended axis (``allow_shape_mismatch``: a layer the checkpoint does
    not have) holds none of it: every axis of the part is empty, padded by
    ``postprocess_loaded`` like an offset past the stored extent of any other axis."""
    shape = region_shape(region)
    local = shape[prepend_axis_num:]
    return local if math.prod(shape[:prepend_axis_num]) else (0,) * len(local)


def postprocess_loaded(x: torch.Tensor, t: ShardedTensor, apply_flattened_range: bool = True) -> torch.Tensor:
    """Pads (allow_shape_mismatch) or checks the shape, then applies the flat range."""
    if tuple(x.shape) != tuple(t.local_shape):
        if not t.allow_shape_mismatch:
            raise CheckpointingException(
                f"Shape mismatch for {t.key!r}: loaded {tuple(x.shape)}, expected {tuple(t.local_shape)}"
            )
        x = pad_to_expected_shape(x, t)
    if apply_flattened_range and t.flattened_range is not None:
        x = flatten_range(t, x)
    return x


def place_loaded(x: torch.Tensor, t: ShardedTensor, where: str, allow_lossy_casts: bool = False) -> torch.Tensor:
    """The loaded tensor in the requested dtype, on ``result_device(t)``.

    Another dtype than the stored one is honoured when every value read converts
    exactly (Megatron-Core's tests load int64 ``arange`` into float32, which its
    backends cast silently), and refused, naming the key and the first value that would
    change, when one does not (0.5 into int64, 1e6 into float16, 2 into bool, uint8 200
    into int8; ``format.dtypes.cast_checked``), unless
    ``allow_lossy_casts``: a trainer asking for the wrong dtype must find out at the
    load, not from a diverging run.
    """
    if x.dtype != t.dtype:
        x = x.to(t.dtype) if allow_lossy_casts else _cast_exactly(x, t, where)
    device = result_device(t)
    if device.type != "cpu":
        x = x.to(device, non_blocking=True)
    return x


def result_device(t: ShardedTensor) -> torch.device:
    """Where a load puts ``t``'s values: on the device of ``t.data``; on the CPU where
    it has none, or lies on the meta device, which holds no values (a model built
    there describes its request with meta tensors)."""
    if t.data is None or t.data.device.type == "meta":
        return torch.device("cpu")
    return t.data.device


def _cast_exactly(x: torch.Tensor, t: ShardedTensor, where: str) -> torch.Tensor:
    converted, changed = cast_checked(x, t.dtype)
    if changed is None:
        return converted
    raise CheckpointingException(
        f"{where}: tensor {t.key!r} is stored as {x.dtype}, the state dict asks for {t.dtype}, which would "
        f"change its value {x[changed].item()!r} at index {list(changed)} of the requested part into "
        f"{converted[changed].item()!r}{_in_the_array(t, changed)}. Request the stored dtype and convert it "
        "yourself, or load with ZarrLoadShardedStrategy(allow_lossy_casts=True)"
    )


def _in_the_array(t: ShardedTensor, at: tuple[int, ...]) -> str:
    """Where index ``at`` of ``t``'s loaded part lies in the stored array, as the
    message says it (a part read in pieces: ``RankReadPlan.pieces``, reports it per
    piece); nothing for a flattened range."""
    kept = t.global_offset[t.prepend_axis_num :]
    if t.flattened_range is not None or len(at) != len(kept):
        return ""
    return f" (element {[*t.global_offset[: t.prepend_axis_num], *(o + i for o, i in zip(kept, at))]} of the array)"


def flatten_range(sharded_tensor: ShardedTensor, x: torch.Tensor) -> torch.Tensor:
    """Applies ``sharded_tensor.flattened_range`` to ``x``."""
    return x.flatten()[sharded_tensor.flattened_range]


def pad_to_expected_shape(x: torch.Tensor, expected_sharded_ten: ShardedTensor) -> torch.Tensor:
    """Zero-pads (or truncates) ``x`` to ``expected_sharded_ten.local_shape``.

    Used with ``allow_shape_mismatch``: e.g. a vocabulary padded differently at load.
    """
    expected = tuple(expected_sharded_ten.local_shape)
    if x.ndim != len(expected):
        raise CheckpointingException(
            f"{expected_sharded_ten.key!r}: cannot pad {tuple(x.shape)} to {expected}: different ranks"
        )
    x = x[tuple(slice(0, e) for e in expected)]
    pad: list[int] = []
    for have, want in reversed(list(zip(x.shape, expected))):
        pad.extend((0, want - have))
    return torch.nn.functional.pad(x, pad) if any(pad) else x
