"""Helpers for sharded state dicts: extraction by type, key prefixes, ids, logging."""

from __future__ import annotations

__all__ = [
    "add_prefix_for_sharding", "apply_prefix_mapping", "debug_msg", "debug_time",
    "extract_nonpersistent", "extract_sharded_base", "extract_sharded_tensors",
    "extract_sharded_tensors_and_factories", "extract_sharded_tensors_or_nonpersistent",
    "fallback_logger", "force_all_tensors_to_non_fp8", "holds_sharded_class", "local_sharded_items",
    "logger_stack", "replace_prefix_for_sharding", "sharded_tensor_slots",
    "sharded_values_in_common", "zip_strict",
]

import functools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shardstore.dict_utils import dict_list_map_inplace, extract_matching_values, nested_values
from shardstore.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)

# (key, global_offset, flattened range or global shape): the same for the same data
# replicated on different ranks.
_ShardId = tuple[Any, ...]


def zip_strict(*args: Any) -> zip:
    """``zip(..., strict=True)`` whose error names every length, not just the shortest."""
    args = tuple(a if isinstance(a, (list, tuple)) else list(a) for a in args)
    lengths = [len(a) for a in args]
    if len(set(lengths)) > 1:
        raise ValueError(f"Tried to zip iterables of unequal lengths: {lengths}")
    return zip(*args)


def _sharded_tensor_shard_id(sharded_tensor: ShardedTensor) -> _ShardId:
    """Unique id of the sharded tensor data (same on every replica)."""
    f_range = sharded_tensor.flattened_range
    return (
        sharded_tensor.key,
        sharded_tensor.global_offset,
        None if f_range is None else (f_range.start, f_range.stop),
    )


def _sharded_object_id(sharded_object: ShardedObject) -> _ShardId:
    """Unique id of the sharded object data (same on every replica)."""
    return (sharded_object.key, sharded_object.global_offset, sharded_object.global_shape)


def _extract_by_types(
    sharded_state_dict: ShardedStateDict, types: tuple[type, ...]
) -> tuple[ShardedStateDict, StateDict]:
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, types))


