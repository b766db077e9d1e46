"""The layout comparison of ``scripts/bench.py`` (issue 65 item 2, ``--cases layouts``).

On each workload, in one interleaved run (``Bench.flush``): ``default``, the save given
NO layout option (whatever shardstore chooses), against every explicit layout that
could be best for that workload (``EXPLICIT``, every field spelled) and against the
peers the issue names. Per method: median and spread (fastest-slowest) of save and load
times, and files (local) or S3 requests (counted at the server); per workload: default
/ best explicit layout and default / each peer, as throughput (best time / default
time: 0.9 or more meets the bar for the explicit layouts, 1.0 or more for DCP's
``FileSystemWriter`` through DCP's door).

Workloads (cases; ``layouts`` runs all four):

- ``layouts-tiny``: ``--tiny`` float32 tensors of 1-64 KiB saved and loaded by rank 0
  alone (a process group of its own), local; peers ``torch.save``/``torch.load`` and
  DCP (``no_dist``).
- ``layouts-s3``: ``--layouts-s3-arrays`` float32 arrays of ``--layouts-s3-rows`` x 256
  split ``Shard(0)`` over the ranks (404 arrays of 512 x 256: 202 MiB), on the local S3
  server; each save to a new prefix, each load of the latest; peers DCP over fsspec and
  s3torchconnector's DCP writer where installed.
- ``layouts-large``: the ``large`` case's Llama-shaped tensor-parallel state
  (``--gib``), local, loads into targets made once; peer DCP.
- ``layouts-fsdp``: a real FSDP2 model (``fully_shard``) of ``--layouts-fsdp-layers``
  ``Linear(d, d)`` layers (``--layouts-fsdp-dim``) with AdamW after one step, through
  ``dcp.save``/``dcp.load`` with ``ShardstoreWriter``/``ShardstoreReader`` (the default:
  no layout keyword); peer DCP's ``FileSystemWriter``/``FileSystemReader``.

``--quick``: every workload small (a smoke test of the comparison in about 2 minutes).
"""

from __future__ import annotations

__all__ = ["CASES", "EXPLICIT", "add_arguments", "expand_cases", "layout_summary", "quick_sizes"]

import argparse
import inspect
import os
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardstore import StorageLayout

KiB, MiB = 2**10, 2**20
PACK = 64 * KiB
SHARD = 64 * MiB


def explicit(pack: int, metadata: str, shard: int | None) -> StorageLayout:
    """A layout with every field spelled (nothing left for shardstore to choose)."""
    return StorageLayout(max_chunk_bytes=64 * MiB, shard_bytes=shard, pack_arrays_up_to=pack, zarr_metadata=metadata,
                         read_grain=None)


EXPLICIT: dict[str, Callable[[int], StorageLayout]] = {
    # name -> the layout, given the pack bound of the workload
    "per-array": lambda pack: explicit(0, "per_node", None),
    "packs": lambda pack: explicit(pack, "per_node", None),
    "consolidated": lambda pack: explicit(0, "consolidated_only", None),
    "packs+consolidated": lambda pack: explicit(pack, "consolidated_only", None),
    "shards": lambda pack: explicit(0, "per_node", SHARD),
    "shards+consolidated": lambda pack: explicit(0, "consolidated_only", SHARD),
}

# the explicit layouts that could be best for each workload (packs and documents do not
# matter where arrays are few and large; shards gather nothing at one rank)
CHOICES = {
    "layouts-tiny": ("per-array", "packs", "consolidated", "packs+consolidated"),
    "layouts-s3": tuple(EXPLICIT),
    "layouts-large": ("per-array", "consolidated", "shards"),
    "layouts-fsdp": tuple(EXPLICIT),
}
PEERS = {
    "layouts-tiny": ("torch", "dcp"),
    "layouts-s3": ("dcp-fsspec-s3", "dcp-s3tc-s3"),
    "layouts-large": ("dcp",),
    "layouts-fsdp": ("dcp-filesystem",),
}


FSDP_REPS = 21
"""Rounds of the FSDP2 workload (``--layouts-fsdp-reps``): its saves take 0.15 s, and
0.3-0.5 s in a round where the disk is slow. A run of 5 rounds gave the default 0.92x
DCP's writer to save and 0.84x to load, where runs of 15 and 21 rounds of the same code
gave 1.01-1.09x and 1.14-1.31x."""

