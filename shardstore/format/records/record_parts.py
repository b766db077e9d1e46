"""The commit record's parts besides its arrays, each with its JSON and that JSON
checked when read back:

- ``ObjectRecord``: where a ShardedObject's shards are, its key and the unique keys of
  its shards, each a file at ``names.object_path``.
- ``ReusedChunks`` (``reused_from``): what a checkpoint shares with the earlier one its
  save reused from; informational, for ``inspect`` and the logs.
- ``DcpMetadata`` (``dcp``): what a save through PyTorch DCP's API recorded of DCP's own
  metadata, and the places in a caller's state dict it names (``StatePath``, checked by
  ``state_paths``).
- ``ArrayPlaces`` (``places``): where an import of model files found the arrays whose
  keys do not spell their places.
"""

from __future__ import annotations

__all__ = [
    "ArrayPlaces",
    "DcpMetadata",
    "ObjectRecord",
    "ReusedChunks",
    "StatePath",
    "state_paths",
]

from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from shardstore.errors import CheckpointingException


@dataclass(frozen=True)
class ObjectRecord:
    """Where a ShardedObject's shards are: its key and the unique keys of its shards."""

    key: str
    shard_keys: tuple[str, ...]


@dataclass(frozen=True)
class ReusedChunks:
    """What a checkpoint shares with the earlier one its save reused from
    (``format.reuse``): informational, for ``inspect`` and the logs. The chunks are
    listed in the record like any other; the checkpoint stands alone.

    Attributes:
        checkpoint: where the earlier checkpoint was, as its save saw it.
        save_id: the earlier checkpoint's save id.
        chunks: how many chunks were shared instead of written.
        nbytes: their stored bytes (each chunk's data and its crc32c).
    """

    checkpoint: str
    save_id: str
    chunks: int
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "save_id": self.save_id, "chunks": self.chunks, "bytes": self.nbytes}

    @classmethod
    def from_json(cls, value: Any, where: str) -> ReusedChunks | None:
        if value is None:
            return None
        fields = (value.get("checkpoint"), value.get("save_id"), value.get("chunks"), value.get("bytes")) if (
            isinstance(value, dict)) else None
        if (fields is None or not isinstance(fields[0], str) or not isinstance(fields[1], str)
                or not all(isinstance(n, int) and n >= 0 for n in fields[2:])):
            raise CheckpointingException(f"{where}: malformed 'reused_from' in the commit record")
        return cls(*fields)


StatePath = tuple[str | int, ...]


def state_paths(planner_data: Any, entries: int) -> dict[str, StatePath] | None:
    """Where each flattened key of a DCP save was in the state dict DCP was given (the
    dict keys and list indices its default planner records as ``planner_data``, by which
    ``dcp_to_torch_save`` rebuilds the nesting), checked; None where ``planner_data`` is
    not such a mapping. Each list index is below ``entries`` and below the number of
    paths under that list, so rebuilding the nesting allocates at most one slot per path
    and level, whatever a hostile file says."""
    if not isinstance(planner_data, dict):
        return None
    paths: dict[str, StatePath] = {}
    for key, path in planner_data.items():
        well_formed = isinstance(key, str) and isinstance(path, tuple) and len(path) > 0 and all(
            isinstance(part, str) or (type(part) is int and 0 <= part < entries) for part in path
        )
        if not well_formed:
            return None
        paths[key] = path
    return paths if _lists_are_dense(paths.values()) else None


def _lists_are_dense(paths: Iterable[StatePath]) -> bool:
    """Whether every list the paths index into has fewer slots than paths under it."""
    under: Counter[tuple] = Counter()
    largest: dict[tuple, int] = {}
    for path in paths:
        for depth, part in enumerate(path):
            if type(part) is int:
                prefix = path[:depth]
                under[prefix] += 1
                largest[prefix] = max(largest.get(prefix, 0), part)
    return all(index < under[prefix] for prefix, index in largest.items())


