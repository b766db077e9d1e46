"""The S3 backend at its edges: capped reads of empty objects, console folders, request
timeouts in TensorStore, ``s3fs_kwargs`` merged with our settings, botocore's attempt count
(each test failed before the fix its docstring names)."""

from __future__ import annotations

import gc
import os
import pickle
import re
import socket
import subprocess
import sys
import threading

import boto3
import pytest
import torch

from shardstore import (
    CheckpointingException,
    SaveOptions,
    ShardedTensor,
    StorageLayout,
    load,
    save,
    verify,
)
from shardstore.stores.locations import open_location
from shardstore.stores.s3 import S3Options, S3Store
from tests.s3_support import KEY, REGION, SECRET, Faults, FaultyProxy, MotoServer, s3_options

BUCKET = "review-r6"


@pytest.fixture(scope="module")
def server(moto_server: MotoServer) -> MotoServer:
    moto_server.create_bucket(BUCKET)
    return moto_server


def _client(server: MotoServer):
    return boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                        region_name=REGION)


_counter = iter(range(10**6))


def _prefix() -> str:
    return f"r6-{next(_counter)}"


# ---------------------------------------------------------------- 1. 416 on an empty object


def test_get_with_a_size_cap_reads_an_empty_object(server: MotoServer) -> None:
    """``Store.get(key, max_bytes)`` of a zero-byte object must return b"" (as without a
    cap, and as every other store does). On S3 the capped read is a ``Range: bytes=0-N``
    GET, which S3 answers 416 for an empty object: a StorageError ("[Errno 22] The
    requested range is not satisfiable") instead."""
    store = S3Store(f"s3://{BUCKET}/{_prefix()}", s3_options(server.endpoint))
    store.put("empty", b"")
    assert store.get("empty") == b""
    assert store.get("empty", max_bytes=10) == b""


def test_verify_reports_an_emptied_array_document_as_bad_json_on_s3(server: MotoServer) -> None:
    """What that costs a user: an array ``zarr.json`` emptied on S3 is reported as an
    unreadable object (a range error) rather than as the damaged document it is."""
    location = open_location(f"s3://{BUCKET}/{_prefix()}", options=s3_options(server.endpoint))
    # per array with its own document: the default on S3 writes neither
    per_node = StorageLayout(pack_arrays_up_to=0, zarr_metadata="per_node")
    save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}, location, options=SaveOptions(layout=per_node))
    location.write_bytes("w/zarr.json", b"")
    report = verify(location)
    problems = [p for p in report.problems if p.key == "w/zarr.json"]
    assert problems, report
    assert "not valid JSON" in problems[0].message, problems[0].message


# ---------------------------------------------------------------- 2. console "folder" objects


def test_a_prefix_made_as_a_console_folder_takes_a_save(server: MotoServer) -> None:
    """The AWS console's "Create folder" (and Hadoop S3A, Cyberduck, ...) makes a zero-byte
    object named ``prefix/``. The listing of the prefix returns that object as an entry
    named after the prefix itself, so the save is refused: "s3://.../run is not empty and
    holds no committed shardstore checkpoint (found run)"; and ``delete_prefix`` could not
    remove it either (it deletes ``prefix``, not ``prefix/``)."""
    prefix = _prefix()
    _client(server).put_object(Bucket=BUCKET, Key=f"{prefix}/", Body=b"")
    location = open_location(f"s3://{BUCKET}/{prefix}", options=s3_options(server.endpoint))
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}
    save(sd, location)
    out = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(6))}
    assert torch.equal(load(out, location)["w"], torch.arange(6.0))


# ---------------------------------------------------------------- 3. TensorStore ignores the timeouts


@pytest.fixture
def black_hole():
    """An endpoint that accepts connections and never answers (a hung server)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    for conn in accepted:  # a reset ends whatever request still waits on them
        conn.close()
    listener.close()


def test_chunk_requests_give_up_after_the_read_timeout(black_hole: str) -> None:
    """``S3Options.read_timeout`` says "seconds before one request is given up (then
    retried)", and s3fs's requests honour it; TensorStore's (every chunk, every
    ``zarr.json``) never got it and waited curl's own 60 s low-speed limit per attempt, so
    a hung store failed a save after (max_retries + 1) x 60 s, five minutes by default.
    TensorStore reads its timeouts once per process: the PUT runs in a fresh one."""
    code = f"""
import time
from shardstore.stores.s3 import S3ChunkStore, S3Options, S3Store
options = S3Options(endpoint_url={black_hole!r}, key={KEY!r}, secret={SECRET!r}, region={REGION!r},
                    max_retries=0, connect_timeout=2, read_timeout=3)
