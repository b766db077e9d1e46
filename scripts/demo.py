"""shardstore demo: save from 2 ranks, load at 1 rank, read the arrays with zarr-python and
TensorStore; on a local disk, then on S3 (MinIO from docker/, or an embedded local S3 server).

    scripts/demo.sh            (sets up .venv, then runs this)
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shardstore
from shardstore import ShardedObject, ShardedTensor
from shardstore.testing import free_port

HIDDEN, VOCAB = 64, 96


def full_model() -> dict[str, torch.Tensor]:
    """The global (unsharded) parameters every rank can recompute to check against."""
    gen = torch.Generator().manual_seed(0)
    return {
        "embedding": torch.randn(VOCAB, HIDDEN, generator=gen).bfloat16(),
        "fc1": torch.randn(4 * HIDDEN, HIDDEN, generator=gen),
        "fc2": torch.randn(HIDDEN, 4 * HIDDEN, generator=gen),
        "layernorm": torch.randn(HIDDEN, generator=gen),
    }


def sharded_state_dict(rank: int, tp: int) -> dict:
    """What a tensor-parallel trainer hands to save: its own shards plus common state."""
    p = full_model()
    return {
        "model": {
            # vocab-parallel embedding and column-parallel fc1: split on axis 0
            "embedding": ShardedTensor.from_rank_offsets("model/embedding", p["embedding"].chunk(tp, 0)[rank].clone(), (0, rank, tp)),
            "fc1": ShardedTensor.from_rank_offsets("model/fc1", p["fc1"].chunk(tp, 0)[rank].clone(), (0, rank, tp)),
            # row-parallel fc2: split on axis 1
            "fc2": ShardedTensor.from_rank_offsets("model/fc2", p["fc2"].chunk(tp, 1)[rank].clone(), (1, rank, tp)),
            # replicated on every rank; only the main replica (replica_id 0) writes it
            "layernorm": ShardedTensor.from_rank_offsets("model/layernorm", p["layernorm"].clone(), replica_id=rank),
        },
        "rng": ShardedObject("rng_state", torch.get_rng_state(), (tp,), (rank,)),
        "iteration": 1000,
    }


def save_worker(rank: int, world: int, port: int, ckpt: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    shardstore.save(sharded_state_dict(rank, world), ckpt)
    dist.destroy_process_group()


def run_demo(ckpt: str) -> None:
    """Save at 2 ranks, load at 1, metadata, verify, zarr and TensorStore: for a local path or an s3:// URL."""
    port = free_port()
    print(f"1. Saving from 2 tensor-parallel ranks to {ckpt}")
    mp.spawn(save_worker, args=(2, port, ckpt), nprocs=2, join=True)

    print("2. Loading at 1 rank (the whole tensors) and checking them bit for bit")
    request = sharded_state_dict(0, 1)
    # ShardedObjects keep the sharding they were saved with: ask for rank 0's RNG state.
    request["rng"] = ShardedObject("rng_state", None, (2,), (0,))
    loaded = shardstore.load(request, ckpt, validate_access_integrity=False)
    for name, tensor in full_model().items():
        got = loaded["model"][name]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
        print(f"   model/{name:<10} {str(tuple(got.shape)):<10} {str(got.dtype):<15} equal")
    assert loaded["iteration"] == 1000

    print("3. Metadata from the commit record alone:")
    for key, meta in sorted(shardstore.load_tensors_metadata(ckpt).items()):
        print(f"   {key:<18} global shape {tuple(meta.global_shape)}, {meta.dtype}")

    print("4. Every chunk and file verified against its checksum:")
    print("  ", shardstore.verify(ckpt))

    print("5. The same bytes without shardstore's API (a fresh interpreter that imports only zarr and tensorstore),")
    print("   as docs/guide/plain-readers.md shows: large arrays by path, small ones from their packs:")
    read = subprocess.run([sys.executable, "-c", PLAIN_READER, ckpt], check=True, capture_output=True, text=True)
    *lines, digests = read.stdout.splitlines()
    print("\n".join(lines))
    read_back = json.loads(digests.removeprefix(DIGESTS))
    saved = {f"model/{name}": _sha256(tensor) for name, tensor in full_model().items()}
    assert read_back == saved, (read_back, saved)
    print(f"   every array's bytes as plain readers see them equal what was saved ({len(saved)} arrays)")


def _sha256(tensor: torch.Tensor) -> str:
    """The SHA-256 of a tensor's bytes in C order, as numpy holds them (bfloat16: its 2 bytes)."""
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


DIGESTS = "digests: "  # the reader's last line, before the SHA-256 of each array

