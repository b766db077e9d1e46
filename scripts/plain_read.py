"""Read every array of a shardstore checkpoint without shardstore: zarr-python where it
can, TensorStore otherwise, following the recipe in the root group's attributes.

    python scripts/plain_read.py /tmp/ckpt/iter_0001000
    python scripts/plain_read.py s3://my-bucket/run7/iter_0001000 --s3-endpoint http://127.0.0.1:9000

Prints each array's key, shape, data type, the reader that opened it and the SHA-256 of
its bytes (C order); ``--json`` prints one JSON object per array instead. Needs only
json, numpy, zarr and tensorstore (and s3fs for zarr-python on S3); S3 credentials come
from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``.

The recipe is ``attributes.readers.recipe`` of the root ``zarr.json`` (docs/format.md,
"Reading without shardstore"): a list of sources, each naming where in the root document
its arrays are listed (``listed_in``), where their bytes are (``store``: a directory per
array, or a zip pack that is a Zarr v3 hierarchy) and where their documents are
(``document``: their own ``zarr.json``, or only the listing); and the data types that
zarr-python cannot read (bfloat16, float8), which TensorStore reads. A checkpoint
without a recipe opens every array by its path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorstore as ts
import zarr

RECIPE_VERSION = 1
# One TensorStore context for every open: a pack's zip directory is then read once, not per array.
CONTEXT = ts.Context()
EXTENSION_METADATA = "shardstore_extension_dtype_metadata"
# What a checkpoint without a recipe means: every array by its path.
BY_PATH = {
    "version": RECIPE_VERSION,
    "sources": [{"listed_in": ["consolidated_metadata", part], "store": "directory", "document": "zarr_json"}
                for part in ("metadata", EXTENSION_METADATA)],
    "tensorstore_only_data_types": ["bfloat16", "float8_e4m3fn", "float8_e5m2"],
}


class Checkpoint:
    """One checkpoint, local or on S3: its kvstore specs and its zarr-python openers."""

    def __init__(self, url: str, endpoint: str | None, region: str) -> None:
        self.url = url.rstrip("/")
        self.s3 = self.url.startswith("s3://")
        if self.s3:
            bucket, _, prefix = self.url[len("s3://"):].partition("/")
            self._base = {"driver": "s3", "bucket": bucket, "aws_region": region,
                          **({"endpoint": endpoint} if endpoint else {})}
            self._prefix = f"{prefix}/" if prefix else ""
            self.storage_options = {"endpoint_url": endpoint} if endpoint else {}
        else:
            self._base, self._prefix, self.storage_options = {"driver": "file"}, f"{self.url}/", None
        self._root_group: Any = None
        self._packs: dict[str, tuple[Any, Any]] = {}
        self._kvstores: dict[str, Any] = {}

    def kvstore(self, rel: str) -> dict[str, Any]:
        """The TensorStore kvstore spec of ``rel`` (a path relative to the checkpoint)."""
        return {**self._base, "path": self._prefix + rel}

    def read_json(self, rel: str, kvstore: dict[str, Any] | None = None) -> Any:
        spec = kvstore or self.kvstore("")
        name = json.dumps(spec, sort_keys=True)
        if name not in self._kvstores:
            self._kvstores[name] = ts.KvStore.open(spec, context=CONTEXT).result()
        result = self._kvstores[name].read(rel).result()
        if result.state != "value":
            raise FileNotFoundError(f"{self.url}: {rel} is missing")
        return json.loads(bytes(result.value))

    def root_group(self) -> Any:
        """zarr-python's root group, through its consolidated metadata (opened once)."""
        if self._root_group is None:
            self._root_group = zarr.open_group(self.url, mode="r", storage_options=self.storage_options)
        return self._root_group

    def zarr_by_path(self, key: str) -> Any:
        return zarr.open_array(f"{self.url}/{key}", mode="r", storage_options=self.storage_options)

    def pack(self, pack: str) -> tuple[dict[str, Any], Any]:
        """A pack's zip kvstore spec, and zarr-python's group of it (local packs only)."""
        if pack not in self._packs:
            spec = {"driver": "zip", "base": self.kvstore(pack)}
            group = None if self.s3 else zarr.open_group(zarr.storage.ZipStore(f"{self.url}/{pack}", mode="r"),
                                                         mode="r")
            self._packs[pack] = (spec, group)
        return self._packs[pack]


