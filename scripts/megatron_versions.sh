#!/usr/bin/env bash
# Runs shardstore's Megatron tests against Megatron-Core releases that pip will not install
# on this Python (0.17 and later require Python 3.12). Their wheels are pure Python where
# dist_checkpointing lives, so each is downloaded without dependencies, unpacked under
# .megatron-versions/ and put ahead of the installed megatron-core on PYTHONPATH; 0.18 and
# later import triton at `import megatron.core` (MoE kernels), so triton is unpacked there
# too (about 1 GB; nothing of it runs on CPU).
#
#   scripts/megatron_versions.sh                 # 0.17.1 0.18.2 0.19.0
#   scripts/megatron_versions.sh 0.19.0          # one version
#   MEGATRON_TESTS="tests/test_megatron_install.py" scripts/megatron_versions.sh
#
# Needs the project's .venv (scripts/setup_venv.sh) and PyPI. Exit status: 0 when every
# version passed. Not part of scripts/test.sh: CI runs the installed megatron-core (0.16.1).
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup_venv.sh || exit 1
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.17.1 0.18.2 0.19.0)
tests=${MEGATRON_TESTS:-"tests/test_megatron_install.py tests/test_megatron_gpt.py"}
cache=.megatron-versions
mkdir -p "$cache"
pip=(.venv/bin/python -m pip -q)

unpacked() {  # the directory holding megatron-core $1, downloaded and unpacked once
  local dir="$cache/megatron-core-$1"
  if [ ! -d "$dir/megatron/core" ]; then
    "${pip[@]}" download --no-deps --only-binary=:all: --python-version 3.12 --dest "$cache/wheels" \
      "megatron-core==$1" >&2 || return 1
    rm -rf "$dir" && mkdir -p "$dir"
    .venv/bin/python -m zipfile -e "$cache"/wheels/megatron_core-"$1"-*.whl "$dir" || return 1
  fi
  echo "$dir"
}

status=0
for version in "${versions[@]}"; do
  dir=$(unpacked "$version") || { echo "megatron-core $version: download failed" >&2; status=1; continue; }
  path="$PWD/$dir"
  if ! PYTHONPATH="$path" .venv/bin/python -W ignore -c "import megatron.core" 2>/dev/null; then
    [ -d "$cache/triton/triton" ] || "${pip[@]}" install --no-deps --target "$cache/triton" triton || status=1
    path="$path:$PWD/$cache/triton"
  fi
  echo "== megatron-core $version"
  # shellcheck disable=SC2086  # $tests is a list of paths
  PYTHONPATH="$path" .venv/bin/python -m pytest -q -p no:cacheprovider $tests || status=1
done
exit $status
