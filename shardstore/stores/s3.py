"""``s3://bucket/prefix`` checkpoint locations: S3, MinIO, Ceph, any S3-compatible store.

A save's objects are written through s3fs's client, each only where none is
(``stores.s3_fenced``: one PUT with ``If-None-Match``, many in flight); chunk reads go
through TensorStore's ``s3`` kvstore; small files, listing and deletion through s3fs,
one request each (``get``, ``size``, ``exists``, ``list_dir`` and ``prepare`` avoid the
extra HEADs and listings s3fs's own calls send; a shard index's suffix GET names the size).

Settings come from the standard AWS environment unless given in code
(``S3Options``): ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_REGION`` /
``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_SESSION_TOKEN``, ``AWS_PROFILE``. TensorStore is told exactly where the
credentials are (environment, profile, or a private credentials file for keys passed
in code), so it does not walk the lookup chain and print its misses to stderr.

Transient failures (HTTP 500/503, throttling, reset connections) are retried with
exponential backoff and jitter by both libraries (TensorStore's
``s3_request_retries``; botocore's ``standard`` retry mode for s3fs), up to
``S3Options.max_retries``; then the error reaches the save, every rank raises and no
commit record is written. A PUT is atomic on S3, so the commit record is one PUT,
issued only after every rank confirmed its data written; durability needs no extra
step once a PUT has returned.

Conditional writes (``S3ConditionalWrites``, with which an in-place save claims its
prefix: ``format.claims``): ``PutObject`` with ``If-None-Match: *`` (AWS since 2024-08)
or ``If-Match: <ETag>`` (since 2024-11), which MinIO, Ceph RGW and moto honour too. AWS
answers 412 where the condition fails and 409 where another conditional write of the
key is in flight (asked again, with backoff); an object's age is the reply's ``Date``
less its ``Last-Modified``, both the server's clock. ``S3Options.conditional_writes=False``
gets a read, a check and a plain PUT instead: not atomic.
"""

from __future__ import annotations

__all__ = ["S3ConditionalWrites", "S3Options", "S3Store"]

import asyncio
import contextlib
import errno
import logging
import math
import os
import stat
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

from shardstore.stores.base import (
    DEFAULT_IO_THREADS,
    OBJECT_VERSION_TEXT,
    Capabilities,
    ChunkAccess,
    CopiedObject,
    NameLimits,
    StorageError,
    Store,
    run_parallel,
)
from shardstore.stores.conditional import ConditionalWrites, PreconditionFailed, VersionedObject
from shardstore.stores.fsspec_base import FsspecStore
from shardstore.stores.kv_chunks import KvChunkStore
from shardstore.stores.s3_fenced import backoff_s, error_code, put_new_objects, put_object

logger = logging.getLogger(__name__)

# S3 takes at most 5 GiB in one PUT, and TensorStore never uses multipart uploads.
S3_MAX_OBJECT_BYTES = 5 * 2**30
# S3's longest object key, in bytes of UTF-8 (the prefix included).
S3_MAX_KEY_BYTES = 1024
# Keys one DeleteObjects request takes at most.
S3_DELETE_BATCH = 1000
# s3fs cuts a path at this text and reads the rest as an object version, whatever the
# file system's settings (``S3FileSystem.split_path``): a key holding it would name
# another object, so such keys and prefixes are refused.
VERSION_SUFFIX = OBJECT_VERSION_TEXT


