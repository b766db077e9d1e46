"""The pickles of a checkpoint's non-sharded part (``common.pt``, ShardedObject shards)
and of other tools' ``common.pt``: written with ``torch.save``, read with
``torch.load(weights_only=True)`` so a crafted checkpoint cannot run code. The
allow-list adds what trainers commonly keep there (numpy arrays and RNG states,
``argparse.Namespace``); anything else is refused with an error that says how to opt
in, for checkpoints the user trusts.
"""

from __future__ import annotations

import argparse
import io
import pickle
from typing import Any

import numpy as np
import torch

from shardstore.core import CheckpointingException


def _numpy_safe_globals() -> list[Any]:
    """What unpickling numpy arrays, dtypes and scalars needs, and nothing that runs code."""
    try:
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct, scalar  # type: ignore[no-redef]
    dtype_classes = {type(np.dtype(t)) for t in np.sctypeDict.values() if t is not np.object_}
    return [_reconstruct, scalar, np.ndarray, np.dtype, *dtype_classes]


SAFE_GLOBALS: list[Any] = [*_numpy_safe_globals(), argparse.Namespace]


def serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def deserialize(data: bytes, where: str, allow_unsafe_pickle: bool) -> Any:
    """Unpickles ``data`` safely unless the caller opted in to arbitrary pickles."""
    buffer = io.BytesIO(data)
    try:
        if allow_unsafe_pickle:
            return torch.load(buffer, map_location="cpu", weights_only=False)
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(buffer, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights_only" in str(exc) or "Unsupported global" in str(exc):
            raise CheckpointingException(
                f"{where} contains objects that a safe load refuses (loading them could run code): "
                f"{str(exc).splitlines()[0]}. If you trust this checkpoint, load with "
                "common_strategy=TorchCommonLoadStrategy(allow_unsafe_pickle=True)."
            ) from exc
        raise CheckpointingException(f"{where} is corrupt: {exc}") from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointingException(f"{where} is corrupt or truncated: {exc}") from exc


def deserialize_dict(data: bytes, where: str, allow_unsafe_pickle: bool) -> dict[str, Any]:
    """``deserialize`` of a common state, which must be a dict."""
    state = deserialize(data, where, allow_unsafe_pickle)
    if not isinstance(state, dict):
        raise CheckpointingException(f"{where} holds a {type(state).__name__}, expected a dict")
    return state