start = time.monotonic()
try:
    S3ChunkStore(S3Store("s3://{BUCKET}/hung", options), 4).put("c/0", [memoryview(b"abc")])
except Exception as exc:
    print("failed after", round(time.monotonic() - start), "s:", type(exc).__name__)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORSTORE_CURL_")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=40, env=env)
    assert "failed after" in result.stdout, result.stdout + result.stderr
    assert int(result.stdout.split()[2]) < 20, result.stdout

# ---------------------------------------------------------------- 4. s3fs_kwargs replace shardstore's own settings


def test_s3fs_kwargs_keep_the_region_retries_and_timeouts() -> None:
    """``S3Options.s3fs_kwargs`` is merged over shardstore's kwargs with ``**``, so a user
    passing ``client_kwargs`` (a CA bundle: ``{"verify": ...}``) or ``config_kwargs``
    (a bigger pool) silently drops ``region_name`` (s3fs then signs for us-east-1 while
    TensorStore signs for the configured region), the standard retry mode and
    ``max_retries``, and the connect/read timeouts."""
    options = S3Options(endpoint_url="http://127.0.0.1:9", key=KEY, secret=SECRET, region="eu-west-1",
                        max_retries=2, read_timeout=3,
                        s3fs_kwargs={"client_kwargs": {"verify": False},
                                     "config_kwargs": {"max_pool_connections": 64}})
    fs = S3Store("s3://bkt/p", options).fs
    fs.connect()  # builds the client; sends no request
    config = fs.s3.meta.config
    assert fs.s3.meta.region_name == "eu-west-1"
    assert config.retries.get("mode") == "standard", config.retries
    assert config.read_timeout == 3


def test_max_retries_bounds_botocores_attempts() -> None:
    """botocore's ``retries={"max_attempts": n}`` counts retries, not attempts (its
    ``total_max_attempts`` is n + 1); ``S3Store.fs`` passes ``max_retries + 1``, so every
    s3fs request makes one attempt more than ``max_retries`` allows (max_retries=0 still
    retries once: a hung endpoint costs 2 x read_timeout)."""
    options = S3Options(endpoint_url="http://127.0.0.1:9", key=KEY, secret=SECRET, region=REGION, max_retries=2)
    fs = S3Store("s3://bkt/p", options).fs
    fs.connect()
    assert fs.s3.meta.config.retries.get("total_max_attempts") == 3, fs.s3.meta.config.retries


def test_a_load_from_a_bucket_that_does_not_exist_names_the_bucket(server: MotoServer) -> None:
    """A load from a missing bucket said "the checkpoint directory is empty (no object
    under this prefix)", sending the user to look for a save that never was; an empty
    prefix of a bucket that exists still says that."""
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}
    missing = open_location("s3://no-such-bucket-r6/ckpt", options=s3_options(server.endpoint))
    with pytest.raises(CheckpointingException, match=r"its bucket 'no-such-bucket-r6' does not exist; check the URL"):
        load(request, missing)
    empty = open_location(f"s3://{BUCKET}/{_prefix()}", options=s3_options(server.endpoint))
    with pytest.raises(CheckpointingException, match=r"the checkpoint directory is empty \(no object under"):
        load(request, empty)


# ---------------------------------------------------------------- 5. a GET's body cut short


@pytest.mark.parametrize("read", ["get", "get with a cap", "get_suffix"])
def test_a_read_whose_body_is_cut_short_is_retried(server: MotoServer, read: str) -> None:
    """A connection reset while an object's bytes arrive (the reply's headers came, then
    half the body) failed ``get`` and ``get_suffix`` at once ("Cannot read ...: Response
    payload is not completed"): botocore's retries end when the headers arrive, and the
    body is read outside them, so a load of ``common.pt``, a sharded object or the commit
    record failed on one transient reset that TensorStore's chunk reads survive."""
    prefix = _prefix()
    data = bytes(range(256)) * 40
    S3Store(f"s3://{BUCKET}/{prefix}", s3_options(server.endpoint)).put("common.pt", data)
    proxy = FaultyProxy(server.port, Faults(cut_bodies=1)).start()
    try:
        store = S3Store(f"s3://{BUCKET}/{prefix}", s3_options(proxy.endpoint, initial_delay=0.01))
        if read == "get":
            assert store.get("common.pt") == data
        elif read == "get with a cap":
            assert store.get("common.pt", max_bytes=len(data)) == data
        else:
            assert store.get_suffix("common.pt", 100) == (data[-100:], len(data))
    finally:
        proxy.stop()
    assert proxy.counts["cut"] == 1, proxy.counts


