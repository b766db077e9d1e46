"""The ``metadata.json`` record of a checkpoint: which backends wrote it.

``metadata.json`` says which backends wrote the checkpoint (Megatron-Core's
``CheckpointingConfig``). It is NOT the commit record: a checkpoint exists only once
the root ``zarr.json`` has been written (see ``shardstore.format.commit``).
``shardstore.core`` exposes these under Megatron-Core's names.
"""

from __future__ import annotations

__all__ = [
    "CONFIG_FNAME", "CheckpointingConfig", "check_is_distributed_checkpoint", "maybe_load_config",
    "write_config",
]

import json
from dataclasses import asdict, dataclass
from typing import Any

from shardstore.errors import CheckpointingException
from shardstore.stores.base import Location
from shardstore.stores.locations import open_location

CONFIG_FNAME = "metadata.json"


@dataclass(frozen=True)
class CheckpointingConfig:
    """Which save strategies (backend and version) wrote a checkpoint.

    Attributes:
        sharded_backend: backend of the sharded tensors (``"shardstore"``; ``"zarr"`` in
            checkpoints of shardstore 0.1, and Megatron-Core's zarr backend's).
        sharded_backend_version: format version of that backend.
        common_backend: backend of the common state (``"torch"``).
        common_backend_version: format version of that backend.
    """

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str = "metadata.json") -> CheckpointingConfig:
        try:
            record: Any = json.loads(data)
            if not isinstance(record, dict):
                raise TypeError(f"expected a JSON object, got {type(record).__name__}")
            config = cls(**record)
        except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: nested past the parser's depth
            raise CheckpointingException(f"{where} is not a valid checkpoint config: {exc}") from exc
        if not isinstance(config.sharded_backend, str) or not isinstance(
            config.sharded_backend_version, int
        ):
            raise CheckpointingException(f"{where} has malformed backend fields: {record}")
        return config


def check_is_distributed_checkpoint(checkpoint_dir: str | Location) -> bool:
    """True if ``checkpoint_dir`` holds a distributed checkpoint's ``metadata.json``.

    Like Megatron-Core this looks for the config only; use
    ``shardstore.format.is_committed`` to know whether the save completed.
    """
    return maybe_load_config(checkpoint_dir) is not None


def maybe_load_config(checkpoint_dir: str | Location) -> CheckpointingConfig | None:
    """Returns the checkpoint's config, or None when there is no ``metadata.json``.

    As in Megatron-Core, an empty path and a path that is a file are no checkpoint
    (None), not an error.
    """
    if checkpoint_dir == "":
        return None
    location = open_location(checkpoint_dir)
    try:
        data = location.read_bytes_or_none(CONFIG_FNAME, max_bytes=2**20)
    except CheckpointingException as exc:  # a StorageError already names the file
        if isinstance(exc.__cause__, NotADirectoryError):  # the path is a file
            return None
        raise
    except OSError as exc:
        raise CheckpointingException(f"Cannot read {location.describe(CONFIG_FNAME)}: {exc}") from exc
    if data is None:
        return None
    return CheckpointingConfig.from_json(data, where=location.describe(CONFIG_FNAME))


def write_config(config: CheckpointingConfig, location: Location) -> None:
    """Writes ``metadata.json`` (call on one rank only). Megatron-Core's ``save_config``,
    which takes a path, is ``shardstore.core.save_config``."""
    location.write_bytes(CONFIG_FNAME, config.to_json())
