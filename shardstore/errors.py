"""The one exception type shardstore raises for problems with a checkpoint.

Its own module, below everything else, so that every layer (storage included) raises
it; ``shardstore.core`` and the package root re-export it.
"""


class CheckpointingException(Exception):
    """The one exception type shardstore raises for problems with a checkpoint."""
