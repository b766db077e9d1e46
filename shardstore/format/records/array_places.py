"""Where an import of model files found the arrays whose keys do not spell their places
(``ArrayPlaces``, ``places`` in the commit record).
"""

from __future__ import annotations

__all__ = [
    "ArrayPlaces",
]

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from shardstore.errors import CheckpointingException
from shardstore.format.records.dcp_metadata import StatePath


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
