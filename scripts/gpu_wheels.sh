#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored), the Python 3.12 x86-64 wheels that the GPU machine
# lacks for the GPU tests (tests/test_gpu.py and tests/test_megatron_gpt.py, `pytest -m gpu`): it has torch, TensorStore,
# numpy, ml_dtypes, fsspec, psutil, pytest, hypothesis, safetensors and xarray, but not
# these (../shared/FACTS.md). There, `bash scripts/gpu_check.sh` installs them and runs every
# GPU test and benchmark (carry .whl with the device tool).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl \
  "zarr==3.1.6" "numcodecs==0.16.5" "crc32c==2.7.1" "google-crc32c==1.7.1" "donfig==0.8.1.post1" \
  "click==8.3.1" "tqdm==4.67.1" "pytest-timeout==2.4.0" "megatron-core==0.16.1" "typing_extensions==4.15.0" \
  "isal==1.9.1"
ls .whl
