"""The names code written for Megatron-Core imports from its torch_dist strategy module
(``dist_checkpointing.strategies.torch``), so that such code runs on shardstore.

shardstore writes no torch_dist checkpoints (its format is ``strategies.zarr``'s) and
reads Megatron's through ``strategies.other_formats`` (``load`` and the queries do so
when given ``TorchDistLoadShardedStrategy`` too). ``TorchDistSaveShardedStrategy``
and ``TorchDistLoadShardedStrategy`` are therefore names for shardstore's own strategies
that take Megatron's arguments (``TorchDistSaveShardedStrategy("torch_dist", 1,
thread_count=2, separation_hint="prefix")``): the options that shape torch_dist's files
(thread count, file separation, cached DCP metadata) have no meaning for shardstore's
and are logged once, not applied. Megatron's default save backend,
``("torch_dist", 1)`` (``get_default_save_sharded_strategy``, a tuple given to
``save``), names ``TorchDistSaveShardedStrategy`` here too. The reformulation API lives
in ``strategies.resharding``.
"""

from __future__ import annotations

__all__ = [
    "TorchDistLoadShardedStrategy", "TorchDistSaveShardedStrategy",
    "get_reformulation_metadata", "register_default_torch_dist_save_strategy",
]

import logging
from typing import Any

from shardstore.compat.megatron.strategies.resharding import get_reformulation_metadata
from shardstore.engine.other_formats import TORCH_DIST_BACKEND
from shardstore.engine.strategies import StrategyAction, register_default_strategy
from shardstore.engine.zarr_strategies import (
    ZARR_VERSION,
    ZarrLoadShardedStrategy,
    ZarrSaveShardedStrategy,
)
from shardstore.progress import log_once

logger = logging.getLogger(__name__)


def _ignored(cls: str, options: dict[str, Any]) -> None:
    """Logs once per class and option set that torch_dist's options do not apply."""
    given = sorted(options)
    message = f"{cls}: shardstore's format ignores torch_dist's {', '.join(given)}"
    if given:
        log_once(logger, message)


class TorchDistSaveShardedStrategy(ZarrSaveShardedStrategy):
    """shardstore's save strategy under Megatron-Core's torch_dist name (module
    docstring). ``backend`` and ``version`` are accepted as Megatron's callers pass
    them (``"torch_dist", 1``) and are shardstore's in the checkpoint."""

    def __init__(self, backend: str = "torch_dist", version: int = 1, **torch_dist_options: Any) -> None:
        super().__init__()
        _ignored(type(self).__name__, torch_dist_options)


class TorchDistLoadShardedStrategy(ZarrLoadShardedStrategy):
    """shardstore's load strategy under Megatron-Core's torch_dist name (module docstring)."""

    def __init__(self, **torch_dist_options: Any) -> None:
        super().__init__()
        _ignored(type(self).__name__, torch_dist_options)


def register_default_torch_dist_save_strategy() -> None:
    """Registers ``TorchDistSaveShardedStrategy`` as the default save strategy of
    Megatron's ``("torch_dist", 1)`` (the load side is ``strategies.other_formats``')."""
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, TORCH_DIST_BACKEND, ZARR_VERSION, TorchDistSaveShardedStrategy()
    )