@dataclass(frozen=True)
class DcpMetadata:
    """What a save through PyTorch DCP's API (``compat.dcp.writer.ShardstoreWriter``)
    recorded of DCP's own metadata, for ``ShardstoreReader.read_metadata`` to give back:
    sealed in the commit record like the rest of it. Checkpoints saved before it existed,
    and every ``shardstore.save``, have none.

    Attributes:
        paths: DCP's ``Metadata.planner_data`` (each saved name -> its dict keys and list
            indices in the caller's state dict), with the list slots DCP's flattening
            dropped (empty dicts) added; None where the planner recorded no such mapping.
        checkpoint_id, save_id, modules: DCP's ``StorageMeta`` of the save, the
            checkpoint id as text.
    """

    paths: dict[str, StatePath] | None
    checkpoint_id: str | None = None
    save_id: str | None = None
    modules: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        paths = None if self.paths is None else {key: list(path) for key, path in self.paths.items()}
        return {"planner_paths": paths, "checkpoint_id": self.checkpoint_id, "save_id": self.save_id,
                "modules": list(self.modules)}

    @classmethod
    def from_json(cls, value: Any, where: str) -> DcpMetadata | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise CheckpointingException(f"{where}: malformed 'dcp' in the commit record")
        modules = value.get("modules", [])
        paths = _paths_from_json(value.get("planner_paths"), where)
        texts = (value.get("checkpoint_id"), value.get("save_id"))
        if not all(t is None or isinstance(t, str) for t in texts) or not (
                isinstance(modules, list) and all(isinstance(m, str) for m in modules)):
            raise CheckpointingException(f"{where}: malformed DCP storage metadata in the commit record")
        return cls(paths, *texts, tuple(modules))


def _paths_from_json(raw: Any, where: str) -> dict[str, StatePath] | None:
    """``DcpMetadata.paths`` as JSON holds them (lists), checked by ``state_paths``."""
    if raw is None:
        return None
    lists = isinstance(raw, dict) and all(isinstance(path, list) for path in raw.values())
    paths = state_paths({key: tuple(path) for key, path in raw.items()}, len(raw)) if lists else None
    if paths is None:
        raise CheckpointingException(f"{where}: malformed DCP planner paths in the commit record")
    return paths


@dataclass(frozen=True)
class ArrayPlaces:
    """Where an import of model files (``tools.convert``: a ``torch.save`` file,
    safetensors) found the arrays whose keys do not spell their places: under an int
    dict key (``optim/state/0/exp_avg`` at ``sd["optim"]["state"][0]["exp_avg"]``), in a
    list, under a key holding a ``/``. The save keeps in the common state no dict or
    list that held only arrays, and a key's text says neither, so without it an export
    would put the array under the str key ``"0"``. Sealed in the commit record; every
    other save, and an import by a shardstore before it, has none.

    Attributes:
        paths: each such array's key -> its dict keys and list indices; an int is a
            list index unless the container it indexes is in ``int_keyed``; a dict key
            of another type than str and int is its text, as the array's key spells it.
        int_keyed: the places of the dicts on those paths that an int part is a key of.
    """

    paths: dict[str, StatePath]
    int_keyed: frozenset[StatePath] = frozenset()

    def to_json(self) -> dict[str, list[Any]]:
        """Each path as a list of parts: a str key, an int list index, ``{"int": n}``
        an int key."""
        return {
            key: [{"int": part} if type(part) is int and path[:depth] in self.int_keyed else part
                  for depth, part in enumerate(path)]
            for key, path in sorted(self.paths.items())
        }

    @classmethod
    def from_json(cls, value: Any, arrays: Collection[str], where: str) -> ArrayPlaces | None:
        """The places ``value`` holds, of some of ``arrays``; anything malformed (a part
        of another type, a container both a dict and a list) is refused naming ``where``.
        Its list indices are bounded where the common state is known (``tools.convert``)."""
        if value is None:
            return None
        try:
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
            paths: dict[str, StatePath] = {}
            int_keyed: set[StatePath] = set()
            kinds: dict[StatePath, type] = {}
            for key, parts in value.items():
                if key not in arrays or not isinstance(parts, list) or not parts:
                    raise ValueError(f"{key!r} is not an array with a list of parts")
                path: list[str | int] = []
                for part in parts:
                    keyed = isinstance(part, dict) and list(part) == ["int"] and type(part["int"]) is int
                    if not (keyed or isinstance(part, str) or (type(part) is int and part >= 0)):
                        raise ValueError(f"{key!r} has the part {part!r}")
                    prefix, kind = tuple(path), list if type(part) is int else dict
                    if kinds.setdefault(prefix, kind) is not kind:
                        raise ValueError(f"{list(prefix)} is both a dict and a list")
                    if keyed:
                        int_keyed.add(prefix)
                    path.append(part["int"] if keyed else part)
                paths[key] = tuple(path)
        except ValueError as exc:
            raise CheckpointingException(
                f"{where}: malformed 'places' in the commit record ({exc}); it is damaged or was edited"
            ) from exc
        return cls(paths, frozenset(int_keyed))