EXPLICIT_BAR = 0.9
"""Issue 65 item 2: the default is at least this fast (throughput) as the best explicit layout."""
PEER_BARS = {"dcp-filesystem": 1.0}
"""... and through DCP's door at least as fast as DCP's own ``FileSystemWriter``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sizes of the layout workloads, and ``--quick``."""
    parser.add_argument("--layouts-s3-arrays", type=int, default=404, help="arrays of the layouts-s3 workload")
    parser.add_argument("--layouts-s3-rows", type=int, default=512, help="rows of 256 fp32 of each of them")
    parser.add_argument("--layouts-fsdp-layers", type=int, default=24, help="Linear layers of the layouts-fsdp model")
    parser.add_argument("--layouts-fsdp-dim", type=int, default=512, help="their width")
    parser.add_argument("--layouts-fsdp-reps", type=int, default=None,
                        help=f"rounds of the layouts-fsdp workload, at least --reps (default {FSDP_REPS}; "
                             "with --quick, --reps)")
    parser.add_argument("--quick", action="store_true",
                        help="the layout workloads small: a smoke test of the comparison, not figures")


def quick_sizes(args: argparse.Namespace) -> None:
    """``--quick``: every layout workload small."""
    args.tiny, args.layouts_s3_arrays, args.layouts_s3_rows = 300, 24, 64
    args.layouts_fsdp_layers, args.layouts_fsdp_dim = 4, 64


def fsdp_rounds(args: argparse.Namespace, reps: int) -> int:
    """The rounds of the FSDP2 workload: ``--layouts-fsdp-reps``, by default
    ``FSDP_REPS`` (with ``--quick``, none more than ``reps``), and at least ``reps``."""
    given = args.layouts_fsdp_reps
    if given is None:
        given = 0 if args.quick else FSDP_REPS
    return max(reps, given)


def expand_cases(cases: list[str]) -> list[str]:
    """``layouts`` names its four workloads."""
    return [c for case in cases for c in (CASES if case == "layouts" else (case,))]


# ----------------------------------------------------------------- registering methods


class Targets:
    """Where each method of a workload saves: a directory of its own (``Bench`` sets the
    last save aside before the next), or on S3 (``bucket``) a new prefix per save, as a
    trainer saves each step (no ``overwrite`` deleting the last one inside the timing);
    a load reads the latest save."""

    def __init__(self, root: Path, case: str, bucket: str | None = None) -> None:
        self.root, self.case, self.bucket = root, case, bucket
        self.saves: dict[str, int] = {}

    def path(self, method: str) -> Path:
        """The method's directory (on S3, a name ``Bench`` finds nothing at)."""
        return self.root / (f"{self.case}-{method}" if self.bucket is None else f"unused-{self.case}-{method}")

    def next(self, method: str) -> str:
        if self.bucket is None:
            return str(self.path(method))
        self.saves[method] = self.saves.get(method, 0) + 1
        return self.last(method)

    def last(self, method: str) -> str:
        if self.bucket is None:
            return str(self.path(method))
        return f"s3://{self.bucket}/{self.case}/{method}-{self.saves[method]}"


def register_layouts(
    b: Any, case: str, nbytes: int, targets: Targets, pack: int,
    save: Callable[[str, StorageLayout | None], None], load: Callable[[str], Any],
    check: Callable[[str, Any], None] | None = None, solo: bool = False,
) -> None:
    """Registers ``default`` (``save(target, None)``: no layout option) and the
    workload's explicit layouts (``CHOICES``) with ``Bench.measure``; ``check(method,
    loaded)`` runs untimed on the first load's result of each."""
    loaded: dict[str, Any] = {}
    for name in ("default", *CHOICES[case]):
        layout = None if name == "default" else EXPLICIT[name](pack)
        b.measure(case, name, nbytes, targets.path(name),
                  lambda name=name, layout=layout: save(targets.next(name), layout),
                  lambda name=name: loaded.__setitem__(name, load(targets.last(name))),
                  (lambda name=name: check(name, loaded.pop(name))) if check else None, solo=solo)


def _files(path: Path) -> int:
    """Files under ``path`` (1 where it is a file, 0 where there is none)."""
    return 1 if path.is_file() else sum(len(files) for _, _, files in os.walk(path))


