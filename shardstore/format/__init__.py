"""The on-disk format: array and group records and the commit record (``records``), the
chunk encoding (``chunks``), publishing and what a save may delete (``commit``),
checksums and ``verify`` (``integrity``), data types (``dtypes``, ``zarr_dtypes``) and
the one place that unpickles (``pickles``).

May import: ``shardstore.stores``, ``shardstore.errors``, ``shardstore.progress``.
"""

__all__: list[str] = []

import shardstore.format.sharding  # noqa: E402,F401  registers sharding_indexed
