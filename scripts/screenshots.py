"""Render the documentation site's pages to PNG screenshots, to look at them as a reader would.

    scripts/screenshots.sh OUT_DIR [PAGE ...]     (installs chromium when missing, then runs this)
    python scripts/screenshots.py OUT_DIR [PAGE ...]

Builds the site (``mkdocs build --strict``, into a temporary directory), serves it with
``python -m http.server`` on 127.0.0.1 at a free port, and renders each page with headless
Chromium (``CHROMIUM``, default ``/usr/bin/chromium``) at 1280x2000 into
``OUT_DIR/<page path with / as ->.png`` (``index.png``, ``guide-cli.png``, ...). A PAGE is a
site path as the navigation names it (``guide/cli/``, ``index.html``, ``""`` for the home
page); without any, every page of the site is rendered. Prints one line per PNG written and
exits non-zero if a page could not be rendered.
"""

from __future__ import annotations

__all__ = ["build_site", "main", "png_name", "render", "site_pages"]

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shardstore.testing import free_port

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
WINDOW = "1280,2000"
RENDER_TIMEOUT_S = 120
# Headless, and nothing that would contact any address but the local server.
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    # every host name but the local server's address resolves to nothing
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
)


def build_site(site_dir: Path) -> None:
    """``mkdocs build --strict`` of this checkout into ``site_dir``; raises with mkdocs' output."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site_dir)],
        capture_output=True, text=True, cwd=ROOT,
    )
    if result.returncode != 0:
        raise RuntimeError(f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}")


def site_pages(site_dir: Path) -> list[str]:
    """Every page of the built site, as the path a browser asks for (``""``, ``guide/cli/``)."""
    pages = []
    for html in sorted(site_dir.rglob("index.html")):
        relative = html.parent.relative_to(site_dir).as_posix()
        if not relative.startswith(("search", "assets")):
            pages.append("" if relative == "." else f"{relative}/")
    return pages


def png_name(page: str) -> str:
    """``guide/cli/`` -> ``guide-cli.png``; the home page is ``index.png``."""
    stem = page.removesuffix("index.html").strip("/").replace("/", "-")
    return f"{stem or 'index'}.png"


@contextmanager
def serving(site_dir: Path) -> Iterator[str]:
    """The site served by ``python -m http.server`` on 127.0.0.1; yields its base URL."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(site_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(base, timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"the site's http.server on {base} did not answer within 30 s") from None
                time.sleep(0.2)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=10)


def render(url: str, png: Path, profile: Path) -> None:
    """One page to ``png`` with headless Chromium, its profile in ``profile`` (a new, empty directory)."""
    profile.mkdir(parents=True)
    result = subprocess.run(
        [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={png}",
         f"--window-size={WINDOW}", url],
        capture_output=True, text=True, timeout=RENDER_TIMEOUT_S,
    )
    if result.returncode != 0 or not png.exists():
        raise RuntimeError(f"chromium did not render {url} to {png} (exit {result.returncode}):\n{result.stderr[-2000:]}")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="shardstore-site-") as tmp:
        site_dir = Path(tmp) / "site"
        build_site(site_dir)
        pages = argv[1:] or site_pages(site_dir)
        with serving(site_dir) as base:
            for number, page in enumerate(pages):
                png = out / png_name(page)
                render(base + page, png, Path(tmp) / f"profile-{number}")
                print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
