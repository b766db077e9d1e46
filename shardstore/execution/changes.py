"""Tensors changed while a save reads them: the caller's race, caught before the commit.

A sync save writes CPU tensors from the caller's memory and checksums each block just
before writing it, so a tensor that another thread changes in place meanwhile (an
optimizer step) can be stored with a checksum of other bytes than the file holds: the
save would commit a chunk that every load refuses. PyTorch counts every in-place
change of a tensor (its version counter, bumped when the op is done); a save notes the
counters of its tensors before it reads them and compares them once it no longer reads
them (a sync save: after its writes; an async save: after its host copies), and fails,
committing nothing, where one moved. Writes that bypass PyTorch (through a NumPy view
or a raw pointer) go unseen; inference tensors keep no counter and are not checked.
"""

from __future__ import annotations

__all__ = ["SourceVersions"]

from dataclasses import dataclass

import torch

from shardstore.errors import CheckpointingException
from shardstore.mapping import ShardedTensor

# The most keys an error names.
_NAMED = 5


@dataclass(frozen=True)
class SourceVersions:
    """The version counters of a save's tensors when it began reading them."""

    keys: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]

    @classmethod
    def of(cls, tensors: list[ShardedTensor]) -> SourceVersions:
        """The counters of ``tensors``' data now (those with one: not inference tensors)."""
        kept = [(t.key, t.data) for t in tensors if isinstance(t.data, torch.Tensor) and not t.data.is_inference()]
        return cls(tuple(k for k, _ in kept), tuple(d for _, d in kept), tuple(d._version for _, d in kept))

    def changed(self) -> list[str]:
        """The keys of the tensors changed in place since (each once, in order)."""
        moved = (key for key, t, v in zip(self.keys, self.tensors, self.versions, strict=True) if t._version != v)
        return list(dict.fromkeys(moved))

    def error(self, where: str, until: str) -> CheckpointingException | None:
        """The failure of the save into ``where`` if a tensor changed before ``until``
        (what ended its reads), else None."""
        keys = self.changed()
        if not keys:
            return None
        named = ", ".join(repr(k) for k in keys[:_NAMED]) + (f" and {len(keys) - _NAMED} more" if len(keys) > _NAMED else "")
        what, it = ("tensor", "it") if len(keys) == 1 else ("tensors", "them")
        return CheckpointingException(
            f"Not committing the save into {where}: the {what} {named} changed in place while the save read {it} "
            f"(before {until}; another thread wrote {it}, an optimizer step for instance), so the bytes written "
            "may not be one state. Nothing was committed. Let no tensor change until a sync save returns, or save "
            "with async_sharded_save=True, which reads them only until it returns"
        )
