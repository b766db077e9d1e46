"""``torch.save`` files, as a format shardstore converts from and to (``.pt``, ``.pth``,
``.bin``): read with ``weights_only=True`` and memory-mapped, never running code.

* ``open_torch_file`` opens one as an export's source: its tensors by their
  ``/``-joined paths in the state dict (``sd["model"]["fc1"]`` is ``model/fc1``), the
  other values where they are, each top-level value at a sharded object's unique key
  (``rng_state/shard_0_2``) one object; where a shardstore export wrote its layout
  (``layout``: an archive entry beside ``data.pkl``), its arrays by their keys and each
  value where the checkpoint had it;
* ``state_to_save`` is what an import saves: the file's state dict with each array a
  ``ShardedTensor`` where it was and each object shard a ``ShardedObject``;
* ``TORCH_FILE_FORMAT`` is its registry entry (``registry``): a local regular file named
  ``*.pt``, ``*.pth`` or ``*.bin``, or starting as a ``torch.save`` file does (a zip
  archive, or the legacy format's pickled magic number); the reader refuses, saying so,
  one that holds no state dict.
"""

from __future__ import annotations

__all__ = ["TORCH_FILE_FORMAT", "TORCH_SUFFIXES", "holds_torch_file", "open_torch_file", "state_to_save"]

import os
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from shardstore.errors import CheckpointingException
from shardstore.format.pickles import load_torch_file
from shardstore.mapping import ShardedObject, ShardedTensor, StateDict
from shardstore.other_formats.base import ExportSource, FileFormat, TensorSpec, is_object_shard_key
from shardstore.other_formats.layout import (
    ExportStructure,
    read_torch_layout,
    value_at,
    without_places,
)
from shardstore.stores.base import Location
from shardstore.stores.local import open_regular

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's archive (PyTorch >= 1.6)
# The legacy format starts with a pickle (b"\x80", its protocol) of torch's magic number
_PICKLE = b"\x80"
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
_HEAD_BYTES = 32  # holds the legacy magic number after any pickle protocol's header


def open_torch_file(path: Path) -> ExportSource:
    """A ``torch.save`` file: its tensors by their ``/``-joined paths (memory-mapped),
    or, where a shardstore export wrote its layout, its arrays by their keys."""
    state = _load_state_dict_file(path)
    layout = read_torch_layout(path)
    if layout is None:
        tensors = _tensors_by_key(state, str(path))
        objects = tuple(k for k in state if is_object_shard_key(k))
        return ExportSource(
            {k: TensorSpec.of(t) for k, (_, t) in sorted(tensors.items())},
            lambda keys, _: ((k, tensors[k][1]) for k in keys), lambda: _without_tensors(state),
            lambda key: tensors[key][0], lambda: objects,
        )
    tensors = _layout_arrays(state, layout, path)
    return ExportSource(
        {k: TensorSpec.of(t) for k, (_, t) in sorted(tensors.items())},
        lambda keys, _: ((k, tensors[k][1]) for k in keys), lambda: without_places(state, set(layout.arrays.values())),
        lambda key: tensors[key][0], lambda: layout.objects,
    )


def _layout_arrays(
    state: dict[Any, Any], layout: ExportStructure, path: Path
) -> dict[str, tuple[tuple[str | int, ...], torch.Tensor]]:
    """The arrays a ``torch.save`` file's layout names, by key, with their places."""
    found = {}
    for key, place in layout.arrays.items():
        value = value_at(state, place, str(path))
        if not isinstance(value, torch.Tensor):
            raise CheckpointingException(
                f"{path}: its shardstore layout names array {key!r} at {list(place)}, which holds a "
                f"{type(value).__name__}; convert the file again from its checkpoint"
            )
        found[key] = (place, value)
    missing = [k for k in layout.objects if k not in state]
    if missing:
        raise CheckpointingException(f"{path}: its shardstore layout names object shard {missing[0]!r}, not in the file")
    return found


def _load_state_dict_file(path: Path) -> dict[Any, Any]:
    state = load_torch_file(path, f"{path} (a torch.save file)")
    if not isinstance(state, dict):
        raise CheckpointingException(f"{path} holds a {type(state).__name__}, not a state dict")
    return state


