"""What a conversion keeps of a checkpoint's structure in a file of another format, so
that converting back gives the same checkpoint (``shardstore diff`` finds nothing).

A ``torch.save`` file or a safetensors model holds tensors and values, but not which
tensor was an array of the checkpoint (and under which key) and which was a value of
its common state (AdamW's 0-dim ``step``); a safetensors file holds no values at all.
An ``ExportStructure`` says it:

* ``arrays``: each array's key and its place in the file's state dict (dict keys and
  list indices, ints kept as ints: ``optim/state/0/exp_avg`` may sit at
  ``("optim", "state", 0, "exp_avg")``; a key of another type, a float or a negative
  int, as its text, as the array's key spells it); every other tensor of the file belongs to the
  common state where it is;
* ``objects``: the top-level entries that are sharded object shards (their unique keys);
* ``common`` (safetensors only): the common state, encoded as tagged JSON: dicts (str or
  int keys), lists, tuples, str, int, float, bool, None, and tensors by the name they
  have in the safetensors files. A value of another type is left out, and the export
  says which.

A ``torch.save`` file carries it as the archive entry ``shardstore_layout.json`` beside
``data.pkl`` (``torch.load`` ignores it); a safetensors model in the ``__metadata__`` of
its first file, under ``shardstore_layout``. Files without one convert as before: every
tensor an array keyed by its ``/``-joined path.

A layout is read as untrusted input: its size is bounded, its JSON parsed without
objects of other types, and each place checked against the file it describes.
"""

from __future__ import annotations

__all__ = [
    "ExportStructure",
    "Place",
    "TORCH_ENTRY",
    "common_tensor_names",
    "decode_common",
    "encode_common",
    "read_safetensors_layout",
    "read_safetensors_metadata",
    "read_torch_layout",
    "refuse_sparse_lists",
    "safetensors_metadata",
    "save_torch_file",
    "sparse_list_index",
    "value_at",
    "without_places",
    "write_torch_layout",
]

import json
import os
import zipfile
from collections import Counter
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardstore.errors import CheckpointingException

TORCH_ENTRY = "shardstore_layout.json"
SAFETENSORS_KEY = "shardstore_layout"
FORMAT = "shardstore-layout"
VERSION = 1
MAX_LAYOUT_BYTES = 64 * 2**20
MAX_DEPTH = 200  # nesting of an encoded common state: far deeper than any state dict, well inside Python's stack

Place = tuple[str | int, ...]


@dataclass(frozen=True)
class ExportStructure:
    """Which values of an exported file are the checkpoint's arrays (by key, at their
    place), which top-level entries are its sharded object shards, and (safetensors
    only) its common state encoded by ``encode_common``."""

    arrays: Mapping[str, Place] = field(default_factory=dict)
    objects: tuple[str, ...] = ()
    common: Any = None

    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT, "version": VERSION,
            "arrays": [[key, [_storable(part) for part in place]] for key, place in self.arrays.items()],
            "objects": list(self.objects), "common": self.common,
        })

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> ExportStructure:
        """The layout ``text`` holds; anything malformed is refused naming ``where``."""
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError("not a shardstore layout")
            if data.get("version") != VERSION:
                raise ValueError(f"version {data.get('version')!r}; this shardstore reads version {VERSION}")
            arrays: dict[str, Place] = {}
            for key, place in data["arrays"]:
                if not isinstance(key, str) or key in arrays or not _is_place(place):
                    raise ValueError(f"array entry {key!r} at {place!r} is malformed or repeated")
                arrays[key] = tuple(place)
            if not isinstance(data["objects"], list) or not all(isinstance(k, str) for k in data["objects"]):
                raise ValueError("its object keys are not a list of strings")
            objects = tuple(data["objects"])
            common = data.get("common")
            if common is not None:
                _check_encoded(common)
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            raise CheckpointingException(
                f"{where}: its shardstore layout is malformed ({exc}); convert it again from the checkpoint"
            ) from exc
        return cls(arrays, objects, common)


def _is_place(place: Any) -> bool:
    return isinstance(place, list) and len(place) > 0 and all(_is_part(p) for p in place)


