"""Stores: where bytes go. The ``Location`` interface (``base``), one module per backend (local disk in ``base``, ``s3``), and the one place that maps a path or URL to its backend (``locations``).

May import: ``shardstore.errors`` only. Nothing here knows about arrays, records or ranks.
"""
