"""shardstore demo: save from 2 ranks, load at 1 rank, read an array with plain zarr;
on a local disk, then on S3 (MinIO from docker/, or an embedded local S3 server).

    scripts/demo.sh            (sets up .venv, then runs this)
"""

from __future__ import annotations

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
    """Save at 2 ranks, load at 1, metadata, plain zarr: for a local path or an s3:// URL."""
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

    print("5. The same bytes through plain zarr (a fresh interpreter, no shardstore import):")
    reader = (
        "import sys, zarr; a = zarr.open_array(sys.argv[1] + '/model/embedding', mode='r'); "
        "print(f'   zarr.open_array: shape={a.shape} dtype={a.dtype} chunks={a.chunks}'); "
        "print('   first row:', a[0, :4])"
    )
    subprocess.run([sys.executable, "-c", reader, ckpt], check=True)


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
