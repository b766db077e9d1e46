"""shardstore benchmark: one run, the same state dict and disk, against the peers.

    .venv/bin/python scripts/bench.py                  # 2 GiB, 3 repetitions
    .venv/bin/python scripts/bench.py --gib 0.5 --reps 1 --cases large

Methods, on the same generated data:

- ``shardstore``  ``shardstore.save`` / ``shardstore.load`` at the same world size;
- ``dcp``         ``torch.distributed.checkpoint`` with DTensors on a gloo CPU mesh and
                  its default file-system writer/reader (``sync_files=True``);
- ``torch``       ``torch.save`` + fsync / ``torch.load`` of the global dict in one process;
- ``raw``         each rank writes its bytes as one plain file with one fsync (reads it
                  back into preallocated memory), all ranks at once: the disk's bound.

Cases: ``large`` (tensor-parallel shards, mixed bfloat16/float32), ``small`` (5,000
replicated 4 KiB tensors), ``reshard`` (saved at 2 ranks, loaded at 1; baseline: the
same tensors saved and loaded by one process), ``dcp-api`` (the large state as DTensors
through DCP's own ``dcp.save``/``dcp.load``: with ``shardstore.ShardstoreWriter`` and
reader against DCP's ``FileSystemWriter``/``FileSystemReader``, and through
``shardstore.save``/``load``), ``dcp-plain`` (a plain model plus Adam, replicated on every
rank as DDP holds it, through ``dcp.save``/``dcp.load`` with ``ShardstoreWriter``/``Reader``
against DCP's ``FileSystemWriter``/``Reader``; ``--plain-gib``) and ``async``
(caller-blocked time of an async save vs ``clone()``; a matmul loop's throughput while
the save runs in the background); ``device`` (not in the default set: tensors on
``--device``, CUDA on the GPU machine, at ``--world 1``: sync save, load into device
targets, async blocked time against a pinned device-to-host copy, against DCP,
``torch.save`` and the raw bound; ``--cases device --world 1 --gib 8``); ``tiny`` (not
in the default set: 10,000 float32 tensors of 1-64 KiB saved by one process against
``torch.save`` and the per-array layout's floor; ``--cases tiny --world 1``);
``reshard-fsdp`` (not in the default set: FSDP2-shaped state saved by all ranks but one
and loaded by all, against DCP, with the bytes each load reads; ``--cases reshard-fsdp
--world 3``); ``layouts`` (not in the default set; ``scripts/bench_layouts.py``): on
each workload of issue 65 (tiny tensors at one rank, FSDP2-shaped blocks on S3, the
Llama-shaped state, FSDP2 + AdamW through ``dcp.save``), the save given no layout option
against every explicit layout that could be best for it and the peers, with default /
best explicit as a throughput ratio; the figures (on a quiet machine)::

    PYTHONPATH=$PWD .venv/bin/python scripts/bench.py --cases layouts --world 2 --reps 5 --gib 2 \
        --json layouts.json

and its smoke test (about 2 minutes; not figures): ``--cases layouts --world 2 --reps 1 --quick``.

Every timed load starts with the page cache dropped (``/proc/sys/vm/drop_caches`` when
writable, else ``posix_fadvise(DONTNEED)`` on the checkpoint's files; the report says
which), and every timed operation after a full garbage collection, untimed
(``Bench._timed``). In the large case shardstore, DCP and the raw read fill targets made once,
before the timings, as a trainer's tensors exist before its load. Peak RSS is the
kernel's high-water mark (reset through ``clear_refs``) minus the RSS before the
operation, maximum over ranks. Times are medians over ``--reps``
(each line also gives the fastest and slowest repetition).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardstore.testing import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the layout workloads' module beside this one

import bench_layouts  # noqa: E402

GiB = 2**30


# ----------------------------------------------------------------- measurement


def drop_page_cache(paths: list[Path]) -> str:
    """Evicts the files under ``paths`` from the page cache; returns the method used."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for root in paths:
            files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
            for p in files:
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return "fadvise"


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field_name} not in /proc/self/status")


class PeakRSS:
    """The rise of this process's resident memory during a block, in bytes."""

    def __enter__(self) -> PeakRSS:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")  # resets VmHWM to the current RSS
        self.before = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc: object) -> None:
        self.extra = _status_kib("VmHWM") * 1024 - self.before


@dataclass
class Sample:
    seconds: float
    extra_rss: int
    requests: dict[str, int] = field(default_factory=dict)  # by HTTP method, where the S3 server counts


S3_METHODS = ("GET", "PUT", "HEAD", "DELETE", "POST")


class RequestCounter:
    """The requests the local S3 server answered, by HTTP method: counted inside its
    WSGI application (in the launcher's process, no proxy in the way) into shared
    memory that the ranks read between operations."""

    def __init__(self) -> None:
        self.counts = mp.get_context("spawn").Array("q", len(S3_METHODS) + 1)  # the last: any other method

    def wrap(self, app: Callable) -> Callable:
        def counting(environ: dict, start_response: Callable) -> object:
            method = environ.get("REQUEST_METHOD", "")
            slot = S3_METHODS.index(method) if method in S3_METHODS else len(S3_METHODS)
            with self.counts.get_lock():
                self.counts[slot] += 1
            return app(environ, start_response)

        return counting

    def snapshot(self) -> list[int]:
        with self.counts.get_lock():
            return list(self.counts)

    def since(self, before: list[int]) -> dict[str, int]:
        """Requests by method since ``snapshot()`` gave ``before`` (methods with none left out)."""
        now = self.snapshot()
        return {name: now[i] - before[i] for i, name in enumerate((*S3_METHODS, "other")) if now[i] > before[i]}


@dataclass
class Result:
    case: str
    method: str
    op: str
    nbytes: int
    samples: list[Sample] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return statistics.median(s.seconds for s in self.samples)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def extra_rss(self) -> int:
        return max(s.extra_rss for s in self.samples)

    @property
    def requests(self) -> int | None:
        """Median S3 requests per operation, or None where none were counted."""
        counted = [sum(s.requests.values()) for s in self.samples if s.requests]
        return round(statistics.median(counted)) if counted else None


# ----------------------------------------------------------------- state


def large_shapes(total_bytes: int, world: int) -> list[tuple[str, torch.dtype, tuple[int, int], int]]:
    """(name, dtype, global shape, TP axis): alternating bf16 column- and fp32 row-parallel."""
    layers = []
    per_layer = 2 * 4096 * 4096 * 2 + 4096 * 4096 * 4  # one bf16 (8192x4096) + one fp32 (4096x4096)
    n = max(1, round(total_bytes / per_layer))
    for i in range(n):
        layers.append((f"layer{i}.qkv", torch.bfloat16, (8192, 4096), 0))
        layers.append((f"layer{i}.fc2", torch.float32, (4096, 4096), 1))
    return layers


def make_global(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def local_shard(full: torch.Tensor, axis: int, rank: int, world: int) -> torch.Tensor:
    return full.chunk(world, axis)[rank].clone()


@dataclass
class State:
    """This rank's shards and how each maps onto the global tensor."""

    shards: dict[str, tuple[torch.Tensor, int]]  # key -> (local tensor, TP axis or -1 = replicated)
    shapes: dict[str, tuple[int, ...]]

    @property
    def local_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, _ in self.shards.values())


def build_large(total_bytes: int, rank: int, world: int) -> State:
    shards, shapes = {}, {}
    for name, dtype, shape, axis in large_shapes(total_bytes, world):
        shards[name] = (local_shard(make_global(name, dtype, shape), axis, rank, world), axis)
        shapes[name] = shape
    return State(shards, shapes)


def build_small(count: int, rank: int) -> State:
    gen = torch.Generator().manual_seed(1)
    shards = {f"norm{i}": (torch.randn(1024, generator=gen), -1) for i in range(count)}
    return State(shards, {k: tuple(t.shape) for k, (t, _) in shards.items()})


def full_bytes(state: State) -> int:
    return sum(
        torch.empty(0, dtype=t.dtype).element_size() * int(torch.Size(state.shapes[k]).numel())
        for k, (t, _) in state.shards.items()
    )


# ----------------------------------------------------------------- methods


def shardstore_sd(state: State, rank: int, world: int, empty: bool = False) -> dict:
    from shardstore import ShardedTensor

    sd = {}
    for key, (t, axis) in state.shards.items():
        data = torch.empty_like(t) if empty else t
        if axis < 0:
            sd[key] = ShardedTensor.from_rank_offsets(key, data, replica_id=rank)
        else:
            sd[key] = ShardedTensor.from_rank_offsets(key, data, (axis, rank, world))
    return sd


def dcp_sd(state: State, mesh, empty: bool = False) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    sd = {}
    for key, (t, axis) in state.shards.items():
        data = torch.empty_like(t) if empty else t
        placement = Replicate() if axis < 0 else Shard(axis)
        sd[key] = DTensor.from_local(data, mesh, [placement], run_check=False)
    return sd


def faulted_in(targets: dict | list) -> dict | list:
    """``targets`` (a state dict of load targets made once, or a list of tensors) with
    every byte written, untimed: a load into fresh ``torch.empty`` memory pays the
    kernel's page faults, so whichever method loaded first in round 0 paid them (1 GiB:
    2.3-4.9 s against 0.8-1.1 s, every run, always the default layout). Returns
    ``targets``."""
    for value in (targets.values() if isinstance(targets, dict) else targets):
        local = value.to_local() if hasattr(value, "to_local") else getattr(value, "data", value)
        local.zero_()
    return targets


