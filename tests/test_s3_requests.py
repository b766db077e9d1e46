"""Issue 44.3's request budget on S3, counted at a proxy in front of the local S3 server
while two ranks save and load: a save makes at most arrays + data objects + 2 x ranks +
a few requests (with small arrays packed, ``SaveOptions.pack_arrays_up_to``: arrays
not packed + their data objects + packs + 2 x ranks + a few), a load one GET per data
object each rank reads + 4 x ranks + a few, and a read of part of a shard one suffix GET for its index (no HEAD) and one ranged GET.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from shardstore import ShardedTensor, StorageLayout, load, save
from shardstore.format.commit import SaveOptions
from shardstore.format.records import read_commit_record
from shardstore.stores.locations import open_location
from shardstore.stores.s3 import S3Options
from shardstore.strategies.zarr import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy
from tests.dist import run_distributed
from tests.s3_support import KEY, REGION, SECRET, Faults, FaultyProxy, MotoServer

BUCKET = "request-budget"
WORLD, ARRAYS, ROWS, COLS = 2, 12, 256, 256  # FSDP2-like: each array split along its rows
SMALL_ARRAYS = 20  # replicated, 16 KiB each: what a packed save puts into packs
# The "a few": with 2 x ranks, room for the 12 requests measured that grow with
# neither arrays nor ranks (the bucket's HEAD, one listing of the target, the save
# marker's PUT, GET and DELETE, metadata.json and common.pt and their reads for the
# record's checksums, the check for a committed record, and the record itself).
SAVE_A_FEW = 8
# One GET of each prefix that holds the target (``s3://request-budget/<objects>/ckpt``:
# ``<objects>/`` and the bucket's root), for a committed checkpoint a save must not go
# inside (``Store.enclosing``): grows with the target's depth, not with arrays or ranks.
ENCLOSING_PREFIXES = 2
# A load's requests per rank beside its data: the commit record, metadata.json,
# common.pt, and the look for another tool's checkpoint in the same prefix.
LOAD_PER_RANK = 4


def _global(i: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + i


def _state(parts: int, part: int, empty: bool = False) -> dict[str, ShardedTensor]:
    out = {}
    for i in range(ARRAYS):
        block = _global(i).chunk(parts)[part].clone()
        out[f"p{i}"] = ShardedTensor.from_rank_offsets(
            f"p{i}", torch.zeros_like(block) if empty else block, (0, part, parts))
    return out


def _with_small_arrays(parts: int, part: int, empty: bool = False) -> dict[str, ShardedTensor]:
    """``_state`` plus ``SMALL_ARRAYS`` replicated arrays of 16 KiB (norms, biases): the
    plan gives each one writer, who writes it whole, so a save may pack them."""
    out = _state(parts, part, empty)
    for i in range(SMALL_ARRAYS):
        value = torch.full((64, 64), float(i))
        out[f"norm{i}"] = ShardedTensor.from_rank_offsets(
            f"norm{i}", torch.zeros_like(value) if empty else value, replica_id=part)
    return out


def _assert_each_put_once(made: list[tuple[str, str]]) -> None:
    """Every object is written once but the root ``zarr.json``: the save's claim, then the
    commit record that replaces it (``format.claims``)."""
    puts = [path for method, path in made if method == "PUT"]
    roots = [path for path in puts if path.endswith("/ckpt/zarr.json")]
    others = [path for path in puts if path not in roots]
    assert len(roots) == 2 and len(others) == len(set(others)), "an object was written twice"


def _location(url: str, endpoint: str):
    return open_location(url, options=S3Options(endpoint_url=endpoint, key=KEY, secret=SECRET, region=REGION))


def saved(rank: int, world: int, url: str, endpoint: str, shard_bytes: int | None) -> None:
    # an array's own objects are counted: small arrays stay out of packs
    save(_state(world, rank), _location(url, endpoint), ZarrSaveShardedStrategy(shard_bytes=shard_bytes),
         layout=StorageLayout(pack_arrays_up_to=0))


def loaded(rank: int, world: int, url: str, endpoint: str, parts: int) -> None:
    """Loads this rank's part of ``parts`` (parts beyond the ranks are read by nobody)."""
    got = load(_state(parts, rank, empty=True), _location(url, endpoint), validate_access_integrity=False)
    for key, expected in _state(parts, rank).items():
        assert torch.equal(got[key], expected.data), key


@pytest.fixture(scope="module")
def proxy(moto_server: MotoServer) -> Iterator[FaultyProxy]:
    moto_server.create_bucket(BUCKET)
    proxy = FaultyProxy(moto_server.port, Faults()).start()
    yield proxy
    proxy.stop()


def _listings(made: list[tuple[str, str]]) -> list[str]:
    """The ListObjectsV2 requests among ``made``."""
    return [path for method, path in made if method == "GET" and "list-type=2" in path]


def _requests(proxy: FaultyProxy, fn, *args) -> list[tuple[str, str]]:
    """The (method, path) of each request ``fn`` makes on ``WORLD`` ranks."""
    before = len(proxy.seen)
    run_distributed(fn, WORLD, *args, timeout=240)
    return proxy.seen[before:]


