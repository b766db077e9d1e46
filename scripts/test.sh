#!/usr/bin/env bash
# Runs the test suite (sets up .venv first when missing). Extra arguments go to pytest:
#   scripts/test.sh                     the default suite: without the tests marked slow,
#                                       and few examples in the Hypothesis property tests
#   scripts/test.sh -m slow             only the tests marked slow
#   SHARDSTORE_SLOW=1 scripts/test.sh   everything, and 4-5x the property tests' examples
#                                       (tests/test_properties.py, test_trust_properties.py)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
.venv/bin/ruff check shardstore tests scripts
args=()
if [ "${SHARDSTORE_SLOW:-0}" = "1" ]; then
  args+=(-m "slow or not slow")
fi
exec .venv/bin/python -m pytest "${args[@]}" "$@"
