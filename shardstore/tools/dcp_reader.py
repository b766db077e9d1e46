"""``shardstore.tools.dcp_reader`` is the first name of ``shardstore.compat.dcp.reader``:
importing it gives that very module, so its state and classes are one whichever name
imported them first, and pickles naming this module keep loading.
"""

from __future__ import annotations

__all__: list[str] = []  # the module's own names: this name gives the module itself

import sys

from shardstore.compat.dcp import reader as _module

sys.modules[__name__] = _module
