"""The one exception type shardstore raises for problems with a checkpoint.

Its own module, below everything else, so that every layer (storage included) raises
it; ``shardstore.core`` and the package root re-export it.
"""

__all__ = ["CheckpointingException"]


class CheckpointingException(Exception):
    """The one exception type shardstore raises for problems with a checkpoint."""