def _same(method: str, want: dict[str, torch.Tensor], got: dict[str, Any]) -> None:
    """Every tensor of ``want`` equal, bit for bit, in ``got`` (DTensors compared locally)."""
    bad = []
    for key, tensor in want.items():
        value = got[key]
        value = value.to_local() if hasattr(value, "to_local") else value
        if not torch.equal(value.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)):
            bad.append(key)
    if bad:
        raise AssertionError(f"{method} loaded {len(bad)} tensors wrong, e.g. {bad[0]!r}")


# ----------------------------------------------------------------- workloads


def warm_up(b: Any, state: Any, target: str, mesh: Any) -> None:
    """First-use costs (imports, the first plan, the first connection to the store) paid
    untimed by a save and a load of the small ``state`` through shardstore and DCP
    (over fsspec where ``target`` is a URL): else whichever method runs first in round 0
    pays them."""
    import bench as core
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    import shardstore

    shardstore.save(core.shardstore_sd(state, b.rank, b.world), target)
    shardstore.load(core.shardstore_sd(state, b.rank, b.world, empty=True), target)
    url = target.startswith("s3://")
    dcp.save(core.dcp_sd(state, mesh), storage_writer=FsspecWriter(target + "-dcp") if url
             else dcp.FileSystemWriter(target + "-dcp"))
    dcp.load(core.dcp_sd(state, mesh, empty=True), storage_reader=FsspecReader(target + "-dcp") if url
             else dcp.FileSystemReader(target + "-dcp"))
    if not url:
        for path in (target, target + "-dcp"):
            b._clean(Path(path))


def run_tiny(b: Any, args: argparse.Namespace) -> None:
    """``layouts-tiny``: rank 0 alone (``Bench.solo``), local."""
    import bench as core
    import torch.distributed.checkpoint as dcp

    import shardstore

    state = core.build_tiny(args.tiny)
    nbytes = core.full_bytes(state)
    plain = {k: t for k, (t, _) in state.shards.items()}
    if b.rank == 0:
        print(f"layouts-tiny: {args.tiny} float32 tensors of 1-64 KiB, {nbytes / MiB:.0f} MiB, rank 0 alone",
              flush=True)
    targets = Targets(b.root, "layouts-tiny")

    def save(target: str, layout: StorageLayout | None) -> None:
        extra = {} if layout is None else {"layout": layout}
        shardstore.save(core.shardstore_sd(state, 0, 1), target, process_group=b.solo, **extra)

    def load(target: str) -> dict:
        return shardstore.load(core.shardstore_sd(state, 0, 1, empty=True), target, process_group=b.solo)

    if b.rank == 0:  # first-use costs (imports), untimed
        warm = core.State(dict(list(state.shards.items())[:2]), state.shapes)
        shardstore.save(core.shardstore_sd(warm, 0, 1), str(b.root / "layouts-tiny-warm"), process_group=b.solo)
        shutil.rmtree(b.root / "layouts-tiny-warm")
    register_layouts(b, "layouts-tiny", nbytes, targets, PACK, save, load,
                     lambda name, got: _same(name, plain, got), solo=True)
    torch_path, dcp_path = b.root / "layouts-tiny-torch.pt", b.root / "layouts-tiny-dcp"
    loaded: dict[str, Any] = {}
    b.measure("layouts-tiny", "torch", nbytes, torch_path, lambda: core.torch_save(plain, torch_path),
              lambda: loaded.update(torch=torch.load(torch_path, weights_only=True)),
              lambda: _same("torch", plain, loaded.pop("torch")), solo=True)

    def dcp_load() -> None:
        target = {k: torch.empty_like(t) for k, t in plain.items()}
        dcp.load(target, checkpoint_id=str(dcp_path), no_dist=True)
        loaded["dcp"] = target

    b.measure("layouts-tiny", "dcp", nbytes, dcp_path,
              lambda: dcp.save(plain, checkpoint_id=str(dcp_path), no_dist=True), dcp_load,
              lambda: _same("dcp", plain, loaded.pop("dcp")), solo=True)
    finish(b, "layouts-tiny", targets, {"torch": torch_path, "dcp": dcp_path})