@dataclass(frozen=True)
class S3Options:
    """How to reach the object store; every field defaults to the AWS environment.

    Attributes:
        endpoint_url: e.g. ``http://minio:9000``; None: AWS, or ``AWS_ENDPOINT_URL[_S3]``.
        region: None: ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, else the profile's region
            in the shared config file (``AWS_CONFIG_FILE``), else ``us-east-1``.
        key, secret, token: explicit credentials (else environment or profile).
        profile: a profile of the shared AWS config files.
        max_retries: attempts after the first for a transient failure (with the
            defaults a dead endpoint fails a save within a minute).
        initial_delay, max_delay: backoff bounds in seconds (jittered, exponential).
        connect_timeout, read_timeout: seconds before one request is given up (then
            retried); TensorStore takes them from the first S3 location a process opens.
        request_concurrency: requests in flight per process (TensorStore's reads; a
            save's writes, through as many of botocore's connections).
        s3fs_kwargs: extra keyword arguments for ``s3fs.S3FileSystem``, merged into
            ours (their keys winning).
        save_lease_s: how long a save's claim on its prefix holds without renewal
            (renewed every quarter of it): an older one is a dead save's.
        conditional_writes: the store honours ``If-None-Match: *`` and ``If-Match`` on
            PUT; False for one that does not (weaker: docs/guide/object-stores.md, "Two
            saves into one prefix", which says all of these at length).
    """

    endpoint_url: str | None = None
    region: str | None = None
    key: str | None = None
    secret: str | None = None
    token: str | None = None
    profile: str | None = None
    max_retries: int = 4
    initial_delay: float = 0.05
    max_delay: float = 2.0
    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    request_concurrency: int = 32
    s3fs_kwargs: dict[str, Any] = field(default_factory=dict)
    save_lease_s: float = 60.0
    conditional_writes: bool = True

    def resolved_endpoint(self) -> str | None:
        return self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")

    def resolved_region(self) -> str:
        return (
            self.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            or _profile_region(self.resolved_profile()) or "us-east-1"
        )

    def resolved_profile(self) -> str | None:
        return self.profile or os.environ.get("AWS_PROFILE")