def _listing(root: dict[str, Any], path: list[str]) -> dict[str, Any]:
    node: Any = root
    for part in path:
        node = node.get(part, {}) if isinstance(node, dict) else {}
    return node


def _data_type(document: dict[str, Any]) -> str:
    data_type = document["data_type"]
    return data_type if isinstance(data_type, str) else data_type["name"]


def arrays(ckpt: Checkpoint) -> Iterator[tuple[str, str, np.ndarray]]:
    """Each array of the checkpoint: its key, the reader that opened it, its values."""
    root = ckpt.read_json("zarr.json")
    recipe = root.get("attributes", {}).get("readers", {}).get("recipe", BY_PATH)
    if recipe.get("version") != RECIPE_VERSION:
        raise SystemExit(f"{ckpt.url}: recipe version {recipe.get('version')!r}; this reader knows {RECIPE_VERSION}")
    tensorstore_only = set(recipe["tensorstore_only_data_types"])
    for source in recipe["sources"]:
        listing = _listing(root, source["listed_in"])
        for key, value in sorted(listing.items()):
            if source["store"] == "directory":
                if value.get("node_type") == "array":
                    yield key, *_directory_array(ckpt, key, value, source["document"], tensorstore_only)
            elif source["store"] == "zip_pack":
                yield key, *_packed_array(ckpt, key, value, tensorstore_only)
            else:
                raise SystemExit(f"{ckpt.url}: unknown store {source['store']!r} in the recipe")


def _directory_array(
    ckpt: Checkpoint, key: str, document: dict[str, Any], where: str, tensorstore_only: set[str],
) -> tuple[str, np.ndarray]:
    if _data_type(document) not in tensorstore_only:
        array = ckpt.zarr_by_path(key) if where == "zarr_json" else ckpt.root_group()[key]
        return "zarr", np.asarray(array[...])
    spec = {"driver": "zarr3", "kvstore": ckpt.kvstore(f"{key}/")}
    if where == "listed":  # its only document is the listed one
        spec["metadata"] = document
        array = ts.open(spec, open=True, assume_metadata=True, context=CONTEXT).result()
    else:
        array = ts.open(spec, open=True, context=CONTEXT).result()
    return "tensorstore", array.read().result()


def _packed_array(ckpt: Checkpoint, key: str, pack: str, tensorstore_only: set[str]) -> tuple[str, np.ndarray]:
    spec, group = ckpt.pack(pack)
    if group is not None and _data_type(ckpt.read_json(f"{key}/zarr.json", spec)) not in tensorstore_only:
        return "zarr", np.asarray(group[key][...])
    array = ts.open({"driver": "zarr3", "kvstore": spec, "path": key}, open=True, context=CONTEXT).result()
    return "tensorstore", array.read().result()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="directories or s3://bucket/prefix")
    parser.add_argument("--s3-endpoint", help="an S3 endpoint URL other than AWS's")
    parser.add_argument("--s3-region", default="us-east-1")
    parser.add_argument("--json", action="store_true", help="one JSON object per array")
    args = parser.parse_args(argv)
    for url in args.checkpoints:
        ckpt = Checkpoint(url, args.s3_endpoint, args.s3_region)
        for key, reader, values in arrays(ckpt):
            row = {"checkpoint": url, "key": key, "shape": list(values.shape), "dtype": str(values.dtype),
                   "reader": reader, "sha256": hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()}
            if args.json:
                print(json.dumps(row))
            else:
                print("  ".join([key, str(tuple(values.shape)), str(values.dtype), reader, f"sha256:{row['sha256'][:16]}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