def run_s3(b: Any, args: argparse.Namespace) -> None:
    """``layouts-s3``: FSDP2-shaped blocks on the local S3 server."""
    import bench as core
    from torch.distributed.device_mesh import init_device_mesh

    import shardstore

    rows = max(args.layouts_s3_rows, b.world)
    state = core.build_fsdp(args.layouts_s3_arrays, rows, b.rank, b.world)
    nbytes = core.full_bytes(state)
    if b.rank == 0:
        print(f"layouts-s3: {args.layouts_s3_arrays} arrays of {rows} x 256 fp32, Shard(0) over {b.world} ranks, "
              f"{nbytes / MiB:.0f} MiB, S3 {os.environ['AWS_ENDPOINT_URL']}", flush=True)
    targets = Targets(b.root, "layouts-s3", core.S3_BUCKET)
    mesh = init_device_mesh("cpu", (b.world,))
    warm_up(b, core.build_fsdp(2, rows, b.rank, b.world), f"s3://{core.S3_BUCKET}/layouts-s3/warm-up", mesh)
    whole_array = rows * 256 * 4  # packs that take these arrays at all

    def save(target: str, layout: StorageLayout | None) -> None:
        extra = {} if layout is None else {"layout": layout}
        shardstore.save(core.shardstore_sd(state, b.rank, b.world), target, **extra)

    def load(target: str) -> dict:
        return shardstore.load(core.shardstore_sd(state, b.rank, b.world, empty=True), target)

    mine = {k: t for k, (t, _) in state.shards.items()}
    register_layouts(b, "layouts-s3", nbytes, targets, whole_array, save, load,
                     lambda name, got: _same(name, mine, got))
    core.measure_dcp_on_s3(b, "layouts-s3", state, nbytes, mesh)
    finish(b, "layouts-s3", targets, {})


def large_state(args: argparse.Namespace, rank: int, world: int) -> Any:
    """The large case's state (``--gib``), or with ``--quick`` two small layers of it."""
    import bench as core

    if not args.quick:
        return core.build_large(int(args.gib * core.GiB), rank, world)
    shards, shapes = {}, {}
    for i in range(2):
        for name, dtype, shape, axis in ((f"layer{i}.qkv", torch.bfloat16, (1024, 512), 0),
                                         (f"layer{i}.fc2", torch.float32, (512, 512), 1)):
            full = core.make_global(name, dtype, shape)
            shards[name], shapes[name] = (core.local_shard(full, axis, rank, world), axis), shape
    return core.State(shards, shapes)


def run_large(b: Any, args: argparse.Namespace) -> None:
    """``layouts-large``: the Llama-shaped TP state, local; loads into targets made once."""
    import bench as core
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import shardstore

    state = large_state(args, b.rank, b.world)
    nbytes = state.local_bytes * b.world
    if b.rank == 0:
        print(f"layouts-large: {nbytes / core.GiB:.2f} GiB in {len(state.shards)} tensors at {b.world} ranks",
              flush=True)
    targets = Targets(b.root, "layouts-large")
    mesh = init_device_mesh("cpu", (b.world,))
    warm_up(b, core.build_fsdp(2, 2 * b.world, b.rank, b.world), str(b.root / "layouts-large-warm-up"), mesh)
    empty = core.faulted_in(core.shardstore_sd(state, b.rank, b.world, empty=True))
    mine = {k: t for k, (t, _) in state.shards.items()}

    def save(target: str, layout: StorageLayout | None) -> None:
        extra = {} if layout is None else {"layout": layout}
        shardstore.save(core.shardstore_sd(state, b.rank, b.world), target, **extra)

    register_layouts(b, "layouts-large", nbytes, targets, PACK, save,
                     lambda target: shardstore.load(empty, target), lambda name, got: _same(name, mine, got))
    dcp_path, dcp_empty = b.root / "layouts-large-dcp", core.faulted_in(core.dcp_sd(state, mesh, empty=True))
    b.measure("layouts-large", "dcp", nbytes, dcp_path,
              lambda: dcp.save(core.dcp_sd(state, mesh), checkpoint_id=str(dcp_path)),
              lambda: dcp.load(dcp_empty, checkpoint_id=str(dcp_path)), lambda: _same("dcp", mine, dcp_empty))
    finish(b, "layouts-large", targets, {"dcp": dcp_path})
    empty.clear()
    dcp_empty.clear()