def _profile_region(profile: str | None) -> str | None:
    """The region the shared AWS config file gives ``profile`` (None: the default
    profile), as botocore and the AWS CLI read it; None where it gives none. A profile
    that does not exist gives none here: the credentials lookup names it."""
    try:
        import botocore.session  # s3fs brings it
        from botocore.exceptions import ProfileNotFound
    except ImportError:
        return None
    try:
        return botocore.session.Session(profile=profile).get_config_variable("region")
    except ProfileNotFound:
        return None


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")`` (trailing ``/`` dropped).

    Raises:
        StorageError: no bucket; a prefix holding ``?versionId=``, or an empty, ``.``
            or ``..`` segment (``_refuse_unplain_segments``)."""
    if not url.startswith("s3://"):
        raise StorageError(f"Not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not bucket:
        raise StorageError(f"No bucket in {url!r}; expected s3://bucket/prefix")
    _refuse_version_suffix(url, url)
    prefix = prefix.rstrip("/")
    _refuse_unplain_segments(url, prefix)
    return bucket, prefix


def _refuse_unplain_segments(url: str, prefix: str) -> None:
    """Refuses a key prefix with an empty, ``.`` or ``..`` segment. S3 keeps such keys
    literally and so does s3fs (the small files), but TensorStore's requests (the
    chunks) resolve ``.`` and ``..``, which would split the checkpoint between two
    prefixes, the chunks' outside this one; and a leading ``/`` (``s3://bucket//p``)
    names the key ``/p`` to S3 and to other tools, not ``p``."""
    odd = next((segment for segment in prefix.split("/") if segment in ("", ".", "..")), None) if prefix else None
    if odd is not None:
        what = "an empty ('//')" if odd == "" else f"a {odd!r}"
        raise StorageError(
            f"{url}: the key prefix {prefix!r} has {what} segment. S3 keeps keys literally, but not every "
            "client does (TensorStore, which writes the chunks, resolves '.' and '..'), and '//' names other "
            "keys than '/' does: the checkpoint would not lie wholly where the URL says. Name the prefix with "
            "plain segments only, as s3://bucket/a/b"
        )


def _refuse_version_suffix(path: str, where: str) -> None:
    """Refuses a path that s3fs would read as a versioned object (``VERSION_SUFFIX``)."""
    if VERSION_SUFFIX in path:
        raise StorageError(
            f"{where}: S3 paths holding {VERSION_SUFFIX!r} name an object version to s3fs, so this one would "
            "reach another object; rename the key or prefix"
        )


def _private_file(kind: str, lines: list[str]) -> str:
    """A file only this user can read, holding ``lines``."""
    fd, path = tempfile.mkstemp(prefix=f"shardstore-aws-{kind}-", suffix=".ini")
    os.fchmod(fd, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _encrypted_by_key(reply: dict[str, Any]) -> bool:
    """Whether an S3 reply describes an object encrypted with SSE-KMS (or DSSE-KMS) or a
    customer key, whose ETag is not the MD5 of its bytes."""
    return str(reply.get("ServerSideEncryption", "")).startswith("aws:kms") or bool(reply.get("SSECustomerAlgorithm"))


def _remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class S3Store(FsspecStore):
    """A checkpoint under ``s3://bucket/prefix`` (``stores.locations.open_location`` makes
    one from the URL and ``options=S3Options(...)``).

    Args:
        url: ``s3://bucket/prefix``.
        options: endpoint, region, credentials, retries (default: the AWS environment).
    """

    capabilities = Capabilities(max_object_bytes=S3_MAX_OBJECT_BYTES, shared_across_processes=True)

    def __init__(self, url: str, options: S3Options | None = None) -> None:
        self.bucket, self.prefix = parse_s3_url(url)
        self.options = options or S3Options()
        self._fs = None
        self._fs_pid = os.getpid()
        self._profile_files: tuple[str, str] | None = None

    def __repr__(self) -> str:
        return f"S3Store({self.describe()!r})"

    def __getstate__(self) -> dict[str, Any]:
        """Without the private credentials files (``_write_profile_files``): they are
        removed when this store is collected, and another process (a spawned writer)
        may not see them at all; a copy writes its own."""
        return {**self.__dict__, "_profile_files": None}

    # ------------------------------------------------------------------ paths

    def _key(self, rel: str) -> str:
        """The object key of ``rel`` (refused where s3fs would not take it literally)."""
        key = self._literal_key(rel)
        _refuse_version_suffix(key, self.describe(rel))
        return key

    def _literal_key(self, rel: str) -> str:
        return "/".join(p for p in (self.prefix, rel) if p)

    def _path(self, rel: str) -> str:
        return f"{self.bucket}/{self._key(rel)}".rstrip("/")

    def describe(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self._literal_key(key)}".rstrip("/")

    @property
    def name_limits(self) -> NameLimits:
        """No limit on one segment; a whole object key, prefix included, has at most
        ``S3_MAX_KEY_BYTES`` and never holds ``VERSION_SUFFIX``."""
        used = len(self._key("x").encode()) - 1  # the prefix and its "/"
        return NameLimits(
            None, S3_MAX_KEY_BYTES - used,
            f"S3's {S3_MAX_KEY_BYTES}-byte object keys, less {used} for the prefix {self.prefix!r}",
            ((VERSION_SUFFIX, "s3fs reads it as an object version, so the key would name another object"),),
        )

    # ------------------------------------------------------------------ s3fs

    @property
    def fs(self) -> Any:
        if self._fs is not None and self._fs_pid != os.getpid():  # forked: s3fs's client is its parent's
            self._fs = None
        if self._fs is None:
            try:
                import s3fs
            except ImportError as exc:
                raise StorageError(
                    f"{self.describe()}: s3:// locations need s3fs, which is not installed; "
                    "pip install 'shardstore[s3]'"
                ) from exc

            o = self.options
            kwargs: dict[str, Any] = {
                "endpoint_url": o.resolved_endpoint(),
                "client_kwargs": {"region_name": o.resolved_region()},
                # botocore's standard mode: exponential backoff with jitter on 5xx,
                # throttling and connection errors; total_max_attempts counts the first
                # attempt (max_attempts would not: one attempt more)
                "config_kwargs": {
                    "retries": {"total_max_attempts": o.max_retries + 1, "mode": "standard"},
                    "connect_timeout": o.connect_timeout,
                    "read_timeout": o.read_timeout,
                    "max_pool_connections": o.request_concurrency,
                },
            }
            kwargs = _merged(kwargs, o.s3fs_kwargs)
            if o.key is not None:
                kwargs.update(key=o.key, secret=o.secret, token=o.token)
            elif o.resolved_profile():
                kwargs["profile"] = o.resolved_profile()
            self._fs, self._fs_pid = s3fs.S3FileSystem(**kwargs), os.getpid()
            # botocore retries; s3fs's own loop around it (5 rounds by default) would
            # multiply the attempts: 81 s to report a refused connection, measured.
            self._fs.retries = 1
        return self._fs

    def _refresh(self) -> None:
        self.fs.invalidate_cache()

    def _run(self, coroutine_function: Any, *args: Any, **kwargs: Any) -> Any:
        """Runs one of s3fs's coroutines (requests s3fs's own methods do not make alone)
        on its event loop, from this thread."""
        from fsspec.asyn import sync  # s3fs brings fsspec

        return sync(self.fs.loop, coroutine_function, *args, **kwargs)

    def _entries(self, path: str) -> list[str]:
        """One listing of ``path/`` (a page per 1,000 names); s3fs's ``ls`` lists the
        parent as well where nothing is under ``path``."""
        listed = self._run(self.fs._lsdir, path, refresh=True)
        # a console's "Create folder" writes an empty object named ``path/``: the folder, not an entry
        return [e["name"] for e in listed if not (e.get("size") == 0 and e["name"].rstrip("/") == path.rstrip("/"))]

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        """One GET (a ranged one under ``max_bytes``). s3fs's ``cat_file`` of a whole
        object sends a HEAD first, to choose between one GET and concurrent ranged GETs
        (worth it above its 50 MiB blocks, which no small file reaches)."""
        if max_bytes is None:
            try:
                data, _ = self._call("read", key, self._run, self._get_object, key)
            except FileNotFoundError:
                return None
            return data
        try:  # one byte more than max_bytes tells a larger object
            found = self._call("read", key, self._run, self._ranged, key, f"bytes=0-{max_bytes}", max_bytes + 1)
        except FileNotFoundError:
            return None
        if found is None:
            return None if self._size_where_refused(key, "its first bytes") is None else b""
        data = found[0]
        if len(data) > max_bytes:
            raise StorageError(f"{self.describe(key)} holds more than the {max_bytes} bytes expected there")
        return data

    def size(self, key: str) -> int | None:
        """One HEAD request (s3fs's ``info`` lists the prefix after a 404)."""
        try:
            reply = self._call("look up", key, self.fs.call_s3, "head_object", Bucket=self.bucket, Key=self._key(key))
        except FileNotFoundError:
            return None
        return int(reply["ContentLength"])

    def exists(self, key: str) -> bool:
        """One HEAD request: whether ``key`` names an object (S3 has no directories)."""
        return self.size(key) is not None

    def get_suffix(self, key: str, nbytes: int) -> tuple[bytes, int] | None:
        """The object's last ``nbytes`` bytes (all of it where it is shorter) and its
        size, or None if it does not exist: one suffix GET, whose ``Content-Range``
        names the size (S3 answers a suffix longer than the object with all of it)."""
        if nbytes <= 0:
            size = self.size(key)
            return None if size is None else (b"", size)
        try:
            found = self._call("read the end of", key, self._run, self._suffix, key, nbytes)
        except FileNotFoundError:
            return None
        if found is not None:
            return found
        return None if self._size_where_refused(key, f"its last {nbytes} bytes") is None else (b"", 0)

    def _size_where_refused(self, key: str, what: str) -> int | None:
        """After S3 refused a ranged read of ``what`` of ``key`` (``_ranged``): None where
        the object is missing (since), 0 where it is empty (AWS answers 416 for any
        range of an empty object).

        Raises:
            StorageError: it holds bytes, which the server refused to read."""
        size = self.size(key)
        if size is None or size == 0:
            return size
        raise StorageError(f"{self.describe(key)}: the server refused a read of {what} although it holds {size}")

    async def _get_object(self, key: str, max_bytes: int | None = None, **kwargs: Any) -> tuple[bytes, dict[str, Any]]:
        """One GetObject request (``kwargs``: its ``Range``): the bytes and the reply.

        A body cut short (a connection reset or stalled while the bytes arrive) is asked
        for again, up to ``max_retries`` times with backoff: botocore's retries end once
        the reply's headers came, and the body is read after them."""
        from s3fs.core import S3_RETRYABLE_ERRORS  # s3fs's transient transfer errors

        attempt = 0
        while True:
            reply = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self._key(key), **kwargs)
            try:
                return await self._body(key, reply, max_bytes), reply
            except S3_RETRYABLE_ERRORS as exc:
                if attempt >= self.options.max_retries:
                    raise
                logger.debug("Reading %s again: its bytes were cut short (%s)", self.describe(key), exc)
            await asyncio.sleep(backoff_s(self.options, attempt))
            attempt += 1

    async def _body(self, key: str, reply: dict[str, Any], max_bytes: int | None) -> bytes:
        """The body of a GetObject ``reply``, closed after. A reply longer than
        ``max_bytes`` (a server that ignores ``Range``) is refused before its body is
        read."""
        try:
            length = int(reply.get("ContentLength", 0))
            if max_bytes is not None and length > max_bytes:
                raise StorageError(
                    f"{self.describe(key)}: a read of at most {max_bytes} bytes was answered with {length} "
                    "bytes; the server ignores byte ranges, which sharded reads need"
                )
            return await reply["Body"].read()
        finally:
            reply["Body"].close()

    async def _ranged(self, key: str, byte_range: str, max_bytes: int) -> tuple[bytes, dict[str, Any]] | None:
        """One GET of ``byte_range`` (``bytes=0-99``, ``bytes=-100``): the bytes and the
        reply, or None where S3 refuses the range (AWS answers 416 for an empty object;
        s3fs says EINVAL for that and other refusals, which ``_size_where_refused`` tells
        apart by the object's size)."""
        try:
            return await self._get_object(key, max_bytes=max_bytes, Range=byte_range)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return None
            raise

    async def _suffix(self, key: str, nbytes: int) -> tuple[bytes, int] | None:
        """``get_suffix``'s GET (``_ranged``): the bytes and the object's size."""
        found = await self._ranged(key, f"bytes=-{nbytes}", nbytes)
        if found is None:
            return None
        data, reply = found
        content_range = str(reply.get("ContentRange") or "")  # "bytes 90-99/100"; absent where all of it came
        total = content_range.rpartition("/")[2]
        if content_range and not total.isdigit():
            raise StorageError(f"{self.describe(key)}: a suffix read named no size ({content_range!r})")
        return data, int(total) if content_range else len(data)

    def put_many(self, objects: dict[str, bytes]) -> None:
        """All in flight at once through TensorStore's kvstore: its requests cost a
        tenth of the CPU of s3fs's, whose connection pool holds 10."""
        for key in objects:
            self._key(key)  # refused here as everywhere else
        if objects:
            KvChunkStore(self, self.options.request_concurrency).put_all(objects)

    def put_new(self, objects: dict[str, bytes]) -> None:
        """Each only where no object is (``stores.s3_fenced``), unless the store takes
        no conditional writes (``S3Options.conditional_writes``)."""
        if self.options.conditional_writes:
            put_new_objects(self, objects)
        else:
            self.put_many(objects)

    def _delete_keys(self, keys: list[str]) -> None:
        """DeleteObjects requests of up to ``S3_DELETE_BATCH`` exact keys (s3fs's
        ``rm`` would expand glob characters, and its batch delete ignores the errors the
        server reports per key)."""
        batches = [keys[i:i + S3_DELETE_BATCH] for i in range(0, len(keys), S3_DELETE_BATCH)]
        run_parallel(self._delete_batch, batches)

    def _delete_batch(self, keys: list[str]) -> None:
        objects = [{"Key": self._key(k)} for k in keys]
        reply = self._call("remove", keys[0], self.fs.call_s3, "delete_objects", Bucket=self.bucket,
                           Delete={"Objects": objects, "Quiet": True})
        errors = reply.get("Errors") or []
        if errors:
            failed = ", ".join(f"{e.get('Key')} ({e.get('Code')}: {e.get('Message')})" for e in errors[:5])
            raise StorageError(f"Cannot remove {len(errors)} objects under {self.describe()}: {failed}")

    def child(self, name: str) -> S3Store:
        return S3Store(self.describe(name), self.options)

    def copy_from(self, source: Store, key: str) -> CopiedObject | None:
        """One CopyObject request (no bytes through this process) between stores on one
        s3fs file system (same endpoint and credentials); returns the ETag S3 gives the
        copy. Objects above 5 GiB, which CopyObject refuses, are never shardstore's
        chunks (TensorStore writes each with one PUT)."""
        if not isinstance(source, S3Store) or source.fs is not self.fs:
            return None
        copy_source = {"Bucket": source.bucket, "Key": source._key(key)}
        try:
            reply = self._call("copy to", key, self.fs.call_s3, "copy_object", Bucket=self.bucket,
                               Key=self._key(key), CopySource=copy_source)
        except FileNotFoundError:
            return None
        self.fs.invalidate_cache(self._path(key))
        etag = (reply.get("CopyObjectResult") or {}).get("ETag")
        if not isinstance(etag, str) or _encrypted_by_key(reply):
            return CopiedObject()  # an object encrypted with SSE-KMS or SSE-C: its ETag is no MD5
        return CopiedObject(etag.strip('"'))

    def conditional_writes(self) -> ConditionalWrites:
        return S3ConditionalWrites(self)

    def prepare(self) -> None:
        """Refuses a bucket that does not exist, by name. A HEAD refused (403) says
        nothing of it: the save's own requests tell."""
        if self._bucket_missing():
            raise StorageError(f"Bucket {self.bucket!r} of {self.describe()} does not exist; create it first")

    def missing_container(self) -> str | None:
        """``"bucket '<name>'"`` where a HEAD of the bucket says it does not exist; None
        where it exists or the HEAD fails otherwise."""
        try:
            missing = self._bucket_missing()
        except StorageError as exc:
            logger.debug("Cannot tell whether bucket %s exists: %s", self.bucket, exc)
            return None
        return f"bucket {self.bucket!r}" if missing else None

    def _bucket_missing(self) -> bool:
        """Whether one HEAD of the bucket (a listing would page through all of its top
        level) says it does not exist. A refused HEAD (403) is False: HeadBucket needs
        s3:ListBucket on the whole bucket, which a policy that grants one prefix does
        not give, although every request a save or load makes under it is allowed.

        Raises:
            StorageError: any other failure, naming the location."""
        try:
            self._call("find bucket of", "", self.fs.call_s3, "head_bucket", Bucket=self.bucket)
        except FileNotFoundError:
            return True
        except StorageError as exc:
            if not isinstance(exc.__cause__, PermissionError):
                raise
            logger.debug("A HEAD of bucket %s was refused (%s); the requests of %s will tell", self.bucket,
                         exc.__cause__, self.describe())
        return False

    def make_durable(self) -> None:
        """Nothing to do: an object is durable once its PUT returned."""

    # ------------------------------------------------------------------ TensorStore

    def chunk_access(self) -> ChunkAccess:
        """TensorStore's ``s3`` kvstore: one PUT or GET per chunk, many in flight."""
        return ChunkAccess(kvstore=self._kvstore_spec(), context=self._tensorstore_context())

    def chunk_store(self, io_concurrency: int, local_threads: int = DEFAULT_IO_THREADS) -> KvChunkStore:
        """Chunks through TensorStore's ``s3`` kvstore, ``io_concurrency`` requests in flight."""
        return S3ChunkStore(self, io_concurrency)

    def _kvstore_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "driver": "s3",
            "bucket": self.bucket,
            "path": self.prefix + "/" if self.prefix else "",
            "aws_region": self.options.resolved_region(),
            "aws_credentials": self._tensorstore_credentials(),
        }
        endpoint = self.options.resolved_endpoint()
        if endpoint:
            spec["endpoint"] = endpoint
        return spec

    def _tensorstore_credentials(self) -> dict[str, Any]:
        o = self.options
        if o.key is not None:
            credentials, config = self._write_profile_files()
            return {"type": "profile", "profile": "shardstore", "credentials_file": credentials, "config_file": config}
        if o.resolved_profile():
            return {"type": "profile", "profile": o.resolved_profile()}
        if os.environ.get("AWS_ACCESS_KEY_ID"):
            return {"type": "environment"}
        return {"type": "default"}

    def _write_profile_files(self) -> tuple[str, str]:
        """Keys given in code, for TensorStore: a private profile, never the environment.
        (Its profile provider needs a config file next to the credentials file.)"""
        if self._profile_files is None:
            o = self.options
            credentials = ["[shardstore]", f"aws_access_key_id = {o.key}", f"aws_secret_access_key = {o.secret}"]
            if o.token:
                credentials.append(f"aws_session_token = {o.token}")
            config = ["[profile shardstore]", f"region = {o.resolved_region()}"]
            self._profile_files = (_private_file("credentials", credentials), _private_file("config", config))
            for path in self._profile_files:
                weakref.finalize(self, _remove_file, path)
        return self._profile_files

    def _tensorstore_context(self) -> dict[str, Any]:
        o = self.options
        _bound_tensorstore_requests(o)
        return {
            "s3_request_retries": {
                "max_retries": o.max_retries,
                "initial_delay": f"{int(o.initial_delay * 1000)}ms",
                "max_delay": f"{int(o.max_delay * 1000)}ms",
            },
            "s3_request_concurrency": {"limit": o.request_concurrency},
        }


