"""The bounds a checkpoint's files read back must respect (a hostile-input guard): a
malformed or hostile record, marker or chunk is refused by its size before it is read
whole, and its shapes before anything is allocated for them.
"""

from __future__ import annotations

__all__ = [
    "MAX_CHUNK_BYTES",
    "MAX_DELETION_MARKER_BYTES",
    "MAX_ELEMENTS",
    "MAX_MARKER_BYTES",
    "MAX_NDIM",
    "MAX_RECORD_BYTES",
    "MAX_UNBOUND_CHUNKS",
]


# The most bytes a marker holds (a few ids); a larger file of that name is not ours.
MAX_MARKER_BYTES = 4096

# Upper bounds that a record read back must respect (hostile-input guard).
MAX_NDIM = 32
MAX_ELEMENTS = 2**62
MAX_CHUNK_BYTES = 2**34  # one chunk is read into memory whole; 16 GiB is far above any we write
# Largest commit record read (a crc32c per chunk: about 11 bytes each in JSON).
MAX_RECORD_BYTES = 2**30
# The checkpoint manager's deletion marker also holds a copy of the commit record (what
# finishing the deletion removes once the record itself is gone).
MAX_DELETION_MARKER_BYTES = MAX_RECORD_BYTES + 4096
# Chunks of all arrays of a format-1 record, which lists no checksums to pay for them.
MAX_UNBOUND_CHUNKS = 2**24