def extract_sharded_tensors(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """Splits off the ShardedTensors, keeping the nesting: ``(sharded, rest)``."""
    return _extract_by_types(sharded_state_dict, (ShardedTensor,))


def extract_sharded_tensors_and_factories(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """Splits off ShardedTensors and ShardedTensorFactories: ``(sharded, rest)``."""
    return _extract_by_types(sharded_state_dict, (ShardedTensor, ShardedTensorFactory))


def extract_sharded_tensors_or_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """Splits off ShardedTensors, factories and LocalNonpersistentObjects."""
    return _extract_by_types(
        sharded_state_dict, (ShardedTensor, ShardedTensorFactory, LocalNonpersistentObject)
    )


def local_sharded_items(sharded_state_dict: ShardedStateDict) -> tuple[list[ShardedTensor], list[ShardedObject]]:
    """The ShardedTensors and ShardedObjects of a (factory-free) sharded state dict, in
    its traversal order: plans name a rank's tensors by their index in this list."""
    values = list(nested_values(sharded_state_dict))
    return (
        [v for v in values if isinstance(v, ShardedTensor)],
        [v for v in values if isinstance(v, ShardedObject)],
    )


def _items(node: dict | list) -> Iterator[tuple[Any, Any]]:
    return iter(node.items()) if isinstance(node, dict) else enumerate(node)


def sharded_tensor_slots(
    sharded_state_dict: ShardedStateDict,
) -> tuple[list[ShardedTensor], list[tuple[dict | list, Any]]]:
    """The ShardedTensors of a sharded state dict in ``local_sharded_items``' order, each
    with its place ``(container, key or index)``, in one walk: a strategy puts what it
    loaded there (``container[key] = tensor``) without walking again.

    An explicit stack, not a recursive closure: a closure that calls itself is a
    reference cycle (function -> cell -> function) holding the lists, hence every tensor
    of the state dict, until the cyclic garbage collector happens to run, which a load
    pauses and few allocations trigger (issue 33.2: a conversion's batches stayed alive
    and its memory bound did not hold)."""
    tensors: list[ShardedTensor] = []
    slots: list[tuple[dict | list, Any]] = []
    stack = [(sharded_state_dict, _items(sharded_state_dict))]
    while stack:
        node, items = stack[-1]
        for k, v in items:  # resumed where it left off when a child is done: depth first, in order
            if isinstance(v, (dict, list)):
                stack.append((v, _items(v)))
                break
            if isinstance(v, ShardedTensor):
                tensors.append(v)
                slots.append((node, k))
        else:
            stack.pop()
    return tensors, slots


def extract_sharded_base(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """Splits off every ShardedBase (tensors, objects, factories)."""
    return _extract_by_types(sharded_state_dict, (ShardedBase,))


def extract_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """Splits off the LocalNonpersistentObjects."""
    return _extract_by_types(sharded_state_dict, (LocalNonpersistentObject,))


# Class names of sharded mapping objects in the libraries trainers use (Megatron-Core's
# dist_checkpointing, torch.distributed's DTensor and legacy ShardedTensor). Found in
# the common state they would be pickled whole into common.pt: no array written, a
# load that cannot restore them. Matched by name so no library has to be imported.
SHARDED_CLASS_NAMES = frozenset(
    {"ShardedBase", "ShardedTensor", "ShardedObject", "ShardedTensorFactory", "LocalNonpersistentObject", "DTensor"}
)


@functools.cache
def _is_sharded_class(cls: type) -> bool:
    return not {c.__name__ for c in cls.__mro__}.isdisjoint(SHARDED_CLASS_NAMES)


def holds_sharded_class(value: Any) -> bool:
    """Whether a plain leaf of a state dict is (or, a tuple, holds) a sharded mapping
    object of any library: what ``sharded_values_in_common`` finds, for one leaf."""
    if isinstance(value, (list, tuple)):
        return bool(sharded_values_in_common(value))
    return _is_sharded_class(type(value))


def sharded_values_in_common(common_state_dict: Any, path: str = "") -> list[str]:
    """Key paths of values in the common state that are sharded mapping objects of any
    library (``SHARDED_CLASS_NAMES``, anywhere in their class hierarchy)."""
    if isinstance(common_state_dict, dict):
        return [p for k, v in common_state_dict.items() for p in sharded_values_in_common(v, f"{path}/{k}")]
    if isinstance(common_state_dict, (list, tuple)):
        return [p for i, v in enumerate(common_state_dict) for p in sharded_values_in_common(v, f"{path}[{i}]")]
    if _is_sharded_class(type(common_state_dict)):
        return [f"{path or '/'} ({type(common_state_dict).__module__}.{type(common_state_dict).__name__})"]
    return []


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepends ``prefix`` to the key of every ShardedBase, in place."""

    def add_prefix(t: Any) -> Any:
        if isinstance(t, ShardedBase):
            t.key = f"{prefix}{t.key}"
        return t

    dict_list_map_inplace(add_prefix, sharded_state_dict)


def replace_prefix_for_sharding(
    sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str
) -> None:
    """Replaces ``old_prefix`` with ``new_prefix`` in every sharded key, in place.

    Raises:
        ValueError: if some sharded key does not start with ``old_prefix``.
    """

    def replace_prefix(x: Any) -> Any:
        if isinstance(x, (ShardedTensor, ShardedTensorFactory, ShardedObject)):
            if not x.key.startswith(old_prefix):
                raise ValueError(f"Expected {x} to begin with prefix {old_prefix!r}")
            x.key = f"{new_prefix}{x.key[len(old_prefix):]}"
        return x

    dict_list_map_inplace(replace_prefix, sharded_state_dict)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: dict[str, str]) -> None:
    """Replaces the first matching old prefix of ``prefix_map`` in every sharded key."""

    def replace_prefixes(x: Any) -> Any:
        if not isinstance(x, (ShardedTensor, ShardedTensorFactory, ShardedObject)):
            return x
        for old_prefix, new_prefix in prefix_map.items():
            if x.key.startswith(old_prefix):
                x.key = f"{new_prefix}{x.key[len(old_prefix):]}"
                break
        return x

    dict_list_map_inplace(replace_prefixes, sharded_state_dict)


def _is_quantized_wrapper(tensor: Any) -> bool:
    """Transformer Engine's FP8 tensors are torch.Tensor subclasses with ``dequantize``.

    Plain ``torch.float8_*`` tensors are real dtypes that shardstore stores natively.
    """
    return (
        isinstance(tensor, torch.Tensor)
        and type(tensor) is not torch.Tensor
        and callable(getattr(tensor, "dequantize", None))
    )


def force_all_tensors_to_non_fp8(sharded_state_dict: ShardedStateDict) -> None:
    """Replaces FP8 wrapper tensors (e.g. Transformer Engine's) by their dequantized values."""

    def force_not_fp8(x: Any) -> Any:
        if isinstance(x, ShardedTensor) and _is_quantized_wrapper(x.data):
            x.data = x.data.dequantize()
            x.dtype = x.data.dtype
        return x

    dict_list_map_inplace(force_not_fp8, sharded_state_dict)


fallback_logger = logging.getLogger(__name__)
__LOGGER_NAME_STACK: list[str] = []
__LOGGER_STACK: list[logging.Logger] = []


@contextmanager
def logger_stack(
    name: str | None = None, current_logger: logging.Logger | None = None
) -> Iterator[tuple[str, logging.Logger]]:
    """Pushes a scope name and/or logger for the block; restores both afterwards.

    Yields:
        ``(dotted scope name, logger)`` for the block.

    Example:
        with logger_stack("scope", logger):
            logger.info("Log within 'scope'")
    """
    if name:
        __LOGGER_NAME_STACK.append(name)
    if current_logger:
        __LOGGER_STACK.append(current_logger)
        last_logger = current_logger
    elif __LOGGER_STACK:
        last_logger = __LOGGER_STACK[-1]
    else:
        last_logger = fallback_logger
    try:
        yield ".".join(__LOGGER_NAME_STACK), last_logger
    finally:
        if name and __LOGGER_NAME_STACK:
            __LOGGER_NAME_STACK.pop(-1)
        if current_logger and __LOGGER_STACK:
            __LOGGER_STACK.pop(-1)


@contextmanager
def debug_time(
    name: str,
    logger: logging.Logger | None = None,
    threshold: float = float("-inf"),
    level: int | None = None,
) -> Iterator[None]:
    """Logs how long the block took, in seconds.

    Args:
        name: label of the timed block
        logger: logger to use; defaults to the innermost of ``logger_stack``
        threshold: only log when the block took longer than this many seconds
        level: log level; DEBUG when no threshold is set, WARNING otherwise
    """
    if level is None:
        level = logging.DEBUG if threshold == float("-inf") else logging.WARNING
    with logger_stack(name, logger) as (stacked_name, last_logger):
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            if elapsed > threshold:
                last_logger.log(level, f"{stacked_name} took {elapsed:.4f}s")


def debug_msg(msg: str) -> None:
    """Logs ``msg`` at DEBUG, prefixed with the current ``logger_stack`` scope."""
    with logger_stack(None, None) as (stacked_name, last_logger):
        last_logger.debug(f"{stacked_name} {msg}")


def _clean_metadata_for_serialization(metadata: dict | None) -> dict | None:
    """A copy of ``metadata`` without the values that cannot be saved (Megatron-Core's
    helper, which ``save`` applies to the common state's ``content_metadata``).

    Drops ``dp_cp_group`` (as Megatron-Core does) and any other process group: content
    metadata may carry the groups needed at sharding time (Megatron-LM's
    ``sharded_sd_metadata`` does), which must not reach the common state. None stays
    None; ``metadata`` itself is not modified.
    """
    if metadata is None:
        return None
    clean = dict(metadata)
    clean.pop("dp_cp_group", None)
    process_group_type = getattr(torch.distributed, "ProcessGroup", None)
    if process_group_type is not None:
        for k in [k for k, v in clean.items() if isinstance(v, process_group_type)]:
            del clean[k]
    return clean