class S3ChunkStore(KvChunkStore):
    """``KvChunkStore`` on S3, whose suffix reads (a sharded read's index) are one GET
    each (``S3Store.get_suffix``): TensorStore does not report an object's size."""

    store: S3Store

    def get_suffix(self, rel: str, nbytes: int) -> tuple[bytes, int] | None:
        return self.store.get_suffix(rel, nbytes)

    def put(self, rel: str, buffers: list[memoryview]) -> str | None:
        """One PUT only where no object is (``stores.s3_fenced``): a chunk is always a
        new object of the save that writes it."""
        if not self.store.options.conditional_writes:
            return super().put(rel, buffers)
        return put_new_objects(self.store, {rel: b"".join(buffers)})[rel]

    def put_all(self, objects: dict[str, bytes]) -> None:
        self.store.put_new(objects)


def _merged(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """``ours`` updated by ``theirs`` (``S3Options.s3fs_kwargs``), the dicts in both
    (``client_kwargs``, ``config_kwargs``) merged one level deep: a CA bundle passed in
    ``client_kwargs`` keeps our region, a pool size in ``config_kwargs`` our retries and
    timeouts; the caller's keys win."""
    merged = {**ours, **theirs}
    for name, value in theirs.items():
        if isinstance(value, dict) and isinstance(ours.get(name), dict):
            merged[name] = {**ours[name], **value}
    return merged


# TensorStore's HTTP transport reads its timeouts from these variables once, when it
# starts; without them a request to a server that accepts and never answers waits curl's
# own 60 s per attempt.
_TENSORSTORE_TIMEOUTS = ("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS", "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS")


def _bound_tensorstore_requests(options: S3Options) -> None:
    """Gives TensorStore's S3 requests (chunks, ``zarr.json`` documents) the options'
    ``connect_timeout`` and ``read_timeout`` (a transfer stalled that long is given up,
    then retried), as s3fs's requests have them. Process-wide and read once: the first
    S3 location opened decides, and variables the user set win."""
    for name, seconds in zip(_TENSORSTORE_TIMEOUTS, (options.connect_timeout, options.read_timeout)):
        os.environ.setdefault(name, str(max(1, math.ceil(seconds))))


# ------------------------------------------------------------------ conditional writes


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
                code = error_code(exc)
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
        reply = s._call("write", key, s._run, put_object, s, key, data, **condition)
        s.fs.invalidate_cache(s._path(key))
        return reply

    def _put_after_check(self, key: str, data: bytes, version: str | None) -> str:
        found = self.get_versioned(key, max_bytes=0)
        if (found is None) != (version is None) or (found is not None and found.version != version):
            raise PreconditionFailed(key)
        return str(self._put_object(key, data, {})["ETag"]).strip('"')

    def _delete(self, key: str) -> None:
        self.store.delete(key)

    def delete_if_version(self, key: str, version: str) -> bool:
        """One DeleteObject with ``If-Match`` (AWS since 2025, MinIO, moto); a store that
        refuses the header gets the default's read, then delete."""
        if not self.store.options.conditional_writes:
            return super().delete_if_version(key, version)
        s = self.store
        try:
            s._call("remove", key, s.fs.call_s3, "delete_object", Bucket=s.bucket, Key=s._key(key), IfMatch=f'"{version}"')
        except FileNotFoundError:
            return False
        except StorageError as exc:
            if error_code(exc) in ("PreconditionFailed", "412"):
                return False
            if error_code(exc) not in ("NotImplemented", "501"):
                raise
            return super().delete_if_version(key, version)
        s.fs.invalidate_cache(s._path(key))
        return True

    def version_of(self, key: str) -> str | None:
        s = self.store
        try:
            reply = s._call("look up", key, s.fs.call_s3, "head_object", Bucket=s.bucket, Key=s._key(key))
        except FileNotFoundError:
            return None
        return str(reply["ETag"]).strip('"')

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
