"""The one exception type shardstore raises for problems with a checkpoint.

Its own module, below everything else, so that every layer (storage included) raises
it; ``shardstore.core`` and the package root re-export it.
"""

__all__ = ["CheckpointingException", "first_failure"]


class CheckpointingException(Exception):
    """The one exception type shardstore raises for problems with a checkpoint."""


def first_failure(earlier: BaseException | None, later: BaseException) -> BaseException:
    """The failure a step reports where it may already carry one: ``earlier`` if given,
    with a note naming ``later`` (never dropped silently), else ``later``."""
    if earlier is None:
        return later
    earlier.add_note(f"Also failed after it: {type(later).__name__}: {later}")
    return earlier
