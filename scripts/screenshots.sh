#!/usr/bin/env bash
# The documentation site's check: builds it with mkdocs --strict, looks for rendering
# faults in its HTML, serves it on 127.0.0.1 and renders every page (or the pages named)
# with headless Chromium (Debian's package, installed here when /usr/bin/chromium is
# missing: needs root and apt-get). Exits 1 on any fault (scripts/screenshots.py says
# which); tests/README.md says when to run it.
#
#   scripts/screenshots.sh OUT_DIR [PAGE ...]      e.g. scripts/screenshots.sh /tmp/shots guide/cli/
#
#   PYTHON   the interpreter with mkdocs (default: .venv/bin/python, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x "${CHROMIUM:-/usr/bin/chromium}" ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "no chromium at ${CHROMIUM:-/usr/bin/chromium}; install Debian's chromium package (apt-get install chromium)" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
fi

python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
exec "$python" scripts/screenshots.py "$@"