def _is_part(part: Any) -> bool:
    """A part of a place as a layout holds it: a str, or an int (not a bool) from 0."""
    return isinstance(part, str) or (type(part) is int and part >= 0)


def _storable(part: Any) -> str | int:
    """A part of a place as a layout writes it: as it is where ``_is_part``, else its
    text (a float or negative int key of a ``torch.save`` file: ``"1.5"``), as its array's
    key spells it and an import without a layout places it."""
    return part if _is_part(part) else str(part)


# --------------------------------------------------------------------------- common state as JSON


def encode_common(state: Mapping[Any, Any]) -> tuple[Any, dict[str, torch.Tensor], list[str]]:
    """``state`` as tagged JSON, with its tensors named by their ``/``-joined paths:
    returns the encoding, the tensors by name, and the paths of the values left out
    (of a type JSON does not hold)."""
    tensors: dict[str, torch.Tensor] = {}
    left_out: list[str] = []
    return _encode(dict(state), (), tensors, left_out), tensors, left_out


def _encode(value: Any, path: tuple[Any, ...], tensors: dict[str, torch.Tensor], left_out: list[str]) -> Any:
    """The encoding of ``value``, or None where it is left out (its path noted in
    ``left_out``; its tensors named in ``tensors``). Module-level, not a closure calling
    itself: that would be a reference cycle holding the tensors (``dict_utils._walk``)."""
    name = "/".join(map(str, path))
    if isinstance(value, torch.Tensor):
        if name in tensors:
            raise CheckpointingException(
                f"Two tensors of the common state have the name {name!r} (an int and a str key that read the "
                "same); convert to a torch.save file, which keeps both"
            )
        tensors[name] = value
        return {"tensor": name}
    if type(value) is dict and all(isinstance(k, str) or type(k) is int for k in value):
        entries = [[k, _encode(v, (*path, k), tensors, left_out)] for k, v in value.items()]
        return {"dict": [[k, v] for k, v in entries if v is not None]}
    if type(value) in (list, tuple):
        noted = len(left_out)
        items = [_encode(v, (*path, i), tensors, left_out) for i, v in enumerate(value)]
        if any(v is None for v in items):  # its indices would shift: all of it is left out
            del left_out[noted:]
            left_out.append(name)
            for v in items:
                for tensor_name in common_tensor_names(v) if v is not None else ():
                    del tensors[tensor_name]
            return None
        return {type(value).__name__: items}
    if value is None or type(value) in (str, int, float, bool):
        return {"value": value}
    left_out.append(name)
    return None


def decode_common(encoded: Any, tensors: Mapping[str, torch.Tensor], where: str) -> dict[Any, Any]:
    """The common state ``encode_common`` encoded, its tensors taken from ``tensors``."""
    state = _decode(encoded, tensors, where)
    if not isinstance(state, dict):
        raise CheckpointingException(f"{where}: its layout's common state is not a dict")
    return state


