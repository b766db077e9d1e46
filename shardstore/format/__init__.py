"""The on-disk format: array and group records and the commit record (``records``), the
chunk encoding (``chunks``), publishing and what a save may delete (``commit``),
checksums and ``verify`` (``integrity``), data types (``dtypes``, ``zarr_dtypes``) and
the one place that unpickles (``pickles``).

May import: ``shardstore.stores``, ``shardstore.errors``, ``shardstore.progress``.

The package is the format's entry for the doors (``shardstore.tools``,
``shardstore.megatron``): they import from ``shardstore.format`` only the names of
``__all__`` (``tests/test_layering.py``), never one of its modules. Each name is imported
from its module on first use (``shardstore.lazy_exports``), so importing the package, as
the zarr start-up hook does for ``zarr_dtypes``, imports nothing else. The doors take
these names from here rather than from the api layer because no api module offers them,
or (``verify``, ``VerifyReport``, which the package root re-exports for users) because
the doors use them beside names that only the format offers (``Problem``).
"""

from __future__ import annotations

__all__ = [
    "array_group_collisions",
    "ArrayChunks",
    "ArrayPlaces",
    "ArrayRecord",
    "BY_TORCH",
    "cast_checked",
    "CheckpointingConfig",
    "chunk_store_for",
    "COMMIT_RECORD",
    "CommitRecord",
    "COMMON_FILE",
    "CONFIG_FNAME",
    "DcpMetadata",
    "DEFAULT_IO_CONCURRENCY",
    "DELETION_MARKER",
    "from_torch",
    "from_zarr_name",
    "group_metadata",
    "holds_its_values",
    "holds_claim",
    "is_claim",
    "is_committed",
    "is_exact_conversion",
    "load_torch",
    "MAX_RECORD_BYTES",
    "numpy_to_tensor",
    "ObjectRecord",
    "own_markers",
    "parent_groups",
    "Problem",
    "read_commit_record",
    "read_config",
    "read_marker",
    "read_region",
    "REPLACED_TAG",
    "remove_unfinished",
    "restore_replaced",
    "run_reads",
    "SaveIntent",
    "SaveOptions",
    "serialize",
    "STAGING_TAG",
    "state_paths",
    "StatePath",
    "StorageLayout",
    "LayoutSite",
    "tensor_to_numpy",
    "UnsupportedFormatVersion",
    "verify",
    "VerifyReport",
    "write_config",
    "WrittenChunk",
    "ZARR_JSON",
]

from shardstore.lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "commit": ("SaveIntent", "SaveOptions", "remove_unfinished", "restore_replaced"),
    "config": ("CONFIG_FNAME", "CheckpointingConfig", "read_config", "write_config"),
    "chunks": ("ArrayChunks", "DEFAULT_IO_CONCURRENCY", "WrittenChunk", "chunk_store_for", "read_region", "run_reads"),
    "dtypes": ("BY_TORCH", "cast_checked", "from_torch", "from_zarr_name", "holds_its_values", "is_exact_conversion",
               "numpy_to_tensor", "tensor_to_numpy"),
    "integrity": ("Problem", "VerifyReport", "verify"),
    "pickles": ("load_torch", "serialize"),
    "storage_layout": ("LayoutSite", "StorageLayout"),
    "features": ("UnsupportedFormatVersion",),
    "records.array_record": ("ArrayRecord",),
    "records.commit_record": ("MAX_RECORD_BYTES", "CommitRecord", "group_metadata"),
    "records.record_parts": ("ArrayPlaces", "DcpMetadata", "ObjectRecord", "StatePath", "state_paths"),
    "records.markers": ("own_markers", "read_marker"),
    "records.names": ("COMMIT_RECORD", "COMMON_FILE", "DELETION_MARKER", "REPLACED_TAG", "STAGING_TAG", "ZARR_JSON",
                      "array_group_collisions", "parent_groups"),
    "records.reading": ("holds_claim", "is_committed", "read_commit_record"),
    "records.claim_document": ("is_claim",),
})