@pytest.mark.parametrize(("shard_bytes", "objects"), [(None, ARRAYS * WORLD), (64 << 20, ARRAYS)],
                         ids=["a-chunk-per-rank", "a-shard-per-array"])
def test_a_two_rank_save_and_load_stay_within_the_request_budget(proxy, shard_bytes, objects) -> None:
    url = f"s3://{BUCKET}/{objects}/ckpt"
    made = _requests(proxy, saved, url, proxy.endpoint, shard_bytes)
    methods = Counter(method for method, _ in made)
    assert len(made) <= ARRAYS + objects + 2 * WORLD + SAVE_A_FEW + ENCLOSING_PREFIXES, methods  # + zarr.json, data
    _assert_each_put_once(made)
    assert methods["HEAD"] <= 2, made  # the bucket, and whether a record is there
    assert len(_listings(made)) == 1, made  # whether the prefix is empty, looked at once

    made = _requests(proxy, loaded, url, proxy.endpoint, WORLD)
    methods = Counter(method for method, _ in made)
    # every rank reads each of its chunks, or each shard it needs half of, whole: one GET
    assert len(made) <= ARRAYS * WORLD + LOAD_PER_RANK * WORLD, methods
    assert methods["HEAD"] <= WORLD, made  # another tool's metadata file, looked for once a rank


def test_a_read_of_part_of_a_shard_is_an_index_get_and_a_ranged_get(proxy) -> None:
    """Two ranks each load a quarter of every array from one shard per array: per shard
    and rank one suffix GET for the index (its Content-Range gives the shard's size, so
    no HEAD) and one ranged GET of the inner chunks wanted."""
    url = f"s3://{BUCKET}/quarters/ckpt"
    _requests(proxy, saved, url, proxy.endpoint, 64 << 20)
    made = _requests(proxy, loaded_by_ranges, url, proxy.endpoint, 2 * WORLD)
    data = Counter(method for method, path in made if "/ckpt/p" in path)
    assert data == {"GET": 2 * ARRAYS * WORLD}, made


def test_verify_lists_the_checkpoint_once(proxy) -> None:
    """``verify`` on S3 listed the checkpoint's objects twice: once for their sizes (a
    chunk object grown since the commit) and once for files the record does not list.
    One listing serves both."""
    from shardstore import verify

    url = f"s3://{BUCKET}/verified/ckpt"
    _requests(proxy, saved, url, proxy.endpoint, None)
    before = len(proxy.seen)
    assert verify(_location(url, proxy.endpoint)).ok
    listings = [path for method, path in proxy.seen[before:] if method == "GET" and "list-type=2" in path]
    assert len(listings) == 1, listings


def test_verify_reports_a_failed_listing_once(proxy, monkeypatch) -> None:
    """The one listing failing: before, verify listed again for the files the record
    does not list, failed again, and reported the same listing error twice."""
    from shardstore import verify
    from shardstore.stores.fsspec_base import FsspecStore

    url = f"s3://{BUCKET}/unlistable/ckpt"
    _requests(proxy, saved, url, proxy.endpoint, None)

    def refused(self, prefix: str = "") -> dict[str, int]:
        raise PermissionError("AccessDenied: s3:ListBucket")

    monkeypatch.setattr(FsspecStore, "list_sizes", refused)
    report = verify(_location(url, proxy.endpoint))
    listing = [p for p in report.problems if p.part == "listing"]
    assert len(listing) == 1 and "AccessDenied" in listing[0].message, report.problems
    assert "files the record does not list" in listing[0].message


def loaded_by_ranges(rank: int, world: int, url: str, endpoint: str, parts: int) -> None:
    """``loaded``, with S3 taken to cost nothing per request, so that these small
    shards are read by ranges (``ChunkStore.request_bytes``)."""
    from shardstore.stores.s3 import S3ChunkStore

    S3ChunkStore.request_bytes = 0
    loaded(rank, world, url, endpoint, parts)


def loaded_reading_shards_once(rank: int, world: int, url: str, endpoint: str) -> None:
    got = load(_state(world, rank, empty=True), _location(url, endpoint),
               sharded_strategy=ZarrLoadShardedStrategy(read_shards_once=True))
    for key, expected in _state(world, rank).items():
        assert torch.equal(got[key], expected.data), key


def test_read_shards_once_gets_each_shard_once_for_all_ranks(proxy) -> None:
    """Two ranks each need half of every shard: each reading its half makes a GET per
    shard and rank; with ``read_shards_once`` one rank GETs each shard for both."""
    url = f"s3://{BUCKET}/once/ckpt"
    _requests(proxy, saved, url, proxy.endpoint, 64 << 20)
    each = _requests(proxy, loaded, url, proxy.endpoint, WORLD)
    once = _requests(proxy, loaded_reading_shards_once, url, proxy.endpoint)
    data = [Counter(method for method, path in made if "/ckpt/p" in path) for made in (each, once)]
    assert data == [{"GET": ARRAYS * WORLD}, {"GET": ARRAYS}], data