def _decode(node: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    (tag, payload), = node.items()
    if tag == "tensor":
        if payload not in tensors:
            raise CheckpointingException(f"{where}: its layout names a tensor {payload!r} that it does not hold")
        return tensors[payload]
    if tag == "dict":
        return {k: _decode(v, tensors, where) for k, v in payload if v is not None}
    if tag in ("list", "tuple"):
        items = [_decode(v, tensors, where) for v in payload]
        return items if tag == "list" else tuple(items)
    return payload


def common_tensor_names(encoded: Any) -> Iterator[str]:
    """The names of the tensors an encoded common state refers to."""
    (tag, payload), = encoded.items()
    if tag == "tensor":
        yield payload
    elif tag == "dict":
        for _, v in payload:
            yield from common_tensor_names(v)
    elif tag in ("list", "tuple"):
        for v in payload:
            yield from common_tensor_names(v)


def _check_encoded(node: Any, depth: int = 0) -> None:
    """Refuses an encoding ``decode_common`` could not read (a hostile or damaged layout)."""
    if depth > MAX_DEPTH or not isinstance(node, dict) or len(node) != 1:
        raise ValueError("its common state is not an encoded value")
    (tag, payload), = node.items()
    if tag == "tensor" and isinstance(payload, str):
        return
    if tag == "value" and (payload is None or isinstance(payload, (str, int, float, bool))):
        return
    if tag == "dict" and isinstance(payload, list):
        for entry in payload:
            if not (isinstance(entry, list) and len(entry) == 2 and (isinstance(entry[0], str) or type(entry[0]) is int)):
                raise ValueError(f"a dict entry {entry!r} is malformed")
            _check_encoded(entry[1], depth + 1)
        return
    if tag in ("list", "tuple") and isinstance(payload, list):
        for v in payload:
            _check_encoded(v, depth + 1)
        return
    raise ValueError(f"an encoded value has the tag {tag!r} with a {type(payload).__name__}")


# --------------------------------------------------------------------------- places in a state dict


def value_at(state: Any, place: Place, where: str) -> Any:
    """The value at ``place`` (dict keys, list indices) of a loaded state dict; refused
    naming ``where`` when the state dict has nothing there."""
    node = state
    for part in place:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError) as exc:
            raise CheckpointingException(
                f"{where}: its shardstore layout places an array at {list(place)}, where the file holds nothing; "
                "convert the file again from its checkpoint"
            ) from exc
    return node


def refuse_sparse_lists(layout: ExportStructure, where: str) -> None:
    """Refuses a layout (read from ``where``) whose arrays go to list indices past what
    the lists could hold (``sparse_list_index``)."""
    found = sparse_list_index(_skeleton(layout.common) if layout.common is not None else {}, layout.arrays.values())
    if found is not None:
        prefix, index, length, arrays = found
        raise CheckpointingException(
            f"{where}: its shardstore layout places an array at index {index} of the list at {list(prefix)}, "
            f"which holds {length} values and {arrays} array(s); the layout is damaged or "
            "hostile: convert it again from the checkpoint"
        )


def sparse_list_index(
    state: Any, places: Iterable[Place], int_keyed: Container[Place] = frozenset()
) -> tuple[Place, int, int, int] | None:
    """The first list index among ``places`` past what its list could hold: the length
    of the list in ``state`` (0 where there is none, and placing an array makes one)
    plus the arrays placed in that list; returns the list's place, the index, that
    length and those arrays, or None. An int part at a place in ``int_keyed`` is a dict
    key (``records.ArrayPlaces``), unless ``state`` has a list there. Placing an array pads its list with None up to its
    index, so a hostile index (``10**12``) would allocate without bound; an export's own
    indices stay within that."""
    lengths: dict[Place, int] = {}
    under: Counter[Place] = Counter()
    largest: dict[Place, int] = {}
    for place in places:
        node = state
        for depth, part in enumerate(place):
            prefix = place[:depth]
            in_list = isinstance(node, list) or (not isinstance(node, dict) and prefix not in int_keyed)
            if type(part) is int and in_list:
                lengths[prefix] = len(node) if isinstance(node, list) else 0  # in one there, or a new one
                under[prefix] += 1
                largest[prefix] = max(largest.get(prefix, 0), part)
            node = _child(node, part)
    for prefix, index in largest.items():
        if index >= lengths[prefix] + under[prefix]:
            return prefix, index, lengths[prefix], under[prefix]
    return None


def _skeleton(encoded: Any) -> Any:
    """The dicts and lists of an encoded common state (``_check_encoded``), other values
    None: what a place walks through."""
    (tag, payload), = encoded.items()
    if tag == "dict":
        return {k: _skeleton(v) for k, v in payload}
    if tag in ("list", "tuple"):
        return [_skeleton(v) for v in payload]
    return None


def _child(node: Any, part: str | int) -> Any:
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and type(part) is int and part < len(node):
        return node[part]
    return None


