"""Conditional writes on S3 (``stores.conditional``): ``PutObject`` with
``If-None-Match: *`` (since 2024-08 on AWS) or ``If-Match: <ETag>`` (since 2024-11),
which MinIO and moto honour too. AWS answers 412 where the condition fails and 409
where another conditional write of the same key is in flight (then asked again, with
backoff); an object's age is the reply's ``Date`` less its ``Last-Modified``, both the
server's clock.

A store that does not honour the headers (``S3Options.conditional_writes=False``) gets
a read, a check and a plain PUT instead: not atomic, said in the docs.
"""

from __future__ import annotations

__all__ = ["S3ConditionalWrites"]

import time
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any

from shardstore.stores.base import StorageError
from shardstore.stores.conditional import ConditionalWrites, PreconditionFailed, VersionedObject

if TYPE_CHECKING:
    from shardstore.stores.s3 import S3Store


class S3ConditionalWrites(ConditionalWrites):
    """``ConditionalWrites`` of an ``S3Store`` (one request each, through s3fs)."""

    def __init__(self, store: S3Store) -> None:
        self.store = store
        self.lease_s = store.options.save_lease_s

    def _put(self, key: str, data: bytes, version: str | None) -> str:
        if not self.store.options.conditional_writes:
            return self._put_after_check(key, data, version)
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": f'"{version}"'}
        for attempt in range(self.store.options.max_retries + 1):
            try:
                reply = self._put_object(key, data, condition)
            except FileNotFoundError as exc:  # If-Match on a key that holds nothing
                raise PreconditionFailed(key) from exc
            except StorageError as exc:
                code = _error_code(exc)
                if code in ("PreconditionFailed", "412"):
                    raise PreconditionFailed(key) from exc
                if code in ("NotImplemented", "501"):
                    raise StorageError(
                        f"{self.store.describe(key)}: the server does not take conditional writes (If-None-Match, "
                        "If-Match), with which a save claims its prefix; pass S3Options(conditional_writes=False) "
                        "for such a store (docs/guide/object-stores.md says what then holds)"
                    ) from exc
                if code not in ("ConditionalRequestConflict", "409") or attempt == self.store.options.max_retries:
                    raise
                time.sleep(min(self.store.options.max_delay, self.store.options.initial_delay * 2**attempt))
                continue
            return str(reply["ETag"]).strip('"')
        raise AssertionError("unreachable")

    def _put_object(self, key: str, data: bytes, condition: dict[str, str]) -> dict[str, Any]:
        s = self.store
        reply = s._call("write", key, s.fs.call_s3, "put_object", Bucket=s.bucket, Key=s._key(key), Body=data,
                        **condition)
        s.fs.invalidate_cache(s._path(key))
        return reply

    def _put_after_check(self, key: str, data: bytes, version: str | None) -> str:
        found = self.get_versioned(key, max_bytes=0)
        if (found is None) != (version is None) or (found is not None and found.version != version):
            raise PreconditionFailed(key)
        return str(self._put_object(key, data, {})["ETag"]).strip('"')

    def get_versioned(self, key: str, max_bytes: int) -> VersionedObject | None:
        s = self.store
        try:
            data, reply = s._call("read", key, s._run, s._get_object, key)
        except FileNotFoundError:
            return None
        return VersionedObject(data[: max_bytes + 1], str(reply["ETag"]).strip('"'), _age_s(reply))


def _age_s(reply: dict[str, Any]) -> float:
    """Seconds between the object's ``Last-Modified`` and the reply's ``Date`` (0 where
    either is missing: the object is then taken as just written)."""
    headers = (reply.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}
    modified, date = reply.get("LastModified"), headers.get("date")
    if modified is None or not date:
        return 0.0
    return max(0.0, (parsedate_to_datetime(date) - modified).total_seconds())


def _error_code(exc: BaseException) -> str | None:
    """The S3 error code (or HTTP status) behind ``exc``, from botocore's ``ClientError``
    down its chain of causes."""
    seen: BaseException | None = exc
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return str(error.get("Code") or status)
        seen = seen.__cause__ or seen.__context__
    return None
