"""Other libraries' dialects of shardstore's API, one package each, above the API they
translate into (``megatron``: Megatron-Core's ``dist_checkpointing``; ``dcp``: PyTorch
DCP's ``StorageWriter`` and ``StorageReader``). The core takes only its own objects (a
save, an opened checkpoint); the mapping from a dialect's paths and names to them lives
here.
"""

from __future__ import annotations

__all__: list[str] = []
