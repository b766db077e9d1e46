#!/usr/bin/env bash
# Creates .venv in the repo root when missing and installs shardstore with its test
# extras into it. Sourced by scripts/demo.sh and scripts/test.sh; safe to run twice
# (it reinstalls only when pyproject.toml changed).
#
#   TORCH_SPEC   the torch requirement to install first (default: torch==2.13.0, which
#                this machine has as a local CPU wheel; an unpinned torch would pull
#                several GB of CUDA packages). E.g. TORCH_SPEC="torch>=2.4" elsewhere.
#   PYTHON       the interpreter for the venv (default: python3, needs >= 3.11: zarr 3.1 does)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo_root/.venv"
python="${PYTHON:-python3}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "shardstore needs Python >= 3.11; $python is $("$python" --version 2>&1)" >&2
  exit 1
fi

if [ ! -x "$venv/bin/python" ]; then
  if ! "$python" -m venv --help >/dev/null 2>&1; then
    # Debian/Ubuntu ship venv separately.
    if command -v apt-get >/dev/null 2>&1; then
      apt-get update -qq && apt-get install -y -qq python3-venv
    fi
  fi
  echo "Creating $venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi

stamp="$venv/.shardstore-installed"
want="$(sha256sum < "$repo_root/pyproject.toml" | cut -d' ' -f1) $torch_spec"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "Installing $torch_spec and shardstore[test] into $venv"
  "$venv/bin/python" -m pip install -q "$torch_spec"
  "$venv/bin/python" -m pip install -q -e "$repo_root[test]"
  echo "$want" > "$stamp"
fi
