"""``shardstore.strategies.zarr_arrays`` is the first name of
``shardstore.engine.zarr_arrays``: importing it gives that very module, so its
state and classes are one whichever name imported them first, and pickles and
Megatron-Core's imports by this name keep working.
"""

from __future__ import annotations

__all__: list[str] = []  # the module's own names: this name gives the module itself

import sys

from shardstore.compat.megatron.strategies import zarr_arrays as _module

sys.modules[__name__] = _module
