"""Stores: where bytes go. ``base`` is the store interface (bytes by key, capability flags,
chunk access as data) and the ``Location`` callers hold, and ``DirectoryPublishing``, the
small interface of stores that publish a save by rename; one module per backend (``local``,
``s3``, ``memory``; the last two share ``fsspec_base``, the store operations on an fsspec
file system); ``locations`` the registry of URL schemes, the one place that knows every
backend.

May import: ``shardstore.errors`` only. Nothing here knows about arrays, records or ranks.
"""

__all__: list[str] = []