def test_a_suffix_read_is_one_request_that_names_the_size(proxy) -> None:
    from shardstore.stores.s3 import S3ChunkStore

    location = _location(f"s3://{BUCKET}/suffix", proxy.endpoint)
    location.write_bytes("obj", bytes(range(200)))
    chunks = location.store.chunk_store(4)
    assert isinstance(chunks, S3ChunkStore)
    for nbytes, expected in ((20, bytes(range(180, 200))), (500, bytes(range(200)))):
        before = len(proxy.seen)
        assert chunks.get_suffix("obj", nbytes) == (expected, 200)
        assert [method for method, _ in proxy.seen[before:]] == ["GET"]
    assert chunks.get_suffix("missing", 20) is None


def saved_packed(rank: int, world: int, url: str, endpoint: str) -> None:
    save(_with_small_arrays(world, rank), _location(url, endpoint), options=SaveOptions(pack_arrays_up_to=64 << 10))


def loaded_packed(rank: int, world: int, url: str, endpoint: str) -> None:
    got = load(_with_small_arrays(world, rank, empty=True), _location(url, endpoint))
    for key, expected in _with_small_arrays(world, rank).items():
        assert torch.equal(got[key], expected.data), key


def test_a_packed_save_stays_within_the_request_budget_with_one_put_per_pack(proxy) -> None:
    """Issue 44.3's budget with packs: the small replicated arrays cost one PUT per pack
    (no document, no chunk object of their own), the FSDP-split arrays (both ranks write
    each) their document and a chunk per rank as before; nothing is read back or asked
    about beyond an unpacked save's fixed requests."""
    url = f"s3://{BUCKET}/packed/ckpt"
    made = _requests(proxy, saved_packed, url, proxy.endpoint)
    record = read_commit_record(_location(url, proxy.endpoint))
    assert set(record.packed_arrays) == {f"norm{i}" for i in range(SMALL_ARRAYS)}
    assert 1 <= len(record.packs) <= WORLD, record.packs
    methods = Counter(method for method, _ in made)
    unpacked = ARRAYS  # the FSDP-split arrays: a document each, and a chunk per rank
    assert len(made) <= unpacked + ARRAYS * WORLD + len(record.packs) + 2 * WORLD + SAVE_A_FEW + ENCLOSING_PREFIXES, \
        methods
    _assert_each_put_once(made)
    puts = [path for method, path in made if method == "PUT"]
    assert sorted(p.split("/ckpt/")[1] for p in puts if "/ckpt/packs/" in p) == sorted(record.packs)
    assert not [(m, p) for m, p in made if "/ckpt/norm" in p or "/ckpt/packs/" in p and m != "PUT"], made
    assert methods["HEAD"] <= 2, made  # the bucket, and whether a record is there
    assert len(_listings(made)) == 1, made

    made = _requests(proxy, loaded_packed, url, proxy.endpoint)
    methods = Counter(method for method, _ in made)
    # one ranged GET per pack and rank (the packed chunks one load reads lie side by side,
    # a few hundred KiB in all: one run, ``format.packs.PACK_RUN_BYTES``), one GET per FSDP chunk
    assert len(made) <= ARRAYS * WORLD + len(record.packs) * WORLD + LOAD_PER_RANK * WORLD, methods
    pack_gets = [p for m, p in made if "/ckpt/packs/" in p]
    assert all(m == "GET" for m, p in made if "/ckpt/packs/" in p), made
    assert len(pack_gets) <= len(record.packs) * WORLD, pack_gets
    assert methods["HEAD"] <= WORLD, made


FSDP_PACK = 1 << 20  # above the FSDP-split arrays' 256 KiB: every array packed


def saved_fsdp_packed(rank: int, world: int, url: str, endpoint: str) -> None:
    save(_state(world, rank), _location(url, endpoint), options=SaveOptions(pack_arrays_up_to=FSDP_PACK))


def test_a_packed_fsdp_save_makes_requests_by_ranks_not_arrays(proxy) -> None:
    """Issue 44.3 with FSDP2-split small arrays packed: each array is gathered whole to
    one writer (balanced over the ranks) and packed there, so the save PUTs a pack per
    rank and no document or chunk object of any array."""
    url = f"s3://{BUCKET}/fsdp-packed/ckpt"
    made = _requests(proxy, saved_fsdp_packed, url, proxy.endpoint)
    record = read_commit_record(_location(url, proxy.endpoint))
    assert set(record.packed_arrays) == set(_state(1, 0)), record.packed_arrays
    assert len(record.packs) == WORLD, record.packs  # the writers are balanced over the ranks
    methods = Counter(method for method, _ in made)
    assert len(made) <= len(record.packs) + 2 * WORLD + SAVE_A_FEW + ENCLOSING_PREFIXES, methods
    puts = [path for method, path in made if method == "PUT"]
    assert not [p for p in puts if "/ckpt/p" in p and "/ckpt/packs/" not in p], puts  # no array's own object
    made = _requests(proxy, loaded, url, proxy.endpoint, WORLD)
    assert len(made) <= ARRAYS * WORLD + LOAD_PER_RANK * WORLD, Counter(method for method, _ in made)