def test_a_body_cut_short_on_every_attempt_fails_naming_the_object(server: MotoServer) -> None:
    """The retries of a body cut short are bounded by ``max_retries``; then the error
    names the object."""
    prefix = _prefix()
    S3Store(f"s3://{BUCKET}/{prefix}", s3_options(server.endpoint)).put("common.pt", b"x" * 1000)
    proxy = FaultyProxy(server.port, Faults(cut_bodies=100)).start()
    try:
        store = S3Store(f"s3://{BUCKET}/{prefix}", s3_options(proxy.endpoint, max_retries=2, initial_delay=0.01))
        with pytest.raises(CheckpointingException, match=rf"s3://{BUCKET}/{prefix}/common\.pt"):
            store.get("common.pt")
    finally:
        proxy.stop()
    assert proxy.counts["cut"] == 3, proxy.counts


# ---------------------------------------------------------------- 6. a policy that grants a prefix


def test_a_save_under_a_policy_that_refuses_the_buckets_head(server: MotoServer) -> None:
    """HeadBucket needs s3:ListBucket on the whole bucket, which an IAM policy granting
    one prefix (ListBucket with an ``s3:prefix`` condition, Get/Put/DeleteObject on
    ``prefix/*``) does not give: AWS answers 403. ``S3Store.prepare`` made that a
    failed save ("Cannot find bucket of s3://...: Forbidden") although every request
    the save makes is allowed; a refused HEAD says nothing of the bucket, and a missing
    bucket still fails the save by name."""
    location_url = f"s3://{BUCKET}/{_prefix()}/ckpt"
    proxy = FaultyProxy(server.port, Faults(forbidden=(("HEAD", f"/{BUCKET}"),))).start()
    try:
        location = open_location(location_url, options=s3_options(proxy.endpoint))
        save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}, location)
        loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(6))}, location)
    finally:
        proxy.stop()
    assert loaded["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert ("HEAD", f"/{BUCKET}") in proxy.seen  # the refusal was met, not avoided
    missing = open_location("s3://no-such-bucket-r6/ckpt", options=s3_options(server.endpoint))
    with pytest.raises(CheckpointingException, match=r"Bucket 'no-such-bucket-r6' .* does not exist; create it"):
        save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}, missing)


# ---------------------------------------------------------------- 7. a pickled store's credentials


def test_a_pickled_store_keeps_its_credentials_when_the_original_is_collected(server: MotoServer) -> None:
    """Keys given in code reach TensorStore through a private credentials file, removed
    when the store that wrote it is collected. A pickled copy (a save handed to a
    spawned writer: Megatron's persistent checkpoint worker) carried the original's file
    names and no files of its own, so once the original was collected the copy could
    not open its chunk store ("Failed to create credentials provider ...
    AWS_ERROR_FILE_INVALID_PATH")."""
    store = S3Store(f"s3://{BUCKET}/{_prefix()}", s3_options(server.endpoint))
    store.chunk_access()  # writes the credentials files
    copy = pickle.loads(pickle.dumps(store))
    del store
    gc.collect()
    chunks = copy.chunk_store(4)
    chunks.put("c/0", [memoryview(b"abc")])
    assert copy.get("c/0") == b"abc"


# ---------------------------------------------------------------- 8. a profile's region


