"""A save's objects on S3, each written only where none is (``If-None-Match: *``).

An in-place save removes what stood under its prefix before it writes (``format.claims``),
so every object it writes is new. Writing each one conditionally makes that a fence: a
writer that lost its claim (paused past its lease, then taken over) and resumes can
never write over an object of the save that holds the prefix now, whatever moment it
resumes at; its write is refused (412) and its save fails. TensorStore's ``s3`` kvstore
checks such a condition with a HEAD before an unconditional PUT, which a pause between
the two defeats, so these writes go through botocore (s3fs's client) as one PUT each.

A refused write whose object holds exactly the bytes written is this save's own,
landed by an attempt whose answer was lost: done. Any other refusal names the object.
"""

from __future__ import annotations

__all__ = ["SLOWEST_UPLOAD", "backoff_s", "error_code", "put_new_objects", "put_object"]

import asyncio
import concurrent.futures
import random
from typing import Any, Protocol

from shardstore.stores.base import StorageError

# The slowest upload a PUT is waited for (bytes per second), past its timeouts.
SLOWEST_UPLOAD = 256 * 1024


class S3Store(Protocol):
    """What these writes use of ``stores.s3.S3Store`` (which builds on this module)."""

    options: Any
    bucket: str
    fs: Any

    def _key(self, rel: str) -> str: ...
    def describe(self, key: str = "") -> str: ...
    async def _get_object(self, key: str) -> tuple[bytes, dict[str, Any]]: ...


def put_new_objects(store: S3Store, objects: dict[str, bytes]) -> dict[str, str | None]:
    """Writes each of ``objects`` (keys relative to ``store``) where no object is, all
    in flight at once up to ``S3Options.request_concurrency``; returns each one's ETag.
    Every write has ended before this returns or raises (in the event loop's thread).

    Raises:
        StorageError: naming the first object that could not be written, or that
            another writer wrote first."""
    if not objects:
        return {}
    for key in objects:
        store._key(key)  # refused here as everywhere else
    running = asyncio.run_coroutine_threadsafe(_put_all(store, objects), store.fs.loop)
    try:
        return running.result()
    except BaseException:  # an interrupt (Ctrl-C) too: the requests in flight end first
        concurrent.futures.wait([running])
        raise


async def _put_all(store: S3Store, objects: dict[str, bytes]) -> dict[str, str | None]:
    gate = asyncio.Semaphore(max(1, store.options.request_concurrency))
    results = await asyncio.gather(*(_put_one(store, key, data, gate) for key, data in objects.items()),
                                   return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        raise failed
    return dict(zip(objects, results, strict=True))  # type: ignore[arg-type]


async def put_object(store: S3Store, key: str, data: bytes, **condition: str) -> dict[str, Any]:
    """One PutObject of ``data`` at ``key`` (``condition``: ``IfNoneMatch``, ``IfMatch``),
    given up after ``S3Options.connect_timeout`` + ``read_timeout`` plus a second per
    ``SLOWEST_UPLOAD`` bytes: botocore's read timeout does not reach a PUT whose server
    never answers (it waited for good), only its GETs.

    Raises:
        TimeoutError: no answer within that time (the write may have landed)."""
    options = store.options
    limit = options.connect_timeout + options.read_timeout + len(data) / SLOWEST_UPLOAD
    call = store.fs._call_s3("put_object", Bucket=store.bucket, Key=store._key(key), Body=data, **condition)
    try:
        return await asyncio.wait_for(call, limit)
    except TimeoutError:
        raise TimeoutError(f"no answer to the PUT of {store.describe(key)} within {limit:.0f} s") from None


async def _put_one(store: S3Store, key: str, data: bytes, gate: asyncio.Semaphore) -> str | None:
    async with gate:
        for attempt in range(store.options.max_retries + 1):
            try:
                return _etag(await put_object(store, key, data, IfNoneMatch="*"))
            except Exception as exc:
                code = error_code(exc)
                if code in ("PreconditionFailed", "412"):
                    return await _settle(store, key, data, exc)
                retried = code in ("ConditionalRequestConflict", "409") or isinstance(exc, TimeoutError)
                if retried and attempt < store.options.max_retries:
                    await asyncio.sleep(backoff_s(store.options, attempt))
                    continue
                if code in ("NotImplemented", "501"):
                    raise StorageError(
                        f"{store.describe(key)}: the server does not take conditional writes (If-None-Match), with "
                        "which a save keeps writers that lost their claim from writing over another save's objects; "
                        "pass S3Options(conditional_writes=False) for such a store (docs/guide/object-stores.md says "
                        "what then holds)"
                    ) from exc
                raise StorageError(f"Cannot write {store.describe(key)}: {exc}") from exc
        raise AssertionError("unreachable")


async def _settle(store: S3Store, key: str, data: bytes, refusal: Exception) -> str | None:
    """A write refused because ``key`` holds an object: done where that object holds
    exactly ``data`` (an earlier attempt of this very write landed); else refused."""
    try:
        found, reply = await store._get_object(key)
    except FileNotFoundError:
        found, reply = None, {}
    if found == data:
        return _etag(reply)
    raise StorageError(
        f"Not writing {store.describe(key)}: another writer wrote an object there while this save wrote into the "
        "prefix (a save that lost its claim on it and is still writing?). Nothing of this save is committed, and "
        "nothing was written over; save again"
    ) from refusal


def _etag(reply: dict[str, Any]) -> str | None:
    etag = reply.get("ETag")
    return etag.strip('"') if isinstance(etag, str) else None


def error_code(exc: BaseException) -> str | None:
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


def backoff_s(options: Any, attempt: int) -> float:
    """Seconds to wait before retry ``attempt + 1`` (``options``: ``S3Options``): exponential from ``initial_delay``,
    at most ``max_delay``, jittered (as botocore's and TensorStore's retries wait)."""
    return min(options.max_delay, options.initial_delay * 2**attempt) * random.uniform(0.5, 1.0)
