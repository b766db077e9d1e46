"""The bytes of the commit record: the JSON it is written in, compact (no spaces),
ASCII, acyclic, with its encoder made once, and the splice by which a record's
pre-encoded parts are put in place (``encode_compact``, ``splice``); and the checksums
it keeps: crc32c (``checksum``) of every non-array file and of the record itself,
XXH3-128 (``file_digest``) of every file and chunk, and the record's own digest
(``seal_record``).

From version 4 the record carries its own digest, ``RECORD_DIGEST``: the crc32c of the
root ``zarr.json`` exactly as written, taken while the digest's own value read
``UNSEALED_DIGEST``. Any change to that file is found whenever the record is read, for
one crc32c pass over its bytes (``seal_mismatch``).
"""

from __future__ import annotations

__all__ = [
    "CHUNK_DIGESTS",
    "COMPACT_JSON",
    "DIGEST_HEX_DIGITS",
    "FILE_DIGESTS",
    "FIRST_SEALED_VERSION",
    "HEX_DIGITS",
    "RECORD_DIGEST",
    "UNSEALED_DIGEST",
    "checksum",
    "encode_compact",
    "file_digest",
    "json_string",
    "seal_mismatch",
    "seal_record",
    "splice",
]

import json
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

import crc32c
import xxhash

from shardstore.errors import CheckpointingException


def _refuse_to_encode(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# The commit record's JSON (compact), as ``json.dumps(..., separators=(",", ":"))`` writes
# it. Its C encoder is made once: ``json.dumps`` makes one per call, which took longer than
# encoding an array's document (6.8 against 3.8 us).
COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))
_C_ENCODER = (
    None if c_make_encoder is None
    else c_make_encoder(None, _refuse_to_encode, encode_basestring_ascii, None, ":", ",", False, False, True)
)


# A string as JSON (``json.dumps`` of a str, without its per-call encoder).
json_string = encode_basestring_ascii


def encode_compact(value: Any) -> str:
    """``value`` as compact JSON (acyclic, as every record is)."""
    return COMPACT_JSON.encode(value) if _C_ENCODER is None else "".join(_C_ENCODER(value, 0))


def splice(text: str, placeholder: str, raw: str) -> str:
    """``text`` with the one occurrence of ``placeholder`` replaced by ``raw``."""
    at = text.find(placeholder)
    if at < 0 or text.find(placeholder, at + 1) >= 0:
        raise CheckpointingException("Internal error: encoding the commit record lost its place; please report it")
    return text[:at] + raw + text[at + len(placeholder) :]


FIRST_SEALED_VERSION = 4
RECORD_DIGEST = "record_digest"
# The digest as it stands in the file while the digest is computed (see seal_record).
UNSEALED_DIGEST = "crc32c:00000000"
# Each chunk's 128-bit content digest in an array's record (``format.reuse``).
CHUNK_DIGESTS = "chunk_xxh3_128"
# Each non-array file's 128-bit content digest in the commit record (``file_digest``):
# its crc32c (``files``) alone could hold a changed file equal.
FILE_DIGESTS = "files_xxh3_128"
DIGEST_HEX_DIGITS = 32
HEX_DIGITS = frozenset("0123456789abcdef")


def _sealed_token(digest: str) -> bytes:
    return COMPACT_JSON.encode({RECORD_DIGEST: digest})[1:-1].encode()


def seal_record(data: bytes) -> bytes:
    """The record ``data`` (its digest ``UNSEALED_DIGEST``, the first in the file) with
    the digest set to the crc32c of ``data``."""
    unsealed = _sealed_token(UNSEALED_DIGEST)
    if data.count(unsealed) != 1:
        raise AssertionError("a record to seal holds its unsealed digest exactly once")
    return data.replace(unsealed, _sealed_token(checksum(data)), 1)


def seal_mismatch(data: bytes, digest: Any) -> str | None:
    """Why the record ``data`` does not carry its own digest ``digest``, or None."""
    if not isinstance(digest, str) or not digest.startswith("crc32c:") or len(digest) != len(UNSEALED_DIGEST):
        return f"its {RECORD_DIGEST} {digest!r} is missing or malformed"
    sealed = _sealed_token(digest)
    if data.count(sealed) != 1:
        return f"its {RECORD_DIGEST} does not stand once in the file as written"
    actual = checksum(data.replace(sealed, _sealed_token(UNSEALED_DIGEST), 1))
    return None if actual == digest else f"its bytes' digest is {actual}, the record says {digest}"


def checksum(data: bytes) -> str:
    """The checksum the commit record keeps for a non-array file (``files``), and the
    record's own digest."""
    return f"crc32c:{crc32c.crc32c(data):08x}"


def file_digest(data: bytes | memoryview) -> str:
    """The content digest the commit record keeps for a non-array file
    (``FILE_DIGESTS``), and for each chunk (``format.chunks.chunk_digest``): XXH3-128
    as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(data)
