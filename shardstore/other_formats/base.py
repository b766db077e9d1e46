"""What shardstore reads of a file or checkpoint another tool wrote, whatever its format.

Every format registers a ``Format`` (``registry``): its name, its title and ``detect``,
how to tell its files from everything else. There are two kinds, one subtype each:

* ``OtherFormat``: a checkpoint directory that ``load`` reads as it is, at any layout
  (PyTorch DCP, Megatron-Core torch_dist and zarr). Its reader implements
  ``OtherCheckpoint``, which ``engine.other_formats`` (``load`` and the queries),
  inspection and ``convert`` use.
* ``FileFormat``: model files that shardstore converts from and to, but does not
  ``load`` (a ``torch.save`` file, safetensors). Its reader opens them as an
  ``ExportSource``: every tensor's ``TensorSpec`` known before its bytes are read, the
  tensors a batch at a time, the other values, and where each tensor goes in a
  ``torch.save`` state dict; and gives the state dict a shardstore save of them is given
  (``FileFormat.state_to_save``).

A reader never executes code from what it reads: pickled values load through
``shardstore.format.pickles`` (exact allow-lists), and every file is opened as a
regular file inside the checkpoint or model (no symbolic links out of it, no FIFOs or
devices), its byte ranges checked against its size.
"""

from __future__ import annotations

__all__ = [
    "ExportSource",
    "FileFormat",
    "Format",
    "OtherCheckpoint",
    "OtherFormat",
    "OtherTensor",
    "TensorSpec",
    "is_object_shard_key",
    "make_parents",
    "place_of_key",
    "place_value",
]

import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from shardstore.errors import CheckpointingException
from shardstore.format.config import CONFIG_FNAME, MAX_CONFIG_BYTES, CheckpointingConfig
from shardstore.format.dtypes import DType, ShapedTensorSize, UnsupportedDTypeError, from_torch
from shardstore.format.pickles import deserialize, deserialize_dict
from shardstore.format.records import COMMON_FILE
from shardstore.mapping import ShardedObject, StateDict
from shardstore.stores.base import Location, StorageError
from shardstore.stores.local import open_regular_file