def without_places(node: Any, places: set[Place], path: Place = ()) -> Any:
    """A copy of the containers of ``node`` without the values at ``places`` (the
    arrays): a dict loses the entry, and one that held only arrays goes too; a list
    keeps None in their slots, so that the other values keep their indices."""
    if type(node) is dict:
        kept = {}
        for k, v in node.items():
            if (*path, k) in places:
                continue
            value = without_places(v, places, (*path, k))
            if not (isinstance(v, (dict, list)) and v and not value):
                kept[k] = value
        return kept
    if type(node) is list:
        return [None if (*path, i) in places else without_places(v, places, (*path, i)) for i, v in enumerate(node)]
    return node


# --------------------------------------------------------------------------- where files carry it


def write_torch_layout(path: Path, layout: ExportStructure) -> None:
    """Adds the layout to the ``torch.save`` archive ``path``, beside its ``data.pkl``."""
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr(f"{_archive_folder(archive, path)}/{TORCH_ENTRY}", layout.to_json())


def read_torch_layout(path: Path) -> ExportStructure | None:
    """The layout a ``torch.save`` file carries; None where it carries none (written by
    another tool, or in the legacy non-zip format)."""
    if not zipfile.is_zipfile(path):
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            name = f"{_archive_folder(archive, path)}/{TORCH_ENTRY}"
            try:
                info = archive.getinfo(name)
            except KeyError:
                return None
            if info.file_size > MAX_LAYOUT_BYTES:
                raise CheckpointingException(f"{path}: its layout entry is larger than {MAX_LAYOUT_BYTES} bytes")
            text = archive.read(info)
    except (OSError, zipfile.BadZipFile) as exc:
        raise CheckpointingException(f"Cannot read {path} as a torch.save archive: {exc}") from exc
    return ExportStructure.from_json(text, str(path))


def _archive_folder(archive: zipfile.ZipFile, path: Path) -> str:
    """The folder of a ``torch.save`` archive's records (the one holding ``data.pkl``)."""
    folders = {name.rsplit("/", 1)[0] for name in archive.namelist() if name.endswith("/data.pkl")}
    if len(folders) != 1:
        raise CheckpointingException(f"{path} is not a torch.save archive (no single data.pkl)")
    return folders.pop()


def safetensors_metadata(layout: ExportStructure) -> dict[str, str]:
    """The ``__metadata__`` entry that carries ``layout`` in a safetensors file."""
    return {SAFETENSORS_KEY: layout.to_json()}


def read_safetensors_layout(path: str | os.PathLike) -> ExportStructure | None:
    """The layout a safetensors file's ``__metadata__`` carries; None where there is none."""
    text = _read_safetensors_metadata(path).get(SAFETENSORS_KEY)
    return None if text is None else ExportStructure.from_json(text, str(path))


def read_safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """A safetensors file's own ``__metadata__`` (``format``, an author's entries), without
    the layout a shardstore export put there: what a safetensors export of it keeps."""
    return {k: v for k, v in _read_safetensors_metadata(path).items() if k != SAFETENSORS_KEY}


def _read_safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), "pt") as f:
            return f.metadata() or {}
    except Exception as exc:  # the library's own errors name no file
        raise CheckpointingException(f"Cannot read {path} as a safetensors file: {type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------- failures while writing


class ErrorKeepingWriter:
    """A file for ``torch.save`` that keeps the ``OSError`` of a failed write: torch's
    archive writer reports it only as ``unexpected pos ...``, naming neither the file
    nor the cause (a full disk)."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


def save_torch_file(state: Any, path: Path, target: Path, layout: ExportStructure | None) -> None:
    """``torch.save(state)`` into ``path`` (with ``layout``), flushed to the disk; a
    failure raises naming ``target`` and the cause (``No space left on device``)."""
    try:
        with open(path, "wb") as file:
            writer = ErrorKeepingWriter(file)
            try:
                torch.save(state, writer)
            except RuntimeError as exc:
                if writer.error is None:
                    raise
                raise writer.error from exc
        if layout is not None:
            write_torch_layout(path, layout)
        with open(path, "rb") as file:
            os.fsync(file.fileno())
    except OSError as exc:
        raise CheckpointingException(
            f"Cannot write {target} (a torch.save file): {exc.strerror or exc}; nothing was left there"
        ) from exc

