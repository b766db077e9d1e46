#!/usr/bin/env bash
# Runs the test suite (sets up .venv first when missing). Extra arguments go to pytest:
#   scripts/test.sh                 the default, fast suite
#   scripts/test.sh -m slow         only the slow tests
#   SHARDSTORE_SLOW=1 scripts/test.sh   everything
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
.venv/bin/ruff check shardstore tests scripts
args=()
if [ "${SHARDSTORE_SLOW:-0}" = "1" ]; then
  args+=(-m "slow or not slow")
fi
exec .venv/bin/python -m pytest "${args[@]}" "$@"