def _tensors_by_key(state: dict[Any, Any], where: str) -> dict[str, tuple[tuple[Any, ...], torch.Tensor]]:
    """Every tensor of a ``torch.save`` state dict (in dicts and lists, not in sharded
    object shards), by its ``/``-joined path, with the path."""
    found: dict[str, tuple[tuple[Any, ...], torch.Tensor]] = {}
    for path, tensor in _tensor_leaves(state, ()):
        key = "/".join(map(str, path))
        if key in found:
            raise CheckpointingException(f"{where}: two tensors have the key {key!r} (their paths joined by '/')")
        found[key] = (path, tensor)
    return found


def _tensor_leaves(node: dict | list, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    for k, v in node.items() if isinstance(node, dict) else enumerate(node):
        if not path and is_object_shard_key(k):
            continue
        if isinstance(v, torch.Tensor):
            yield (*path, k), v
        elif isinstance(v, (dict, list)):
            yield from _tensor_leaves(v, (*path, k))


def _without_tensors(node: dict | list, top: bool = True) -> dict | list:
    """``node`` without its tensors, sharded object shards kept whole: what a
    safetensors file cannot hold. A dict loses a tensor's entry but stays, emptied, where
    it held only tensors: its keys' types (an optimizer's int parameter ids) are known
    from it alone, since a tensor's place names an int dict key and a list index alike.
    A list keeps None in a tensor's slot, so that its other values keep their indices
    (as ``layout.without_places`` keeps them). An import puts each array back at its
    place, and the save drops what the arrays emptied, as a direct import does."""
    if isinstance(node, list):
        return [None if isinstance(v, torch.Tensor) else _without_tensors_in(v) for v in node]
    return {
        k: v if top and is_object_shard_key(k) else _without_tensors_in(v)
        for k, v in node.items()
        if not isinstance(v, torch.Tensor) or (top and is_object_shard_key(k))
    }


def _without_tensors_in(value: Any) -> Any:
    """A value of a container, without its tensors where it is a dict or a list."""
    return _without_tensors(value, top=False) if isinstance(value, (dict, list)) else value


def state_to_save(path: Path) -> StateDict:
    """What an import of the ``torch.save`` file at ``path`` saves (loaded with
    ``weights_only=True``, memory-mapped): each tensor an array keyed by its path, each
    value at a sharded object's unique key (how an export writes one) that sharded
    object, the rest the common state; where a shardstore export wrote its layout, each
    value goes back where it was, arrays and common state."""
    state = _load_state_dict_file(path)
    layout = read_torch_layout(path)
    if layout is None:
        tensors = _tensors_by_key(state, str(path))
        objects: Sequence[str] = [k for k in state if is_object_shard_key(k)]
    else:
        tensors, objects = _layout_arrays(state, layout, path), layout.objects
    for key in objects:
        state[key] = replace(ShardedObject.empty_from_unique_key(key), data=state[key])
    for key, (where, tensor) in tensors.items():
        _parent(state, where)[where[-1]] = ShardedTensor.from_rank_offsets(key, tensor)
    return state


def _parent(state: dict[Any, Any], path: tuple[Any, ...]) -> Any:
    """The dict or list that holds the value at ``path``."""
    node: Any = state
    for part in path[:-1]:
        node = node[part]
    return node


def holds_torch_file(location: Location) -> bool:
    """A local regular file named like one (``TORCH_SUFFIXES``) or whose first bytes
    are those of a ``torch.save`` file: a zip archive, or the legacy format's pickled
    magic number; its first bytes read, nothing unpickled."""
    local = location.local_path()
    if local is None or not local.is_file():
        return False
    return local.name.endswith(TORCH_SUFFIXES) or _starts_like_torch_save(local)


def _starts_like_torch_save(path: Path) -> bool:
    try:
        fd = open_regular(path)  # a FIFO never blocks the look
    except OSError:
        return False  # unreadable: no format of ours; opening it as a checkpoint says why
    if fd is None:
        return False
    with os.fdopen(fd, "rb") as f:
        head = f.read(_HEAD_BYTES)
    return head.startswith(_ZIP_MAGIC) or (head.startswith(_PICKLE) and _LEGACY_MAGIC in head)


TORCH_FILE_FORMAT = FileFormat(
    "torch", "a torch.save file", holds_torch_file, open_torch_file, state_to_save, TORCH_SUFFIXES
)
