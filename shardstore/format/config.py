"""The ``metadata.json`` record of a checkpoint: which backends wrote it.

``metadata.json`` says which backends wrote the checkpoint (Megatron-Core's
``CheckpointingConfig``). It is NOT the commit record: a checkpoint exists only once
the root ``zarr.json`` has been written (see ``shardstore.format.commit``).
``read_config`` and ``write_config`` take a Location; Megatron-Core's functions of a
checkpoint directory (``maybe_load_config``, ``check_is_distributed_checkpoint``,
``save_config``) are ``shardstore.core``'s (``compat.megatron.core``).
"""

from __future__ import annotations

__all__ = ["CONFIG_FNAME", "MAX_CONFIG_BYTES", "CheckpointingConfig", "read_config", "write_config"]

import json
from dataclasses import asdict, dataclass
from typing import Any

from shardstore.errors import CheckpointingException
from shardstore.stores.base import Location

CONFIG_FNAME = "metadata.json"
MAX_CONFIG_BYTES = 2**20  # a config larger than this is refused before it is read


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


def read_config(location: Location) -> CheckpointingConfig | None:
    """The config of the checkpoint at ``location``; None where there is no
    ``metadata.json``, or the location is a file (as in Megatron-Core: no checkpoint,
    not an error).

    Raises:
        CheckpointingException: the file cannot be read, or is no config.
    """
    try:
        data = location.read_bytes_or_none(CONFIG_FNAME, max_bytes=MAX_CONFIG_BYTES)
    except CheckpointingException as exc:  # a StorageError already names the file
        if isinstance(exc.__cause__, NotADirectoryError):  # the location is a file
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
