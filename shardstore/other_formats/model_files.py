"""The files of a safetensors model (a Hugging Face model directory), opened as safely as
a checkpoint's (``safetensors`` reads a model through them).

A model directory is downloaded or shared: its ``model.safetensors.index.json`` names
the shard files, and whoever wrote it chooses those names. Imports therefore open only
regular files inside the model directory: a FIFO named by the index would block the
import forever, ``/dev/zero`` would never end, and ``../../.ssh/id_rsa`` or a symbolic
link out of the directory would read someone else's file. The one link allowed out of
the directory is the Hugging Face cache's own: ``models--org--name/snapshots/<rev>/f``
links to ``models--org--name/blobs/<hash>``, inside the same cached repository.

Every file is opened without following a link at its last component and without
blocking (``stores.local_files.open_regular``: ``O_NOFOLLOW | O_NONBLOCK``, then ``fstat``
must say regular file), after its real path was checked to lie inside the directory
(or the cached repository). The index is read through the same size bound as a
checkpoint's records.

An index is also a promise about what the files hold: every tensor its ``weight_map``
names must be in the file it names (``SafetensorsModel.refuse_unheld``), so that an
import never drops a tensor the model needs without a word.
"""

from __future__ import annotations

__all__ = [
    "MAX_INDEX_BYTES",
    "SAFETENSORS_INDEX",
    "SAFETENSORS_SINGLE",
    "SafetensorsModel",
    "open_model_file",
    "safetensors_model",
]

import json
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardstore.errors import CheckpointingException
from shardstore.stores.base import StorageError
from shardstore.stores.local import check_inside, open_regular

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
# An index of a 1-trillion-parameter model lists ~10^5 tensor names: a few MiB.
MAX_INDEX_BYTES = 64 * 2**20


@dataclass(frozen=True)
class SafetensorsModel:
    """The files of a safetensors model and, where an index names them, which file holds
    each tensor.

    Attributes:
        files: each file's real path, checked (module docstring), sorted by name.
        index: the index file, None for a single file.
        weight_map: tensor name -> the real path of the file the index says holds it;
            empty without an index.
    """

    files: tuple[Path, ...]
    index: Path | None = None
    weight_map: Mapping[str, Path] = field(default_factory=dict)

    def refuse_unheld(self, held: Mapping[Path, Collection[str]]) -> None:
        """Refuses a model whose index names a tensor that the file it names does not hold.

        Args:
            held: each of ``files`` -> the tensor names its header lists.

        Raises:
            CheckpointingException: naming the first such tensor, its file and the index.
        """
        for name, file in sorted(self.weight_map.items()):
            if name not in held.get(file, ()):
                holders = sorted(f.name for f, names in held.items() if name in names)
                found = f"; it is in {holders[0]}" if holders else "; no file of the model holds it"
                raise CheckpointingException(
                    f"{self.index}: weight_map names tensor {name!r} in {file.name}, which does not hold it{found}. "
                    "Importing would lose that tensor; download the model again or fix its index"
                )


def safetensors_model(path: str | os.PathLike) -> SafetensorsModel:
    """The files of the safetensors model at ``path``: ``path`` itself when it is a file,
    or the shards its directory's index names, or the directory's single
    ``model.safetensors``.

    Raises:
        CheckpointingException: naming the file (and the index key) that is not a
            regular file inside the model directory, or a malformed index.
    """
    root = Path(path)
    if root.is_file():
        return SafetensorsModel((Path(os.path.realpath(root)),))
    index = root / SAFETENSORS_INDEX
    if os.path.lexists(index):
        weight_map = _weight_map(index, _read_index(index, root))
        files = {name: _checked(root, name, f"{index} (weight_map)") for name in sorted(set(weight_map.values()))}
        return SafetensorsModel(
            tuple(files.values()), index, {tensor: files[name] for tensor, name in weight_map.items()}
        )
    if os.path.lexists(root / SAFETENSORS_SINGLE):
        return SafetensorsModel((_checked(root, SAFETENSORS_SINGLE, str(root)),))
    raise CheckpointingException(f"{root} holds no safetensors model ({SAFETENSORS_INDEX} or {SAFETENSORS_SINGLE})")


def open_model_file(path: Path) -> int:
    """A read-only descriptor of ``path`` (one of ``SafetensorsModel.files``), still a regular
    file (it could have been swapped for a FIFO since it was listed)."""
    try:
        fd = open_regular(path)
    except OSError as exc:  # StorageError names the path and why
        raise CheckpointingException(f"Cannot read {path}: {exc}") from exc
    if fd is None:
        raise CheckpointingException(f"{path} disappeared while the model was read")
    return fd


def _read_index(index: Path, root: Path) -> dict[str, Any]:
    """The index's JSON object, read as a regular file inside ``root``, bounded."""
    fd = open_model_file(_checked(root, SAFETENSORS_INDEX, str(root)))
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_INDEX_BYTES + 1)
    if len(data) > MAX_INDEX_BYTES:
        raise CheckpointingException(
            f"{index} is larger than {MAX_INDEX_BYTES} bytes, more than any model's index; is it one?"
        )
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser's depth
        raise CheckpointingException(f"{index} is not a safetensors index (not JSON: {exc})") from exc
    if not isinstance(value, dict):
        raise CheckpointingException(f"{index} is not a safetensors index: a JSON object was expected")
    return value


def _weight_map(index: Path, value: dict[str, Any]) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> file name), each file a plain name in
    the model directory."""
    weight_map = value.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointingException(
            f"{index} has no 'weight_map' object naming each tensor's file; fix or remove the index "
            f"(a single {SAFETENSORS_SINGLE} needs none)"
        )
    for key, name in weight_map.items():
        if not isinstance(name, str) or not _plain_name(name):
            raise CheckpointingException(
                f"{index}: weight_map[{key!r}] is {name!r}, not the name of a file in the model directory "
                "(no '/', no leading '.'); the index is damaged or not meant for this directory"
            )
    return weight_map


def _plain_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and "\0" not in name and not name.startswith(".")


def _checked(root: Path, name: str, named_by: str) -> Path:
    """The real path of ``root/name``, which must lie inside the model directory or its
    Hugging Face cache repository."""
    path = root / name
    real = Path(os.path.realpath(path))
    try:
        check_inside(_allowed_root(root), real.parent)
    except StorageError as exc:
        raise CheckpointingException(
            f"{path}, named by {named_by}, leads outside the model directory (to {real}); refusing to read it"
        ) from exc
    return real


def _allowed_root(root: Path) -> Path:
    """Where the files of the model at ``root`` may really lie: the Hugging Face cache
    repository ``models--*`` for a ``snapshots/<rev>`` directory, else ``root``."""
    absolute = Path(os.path.abspath(root))
    snapshots, repo = absolute.parent, absolute.parent.parent
    if snapshots.name == "snapshots" and repo.name.startswith(("models--", "datasets--")):
        return repo
    return absolute
