"""What a save through PyTorch DCP's API recorded of DCP's own metadata (``DcpMetadata``,
``dcp`` in the commit record), and the places in a caller's state dict it names
(``StatePath``, checked by ``state_paths``).
"""

from __future__ import annotations

__all__ = [
    "DcpMetadata",
    "StatePath",
    "state_paths",
]

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shardstore.errors import CheckpointingException

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