def raw_save(state: State, path: Path) -> None:
    with open(path, "wb") as f:
        for t, _ in state.shards.values():
            f.write(memoryview(t.view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def raw_load(buffers: list[torch.Tensor], path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        for b in buffers:
            view = memoryview(b.view(torch.uint8).numpy())
            got = 0
            while got < len(view):
                got += f.readinto(view[got:])


def files_save(state: State, path: Path, rank: int, world: int) -> None:
    """The small case's bound for a format of one Zarr array per key: this rank's share
    of the keys each as a directory with a 600-byte metadata file and a chunk file, made
    by 8 threads, then one ``sync``. No checksums, no record, no checks."""
    from shardstore.stores.base import run_parallel

    mine = list(state.shards.items())[rank::world]
    meta = b" " * 600

    def write(item: tuple[str, tuple[torch.Tensor, int]]) -> None:
        key, (t, _) = item
        os.makedirs(path / key, exist_ok=True)
        for name, data in (("zarr.json", meta), ("c.0", memoryview(t.view(torch.uint8).numpy()))):
            fd = os.open(path / key / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            os.write(fd, data)
            os.close(fd)

    run_parallel(write, mine, 8)
    os.sync()


def files_load(state: State, path: Path, rank: int, world: int) -> None:
    """Reads this rank's chunk files of ``files_save`` into new tensors, 8 threads."""
    from shardstore.stores.base import run_parallel

    def read(item: tuple[str, tuple[torch.Tensor, int]]) -> None:
        key, (t, _) = item
        out = torch.empty_like(t)
        fd = os.open(path / key / "c.0", os.O_RDONLY)
        os.readv(fd, [memoryview(out.view(torch.uint8).numpy())])
        os.close(fd)

    run_parallel(read, list(state.shards.items())[rank::world], 8)


def torch_save(sd: dict, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------- harness


class Bench:
    """Runs identical sequences on every rank; rank 0 keeps the results."""

    def __init__(self, rank: int, world: int, root: Path, reps: int, s3_requests: RequestCounter | None = None,
                 methods: frozenset[str] | None = None) -> None:
        self.rank, self.world, self.root, self.reps = rank, world, root, reps
        self.methods = methods  # ``--methods``: only these are measured (None: all)
        self.s3_requests = s3_requests
        self.results: list[Result] = []
        self.cache_method = "none"
        self.extra: dict[str, float] = {}  # figures beside the timings (rank 0's)
        self.sections: dict[str, dict] = {}  # structured figures of a case, written to the JSON as they are
        self.solo = dist.new_group([0])
        self._methods: list[Method] = []

    def _timed(self, fn: Callable[[], None], participate: bool = True) -> Sample:
        """``fn`` on every rank between barriers, with the S3 requests it made (read on
        rank 0 before the first barrier and after the last, so none is another's).

        A full garbage collection runs first, untimed, on every rank. Otherwise one
        of 150-185 ms over the FSDP2 workload's 300,000 objects fell into whichever
        operation crossed the collector's threshold, left there by all that ran before
        (24 of the 26 slow saves among 90 saves of three methods had one, 5-10 per
        method), in saves of 0.12-0.16 s; ``timeit`` pauses the collector for the same
        reason. An operation still pays for the collections its own allocations start
        while the collector runs (``shardstore.save`` and ``load`` pause it: their
        cycles are collected after them, here untimed)."""
        before = self.s3_requests.snapshot() if self.s3_requests is not None and self.rank == 0 else None
        gc.collect()
        dist.barrier()
        with PeakRSS() as rss:
            start = time.perf_counter()
            if participate:
                fn()
            dist.barrier()
            seconds = time.perf_counter() - start
        peak = [0] * self.world
        dist.all_gather_object(peak, rss.extra)
        return Sample(seconds, max(peak), self.s3_requests.since(before) if before is not None else {})

    def _drop(self, paths: list[Path]) -> None:
        dist.barrier()
        if self.rank == 0:
            self.cache_method = drop_page_cache(paths)
        dist.barrier()

    def _set_aside(self, path: Path, graveyard: Path) -> None:
        """Moves a method's earlier output into ``graveyard`` (a rename; ``flush``
        deletes it after its rounds). On this machine's ext4 without a journal,
        creating an inode skips every inode freed in the last 60-360 s, so deleting the
        last output right before a save made the next save pay for it: 10,000
        ``mkdir``s took 2-8 s after such a deletion and 0.27-0.70 s without
        (docs/measurements/small-tensors.md), a cost that falls on the methods that
        create many files, not on ``torch.save``."""
        if self.rank == 0 and path.exists():
            graveyard.mkdir(exist_ok=True)
            path.rename(graveyard / f"{path.name}-{len(os.listdir(graveyard))}")
        dist.barrier()

    def _make_room(self, graveyards: set[Path], outputs: list[Path]) -> None:
        """At the end of a round, untimed: deletes the outputs set aside so far
        (``_set_aside``) where the disk could not hold two more rounds of ``outputs``
        (the bytes this round's added, ``bytes_only_here``) and ``ROOM_SPARE``. A round of the Llama-shaped layouts workload
        writes about 10 GB: 5 rounds fit on this machine's disk, 11 did not."""
        dist.barrier()
        if self.rank == 0:
            need = 2 * sum(bytes_only_here(p) for p in outputs) + ROOM_SPARE
            if shutil.disk_usage(self.root).free < need:
                for graveyard in sorted(g for g in graveyards if g.exists()):
                    shutil.rmtree(graveyard)
                os.sync()
        dist.barrier()

    def _clean(self, path: Path) -> None:
        dist.barrier()
        if self.rank == 0 and path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            os.sync()  # let the deletion settle before the next timed operation
        dist.barrier()

    def measure(
        self, case: str, method: str, nbytes: int, path: Path,
        save: Callable[[], None] | None, load: Callable[[], None] | None,
        check: Callable[[], None] | None = None, solo: bool = False,
        before_save: Callable[[], None] | None = None,
    ) -> None:
        """Registers a method (unless ``--methods`` leaves it out); ``flush`` measures all
        registered methods together. ``before_save``: runs untimed before each save,
        after the page cache is dropped."""
        if self.methods is not None and method not in self.methods:
            return
        self._methods.append(Method(case, method, nbytes, path, save, load, check, solo, before_save))

    def flush(self) -> None:
        """``reps`` rounds over the registered methods, interleaved, so that the disk's
        slow phases (seen here: the same write taking 0.7 s or 3.4 s minutes apart) fall
        on every method alike. A round saves by every method, then loads each one's
        output, each operation starting with the page cache dropped. What ran just
        before matters: at 2 ranks on the 2-core machine a save right after a 2 GiB
        ``torch.load`` took 1.6-1.8 s instead of 0.5-0.7 s (shardstore) and 0.6-1.5 s
        instead of 0.6-0.7 s (DCP), and dropping the cache first removed the
        difference; a 2 GiB save right after a 2 GiB load still ran 0.89-1.74 s
        against 1.02-1.33 s after another save, the same save in every round. So saves
        follow saves, and the order changes every round (``round_order``):
        a plain rotation keeps each method's predecessor the same in every round, and one
        method paid for the one-process ``torch`` case every time."""
        methods, self._methods = self._methods, []
        results = {}
        for m in methods:
            results[m] = (Result(m.case, m.name, "save", m.nbytes), Result(m.case, m.name, "load", m.nbytes))
        graveyards: set[Path] = set()  # earlier outputs set aside (``_set_aside``), deleted after the rounds
        for rep in range(self.reps):
            order = round_order(methods, rep)
            for m in order:
                if m.save is not None:
                    graveyards.add(m.path.parent / "set-aside")
                    self._set_aside(m.path, m.path.parent / "set-aside")
                    self._drop([x.path for x in methods if x.path.exists()])
                    here = self.rank == 0 or not m.solo
                    if m.before_save is not None and here:
                        m.before_save()
                    results[m][0].samples.append(self._timed(m.save, participate=here))
            for m in order:
                if m.load is not None:
                    here = self.rank == 0 or not m.solo
                    self._drop([m.path])
                    results[m][1].samples.append(self._timed(m.load, participate=here))
                    if m.check is not None and rep == 0 and here:
                        m.check()
            self._make_room(graveyards, [m.path for m in methods])
        for graveyard in sorted(graveyards):
            self._clean(graveyard)
        for saved, loaded in results.values():
            self.results += [r for r in (saved, loaded) if r.samples]
            if self.rank == 0:
                for r in (saved, loaded):
                    if r.samples:
                        low, high = min(x.seconds for x in r.samples), max(x.seconds for x in r.samples)
                        counted = (f"  {r.requests} requests ({', '.join(f'{n} {m}' for m, n in r.samples[-1].requests.items())})"
                                   if r.requests else "")
                        print(f"  {r.case:8} {r.method:11} {r.op}: {r.seconds:7.3f} s ({low:.3f}-{high:.3f})  "
                              f"{r.gbps:6.2f} GB/s  +{r.extra_rss / 2**20:7.1f} MiB RSS{counted}", flush=True)


ROOM_SPARE = 5 * GiB
"""Free disk ``Bench._make_room`` keeps beyond two rounds' outputs (a nearly full disk
measured the Llama-shaped save 0.60-0.69x)."""


def round_order(methods: list, rep: int) -> list:
    """The order of ``methods`` in round ``rep``: round r starts with method r (mod n),
    so every method runs first as often as any other (the first of a round runs after
    the last round's last load, which costs a 2 GiB save up to 2.7x: 3.5 s against
    1.3 s); even rounds go on in the listed order, odd rounds against it, so that a
    method's predecessor changes too."""
    k = rep % len(methods)
    ascending = methods[k:] + methods[:k]
    return ascending if rep % 2 == 0 else ascending[:1] + ascending[:0:-1]


@dataclass(eq=False)
class Method:
    case: str
    name: str
    nbytes: int
    path: Path
    save: Callable[[], None] | None
    load: Callable[[], None] | None
    check: Callable[[], None] | None
    solo: bool
    before_save: Callable[[], None] | None = None  # untimed, after the page cache is dropped


def run_large(b: Bench, args: argparse.Namespace) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import shardstore

    state = build_large(int(args.gib * GiB), b.rank, b.world)
    nbytes = state.local_bytes * b.world
    case = "large"
    if b.rank == 0:
        print(f"large: {nbytes / GiB:.2f} GiB in {len(state.shards)} tensors at {b.world} ranks", flush=True)

    def check_equal(loaded: dict) -> None:
        for k, (t, _) in state.shards.items():
            got = loaded[k]
            got = got.to_local() if hasattr(got, "to_local") else got
            assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), k

    ss_path = b.root / "shardstore"
    ss_target: dict = {}
    # Every load fills targets made once, as the raw read fills its buffers and as a
    # trainer's model and optimizer hold their tensors before a load: allocating them
    # inside the timing measured the kernel's page faults, not the read.
    ss_empty = faulted_in(shardstore_sd(state, b.rank, b.world, empty=True))

    def ss_load() -> None:
        ss_target.clear()
        ss_target.update(shardstore.load(ss_empty, str(ss_path)))

    b.measure(case, "shardstore", nbytes, ss_path,
              lambda: shardstore.save(shardstore_sd(state, b.rank, b.world), str(ss_path)),
              ss_load, lambda: check_equal(ss_target))

    mesh = init_device_mesh("cpu", (b.world,))
    dcp_path = b.root / "dcp"
    dcp_target: dict = {}

    dcp_empty = faulted_in(dcp_sd(state, mesh, empty=True))

    def dcp_load() -> None:
        dcp_target.clear()
        dcp_target.update(dcp_empty)
        dcp.load(dcp_target, checkpoint_id=str(dcp_path))

    b.measure(case, "dcp", nbytes, dcp_path,
              lambda: dcp.save(dcp_sd(state, mesh), checkpoint_id=str(dcp_path)),
              dcp_load, lambda: check_equal(dcp_target))

    raw_path = b.root / "raw"
    if b.rank == 0:
        raw_path.mkdir(exist_ok=True)
    dist.barrier()
    buffers = faulted_in([torch.empty_like(t) for t, _ in state.shards.values()])
    b.measure(case, "raw", nbytes, raw_path,
              lambda: (raw_path.mkdir(exist_ok=True), raw_save(state, raw_path / f"rank{b.rank}")),
              lambda: raw_load(buffers, raw_path / f"rank{b.rank}"))

    # torch.save of the global dict in one process (rank 0 builds it)
    full = {}
    if b.rank == 0:
        full = {name: make_global(name, dtype, shape) for name, dtype, shape, _ in large_shapes(int(args.gib * GiB), b.world)}
    torch_path = b.root / "torch.pt"
    b.measure(case, "torch", nbytes, torch_path,
              lambda: torch_save(full, torch_path),
              lambda: torch.load(torch_path, weights_only=True), solo=True)
    b.flush()
    for held in (buffers, ss_empty, dcp_empty, full):
        held.clear()
    b._clean(torch_path)

    if args.cases and "reshard" in args.cases:
        run_reshard(b, state, ss_path, dcp_path, nbytes)
    if args.cases and "async" in args.cases:
        run_async(b, state, nbytes)
    for p in (ss_path, dcp_path, raw_path):
        b._clean(p)


def run_reshard(b: Bench, state: State, ss_path: Path, dcp_path: Path, nbytes: int) -> None:
    """Loads the 2-rank checkpoints (left by the large case) into one process.

    The same-layout baseline is a checkpoint of the same global tensors saved by one
    process and loaded by one process: same reader, same bytes, only the layout
    differs, so the ratio isolates the cost of resharding (the 2-rank load of the
    large case has twice the readers)."""
    import torch.distributed.checkpoint as dcp

    import shardstore
    from shardstore import ShardedTensor

    def full_empty() -> dict[str, torch.Tensor]:
        return {k: torch.empty(state.shapes[k], dtype=t.dtype) for k, (t, _) in state.shards.items()}

    def ss_load(path: Path = ss_path) -> None:
        sd = {k: ShardedTensor.from_rank_offsets(k, t) for k, t in full_empty().items()}
        shardstore.load(sd, str(path), process_group=b.solo)

    full = {name: make_global(name, t.dtype, state.shapes[name]) for name, (t, _) in state.shards.items()} if b.rank == 0 else {}
    same_path = b.root / "reshard-same-layout"

    def ss_save_one_rank() -> None:
        sd = {k: ShardedTensor.from_rank_offsets(k, t) for k, t in full.items()}
        shardstore.save(sd, str(same_path), process_group=b.solo)

    def dcp_load() -> None:
        dcp.load(full_empty(), checkpoint_id=str(dcp_path), no_dist=True)

    b.measure("reshard", "shardstore", nbytes, ss_path, None, ss_load, solo=True)
    b.measure("reshard", "dcp", nbytes, dcp_path, None, dcp_load, solo=True)
    b.measure("reshard", "shardstore-1rank", nbytes, same_path, ss_save_one_rank,
              lambda: ss_load(same_path), solo=True)
    b.flush()
    full.clear()
    b._clean(same_path)


def run_dcp_api(b: Bench, args: argparse.Namespace) -> None:
    """DCP's own API on both formats: ``dcp.save`` / ``dcp.load`` of the large case's
    state as DTensors, through ``shardstore.ShardstoreWriter`` and through DCP's
    ``FileSystemWriter`` / ``FileSystemReader`` (``sync_files=True``); and the same
    DTensors through ``shardstore.save`` / ``load`` (``shardstore.inputs.dtensors``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    import shardstore
    from shardstore import ShardstoreReader, ShardstoreWriter

    state = build_large(int(args.gib * GiB), b.rank, b.world)
    nbytes = state.local_bytes * b.world
    if b.rank == 0:
        print(f"dcp-api: {nbytes / GiB:.2f} GiB in {len(state.shards)} DTensors at {b.world} ranks", flush=True)
    mesh = init_device_mesh("cpu", (b.world,))

    def method(name: str, path: Path, save: Callable[[dict], None], load: Callable[[dict], None]) -> None:
        # first-call costs (lazy imports, DCP's first plan and collectives) paid untimed, by each
        # method alike: else whichever runs first in round 0 pays them (+1-10 s seen here)
        warm = {"warm-up": DTensor.from_local(torch.zeros(4), mesh, [Replicate()], run_check=False)}
        save(warm)
        load(warm)
        b._clean(path)
        target: dict = {}

        def load_into() -> None:
            target.clear()
            target.update(dcp_sd(state, mesh, empty=True))
            load(target)

        def check() -> None:
            for k, (t, _) in state.shards.items():
                assert torch.equal(target[k].to_local().view(torch.uint8), t.view(torch.uint8)), (name, k)

        b.measure("dcp-api", name, nbytes, path, lambda: save(dcp_sd(state, mesh)), load_into, check)

    ours, theirs, api = b.root / "dcp-api-shardstore", b.root / "dcp-api-dcp", b.root / "dcp-api-dtensor"
    method("shardstore", ours, lambda sd: dcp.save(sd, storage_writer=ShardstoreWriter(ours)),
           lambda sd: dcp.load(sd, storage_reader=ShardstoreReader(ours)))
    method("dcp", theirs, lambda sd: dcp.save(sd, storage_writer=dcp.FileSystemWriter(theirs)),
           lambda sd: dcp.load(sd, storage_reader=dcp.FileSystemReader(theirs)))
    method("ss-api", api, lambda sd: shardstore.save(sd, str(api)), lambda sd: shardstore.load(sd, str(api)))
    b.flush()
    for p in (ours, theirs, api):
        b._clean(p)


def plain_model_state(total_bytes: int) -> dict:
    """A plain (non-DTensor) model and its Adam state after one step, as DDP or a
    one-process fine-tuning script holds it on every rank: ``Linear(2048, 2048)``
    layers (16 MiB weights, 8 KiB biases) whose weights and moments make up about
    ``total_bytes``; the same on every rank (seeded)."""
    from torch import nn

    torch.manual_seed(0)
    layers = max(1, round(total_bytes / (3 * 2048 * 2048 * 4)))
    model = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(layers)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 2048)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def run_dcp_plain(b: Bench, args: argparse.Namespace) -> None:
    """``dcp.save`` / ``dcp.load`` of a plain model plus Adam (issue 31.3), every tensor
    replicated on every rank: ``ShardstoreWriter`` (tensors >= 1 KiB as arrays, each
    written by one rank) against DCP's ``FileSystemWriter`` (``sync_files=True``),
    interleaved. Loads fill a state of the same structure in place."""
    import torch.distributed.checkpoint as dcp

    from shardstore import ShardstoreReader, ShardstoreWriter

    state = plain_model_state(int(args.plain_gib * GiB))
    tensors = [t for group in (state["model"], *state["optim"]["state"].values()) for t in group.values()]
    nbytes = sum(t.nbytes for t in tensors)
    if b.rank == 0:
        print(f"dcp-plain: {nbytes / 2**20:.0f} MiB in {len(tensors)} plain tensors, replicated on {b.world} ranks",
              flush=True)

    def empty_like(value):
        if isinstance(value, dict):
            return {k: empty_like(v) for k, v in value.items()}
        if isinstance(value, list):
            return [empty_like(v) for v in value]
        return torch.zeros_like(value) if isinstance(value, torch.Tensor) else value

    def method(name: str, path: Path, writer: Callable[[], object], reader: Callable[[], object]) -> None:
        dcp.save({"warm-up": torch.zeros(4)}, storage_writer=writer())  # first-call costs, untimed
        dcp.load({"warm-up": torch.zeros(4)}, storage_reader=reader())
        b._clean(path)
        target: dict = {}

        def load_into() -> None:
            target.clear()
            target.update(empty_like(state))
            dcp.load(target, storage_reader=reader())

        def check() -> None:
            for key, tensor in state["model"].items():
                assert torch.equal(target["model"][key], tensor), (name, key)
            for index, moments in state["optim"]["state"].items():
                for key, tensor in moments.items():
                    assert torch.equal(target["optim"]["state"][index][key], tensor), (name, index, key)

        b.measure("dcp-plain", name, nbytes, path, lambda: dcp.save(state, storage_writer=writer()), load_into, check)

    ours, theirs = b.root / "dcp-plain-shardstore", b.root / "dcp-plain-dcp"
    method("shardstore", ours, lambda: ShardstoreWriter(ours), lambda: ShardstoreReader(ours))
    method("dcp", theirs, lambda: dcp.FileSystemWriter(theirs), lambda: dcp.FileSystemReader(theirs))
    b.flush()
    for p in (ours, theirs):
        b._clean(p)


def measure_dcp_and_files(b: Bench, case: str, state: State, nbytes: int) -> tuple[Path, Path]:
    """Registers the peers of a case: DCP (DTensors of the same shards) and the raw
    files (one per shard); returns their paths."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (b.world,))
    dcp_path, files_path = b.root / f"{case}-dcp", b.root / f"{case}-files"
    b.measure(case, "dcp", nbytes, dcp_path,
              lambda: dcp.save(dcp_sd(state, mesh), checkpoint_id=str(dcp_path)),
              lambda: dcp.load(dcp_sd(state, mesh, empty=True), checkpoint_id=str(dcp_path)))
    b.measure(case, "files", nbytes, files_path,
              lambda: files_save(state, files_path, b.rank, b.world),
              lambda: files_load(state, files_path, b.rank, b.world))
    return dcp_path, files_path


def run_small(b: Bench, args: argparse.Namespace) -> None:

    import shardstore

    state = build_small(args.small, b.rank)
    nbytes = full_bytes(state)
    if b.rank == 0:
        print(f"small: {args.small} tensors of 4 KiB, replicated on {b.world} ranks", flush=True)
    ss_path = b.root / "small-shardstore"
    b.measure("small", "shardstore", nbytes, ss_path,
              lambda: shardstore.save(shardstore_sd(state, b.rank, b.world), str(ss_path)),
              lambda: shardstore.load(shardstore_sd(state, b.rank, b.world, empty=True), str(ss_path)))
    dcp_path, files_path = measure_dcp_and_files(b, "small", state, nbytes)
    plain = {k: t for k, (t, _) in state.shards.items()}
    torch_path = b.root / "small-torch.pt"
    b.measure("small", "torch", nbytes, torch_path,
              lambda: torch_save(plain, torch_path),
              lambda: torch.load(torch_path, weights_only=True), solo=True)
    b.flush()
    for p in (ss_path, dcp_path, files_path, torch_path):
        b._clean(p)


def build_tiny(count: int) -> State:
    """``count`` float32 tensors of 1-64 KiB (256-16,384 elements, uniform), held whole."""
    gen = torch.Generator().manual_seed(3)
    sizes = torch.randint(256, 16385, (count,), generator=gen).tolist()
    shards = {f"tiny{i}": (torch.randn(n, generator=gen), -1) for i, n in enumerate(sizes)}
    return State(shards, {k: tuple(t.shape) for k, (t, _) in shards.items()})


def files_dirs_first_save(state: State, path: Path) -> None:
    """``files_save`` with the directories made first by one thread (as
    ``LocalStore.put_many`` makes them), the files then written by 8 threads, one
    ``sync``: the layout's floor where ``mkdir``s do not contend for their parent."""
    from shardstore.stores.base import run_parallel

    os.makedirs(path, exist_ok=True)
    for key in state.shards:
        os.mkdir(path / key)
    meta = b" " * 600

    def write(item: tuple[str, tuple[torch.Tensor, int]]) -> None:
        key, (t, _) = item
        for name, data in (("zarr.json", meta), ("c.0", memoryview(t.view(torch.uint8).numpy()))):
            fd = os.open(path / key / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            os.write(fd, data)
            os.close(fd)

    run_parallel(write, list(state.shards.items()), 8)
    os.sync()


def zip_pack_save(state: State, path: Path) -> None:
    """The tiny case's floor for a packed design (none is built yet): every tensor a
    Zarr v3 array (its ``zarr.json`` as shardstore writes it, its chunk with the
    ``crc32c`` codec's trailer) inside ONE stored (uncompressed) zip, as zarr-python's
    ``ZipStore`` and TensorStore's ``zip`` kvstore read it; the chunks' XXH3-128
    digests (what a commit record binds) taken on 4 threads; one file, one ``fsync``."""
    import crc32c
    import xxhash

    from shardstore.format.records import ArrayRecord, group_metadata
    from shardstore.stores.base import run_parallel

    chunks: dict[str, tuple[memoryview, bytes]] = {}

    def encode(item: tuple[str, tuple[torch.Tensor, int]]) -> None:
        key, (t, _) = item
        data = memoryview(t.numpy()).cast("B")
        xxhash.xxh3_128_hexdigest(data)
        chunks[key] = (data, crc32c.crc32c(data).to_bytes(4, "little"))

    run_parallel(encode, list(state.shards.items()), 4)
    with open(path, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
        z.writestr("zarr.json", json.dumps(group_metadata()))
        for key, (t, _) in state.shards.items():
            record = ArrayRecord(key, tuple(t.shape), "float32", tuple(t.shape))
            z.writestr(f"{key}/zarr.json", json.dumps(record.zarr_metadata()))
            data, trailer = chunks[key]
            z.writestr(f"{key}/c.0", b"".join((data, trailer)))
        z.close()
        f.flush()
        os.fsync(f.fileno())


def zip_pack_load(state: State, path: Path) -> dict[str, torch.Tensor]:
    """Reads every chunk of ``zip_pack_save`` into new tensors at the offsets its zip
    directory gives (a record would give them): 8 threads of ``preadv``, no checks."""
    from shardstore.stores.base import run_parallel

    out = {key: torch.empty_like(t) for key, (t, _) in state.shards.items()}
    with zipfile.ZipFile(path) as z:
        infos = {info.filename: info for info in z.infolist()}
    fd = os.open(path, os.O_RDONLY)
    try:
        def read(key: str) -> None:
            info = infos[f"{key}/c.0"]
            start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
            os.preadv(fd, [memoryview(out[key].numpy()).cast("B")], start)

        run_parallel(read, list(out), 8)
    finally:
        os.close(fd)
    return out


def run_tiny(b: Bench, args: argparse.Namespace) -> None:
    """Issue 44.6: ``--tiny`` float32 tensors of 1-64 KiB saved and loaded by one process
    (``--world 1``) as ``ShardedTensor``s, against ``torch.save``/``torch.load`` of the
    same dict and the per-array layout's floor (``files``: each key a directory with a
    metadata file and a chunk file, 8 threads, one ``sync``; ``files-dirs-first``: the
    directories made first by one thread), interleaved. ``shardstore``: the layout
    shardstore chooses (arrays of at most 256 KiB packed); ``shardstore-per-array``: a
    directory per key; ``shardstore-consolidated``: the same with the arrays' metadata
    in the root's consolidated metadata only (no ``zarr.json`` per key);
    ``shardstore-packed``: arrays of at most 64 KiB packed into the process's zip
    (feature ``packs``); ``zip-pack``: the floor of a packed design, every array inside
    one zip (``zip_pack_save``)."""
    import shardstore
    from shardstore.format.commit import SaveOptions

    if b.world != 1:
        if b.rank == 0:
            print("tiny: skipped (a one-process case: run it with --world 1)", flush=True)
        return
    state = build_tiny(args.tiny)
    nbytes = full_bytes(state)
    print(f"tiny: {args.tiny} float32 tensors of 1-64 KiB, {nbytes / 2**20:.0f} MiB, one process", flush=True)
    plain = {k: t for k, (t, _) in state.shards.items()}
    ss_path, torch_path = b.root / "tiny-shardstore", b.root / "tiny-torch.pt"
    warm = State(dict(list(state.shards.items())[:2]), state.shapes)  # imports on first use: untimed
    shardstore.save(shardstore_sd(warm, 0, 1), str(ss_path))
    shardstore.load(shardstore_sd(warm, 0, 1, empty=True), str(ss_path))
    b._clean(ss_path)
    files_path, first_path = b.root / "tiny-files", b.root / "tiny-files-dirs-first"

    loaded: dict[str, dict] = {}  # the latest load of each method, checked untimed

    def check(method: str) -> Callable[[], None]:
        def compare() -> None:
            bad = [k for k, t in plain.items() if not torch.equal(loaded[method][k], t)]
            if bad:
                raise AssertionError(f"tiny: {method} loaded {len(bad)} tensors wrong, e.g. {bad[0]!r}")
        return compare

    b.measure("tiny", "shardstore", nbytes, ss_path,
              lambda: shardstore.save(shardstore_sd(state, 0, 1), str(ss_path)),
              lambda: loaded.update(shardstore=shardstore.load(shardstore_sd(state, 0, 1, empty=True), str(ss_path))),
              check("shardstore"))
    per_array_path = b.root / "tiny-shardstore-per-array"
    per_array = SaveOptions(pack_arrays_up_to=0, zarr_metadata="per_node")
    b.measure("tiny", "shardstore-per-array", nbytes, per_array_path,
              lambda: shardstore.save(shardstore_sd(state, 0, 1), str(per_array_path), options=per_array),
              lambda: loaded.update({"shardstore-per-array": shardstore.load(
                  shardstore_sd(state, 0, 1, empty=True), str(per_array_path))}),
              check("shardstore-per-array"))
    consolidated_path = b.root / "tiny-shardstore-consolidated"
    consolidated = SaveOptions(zarr_metadata="consolidated_only", pack_arrays_up_to=0)
    b.measure("tiny", "shardstore-consolidated", nbytes, consolidated_path,
              lambda: shardstore.save(shardstore_sd(state, 0, 1), str(consolidated_path), options=consolidated),
              lambda: loaded.update({"shardstore-consolidated": shardstore.load(
                  shardstore_sd(state, 0, 1, empty=True), str(consolidated_path))}),
              check("shardstore-consolidated"))
    packed_path = b.root / "tiny-shardstore-packed"
    packed = SaveOptions(pack_arrays_up_to=64 * 1024)
    b.measure("tiny", "shardstore-packed", nbytes, packed_path,
              lambda: shardstore.save(shardstore_sd(state, 0, 1), str(packed_path), options=packed),
              lambda: loaded.update({"shardstore-packed": shardstore.load(
                  shardstore_sd(state, 0, 1, empty=True), str(packed_path))}),
              check("shardstore-packed"))
    b.measure("tiny", "torch", nbytes, torch_path, lambda: torch_save(plain, torch_path),
              lambda: loaded.update(torch=torch.load(torch_path, weights_only=True)), check("torch"))
    b.measure("tiny", "files", nbytes, files_path, lambda: files_save(state, files_path, 0, 1),
              lambda: files_load(state, files_path, 0, 1))
    b.measure("tiny", "files-dirs-first", nbytes, first_path, lambda: files_dirs_first_save(state, first_path),
              lambda: files_load(state, first_path, 0, 1))
    zip_path = b.root / "tiny-zip-pack.zip"
    b.measure("tiny", "zip-pack", nbytes, zip_path, lambda: zip_pack_save(state, zip_path),
              lambda: loaded.update({"zip-pack": zip_pack_load(state, zip_path)}), check("zip-pack"))
    b.flush()
    for p in (ss_path, per_array_path, consolidated_path, packed_path, torch_path, files_path, first_path, zip_path):
        b._clean(p)


def build_fsdp(count: int, rows: int, rank: int, world: int) -> State:
    """``count`` fp32 arrays of ``rows`` x 256, each split along its first axis over the
    ranks (FSDP2's ``Shard(0)``): small blocks, one per rank per array."""
    shards, shapes = {}, {}
    for i in range(count):
        shape = (rows, 256)
        shards[f"p{i}"] = (local_shard(make_global(f"p{i}", torch.float32, shape), 0, rank, world), 0)
        shapes[f"p{i}"] = shape
    return State(shards, shapes)


def run_fsdp(b: Bench, args: argparse.Namespace) -> None:
    """Issue 44.1: FSDP-shaped state of many small first-axis blocks, saved with every
    block a chunk file and with the blocks gathered into 64 MiB shards (through
    ``shardstore.save`` and through DCP's door, ``dcp.save`` with
    ``ShardstoreWriter(shard_bytes=...)``), against DCP and the raw files, in one
    interleaved run."""

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import shardstore
    from shardstore import ShardstoreReader, ShardstoreWriter
    from shardstore.engine.zarr_strategies import ZarrSaveShardedStrategy

    rows = args.fsdp_rows * b.world
    state = build_fsdp(args.fsdp_arrays, rows, b.rank, b.world)
    nbytes = full_bytes(state)
    if b.rank == 0:
        print(f"fsdp: {args.fsdp_arrays} arrays of {rows} x 256 fp32, Shard(0) over {b.world} ranks, "
              f"{nbytes / 2**20:.0f} MiB", flush=True)
    for method, strategy in (("shardstore", None), ("shardstore-sharded", ZarrSaveShardedStrategy(shard_bytes=64 << 20))):
        path = b.root / f"fsdp-{method}"
        b.measure("fsdp", method, nbytes, path,
                  lambda path=path, strategy=strategy: shardstore.save(
                      shardstore_sd(state, b.rank, b.world), str(path), strategy),
                  lambda path=path: shardstore.load(shardstore_sd(state, b.rank, b.world, empty=True), str(path)))
    mesh, default_door = init_device_mesh("cpu", (b.world,)), b.root / "fsdp-dcp-writer"
    b.measure("fsdp", "dcp-writer", nbytes, default_door,  # the layout the writer chooses
              lambda: dcp.save(dcp_sd(state, mesh), storage_writer=ShardstoreWriter(str(default_door))),
              lambda: dcp.load(dcp_sd(state, mesh, empty=True), storage_reader=ShardstoreReader(str(default_door))))
    door = b.root / "fsdp-dcp-writer-sharded"
    b.measure("fsdp", "dcp-writer-sharded", nbytes, door,
              lambda: dcp.save(dcp_sd(state, mesh), storage_writer=ShardstoreWriter(str(door), shard_bytes=64 << 20)),
              lambda: dcp.load(dcp_sd(state, mesh, empty=True), storage_reader=ShardstoreReader(str(door))))
    dcp_path, files_path = measure_dcp_and_files(b, "fsdp", state, nbytes)
    if "s3" in args.cases:
        measure_fsdp_on_s3(b, state, nbytes)
    b.flush()
    methods = ("shardstore", "shardstore-sharded", "dcp-writer", "dcp-writer-sharded", "dcp", "files")
    if b.rank == 0:
        for method in methods:
            path = b.root / f"fsdp-{method}"
            b.extra[f"fsdp {method} files"] = sum(len(f) for _, _, f in os.walk(path)) if path.exists() else 0
    for method in methods:
        b._clean(b.root / f"fsdp-{method}")


def io_read_chars() -> int:
    """Bytes this process has read through system calls so far (``/proc/self/io``'s
    ``rchar``: every thread, cached or not)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def run_reshard_fsdp(b: Bench, args: argparse.Namespace) -> None:
    """Issue 44.4: FSDP2-shaped state saved by ranks 0..W-2 and loaded by all W ranks
    (2 -> 3 at ``--world 3``), against DCP in the same interleaved run: shardstore with
    every block a chunk, shardstore with 64 MiB shards (inner chunks finer than a block),
    and DCP. Besides the time, each load's bytes read (``rchar`` across the load,
    records included) over the bytes the rank asked for, the maximum over ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import shardstore
    from shardstore.engine.zarr_strategies import ZarrSaveShardedStrategy

    saving = b.world - 1
    rows = 64 * saving * b.world
    saver = build_fsdp(args.fsdp_arrays, rows, b.rank, saving) if b.rank < saving else None
    loader = build_fsdp(args.fsdp_arrays, rows, b.rank, b.world)
    nbytes = full_bytes(loader)
    save_group = dist.new_group(list(range(saving)))
    save_mesh, load_mesh = DeviceMesh("cpu", list(range(saving))), init_device_mesh("cpu", (b.world,))
    if b.rank == 0:
        print(f"reshard-fsdp: {args.fsdp_arrays} arrays of {rows} x 256 fp32, Shard(0), saved by {saving} "
              f"ranks, loaded by {b.world}; {nbytes / 2**20:.0f} MiB", flush=True)
    read_ratio: dict[str, list[float]] = {}

    def counted(method: str, load: Callable[[], dict]) -> Callable[[], None]:
        def run() -> None:
            before = io_read_chars()
            loaded = load()
            read_ratio.setdefault(method, []).append((io_read_chars() - before) / loader.local_bytes)
            for key, (want, _) in loader.shards.items():
                got = loaded[key]
                got = got.to_local() if hasattr(got, "to_local") else got
                assert torch.equal(got, want), (method, key)
        return run

    def only_savers(save: Callable[[], None]) -> Callable[[], None]:
        return lambda: save() if saver is not None else None

    paths = []
    for method, strategy in (("shardstore", None), ("shardstore-sharded", ZarrSaveShardedStrategy(shard_bytes=64 << 20))):
        path = b.root / f"reshard-fsdp-{method}"
        paths.append(path)
        b.measure("reshard-fsdp", method, nbytes, path,
                  only_savers(lambda path=path, strategy=strategy: shardstore.save(
                      shardstore_sd(saver, b.rank, saving), str(path), strategy, process_group=save_group)),
                  counted(method, lambda path=path: shardstore.load(
                      shardstore_sd(loader, b.rank, b.world, empty=True), str(path))))
    dcp_path = b.root / "reshard-fsdp-dcp"
    paths.append(dcp_path)

    def dcp_load() -> dict:
        target = dcp_sd(loader, load_mesh, empty=True)
        dcp.load(target, checkpoint_id=str(dcp_path))
        return target

    b.measure("reshard-fsdp", "dcp", nbytes, dcp_path,
              only_savers(lambda: dcp.save(dcp_sd(saver, save_mesh), checkpoint_id=str(dcp_path),
                                           process_group=save_group)),
              counted("dcp", dcp_load))
    b.flush()
    every = [None] * b.world
    dist.all_gather_object(every, read_ratio)
    if b.rank == 0:
        for method in read_ratio:
            worst = [max(r[method][i] for r in every) for i in range(len(read_ratio[method]))]
            b.extra[f"reshard-fsdp {method} bytes read / needed (max over ranks, median)"] = round(
                statistics.median(worst), 3)
            print(f"  reshard-fsdp {method}: read {statistics.median(worst):.2f}x the bytes needed "
                  f"(max over ranks; reps {', '.join(f'{w:.2f}' for w in worst)})", flush=True)
    for p in paths:
        b._clean(p)


def measure_fsdp_on_s3(b: Bench, state: State, nbytes: int) -> None:
    """The fsdp case on the local S3 server (``--cases fsdp,s3``), interleaved with the
    local methods: shardstore with and without shards (and loaded with each shard read
    once, ``read_shards_once``), and with every array packed (gathered whole to one
    writer each, ``pack_arrays_up_to``), against DCP over fsspec (torch's
    ``FsspecWriter``/``FsspecReader`` with s3fs), issue 44.3's comparison."""
    from torch.distributed.device_mesh import init_device_mesh

    import shardstore
    from shardstore.engine.zarr_strategies import (
        ZarrLoadShardedStrategy,
        ZarrSaveShardedStrategy,
    )
    from shardstore.format.commit import SaveOptions

    sharded = ZarrSaveShardedStrategy(shard_bytes=64 << 20)
    per_node, consolidated = SaveOptions(overwrite=True), SaveOptions(overwrite=True, zarr_metadata="consolidated_only")
    once = ZarrLoadShardedStrategy(read_shards_once=True)  # each shard read by one rank (default from 32 ranks)
    # every array packed: gathered whole to one writer each, a pack per rank
    packed = SaveOptions(overwrite=True, pack_arrays_up_to=max(
        math.prod(shape) * t.element_size() for (t, _), shape in zip(state.shards.values(), state.shapes.values())))
    for method, strategy, options, loader in (
        ("shardstore-s3", None, per_node, None), ("shardstore-sharded-s3", sharded, per_node, None),
        ("shardstore-packed-s3", None, packed, None),
        ("shardstore-consolidated-s3", None, consolidated, None),
        ("shardstore-sharded-consolidated-s3", sharded, consolidated, None),
        ("shardstore-sharded-consolidated-once-s3", sharded, consolidated, once),
    ):
        url = f"s3://{S3_BUCKET}/fsdp/{method}"
        b.measure("fsdp", method, nbytes, b.root / f"unused-{method}",
                  lambda url=url, strategy=strategy, options=options: shardstore.save(
                      shardstore_sd(state, b.rank, b.world), url, strategy, options=options),
                  lambda url=url, loader=loader: shardstore.load(
                      shardstore_sd(state, b.rank, b.world, empty=True), url, sharded_strategy=loader))
    measure_dcp_on_s3(b, "fsdp", state, nbytes, init_device_mesh("cpu", (b.world,)))


def measure_dcp_on_s3(b: Bench, case: str, state: State, nbytes: int, mesh) -> None:
    """DCP over fsspec (torch's ``FsspecWriter``/``FsspecReader`` with s3fs) and, where
    installed, s3torchconnector's DCP writer on the local S3 server: issue 44.3's peers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    url = f"s3://{S3_BUCKET}/{case}/dcp-fsspec"
    b.measure(case, "dcp-fsspec-s3", nbytes, b.root / f"unused-{case}-dcp-fsspec",
              lambda: dcp.save(dcp_sd(state, mesh), storage_writer=FsspecWriter(url)),
              lambda: dcp.load(dcp_sd(state, mesh, empty=True), storage_reader=FsspecReader(url)))
    run_s3_torchconnector(b, case, state, nbytes, mesh)


def run_s3_torchconnector(b: Bench, case: str, state: State, nbytes: int, mesh) -> None:
    """s3torchconnector's DCP writer and reader (AWS's CRT client: multipart uploads,
    ranged GETs) on the same local S3 server, where it is installed (``pip install
    "s3torchconnector[dcp]"``, never a dependency of shardstore); its client finds the
    server through ``AWS_ENDPOINT_URL``, as the other methods do."""
    try:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    except ImportError as exc:
        if b.rank == 0:
            print(f"{case}: s3torchconnector's DCP writer not measured ({exc})", flush=True)
        return
    region = os.environ.get("AWS_REGION", "us-east-1")
    config = S3ClientConfig(force_path_style=True)  # a local server: the bucket in the path, not the host
    url = f"s3://{S3_BUCKET}/{case}/dcp-s3torchconnector"
    b.measure(case, "dcp-s3tc-s3", nbytes, b.root / f"unused-{case}-dcp-s3tc",
              lambda: dcp.save(dcp_sd(state, mesh), storage_writer=S3StorageWriter(region, url, s3client_config=config)),
              lambda: dcp.load(dcp_sd(state, mesh, empty=True),
                               storage_reader=S3StorageReader(region, url, s3client_config=config)))


def run_s3(b: Bench, args: argparse.Namespace) -> None:
    """shardstore save/load on S3 vs the same bytes as plain objects through s3fs (one
    object per tensor shard, all of a rank's objects in flight at once), against the
    local S3 server the launcher started (moto: in-memory, so this measures the client
    side and the protocol, not a disk); then ``--s3-small`` small arrays
    (``measure_small_arrays_on_s3``). Every operation's requests are counted at the server."""
    import s3fs
    from torch.distributed.device_mesh import init_device_mesh

    import shardstore

    state = build_large(int(args.s3_gib * GiB), b.rank, b.world)
    nbytes = state.local_bytes * b.world
    if b.rank == 0:
        print(f"s3: {nbytes / GiB:.2f} GiB in {len(state.shards)} tensors at {b.world} ranks, "
              f"server {os.environ['AWS_ENDPOINT_URL']}", flush=True)
    fs = s3fs.S3FileSystem()
    url = f"s3://{S3_BUCKET}/shardstore"
    plain = f"{S3_BUCKET}/plain/rank{b.rank}"

    def ss_save() -> None:
        shardstore.save(shardstore_sd(state, b.rank, b.world), url, overwrite=True)

    def ss_load() -> None:
        shardstore.load(shardstore_sd(state, b.rank, b.world, empty=True), url)

    def plain_save() -> None:
        fs.pipe({f"{plain}/{k}": t.view(torch.uint8).numpy().tobytes() for k, (t, _) in state.shards.items()})

    def plain_load() -> None:
        blobs = fs.cat([f"{plain}/{k}" for k in state.shards])
        for k, (t, _) in state.shards.items():
            torch.empty_like(t).view(torch.uint8).numpy().reshape(-1)[...] = memoryview(blobs[f"{plain}/{k}"]).cast("B")

    b.measure("s3", "shardstore", nbytes, b.root / "unused-s3-a", ss_save, ss_load)
    b.measure("s3", "s3fs-plain", nbytes, b.root / "unused-s3-b", plain_save, plain_load)
    measure_dcp_on_s3(b, "s3", state, nbytes, init_device_mesh("cpu", (b.world,)))
    b.flush()
    if args.s3_small:
        measure_small_arrays_on_s3(b, args)


def build_replicated(count: int, nbytes: int) -> State:
    """``count`` float32 arrays of ``nbytes`` each, the same on every rank (norms, biases,
    the small parameters that tensor and pipeline parallelism replicate)."""
    gen = torch.Generator().manual_seed(2)
    shards = {f"small{i}": (torch.randn(nbytes // 4, generator=gen), -1) for i in range(count)}
    return State(shards, {k: tuple(t.shape) for k, (t, _) in shards.items()})


def measure_small_arrays_on_s3(b: Bench, args: argparse.Namespace) -> None:
    """Issue 44.3 where arrays are small: ``--s3-small`` replicated float32 arrays of
    ``--s3-small-kib`` each on the local S3 server, interleaved: shardstore's default (a
    ``zarr.json`` and a chunk object per array), ``consolidated_only`` (a chunk object per
    array), packed (``SaveOptions(pack_arrays_up_to=...)``: one object per pack, a pack
    per writing rank) against DCP over fsspec (and s3torchconnector where installed).
    Each shardstore save goes to a new prefix, as a trainer saves each step (no
    ``overwrite`` deleting the previous save inside the timing); each load reads the
    latest. The first load of each method is checked against the saved values."""
    from torch.distributed.device_mesh import init_device_mesh

    import shardstore
    from shardstore.format.commit import SaveOptions

    state = build_replicated(args.s3_small, args.s3_small_kib * 1024)
    nbytes = full_bytes(state)
    if b.rank == 0:
        print(f"s3-small: {args.s3_small} replicated float32 arrays of {args.s3_small_kib} KiB, "
              f"{nbytes / 2**20:.0f} MiB, {b.world} ranks", flush=True)
    saves = {"n": 0}
    loaded: dict[str, dict] = {}

    def check(method: str) -> Callable[[], None]:
        def compare() -> None:
            bad = [k for k, (t, _) in state.shards.items() if not torch.equal(loaded[method][k], t)]
            if bad:
                raise AssertionError(f"s3-small: {method} loaded {len(bad)} tensors wrong, e.g. {bad[0]!r}")
        return compare

    for method, options in (
        ("shardstore-s3", SaveOptions()),  # the layout shardstore chooses
        ("shardstore-per-array-s3", SaveOptions(pack_arrays_up_to=0, zarr_metadata="per_node")),
        ("shardstore-consolidated-s3", SaveOptions(zarr_metadata="consolidated_only", pack_arrays_up_to=0)),
        ("shardstore-packed-s3", SaveOptions(pack_arrays_up_to=args.s3_small_kib * 1024, zarr_metadata="per_node")),
        ("shardstore-packed-consolidated-s3", SaveOptions(pack_arrays_up_to=args.s3_small_kib * 1024,
                                                          zarr_metadata="consolidated_only")),
    ):
        def url(method: str = method) -> str:
            return f"s3://{S3_BUCKET}/small-{method}-{saves[method]}"

        def save(method: str = method, options: SaveOptions = options) -> None:
            saves[method] = saves.get(method, 0) + 1
            shardstore.save(shardstore_sd(state, b.rank, b.world), url(method), options=options)

        def load(method: str = method) -> None:
            loaded[method] = shardstore.load(shardstore_sd(state, b.rank, b.world, empty=True), url(method))

        b.measure("s3-small", method, nbytes, b.root / f"unused-s3-small-{method}", save, load, check(method))
    measure_dcp_on_s3(b, "s3-small", state, nbytes, init_device_mesh("cpu", (b.world,)))
    b.flush()


def incr_adapter(args: argparse.Namespace) -> tuple[int, int]:
    """The shape of the incremental case's trained part (float32, ``--incr-adapter-mib``)."""
    return (args.incr_adapter_mib * 256, 1024)


def incremental_state(b: Bench, base: State, step: int, shape: tuple[int, int]) -> State:
    """The frozen ``base`` plus a small adapter of ``shape`` whose values depend on ``step``."""
    adapter = make_global("adapter", torch.float32, shape) + step
    shards = dict(base.shards) | {"adapter": (local_shard(adapter, 0, b.rank, b.world), 0)}
    return State(shards, dict(base.shapes) | {"adapter": shape})


def bytes_only_here(path: Path) -> int:
    """Bytes of the files under ``path`` (or of the file ``path``; 0 where there is none)
    that no other path shares (a file hard-linked from another checkpoint has more than
    one link): what a save added to the disk."""
    files = [path] if path.is_file() else (p for p in path.rglob("*") if p.is_file())
    return sum(st.st_size for st in map(Path.stat, files) if st.st_nlink == 1)


def s3_bytes_written() -> int:
    """Bytes this process's TensorStore sent to S3 in chunk writes (its own metric)."""
    import tensorstore as ts

    metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/s3/bytes_written")
    return sum(int(v.get("value", 0)) for m in metrics for v in m.get("values", []))


class ReuseTallies(logging.Handler):
    """Collects the tally each reusing save logs (``format.reuse.ChunkReuse.log_tally``):
    chunks shared and the seconds spent sharing and proving them, summed over threads."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seconds: list[float] = []
        self.shared: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("save: shared"):
            self.shared.append(int(record.args[0]))
            self.seconds.append(float(record.args[-1]))


def read_files(path: Path) -> None:
    """Reads every file under ``path`` once (into the page cache)."""
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while f.read(4 * 2**20):
                    pass


def check_only_seconds(path: Path) -> tuple[float, int]:
    """The check alone, as a reusing save does it for each shared file: read it back and
    hash it (XXH3-128), one thread, starting cold; returns seconds and bytes."""
    import xxhash

    shared = [p for p in path.rglob("*") if p.is_file() and p.stat().st_nlink > 1]
    drop_page_cache(shared)
    start, nbytes = time.perf_counter(), 0
    for p in shared:
        hasher = xxhash.xxh3_128()
        with open(p, "rb", buffering=0) as f:
            while block := f.read(4 * 2**20):
                hasher.update(block)
                nbytes += len(block)
    return time.perf_counter() - start, nbytes


def run_incremental(b: Bench, args: argparse.Namespace) -> None:
    """Step 2 of a run whose base is frozen and whose small adapter trained: a full save
    against a save that reuses step 1's unchanged chunks (``reuse_from``), interleaved, on
    the local disk and, when the s3 case's server runs, on S3. Reports seconds (medians),
    the bytes each adds to the disk or uploads, what proving the shared chunks cost (the
    saves' own tally, and the check alone: a cold read-back and XXH3-128 locally, the MD5
    of the shared bytes for S3) and the digest's throughput beside crc32c's."""
    import crc32c
    import xxhash

    import shardstore

    tallies = ReuseTallies()
    logging.getLogger("shardstore.format.reuse").addHandler(tallies)
    logging.getLogger("shardstore.format.reuse").setLevel(logging.DEBUG)
    base = build_large(int(args.incr_gib * GiB), b.rank, b.world)
    shape = incr_adapter(args)
    step1, step2 = incremental_state(b, base, 1, shape), incremental_state(b, base, 2, shape)
    nbytes = full_bytes(step2)
    changed = shape[0] * shape[1] * 4
    if b.rank == 0:
        print(f"incremental: {nbytes / GiB:.2f} GiB, of which {changed / 2**20:.1f} MiB change per step, "
              f"{b.world} ranks", flush=True)
    first = b.root / "incr-step1"
    shardstore.save(shardstore_sd(step1, b.rank, b.world), str(first))
    full, incr = b.root / "incr-full", b.root / "incr-reuse"
    b.measure("incr", "full", nbytes, full, lambda: shardstore.save(shardstore_sd(step2, b.rank, b.world), str(full)),
              None)
    b.measure("incr", "reuse", nbytes, incr,
              lambda: shardstore.save(shardstore_sd(step2, b.rank, b.world), str(incr), reuse_from=str(first)), None)
    warm = b.root / "incr-reuse-warm"  # the base still in the page cache, as after a recent save
    b.measure("incr", "reuse-warm", nbytes, warm,
              lambda: shardstore.save(shardstore_sd(step2, b.rank, b.world), str(warm), reuse_from=str(first)), None,
              before_save=lambda: read_files(first))
    b.flush()
    extra: dict[str, float] = {}
    if b.rank == 0:
        added_full, added_incr = bytes_only_here(full), bytes_only_here(incr)
        check_s, checked = check_only_seconds(incr)
        extra |= {"incr.local.added_bytes_full": added_full, "incr.local.added_bytes_reuse": added_incr,
                  "incr.local.added_vs_changed": round(added_incr / changed, 3),
                  "incr.local.share_and_prove_s_per_save": round(statistics.median(tallies.seconds or [0.0]), 3),
                  "incr.local.check_only_cold_s": round(check_s, 3), "incr.local.check_only_bytes": checked}
    if "s3" in args.cases:
        extra |= run_incremental_s3(b, args, step1, step2, tallies)
    if b.rank == 0:
        block = torch.randint(0, 255, (256 * 2**20,), dtype=torch.uint8).numpy()
        for name, fn in (("xxh3_128", xxhash.xxh3_128_digest), ("crc32c", crc32c.crc32c),
                         ("md5", lambda data: hashlib.md5(data, usedforsecurity=False).digest())):
            times = []
            for _ in range(5):
                start = time.perf_counter()
                fn(block)
                times.append(time.perf_counter() - start)
            extra[f"digest.{name}_gbps"] = round(block.nbytes / statistics.median(times) / 1e9, 2)
        for key, value in extra.items():
            print(f"  {key}: {value}", flush=True)
    b.extra |= extra
    for p in (first, full, incr, warm):
        b._clean(p)


def run_incremental_s3(b: Bench, args: argparse.Namespace, step1: State, step2: State,
                       tallies: ReuseTallies) -> dict[str, float]:
    """The incremental case on S3: full and reusing saves of step 2, interleaved (the
    order alternates every repetition), each into a new prefix; seconds (medians),
    bytes uploaded, and what proving the copies cost."""
    import shardstore

    url = f"s3://{S3_BUCKET}/incremental-{os.getpid() if b.rank == 0 else 0}"
    url = dist_broadcast_str(url)
    shardstore.save(shardstore_sd(step1, b.rank, b.world), f"{url}/step1")
    seconds: dict[str, list[float]] = {"full": [], "reuse": []}
    uploads: dict[str, int] = {}
    tallies.seconds.clear()
    for rep in range(b.reps):
        for name in ("full", "reuse") if rep % 2 == 0 else ("reuse", "full"):
            reuse = f"{url}/step1" if name == "reuse" else None
            target = f"{url}/step2-{name}-{rep}"
            dist.barrier()
            before = s3_bytes_written()
            sample = b._timed(lambda target=target, reuse=reuse: shardstore.save(
                shardstore_sd(step2, b.rank, b.world), target, reuse_from=reuse))
            seconds[name].append(sample.seconds)
            sent = [0] * b.world
            dist.all_gather_object(sent, s3_bytes_written() - before)
            uploads[name] = sum(sent)
    shape = incr_adapter(args)
    shared = sum(t.nbytes for t, _ in step2.shards.values()) - shape[0] * shape[1] * 4 // b.world
    md5 = torch.cat([t.reshape(-1).view(torch.uint8) for t, _ in step2.shards.values()]).numpy()[:max(shared, 0)]
    start = time.perf_counter()
    hashlib.md5(md5, usedforsecurity=False).digest()
    md5_s = time.perf_counter() - start
    full_s, reuse_s = statistics.median(seconds["full"]), statistics.median(seconds["reuse"])
    if b.rank == 0:
        print(f"  incr     s3 full  save: {full_s:7.3f} s ({min(seconds['full']):.3f}-{max(seconds['full']):.3f})",
              flush=True)
        print(f"  incr     s3 reuse save: {reuse_s:7.3f} s ({min(seconds['reuse']):.3f}-{max(seconds['reuse']):.3f})",
              flush=True)
    return {"incr.s3.uploaded_bytes_full": uploads["full"], "incr.s3.uploaded_bytes_reuse": uploads["reuse"],
            "incr.s3.save_s_full": round(full_s, 3), "incr.s3.save_s_reuse": round(reuse_s, 3),
            "incr.s3.reuse_vs_full": round(reuse_s / full_s, 3),
            "incr.s3.share_and_prove_s_per_save": round(statistics.median(tallies.seconds or [0.0]), 3),
            "incr.s3.check_only_md5_s_rank0": round(md5_s, 3)}


def dist_broadcast_str(value: str) -> str:
    """Rank 0's ``value`` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


STAGING_CAP_MIB = 256


def run_async(b: Bench, state: State, nbytes: int) -> None:
    """Caller-blocked time of an async save vs clone(); a matmul loop during the save."""
    import shardstore
    from shardstore.engine.async_requests import AsyncCallsQueue

    path = b.root / "async"
    blocked = Result("async", "shardstore", "blocked", nbytes)
    cloned = Result("async", "clone", "blocked", nbytes)
    loop_alone = Result("async", "matmul-loop", "alone", 0)
    loop_busy = Result("async", "matmul-loop", "during-save", 0)
    queue = AsyncCallsQueue()
    a = torch.randn(512, 512)

    def loop(until: Callable[[], bool]) -> tuple[float, float]:
        """Matmul rate (per second) until ``until()``; a collective step every 20."""
        n, start = 0, time.perf_counter()
        while not until():
            for _ in range(20):
                a @ a
            n += 20
        elapsed = time.perf_counter() - start
        return n / elapsed, elapsed

    def finished() -> bool:
        queue.maybe_finalize_async_calls(blocking=False)  # collective, like a trainer's step
        return queue.get_num_unfinalized_calls() == 0

    for _ in range(b.reps):
        b._clean(path)
        cloned.samples.append(b._timed(lambda: [t.clone() for t, _ in state.shards.values()]))
        requests: list = []

        def start_save(requests: list = requests) -> None:
            sd = shardstore_sd(state, b.rank, b.world)
            requests.append(shardstore.save(sd, str(path), async_sharded_save=True))

        blocked.samples.append(b._timed(start_save))
        queue.schedule_async_request(requests[0])
        busy, elapsed = loop(finished)
        flag = torch.zeros(1)
        stop = time.perf_counter() + elapsed

        def alone_done(flag: torch.Tensor = flag, stop: float = stop) -> bool:
            flag.fill_(float(time.perf_counter() >= stop))
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            return bool(flag.item())

        alone, _ = loop(alone_done)
        loop_busy.samples.append(Sample(1 / busy, 0))
        loop_alone.samples.append(Sample(1 / alone, 0))
    queue.close()

    # with a staging cap: the snapshot is written in waves, host memory stays bounded
    from shardstore.engine.zarr_strategies import ZarrSaveShardedStrategy

    capped = Result("async", f"capped-{STAGING_CAP_MIB}MiB", "blocked", nbytes)
    strategy = ZarrSaveShardedStrategy(max_staging_bytes=STAGING_CAP_MIB * 2**20)
    for _ in range(b.reps):
        b._clean(path)
        requests.clear()
        capped.samples.append(b._timed(lambda: requests.append(shardstore.save(
            shardstore_sd(state, b.rank, b.world), str(path), strategy, async_sharded_save=True))))
        requests[0].execute_sync()
    b._clean(path)
    b.results += [blocked, cloned, capped, loop_alone, loop_busy]
    if b.rank == 0:
        print(f"  async blocked {blocked.seconds:.3f} s vs clone {cloned.seconds:.3f} s; "
              f"matmul rate during save {loop_alone.seconds / loop_busy.seconds:.2f}x of alone", flush=True)


def run_device(b: Bench, args: argparse.Namespace) -> None:
    """Issue 15: tensors on ``--device`` (CUDA on the GPU machine): shardstore's sync
    save and its load into device targets against DCP (plain tensors), ``torch.save``
    and the raw bound (copy into pinned memory, one file, fsync; read back into pinned
    memory, copy to the device); an async save's caller-blocked time against its floor, a pinned
    device-to-host copy of the same bytes. Run it at ``--world 1`` (NCCL puts one rank on
    a GPU; the group here is gloo, whose collectives are trivial at world 1)."""
    import torch.distributed.checkpoint as dcp

    import shardstore
    from shardstore.engine.async_requests import AsyncCallsQueue

    device = torch.device(args.device)
    cpu_state = build_large(int(args.gib * GiB), b.rank, b.world)
    state = State({k: (t.to(device), axis) for k, (t, axis) in cpu_state.shards.items()}, cpu_state.shapes)
    del cpu_state
    nbytes = state.local_bytes * b.world
    case = f"{device.type}"
    if b.rank == 0:
        print(f"{case}: {nbytes / GiB:.2f} GiB in {len(state.shards)} tensors on {device} at {b.world} rank(s)",
              flush=True)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def check_equal(loaded: dict) -> None:
        for k, (t, _) in state.shards.items():
            assert loaded[k].device.type == device.type, (k, loaded[k].device)
            assert torch.equal(loaded[k].view(torch.uint8), t.view(torch.uint8)), k

    ss_path, ss_target = b.root / "device-shardstore", {}

    def ss_load() -> None:
        ss_target.clear()
        ss_target.update(shardstore.load(shardstore_sd(state, b.rank, b.world, empty=True), str(ss_path)))
        synchronize()

    b.measure(case, "shardstore", nbytes, ss_path,
              lambda: shardstore.save(shardstore_sd(state, b.rank, b.world), str(ss_path)),
              ss_load, lambda: check_equal(ss_target))

    plain = {k: t for k, (t, _) in state.shards.items()}  # world 1: the local tensors are the global ones
    dcp_path, dcp_target = b.root / "device-dcp", {}

    def dcp_load() -> None:
        dcp_target.clear()
        dcp_target.update({k: torch.empty_like(t) for k, t in plain.items()})
        dcp.load(dcp_target, checkpoint_id=str(dcp_path))
        synchronize()

    if b.world == 1:
        b.measure(case, "dcp", nbytes, dcp_path, lambda: dcp.save(plain, checkpoint_id=str(dcp_path)), dcp_load,
                  lambda: check_equal(dcp_target))
        torch_path = b.root / "device-torch.pt"
        b.measure(case, "torch", nbytes, torch_path, lambda: torch_save(plain, torch_path),
                  lambda: (torch.load(torch_path, map_location=device, weights_only=True), synchronize()))

    raw_path = b.root / "device-raw"
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=device.type == "cuda") for t, _ in state.shards.values()]
    targets = [torch.empty_like(t) for t, _ in state.shards.values()]

    def raw_device_save() -> None:  # through the pinned buffers: a pageable .cpu() halved it on an H200
        raw_path.mkdir(exist_ok=True)
        host = state
        if device.type == "cuda":
            for (t, _), dst in zip(state.shards.values(), pinned):
                dst.copy_(t, non_blocking=True)
            synchronize()
            host = State({k: (dst, a) for (k, (_, a)), dst in zip(state.shards.items(), pinned)}, state.shapes)
        raw_save(host, raw_path / f"rank{b.rank}")

    def raw_device_load() -> None:
        raw_load(pinned, raw_path / f"rank{b.rank}")
        for src, dst in zip(pinned, targets):
            dst.copy_(src, non_blocking=True)
        synchronize()

    b.measure(case, "raw", nbytes, raw_path, raw_device_save, raw_device_load)
    b.flush()

    # async: what the caller waits for, against a pinned device-to-host copy of the same bytes
    path = b.root / "device-async"
    blocked = Result(case, "shardstore-async", "blocked", nbytes)
    floor = Result(case, "pinned-copy", "blocked", nbytes)
    written = Result(case, "shardstore-async", "until-written", nbytes)
    queue = AsyncCallsQueue()

    def pinned_copy() -> None:
        for src, dst in zip(state.shards.values(), pinned):
            dst.copy_(src[0], non_blocking=True)
        synchronize()

    for _ in range(b.reps):
        b._clean(path)
        floor.samples.append(b._timed(pinned_copy))
        requests: list = []
        blocked.samples.append(b._timed(lambda requests=requests: requests.append(
            shardstore.save(shardstore_sd(state, b.rank, b.world), str(path), async_sharded_save=True))))
        start = time.perf_counter()
        queue.schedule_async_request(requests[0])
        queue.maybe_finalize_async_calls(blocking=True)
        written.samples.append(Sample(time.perf_counter() - start + blocked.samples[-1].seconds, 0))
    queue.close()
    b._clean(path)
    for p in (ss_path, dcp_path, raw_path):
        b._clean(p)
    b.results += [blocked, floor, written]
    if b.rank == 0:
        print(f"  async blocked {blocked.seconds:.3f} s vs pinned copy {floor.seconds:.3f} s "
              f"({blocked.seconds / floor.seconds:.2f}x); written after {written.seconds:.3f} s", flush=True)


# ----------------------------------------------------------------- report


def ratios(results: list[Result]) -> dict[str, float]:
    by = {(r.case, r.method, r.op): r for r in results}

    def ratio(name: str, num: tuple, den: tuple, invert: bool = False) -> dict[str, float]:
        if num in by and den in by:
            value = by[den].seconds / by[num].seconds  # throughput ratio = inverse time ratio
            return {name: round(1 / value if invert else value, 3)}
        return {}

    out: dict[str, float] = {}
    for op in ("save", "load"):
        for peer in ("dcp", "raw", "torch"):
            out |= ratio(f"large.{op}.vs_{peer}", ("large", "shardstore", op), ("large", peer, op))
        for peer in ("dcp", "files", "torch"):
            out |= ratio(f"small.{op}.vs_{peer}", ("small", "shardstore", op), ("small", peer, op))
        for peer in ("torch", "files", "files-dirs-first"):
            out |= ratio(f"tiny.{op}.vs_{peer}", ("tiny", "shardstore", op), ("tiny", peer, op))
            out |= ratio(f"tiny.consolidated.{op}.vs_{peer}", ("tiny", "shardstore-consolidated", op), ("tiny", peer, op))
        out |= ratio(f"tiny.per-array.{op}.vs_torch", ("tiny", "shardstore-per-array", op), ("tiny", "torch", op))
        out |= ratio(f"tiny.packed.{op}.vs_torch", ("tiny", "shardstore-packed", op), ("tiny", "torch", op))
        out |= ratio(f"tiny.packed.{op}.vs_zip-pack-floor", ("tiny", "shardstore-packed", op), ("tiny", "zip-pack", op))
        # the packed design's floor against torch.save/load: what such a layout could reach
        out |= ratio(f"tiny.zip-pack-floor.{op}.vs_torch", ("tiny", "zip-pack", op), ("tiny", "torch", op))
        for method in ("shardstore", "shardstore-sharded", "shardstore-consolidated", "shardstore-sharded-consolidated",
                       "shardstore-packed"):
            out |= ratio(f"fsdp.{method}-s3.{op}.vs_dcp_fsspec", ("fsdp", f"{method}-s3", op), ("fsdp", "dcp-fsspec-s3", op))
        # dcp.save/load through shardstore.ShardstoreWriter vs DCP's file system writer/reader,
        # and shardstore.save/load of the same DTensors vs the same
        out |= ratio(f"dcp-api.{op}.vs_dcp", ("dcp-api", "shardstore", op), ("dcp-api", "dcp", op))
        out |= ratio(f"dcp-api.{op}.ss_api_vs_dcp", ("dcp-api", "ss-api", op), ("dcp-api", "dcp", op))
        out |= ratio(f"dcp-plain.{op}.vs_dcp", ("dcp-plain", "shardstore", op), ("dcp-plain", "dcp", op))
    # time of the 2->1 resharded load / time of a 1->1 load of the same tensors (one reader each)
    out |= ratio("reshard.load_time_vs_same_layout", ("reshard", "shardstore-1rank", "load"),
                 ("reshard", "shardstore", "load"))
    # the same against the large case's 2-rank load (twice the readers)
    out |= ratio("reshard.load_time_vs_2rank_load", ("large", "shardstore", "load"), ("reshard", "shardstore", "load"))
    out |= ratio("reshard.load.vs_dcp", ("reshard", "shardstore", "load"), ("reshard", "dcp", "load"))
    for method in ("shardstore", "shardstore-sharded"):
        out |= ratio(f"reshard-fsdp.{method}.load.vs_dcp", ("reshard-fsdp", method, "load"),
                     ("reshard-fsdp", "dcp", "load"))
    out |= ratio("s3.save.vs_s3fs_plain", ("s3", "shardstore", "save"), ("s3", "s3fs-plain", "save"))
    out |= ratio("s3.load.vs_s3fs_plain", ("s3", "shardstore", "load"), ("s3", "s3fs-plain", "load"))
    for op in ("save", "load"):
        for peer in ("dcp-fsspec-s3", "dcp-s3tc-s3"):
            out |= ratio(f"s3.{op}.vs_{peer.removesuffix('-s3').replace('-', '_')}", ("s3", "shardstore", op),
                         ("s3", peer, op))
            for method in ("shardstore-s3", "shardstore-consolidated-s3", "shardstore-packed-s3"):
                out |= ratio(f"s3-small.{method.removesuffix('-s3')}.{op}.vs_{peer.removesuffix('-s3').replace('-', '_')}",
                             ("s3-small", method, op), ("s3-small", peer, op))
    # time of step 2 saved reusing step 1's unchanged chunks / time of a full save of it
    out |= ratio("incr.save.time_reuse_vs_full", ("incr", "reuse", "save"), ("incr", "full", "save"), invert=True)
    out |= ratio("incr.save.time_reuse_warm_vs_full", ("incr", "reuse-warm", "save"), ("incr", "full", "save"),
                 invert=True)
    out |= ratio("async.blocked_time_vs_clone", ("async", "clone", "blocked"), ("async", "shardstore", "blocked"))
    out |= ratio("async.loop_rate_vs_alone", ("async", "matmul-loop", "during-save"), ("async", "matmul-loop", "alone"))
    for device in ("cuda", "cpu"):  # the device case
        for op in ("save", "load"):
            for peer in ("dcp", "raw", "torch"):
                out |= ratio(f"{device}.{op}.vs_{peer}", (device, "shardstore", op), (device, peer, op))
        # time the caller waits for an async save / time of a pinned copy of the same bytes
        out |= ratio(f"{device}.async_blocked_time_vs_pinned_copy", (device, "pinned-copy", "blocked"),
                     (device, "shardstore-async", "blocked"))
    for r in results:
        if (r.case, r.method, r.op) == ("large", "shardstore", "save"):
            out["large.save.extra_rss_vs_state"] = round(r.extra_rss / (r.nbytes / 2), 3)
        if r.case == "async" and r.method.startswith("capped"):
            out["async.capped_extra_rss_vs_cap"] = round(r.extra_rss / (STAGING_CAP_MIB * 2**20), 3)
    return out


def markdown(results: list[Result], extra: dict) -> str:
    lines = [
        f"world size {extra['world']}, {extra['reps']} repetitions (median), page cache: {extra['cache']}",
        "",
        "| case | method | op | seconds | GB/s | peak extra RSS (MiB, max over ranks) | S3 requests |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        rate = f"{r.gbps:.2f}" if r.nbytes else "-"
        lines.append(f"| {r.case} | {r.method} | {r.op} | {r.seconds:.3f} | {rate} | {r.extra_rss / 2**20:.0f} | "
                     f"{r.requests if r.requests is not None else '-'} |")
    lines += ["", "| ratio (shardstore / peer throughput, or as named) | value |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in extra["ratios"].items()]
    return "\n".join(lines)


# The cases a run may name, each run by its function, in this order ("reshard" and
# "async" run inside "large", on its checkpoints; "s3" also adds methods to "fsdp").
CASES: dict[str, Callable[[Bench, argparse.Namespace], None]] = {
    "large": run_large,
    "dcp-api": run_dcp_api,
    "dcp-plain": run_dcp_plain,
    "small": run_small,
    "fsdp": run_fsdp,
    "reshard-fsdp": run_reshard_fsdp,
    "tiny": run_tiny,
    "s3": run_s3,
    "device": run_device,
    "incr": run_incremental,
    **bench_layouts.CASES,  # "layouts" names them all
}


def worker(rank: int, world: int, port: int, args: argparse.Namespace, root: str,
           s3_requests: RequestCounter | None) -> None:
    torch.set_num_threads(1)  # one core per rank, as a trainer's rank has its own GPU
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=30))
    methods = frozenset(args.methods.split(",")) if args.methods else None
    b = Bench(rank, world, Path(root), args.reps, s3_requests, methods)
    for case, run in CASES.items():  # in this order, whatever order --cases names them in
        if case in args.cases:
            run(b, args)
    if rank == 0:
        table = ratios(b.results) | b.extra
        extra = {"world": world, "reps": args.reps, "cache": b.cache_method, "ratios": table}
        report = markdown(b.results, extra)
        print("\n" + report)
        payload = {
            **extra,
            "gib": args.gib,
            **b.sections,
            "results": [asdict(r) | {"median_seconds": r.seconds, "gbps": r.gbps, "extra_rss": r.extra_rss}
                        for r in b.results],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
        print(f"\nJSON written to {args.json}")
    dist.destroy_process_group()


S3_BUCKET = "shardstore-bench"


def start_local_s3(counter: RequestCounter):
    """A local S3 server for the s3 case, its requests counted by ``counter``; the ranks
    find it through the AWS environment variables, as a trainer would find its object
    store."""
    from shardstore.testing import LocalS3Server

    server = LocalS3Server("bench", "bench-secret").start()
    wsgi = server._server._server  # moto's werkzeug server: each request calls its ``app``
    wsgi.app = counter.wrap(wsgi.app)
    server.export_environment()
    server.create_bucket(S3_BUCKET)
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="size of the large state (all ranks)")
    parser.add_argument("--small", type=int, default=5000, help="number of 4 KiB tensors")
    parser.add_argument("--tiny", type=int, default=10000, help="number of 1-64 KiB tensors (tiny case)")
    parser.add_argument("--fsdp-arrays", type=int, default=1000, help="arrays of the fsdp case")
    parser.add_argument("--fsdp-rows", type=int, default=64,
                        help="rows of 256 fp32 per rank of each fsdp array (64: 64 KiB per rank)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--methods", default=None,
                        help="measure only these methods of each case, comma-separated (e.g. default,consolidated)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--cases", default="large,reshard,dcp-api,dcp-plain,small,async,s3,incr")
    parser.add_argument("--plain-gib", type=float, default=0.5, help="size of the dcp-plain case's model + Adam")
    parser.add_argument("--incr-gib", type=float, default=0.25, help="size of the incremental case's frozen base")
    parser.add_argument("--incr-adapter-mib", type=int, default=3, help="size of its trained part, MiB")
    parser.add_argument("--s3-gib", type=float, default=0.25, help="size of the S3 case's state (all ranks)")
    parser.add_argument("--s3-small", type=int, default=300,
                        help="replicated small arrays of the S3 case, saved unpacked and packed (0: none)")
    parser.add_argument("--s3-small-kib", type=int, default=128, help="size of each of those arrays, KiB")
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    parser.add_argument("--json", default="bench.json")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device of the tensors in the 'device' case (default: cuda when available)")
    bench_layouts.add_arguments(parser)
    args = parser.parse_args()
    args.cases = bench_layouts.expand_cases(args.cases.split(","))
    if args.quick:
        bench_layouts.quick_sizes(args)
    root = tempfile.mkdtemp(prefix="shardstore-bench-", dir=args.dir)
    port = free_port()
    counter = RequestCounter() if {"s3", "layouts-s3"} & set(args.cases) else None
    server = start_local_s3(counter) if counter is not None else None
    try:
        mp.spawn(worker, args=(args.world, port, args, root, counter), nprocs=args.world)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