@dataclass(frozen=True)
class OtherTensor(ShapedTensorSize):
    """A tensor of another tool's checkpoint: its global shape and dtype; each reader's
    subclass says how it is chunked."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """The shape of every saved chunk, or () where they differ."""
        return ()

    @property
    def chunk_count(self) -> int:
        """How many chunks hold it: one (the tensor whole) unless a chunked format's
        subclass says otherwise."""
        return 1


class OtherCheckpoint(ABC):
    """A checkpoint directory of another tool, opened for reading.

    Attributes:
        path: the directory.
        kind: the checkpoint's backend name (``"torch_dist"``, ``"dcp"``, ``"zarr"``).
        tensors: every tensor by key (``OtherTensor`` or a subclass).
        items: the keys of its non-tensor items (Megatron's ShardedObject shards by
            their unique key, ``<key>/shard_<offset>_<shape>``, or a plain DCP's values).
        saved_paths: where a key's value was in the state dict the tool saved (dict keys
            and list indices), for a format whose keys are flattened paths (plain DCP's
            ``a.b.0``): an export to one ``torch.save`` file puts it back there. Empty
            where a key is its own place (an array key, ``/`` nesting its dicts).
    """

    path: Path
    kind: str
    tensors: dict[str, OtherTensor]
    items: dict[str, Any]
    saved_paths: Mapping[str, tuple[str | int, ...]] = MappingProxyType({})

    @abstractmethod
    def read_region(self, key: str, region: tuple[slice, ...]) -> torch.Tensor:
        """The part ``region`` of the global tensor ``key``; a part the checkpoint does
        not hold is an error."""

    @abstractmethod
    def read_item(self, key: str, allow_unsafe_pickle: bool = False) -> Any:
        """A non-tensor item, loaded with ``weights_only=True`` unless the caller trusts
        the checkpoint (``allow_unsafe_pickle``, ``load_pickled``)."""

    def read_object_shard(self, unique_key: str, allow_unsafe_pickle: bool = False) -> Any:
        """A ShardedObject shard's value, as the tool's own load returns it (a reader
        whose tool wraps it, as Megatron's torch_dist does, unwraps it)."""
        return self.read_item(unique_key, allow_unsafe_pickle)

    def stored_dtype(self, key: str) -> DType:
        """The data type shardstore stores the tensor ``key`` as. Raises a
        CheckpointingException naming the checkpoint and the tensor where shardstore
        has none for its dtype (``float8_e4m3fnuz``): a ``torch.save`` file holds it."""
        dtype = self.tensors[key].dtype
        try:
            return from_torch(dtype)
        except UnsupportedDTypeError as exc:
            raise CheckpointingException(
                f"{self.path}: tensor {key!r} is {dtype}, a dtype shardstore does not store; convert the "
                f"checkpoint to a torch.save file instead (`shardstore convert {self.path} model.pt`), which holds it"
            ) from exc

    def read_tensor(self, key: str) -> torch.Tensor:
        """The whole global tensor ``key``."""
        return self.read_region(key, tuple(slice(0, n) for n in self.tensors[key].shape))

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, whole, one at a time (sorted by key)."""
        for key in sorted(self.tensors):
            yield key, self.read_tensor(key)

    def common_state(self, allow_unsafe_pickle: bool = False) -> dict[str, Any]:
        """Megatron's ``common.pt`` (weights_only unless ``allow_unsafe_pickle``), or {}
        where there is none."""
        data = self.read_file(COMMON_FILE, missing_ok=True, what="the common state")
        if data is None:
            return {}
        return deserialize_dict(data, str(self.path / COMMON_FILE), allow_unsafe_pickle)

    def config(self) -> CheckpointingConfig | None:
        """Its ``metadata.json`` (Megatron-Core's record of the backends that wrote it),
        read as every file of it is; None where there is none."""
        what = "the checkpoint's config"
        if self.file_size(CONFIG_FNAME, what) is None:
            return None
        data = self.read_bounded(CONFIG_FNAME, MAX_CONFIG_BYTES, what)
        return CheckpointingConfig.from_json(data, where=str(self.path / CONFIG_FNAME))

    def file_size(self, rel: str, what: str) -> int | None:
        """The size of the regular file ``rel`` from ``lstat``, nothing opened or read:
        what bounds a read before anything is allocated (a reader never trusts the
        sizes its metadata claims). None where it is missing; a symbolic link,
        directory or special file is refused. ``what``: for the error messages."""
        try:
            info = os.lstat(self.path / rel)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointingException(f"{self.path}: cannot inspect {rel!r}, holding {what}: {exc}") from exc
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointingException(
                f"{self.path}: refusing to read {what} from {rel!r}: not a regular file "
                "(a symbolic link, directory or special file)"
            )
        return info.st_size

    def read_bounded(self, rel: str, max_bytes: int, what: str) -> bytes:
        """The whole file ``rel``, refused before it is read when it is missing or
        larger than ``max_bytes`` (a metadata file: it is parsed whole)."""
        size = self.file_size(rel, what)
        if size is None:
            raise CheckpointingException(f"{self.path}: {rel!r}, holding {what}, is missing")
        if size > max_bytes:
            raise CheckpointingException(f"{self.path / rel}, holding {what}, is larger than {max_bytes} bytes")
        return self.read_file(rel, 0, size, what=what)

    def read_file(
        self, rel: str, offset: int = 0, length: int | None = None, missing_ok: bool = False, what: str = "data"
    ) -> bytes | None:
        """Bytes ``[offset, offset + length)`` of the file ``rel`` (the rest of it when
        ``length`` is None), read safely; None for a missing file when ``missing_ok``.
        ``what``: what the bytes are, for the error messages (e.g. the tensor's key)."""
        try:
            fd = open_regular_file(self.path, self.path / rel)
        except StorageError as exc:
            raise CheckpointingException(f"{self.path}: refusing to read {what} from {rel!r}: {exc}") from exc
        if fd is None:
            if missing_ok:
                return None
            raise CheckpointingException(f"{self.path}: {rel!r}, holding {what}, is missing")
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            stop = size if length is None else offset + length
            if offset < 0 or stop < offset or stop > size:
                raise CheckpointingException(
                    f"{self.path / rel}: {what} at bytes [{offset}, {stop}) lies outside the {size}-byte file"
                )
            f.seek(offset)
            return f.read(stop - offset)

    def load_pickled(self, data: bytes, what: str, allow_unsafe_pickle: bool = False) -> Any:
        """A ``torch.save`` value from ``data``, loaded safely (``shardstore.format.pickles``),
        or, for a checkpoint the caller trusts (``allow_unsafe_pickle``), as it is."""
        return deserialize(data, f"{what} of {self.path}", allow_unsafe_pickle)


@dataclass(frozen=True)
class Format:
    """A format of another tool's files, as the registry lists it (``registry``); each
    kind of format is a subtype (``OtherFormat``, ``FileFormat``).

    Attributes:
        name: what the format is called in data: inspection's ``kind`` and the command's
            ``source_format`` (``"torch_dist"``, ``"safetensors"``).
        title: what messages call one of its checkpoints or files
            (``"a PyTorch DCP checkpoint"``).
        detect: whether a location holds one of its checkpoints or files; cheap (at most
            a small metadata file read, by name, through the location: local or S3) and
            never unpickling, because every load, every conversion and every error about
            a directory without a commit record asks each format in turn.
    """

    name: str
    title: str
    detect: Callable[[Location], bool]


@dataclass(frozen=True)
class OtherFormat(Format):
    """A format of checkpoint directories that ``load`` reads as they are.

    Attributes:
        open: the reader, given the local directory: parses the metadata and refuses what
            it cannot read safely. Its checkpoints' ``OtherCheckpoint.kind`` is ``name``.
        metadata_file: the file that says what the checkpoint holds; an opened checkpoint
            is read again when this file changes (one load opens it several times).
        files: the top-level entries of its checkpoint at a location that holds its
            ``metadata_file``, told from other files there (a job's log, a shardstore
            checkpoint it was saved over) by their names alone; None where a checkpoint
            of the format is its whole directory. What a save names instead of deleting
            and a load names as ambiguous (``records.other_checkpoint_files``).
    """

    open: Callable[[Path], OtherCheckpoint]
    metadata_file: str
    files: Callable[[Location], list[str]] | None = None


@dataclass(frozen=True)
class TensorSpec(ShapedTensorSize):
    """A source tensor's dtype and shape, known before its bytes are read (a streamed
    safetensors file's header comes first)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tensor.dtype, tuple(tensor.shape))


@dataclass(frozen=True)
class ExportSource:
    """A source opened for an export (``tools.convert``: a ``torch.save`` file, a
    safetensors model), whatever its format, so that each target is written by one
    function.

    Attributes:
        tensors: each tensor's key (an array key; a ``torch.save`` file's tensors by
            their ``/``-joined path) -> its dtype and shape, sorted by key.
        read: ``read(keys, memory_bytes)`` yields ``(key, whole tensor)`` for ``keys``,
            at most ``memory_bytes`` alive at once (a larger tensor alone).
        other_values: everything else (common state, sharded object shards at their
            unique keys), nested as a ``torch.save`` file of the source holds it.
        place: where a tensor goes in that file: its dict keys and list indices.
        objects: the top-level keys of ``other_values`` that are sharded object shards.
        metadata: the source files' own metadata (a safetensors file's ``__metadata__``,
            without a shardstore layout), which a safetensors export keeps; {} for
            sources without any.
    """

    tensors: dict[str, TensorSpec]
    read: Callable[[list[str], int], Iterator[tuple[str, torch.Tensor]]]
    other_values: Callable[[], dict[Any, Any]]
    place: Callable[[str], tuple[str | int, ...]]
    objects: Callable[[], tuple[str, ...]] = tuple
    metadata: Callable[[], dict[str, str]] = dict

    @property
    def tensor_bytes(self) -> dict[str, int]:
        """Each tensor's size in bytes, by key."""
        return {key: spec.nbytes for key, spec in self.tensors.items()}

    def places(self) -> dict[str, tuple[str | int, ...]]:
        """Each tensor's place, for the layout that lets an export convert back exactly."""
        return {key: self.place(key) for key in self.tensor_bytes}


@dataclass(frozen=True)
class FileFormat(Format):
    """A format of model files (one file, or a directory of them, as a Hugging Face
    model) that shardstore converts from, and ``load`` does not read.

    Attributes:
        open: the reader, given the local path: its tensors memory-mapped, nothing
            unpickled that could run code.
        state_to_save: the state dict a shardstore save of the files at the local path
            is given: each array a ``ShardedTensor`` (memory-mapped) at its place, each
            sharded object shard a ``ShardedObject``, the rest the common state.
        suffixes: how the name of one of its files ends (``".pt"``); a conversion's
            destination named so is written in this format.
    """

    open: Callable[[Path], ExportSource]
    state_to_save: Callable[[Path], StateDict]
    suffixes: tuple[str, ...] = ()


def place_value(state: dict[Any, Any], path: tuple[Any, ...], value: Any, key: str) -> None:
    """Puts ``value`` at ``path`` (dict keys, list indices) of ``state``, making the
    dicts and lists on the way as ``dcp_to_torch_save`` does; refuses to replace a
    value, or to go through one that is not the container the path needs. How a plain
    DCP checkpoint's flattened values go back where they were in the state dict it saved
    (``OtherCheckpoint.saved_paths``), and how a conversion places every value."""
    node = make_parents(state, path, key)
    if not _is_free(node, path[-1], key):
        raise CheckpointingException(f"Cannot place {key!r}: another value is already at {list(path)}")
    node[path[-1]] = value


def make_parents(
    state: dict[Any, Any], path: tuple[Any, ...], key: str, int_keyed: Container[tuple[Any, ...]] = frozenset()
) -> Any:
    """The dict or list of ``state`` that holds the value at ``path``, making the dicts
    and lists on the way as ``dcp_to_torch_save`` does (a list where an int part
    follows), except a dict at a place in ``int_keyed``: one whose int keys the path
    names (``records.ArrayPlaces``); refuses to go through a value that is not the
    container the path needs."""
    node: Any = state
    for depth, (part, following) in enumerate(zip(path, path[1:])):
        if _is_free(node, part, key):
            node[part] = [] if isinstance(following, int) and path[:depth + 1] not in int_keyed else {}
        node = node[part]
    return node


def place_of_key(key: str, state: Any) -> tuple[str | int, ...]:
    """Where the array ``key`` goes in ``state`` (the other values of its checkpoint)
    when nothing else says: its ``/``-separated parts, each a dict key, except a part
    written as an index (``0``, ``12``; not ``01``) where ``state`` has a list on the
    way, which is that int index: ``layers/0`` beside ``{"layers": [None, 5]}`` goes to
    ``("layers", 0)``, where ``place_value`` puts it and a layout records it."""
    place: list[str | int] = []
    node = state
    for part in key.split("/"):
        index = _index(part) if isinstance(node, list) else None
        place.append(part if index is None else index)
        node = _child(node, part if index is None else index)
    return tuple(place)


def _index(part: str) -> int | None:
    """``part`` as a list index where it is written as one (ASCII digits, no leading 0)."""
    return int(part) if part.isascii() and part.isdigit() and str(int(part)) == part else None


def _child(node: Any, part: str | int) -> Any:
    """What ``node`` holds at ``part``; None where it holds nothing there."""
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and isinstance(part, int) and part < len(node):
        return node[part]
    return None


def _is_free(node: Any, part: Any, key: str) -> bool:
    """Whether ``node`` holds nothing at ``part``: a dict (any key), or a list (an
    index, up to which it is padded with None, as DCP pads it)."""
    if isinstance(node, list) and isinstance(part, int):
        node.extend([None] * (part + 1 - len(node)))
        return node[part] is None
    if not isinstance(node, dict):
        raise CheckpointingException(
            f"Cannot place {key!r}: a {type(node).__name__} is where its path needs a "
            f"{'list' if isinstance(part, int) else 'dict'} (at {part!r})"
        )
    return part not in node


def is_object_shard_key(key: Any) -> bool:
    """Whether ``key`` is a sharded object shard's unique key (``rng_state/shard_0_2``):
    Megatron's items in its checkpoints, and a top-level entry of a ``torch.save`` file
    whose value stays one object, whatever it holds."""
    if not isinstance(key, str):
        return False
    try:
        ShardedObject.empty_from_unique_key(key)
    except CheckpointingException:
        return False
    return True