@pytest.fixture
def aws_config(tmp_path, monkeypatch):
    """Shared AWS config files giving the default profile and the profile ``regional``
    regions of their own, and no region in the environment."""
    config, credentials = tmp_path / "config", tmp_path / "credentials"
    config.write_text("[default]\nregion = ap-south-1\n\n[profile regional]\nregion = eu-west-2\n")
    credentials.write_text(f"[default]\naws_access_key_id = {KEY}\naws_secret_access_key = {SECRET}\n\n"
                           f"[regional]\naws_access_key_id = {KEY}\naws_secret_access_key = {SECRET}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("profile", "region"), [("regional", "eu-west-2"), (None, "ap-south-1")])
def test_the_region_comes_from_the_profile_where_nothing_else_names_one(aws_config, profile, region) -> None:
    """``S3Options.resolved_region`` read ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` and
    else said us-east-1, ignoring the region the shared config file gives the profile
    (``aws configure`` writes it there, not into the environment): s3fs and TensorStore
    were both told us-east-1, so TensorStore signed its chunk requests for, and sent them
    to, the wrong region of AWS (s3fs's botocore follows the redirect; TensorStore
    does not), while botocore itself and the AWS CLI use the profile's."""
    options = S3Options(endpoint_url="http://127.0.0.1:9", profile=profile)
    store = S3Store("s3://bkt/p", options)
    assert options.resolved_region() == region
    assert store.chunk_access().kvstore["aws_region"] == region
    store.fs.connect()  # builds the client; sends no request
    assert store.fs.s3.meta.region_name == region
    aws_config.setenv("AWS_REGION", "sa-east-1")  # the environment still wins
    assert options.resolved_region() == "sa-east-1"


# ---------------------------------------------------------------- 9. a commit whose reply is lost


def test_a_commit_record_written_whose_replies_were_lost_commits_the_save(server: MotoServer) -> None:
    """The commit record's PUT reached the store, but every answer to it was lost (the
    connection dropped after the request was sent; botocore sends it again, as it
    should, and loses that answer too): the save raised "Cannot write .../zarr.json"
    on every rank although the checkpoint was committed, loadable and verified; its
    marker stayed behind, and saving again was refused ("already holds a committed
    checkpoint"), or with ``overwrite=True`` deleted the good checkpoint first."""
    from shardstore.format.records import COMMIT_RECORD, SAVE_MARKER, is_committed

    prefix = _prefix()
    record = ("PUT", f"/{BUCKET}/{prefix}/{COMMIT_RECORD}")
    proxy = FaultyProxy(server.port, Faults(lose_replies=(record,))).start()
    try:
        location = open_location(f"s3://{BUCKET}/{prefix}", options=s3_options(proxy.endpoint, max_retries=1))
        save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}, location)
    finally:
        proxy.stop()
    assert proxy.seen.count(record) >= 2, proxy.seen  # sent again, every answer lost
    direct = open_location(f"s3://{BUCKET}/{prefix}", options=s3_options(server.endpoint))
    assert is_committed(direct) and not direct.exists(SAVE_MARKER)
    loaded = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(6))}, direct)
    assert loaded["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_an_atomic_put_that_failed_and_stored_nothing_still_fails(server: MotoServer) -> None:
    """The read-back that tells a lost answer from a failed write: a PUT refused (the
    object holds other bytes, or none) still raises, naming the object."""
    prefix = _prefix()
    S3Store(f"s3://{BUCKET}/{prefix}", s3_options(server.endpoint)).put("record", b"old")
    proxy = FaultyProxy(server.port, Faults(forbidden=(("PUT", f"/{BUCKET}/{prefix}/record"),))).start()
    try:
        store = S3Store(f"s3://{BUCKET}/{prefix}", s3_options(proxy.endpoint, max_retries=0))
        with pytest.raises(CheckpointingException, match=rf"Cannot write s3://{BUCKET}/{prefix}/record"):
            store.put_atomic("record", b"new")
    finally:
        proxy.stop()
    assert store.get("record") == b"old"


# ---------------------------------------------------------------- 10. prefixes that clients spell differently


@pytest.mark.parametrize(("spelled", "reason"), [
    ("/{p}", "empty"),  # s3://bucket//p
    ("{p}//b", "empty"),
    ("{p}/../b", r"'\.\.'"),
    ("{p}/./b", r"'\.'"),
])
def test_a_prefix_with_empty_or_dot_segments_is_refused_before_anything_is_written(
    server: MotoServer, spelled: str, reason: str,
) -> None:
    """S3 keys are literal, but not to every client: a save to ``s3://bucket/p/../e``
    wrote common.pt, metadata.json and the commit record through s3fs under the key
    ``p/../e/`` and the chunks through TensorStore (curl resolves dot segments) under
    ``e/``, outside the prefix, over any checkpoint there; verify named the split. And
    ``s3://bucket//p`` was saved under ``p``, not under the key ``/p`` that the URL
    names to S3 and to other tools. Such prefixes are refused when the store is made."""
    prefix = _prefix()
    url = f"s3://{BUCKET}/{spelled.format(p=prefix)}"
    with pytest.raises(CheckpointingException, match=rf"{re.escape(url)}.*{reason}.* segment"):
        save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}, open_location(
            url, options=s3_options(server.endpoint)))
    listed = _client(server).list_objects_v2(Bucket=BUCKET).get("Contents", [])
    assert not [o["Key"] for o in listed if prefix in o["Key"] or o["Key"].startswith(("b/", "/"))]


@pytest.mark.parametrize("url", [f"s3://{BUCKET}", f"s3://{BUCKET}/", f"s3://{BUCKET}/a/b", f"s3://{BUCKET}/a/b/",
                                 f"s3://{BUCKET}/a.b/..c/%2E%2E"])
def test_plain_prefixes_and_a_trailing_slash_are_taken(url: str) -> None:
    assert S3Store(url).describe() == url.rstrip("/")