# Step 5's reader, the routes of docs/guide/plain-readers.md. The root group's
# 'packed_arrays' attribute names the zip of each small array (packs/<rank>-<n>.zip, a Zarr
# hierarchy of its own): zarr-python opens a local pack with ZipStore, TensorStore with its
# zip kvstore over the file or the S3 object. The other arrays are directories, opened by
# path. zarr-python reads bfloat16 only where shardstore is installed (its start-up hook,
# shardstore_zarr_dtypes.pth, registers the type; this venv has it); TensorStore reads it
# natively. tests/test_plain_readers.py runs readers in a venv without shardstore.
PLAIN_READER = """
import hashlib, json, os, sys
import numpy as np
import tensorstore as ts
import zarr

ckpt = sys.argv[1]
endpoint = os.environ.get("AWS_ENDPOINT_URL")
if ckpt.startswith("s3://"):
    bucket, _, prefix = ckpt.removeprefix("s3://").partition("/")
    base = {"driver": "s3", "bucket": bucket, "aws_region": os.environ.get("AWS_REGION", "us-east-1")}
    if os.environ.get("AWS_ACCESS_KEY_ID"):  # keys in the environment: no lookup chain printing its misses
        base["aws_credentials"] = {"type": "environment"}
    if endpoint:
        base["endpoint"] = endpoint
    kvstore = lambda rel: {**base, "path": f"{prefix}/{rel}"}
    storage_options = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else None
else:
    kvstore = lambda rel: {"driver": "file", "path": f"{ckpt}/{rel}"}
    storage_options = None

group = zarr.open_group(ckpt, mode="r", storage_options=storage_options)  # consolidated: one read
packed = group.attrs.get("packed_arrays", {})  # {key: "packs/<rank>-<n>.zip"}
digests = {}

def show(key, values, where, reader):
    digests[key] = hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()
    print(f"   {key:<16} {str(values.dtype):<9} {str(values.shape):<10} {where:<15} {reader}")

for key, array in sorted(group.members(max_depth=None)):
    if isinstance(array, zarr.Array):  # a directory of its own
        show(key, array[...], f"{key}/", "zarr-python, by path")
for key, pack in sorted(packed.items()):
    spec = {"driver": "zarr3", "kvstore": {"driver": "zip", "base": kvstore(pack)}, "path": key}
    values = ts.open(spec, read=True).result().read().result()
    if not ckpt.startswith("s3://"):
        from_zarr = zarr.open_group(zarr.storage.ZipStore(f"{ckpt}/{pack}", mode="r"), mode="r")[key][...]
        assert from_zarr.tobytes() == values.tobytes(), key
        reader = "TensorStore, and zarr-python's ZipStore" + (" (bfloat16: shardstore's hook)" if values.dtype.name == "bfloat16" else "")
    else:
        reader = "TensorStore (its zip kvstore over S3; ZipStore takes a local file)"
    show(key, values, pack, reader)
readers = group.attrs.get("readers", {})
needing = [*readers.get("arrays_needing_shardstore_or_tensorstore", {}),
           *readers.get("packed_arrays_needing_shardstore_or_tensorstore", {})]
print(f"   without shardstore, zarr-python cannot read {', '.join(sorted(needing)) or 'none of them'}: "
      "the root's 'readers' attribute says so, and names TensorStore")
print("digests: " + json.dumps(digests, sort_keys=True))  # the last line: run_demo checks them
"""


def s3_demo() -> None:
    """The same demo on S3: the endpoint in AWS_ENDPOINT_URL (MinIO in docker/), or an
    embedded moto S3 server on 127.0.0.1 when none is set."""
    server = None
    if not os.environ.get("AWS_ENDPOINT_URL"):
        from shardstore.testing import LocalS3Server

        server = LocalS3Server("demo", "demo-secret").start()
        server.export_environment()
        print(f"Started an embedded S3 server (moto) at {server.endpoint}")
    try:
        import s3fs

        bucket = os.environ.get("SHARDSTORE_DEMO_BUCKET", "shardstore-demo")
        fs = s3fs.S3FileSystem()
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        run_demo(f"s3://{bucket}/run-{int(time.time())}/iter_0001000")
    finally:
        if server is not None:
            server.stop()


def main() -> None:
    print("== Local disk ==")
    run_demo(os.path.join(tempfile.mkdtemp(prefix="shardstore-demo-"), "iter_0001000"))
    print("\n== S3 ==")
    s3_demo()
    print("Demo finished: all tensors round-tripped exactly, on disk and on S3.")


if __name__ == "__main__":
    main()
