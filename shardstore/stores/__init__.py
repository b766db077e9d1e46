"""Stores: where bytes go. ``base`` is the store interface (bytes by key, capability flags,
chunk access as data) and the ``Location`` callers hold, and ``DirectoryPublishing``, the
small interface of stores that publish a save by rename; one module per backend (``local``,
``s3``, ``memory``; the last two share ``fsspec_base``, the store operations on an fsspec
file system); ``locations`` the registry of URL schemes, the one place that knows every
backend.

May import: ``shardstore.errors`` only. Nothing here knows about arrays, records or ranks.

The package is the stores' entry for the doors (``shardstore.tools``,
``shardstore.megatron``): they import from ``shardstore.stores`` only the names of
``__all__`` (``tests/test_layering.py``), each imported from its module on first use
(``shardstore.lazy_exports``). A door holds a ``Location`` that the api opened for it
(``shardstore.opened``); it never opens one by URL itself, so ``open_location`` is not
offered here.
"""

from __future__ import annotations

__all__ = ["Location", "NameLimits", "run_parallel"]

from shardstore.lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {"base": ("Location", "NameLimits", "run_parallel")})