def fsdp_state(layers: int, dim: int, world: int) -> dict:
    """``{"model", "optim"}`` of a ``fully_shard`` model of ``layers`` ``Linear(dim, dim)``
    with AdamW after one step (``get_state_dict``: DTensors ``Shard(0)``, step tensors)."""
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, dim)).sum().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _tensors(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state, by its path."""
    if isinstance(value, dict):
        return {k: t for key, v in value.items() for k, t in _tensors(v, f"{prefix}{key}.").items()}
    if isinstance(value, list):
        return {k: t for i, v in enumerate(value) for k, t in _tensors(v, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value} if isinstance(value, torch.Tensor) else {}


def _zeros_like(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _zeros_like(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_zeros_like(v) for v in value]
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else value


def shardstore_writer(path: str, layout: StorageLayout | None) -> Any:
    """DCP's door: ``ShardstoreWriter(path)`` with no layout keyword for the default;
    an explicit layout as ``layout=`` where the writer takes it, else as its older
    keywords (every field spelled)."""
    from shardstore import ShardstoreWriter

    if layout is None:
        return ShardstoreWriter(path)
    if "layout" in inspect.signature(ShardstoreWriter).parameters:
        return ShardstoreWriter(path, layout=layout)
    return ShardstoreWriter(path, max_chunk_bytes=layout.max_chunk_bytes, shard_bytes=layout.shard_bytes,
                            pack_arrays_up_to=layout.pack_arrays_up_to,
                            zarr_metadata=getattr(layout.zarr_metadata, "value", layout.zarr_metadata))


def run_fsdp(b: Any, args: argparse.Namespace) -> None:
    """``layouts-fsdp``: FSDP2 + AdamW through ``dcp.save``/``dcp.load``."""
    import torch.distributed.checkpoint as dcp

    from shardstore import ShardstoreReader

    state = fsdp_state(args.layouts_fsdp_layers, args.layouts_fsdp_dim, b.world)
    rounds = fsdp_rounds(args, b.reps)
    mine = {k: (t.to_local() if hasattr(t, "to_local") else t).clone() for k, t in _tensors(state).items()}
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state).values())
    if b.rank == 0:
        print(f"layouts-fsdp: FSDP2 {args.layouts_fsdp_layers} x Linear({args.layouts_fsdp_dim}) + AdamW, "
              f"{len(mine)} tensors, {nbytes / MiB:.1f} MiB, {b.world} ranks, through dcp.save, "
              f"{rounds} rounds", flush=True)
    targets = Targets(b.root, "layouts-fsdp")

    def load(storage_reader: Any) -> dict:
        target = _zeros_like(state)
        dcp.load(target, storage_reader=storage_reader)
        return _tensors(target)

    warm = b.root / "layouts-fsdp-warm-up"  # first-call costs of each door, untimed
    for writer, reader in ((shardstore_writer(str(warm), None), lambda: ShardstoreReader(str(warm))),
                           (dcp.FileSystemWriter(warm.with_name("warm-up-dcp")),
                            lambda: dcp.FileSystemReader(warm.with_name("warm-up-dcp")))):
        dcp.save({"warm-up": torch.zeros(4)}, storage_writer=writer)
        dcp.load({"warm-up": torch.zeros(4)}, storage_reader=reader())
    for path in (warm, warm.with_name("warm-up-dcp")):
        b._clean(path)
    register_layouts(b, "layouts-fsdp", nbytes, targets, PACK,
                     lambda target, layout: dcp.save(state, storage_writer=shardstore_writer(target, layout)),
                     lambda target: load(ShardstoreReader(target)), lambda name, got: _same(name, mine, got))
    dcp_path = b.root / "layouts-fsdp-dcp-filesystem"
    loaded: dict[str, Any] = {}
    b.measure("layouts-fsdp", "dcp-filesystem", nbytes, dcp_path,
              lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_path)),
              lambda: loaded.update(dcp=load(dcp.FileSystemReader(dcp_path))),
              lambda: _same("dcp-filesystem", mine, loaded.pop("dcp")))
    reps, b.reps = b.reps, rounds
    try:
        finish(b, "layouts-fsdp", targets, {"dcp-filesystem": dcp_path})
    finally:
        b.reps = reps


CASES: dict[str, Callable[[Any, argparse.Namespace], None]] = {
    "layouts-tiny": run_tiny,
    "layouts-s3": run_s3,
    "layouts-large": run_large,
    "layouts-fsdp": run_fsdp,
}


# ----------------------------------------------------------------- report


def finish(b: Any, case: str, targets: Targets, peers: dict[str, Path]) -> None:
    """Measures the registered methods (``Bench.flush``); rank 0 counts the files each
    left where it saved locally (``peers``: the peers' paths), keeps the summary in
    ``b.sections["layouts"][case]`` and prints it; then the outputs are removed."""
    b.flush()
    paths = {m: targets.path(m) for m in ("default", *CHOICES[case])} | peers
    if b.rank == 0:
        files = {m: _files(p) for m, p in paths.items()} if targets.bucket is None else {}
        summary = layout_summary([r for r in b.results if r.case == case], CHOICES[case], files)
        summary["rounds"] = b.reps  # the case's own, where it runs more than --reps
        b.sections.setdefault("layouts", {})[case] = summary
        print_summary(case, summary)
    for path in paths.values():
        b._clean(path)


def _seconds(results: list[Any], method: str, op: str) -> list[float]:
    """``method``'s time of ``op`` in each round, in order ([] where it did not run)."""
    found = [r for r in results if r.method == method and r.op == op]
    return [s.seconds for s in found[0].samples] if found else []


def _op(results: list[Any], method: str, op: str) -> dict[str, Any] | None:
    found = [r for r in results if r.method == method and r.op == op]
    if not found:
        return None
    seconds = [s.seconds for s in found[0].samples]
    return {"median_s": round(statistics.median(seconds), 4), "min_s": round(min(seconds), 4),
            "max_s": round(max(seconds), 4), "requests": found[0].requests}


def _paired(results: list[Any], method: str, other: str, op: str) -> float | None:
    """The median over rounds of ``other``'s time / ``method``'s in the same round (a
    throughput ratio): the methods of one round run back to back, so a slow phase of
    the machine, which lasts seconds, falls on both sides of most pairs."""
    pairs = [b / a for a, b in zip(_seconds(results, method, op), _seconds(results, other, op))]
    return round(statistics.median(pairs), 3) if pairs else None


def layout_summary(results: list[Any], explicit_names: tuple[str, ...], files: dict[str, int | None]) -> dict:
    """Per method the save and load times (median, fastest, slowest) and S3 requests,
    and files; the ratios of ``default`` to the best explicit layout and to each peer,
    as throughput, per operation: each the median over rounds of the same round's
    ratio (``_paired``). The best explicit layout is the one of the lowest median time:
    the lowest of several noisy paired ratios would be biased low (every explicit
    layout's ratio is kept as ``default_vs_<layout>``)."""
    methods = list(dict.fromkeys(r.method for r in results))
    table = {m: {"save": _op(results, m, "save"), "load": _op(results, m, "load"), "files": files.get(m)}
             for m in methods}
    ratios: dict[str, Any] = {}
    bars: dict[str, bool] = {}
    for op in ("save", "load"):
        if not table.get("default", {}).get(op):
            continue
        paired = {m: r for m in explicit_names if (r := _paired(results, "default", m, op)) is not None}
        if paired:
            best = min(paired, key=lambda m: statistics.median(_seconds(results, m, op)))
            ratios[f"{op}.default_vs_best_explicit"] = paired[best]
            ratios[f"{op}.best_explicit"] = best
            bars[f"{op}: default >= {EXPLICIT_BAR}x the best explicit layout"] = paired[best] >= EXPLICIT_BAR
            ratios.update({f"{op}.default_vs_{m}": r for m, r in paired.items()})
        for peer in (m for m in methods if m != "default" and m not in explicit_names):
            if (r := _paired(results, "default", peer, op)) is not None:
                ratios[f"{op}.default_vs_{peer}"] = r
                if peer in PEER_BARS:
                    bars[f"{op}: default >= {PEER_BARS[peer]}x {peer}"] = r >= PEER_BARS[peer]
    return {"methods": table, "ratios": ratios, "bars": bars}


def print_summary(case: str, summary: dict) -> None:
    """A short table: per method save and load (median, spread), files or requests."""
    print(f"\n{case}: method | save s (min-max) | load s (min-max) | files or S3 requests (save / load)")
    for method, row in summary["methods"].items():
        cells = []
        for op in ("save", "load"):
            x = row[op]
            cells.append(f"{x['median_s']:.3f} ({x['min_s']:.3f}-{x['max_s']:.3f})" if x else "-")
        count = (f"{row['files']} files" if row["files"] is not None else
                 f"{(row['save'] or {}).get('requests')} / {(row['load'] or {}).get('requests')} requests")
        print(f"  {method:20} | {cells[0]:24} | {cells[1]:24} | {count}")
    print("  " + ", ".join(f"{k} {v}" for k, v in summary["ratios"].items()))
    print("  bars: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in summary["bars"].items()), flush=True)
