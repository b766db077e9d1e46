#!/usr/bin/env bash
# The shardstore demo (sets up .venv first when missing): 2 ranks save a checkpoint
# with tensor-parallel shards, a replicated tensor and bfloat16; 1 rank loads it back
# and checks every tensor; zarr-python and TensorStore read the arrays (no shardstore API).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
exec .venv/bin/python scripts/demo.py "$@"
