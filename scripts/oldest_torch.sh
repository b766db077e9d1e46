#!/usr/bin/env bash
# Runs the test suite once against the oldest torch shardstore claims to support, in a
# venv of its own, so that the floor in pyproject.toml (`torch>=X`) is a version that was
# tested and not a guess. scripts/test.sh tests the newest (torch 2.13 here).
#
#   scripts/oldest_torch.sh                 torch at the floor pyproject.toml declares
#   scripts/oldest_torch.sh 2.6.0 -x -q     another version; further arguments go to pytest
#
# The venv lives under ${SHARDSTORE_CACHE:-~/.cache/shardstore}/venv-torch-<version> and is
# reused by later runs. On Linux x86_64, PyPI has no CPU build of old torch releases: pip
# installs the CUDA build with its nvidia-* wheels (about 5 GB in the venv, 4 minutes to
# fetch here; it runs on the CPU all the same). On a machine with the PyTorch CPU index,
# set PIP_INDEX_URL=https://download.pytorch.org/whl/cpu for the first run instead.
# Measured here (2 cores shared with other work): torch 2.10.0, the floor, passes (581
# passed, 7 skipped: CUDA-only and one Megatron-version case) in 7.5 minutes; 2.5.1 fails
# only the DTensor and DCP-storage tests (torch internals new in 2.10) besides timeouts
# under load that pass when rerun; 2.4.1 fails from the first weights_only load (no
# torch.serialization.safe_globals).
#
# megatron-core 0.16.1 (a test extra) requires torch>=2.6: below that it is left out and its
# tests skip, since shardstore itself never imports it.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
floor="$("$python" - "$repo_root/pyproject.toml" <<'EOF'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print(next(re.fullmatch(r"torch>=([0-9.]+)", d).group(1) for d in deps if d.startswith("torch")))
EOF
)"
version="${1:-$floor}"
[ $# -gt 0 ] && shift
venv="${SHARDSTORE_CACHE:-$HOME/.cache/shardstore}/venv-torch-$version"

if [ ! -x "$venv/bin/python" ]; then
  echo "Creating $venv"
  "$python" -m venv "$venv"
fi
constraints="$venv/constraints.txt"
echo "torch==$version" > "$constraints"
stamp="$venv/.shardstore-installed"
want="$(sha256sum < "$repo_root/pyproject.toml" | cut -d' ' -f1) $repo_root"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "Installing torch==$version and shardstore's test dependencies into $venv"
  "$venv/bin/python" -m pip install -q "torch==$version"
  # the test extras by name, without megatron-core (below), pinned to this torch
  mapfile -t extras < <("$python" - "$repo_root/pyproject.toml" <<'EOF'
import sys, tomllib
extras = tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]
for name in ("s3", "test"):
    for requirement in extras[name]:
        if not requirement.startswith(("shardstore", "megatron-core")):
            print(requirement)
EOF
  )
  "$venv/bin/python" -m pip install -q -c "$constraints" -e "$repo_root" "${extras[@]}"
  megatron="$(grep -o '"megatron-core[^"]*"' "$repo_root/pyproject.toml" | tr -d '"')"
  if ! "$venv/bin/python" -m pip install -q -c "$constraints" "$megatron" 2>"$venv/megatron.log"; then
    echo "$megatron cannot be installed beside torch $version (see $venv/megatron.log): its tests skip"
  fi
  echo "$want" > "$stamp"
fi

cd "$repo_root"
"$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'
start=$(date +%s)
status=0
"$venv/bin/python" -m pytest -p no:cacheprovider "$@" || status=$?
echo "torch $version: pytest exited $status after $(( $(date +%s) - start )) s"
exit "$status"
