"""Check the documentation site as a reader sees it: build it, find rendering faults in
its HTML, and render every page to a PNG with headless Chromium.

    scripts/screenshots.sh OUT_DIR [PAGE ...]     (installs chromium when missing, then runs this)
    python scripts/screenshots.py [--static] OUT_DIR [PAGE ...]

Builds the site (``mkdocs build --strict``, into a temporary directory) and looks for
the faults a strict build lets through (``site_faults``): raw RST double backticks in a
page's text, an image, stylesheet, script or link to a file the site lacks, and bold
text opened or closed inside a word (``2**24 + 1`` outside a code span) or running
across sentences. Then serves the site with ``python -m http.server`` on 127.0.0.1 and
renders each page with headless Chromium (``CHROMIUM``, default ``/usr/bin/chromium``)
at 1280x2000 into ``OUT_DIR/<page path with / as ->.png`` (``index.png``,
``guide-cli.png``); a page the server does not find, or a render that comes out blank,
is a fault too. A PAGE is a site path as the navigation names it (``guide/cli/``,
``""`` for the home page); without any, every page is checked. ``--static`` skips
Chromium (the static checks alone, what the test suite runs). Prints one line per PNG
written, then every fault, and exits 1 if there was any.
"""

from __future__ import annotations

__all__ = ["build_site", "main", "page_faults", "png_name", "render", "site_faults", "site_pages"]

import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

from shardstore.testing import free_port

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
WINDOW = "1280,2000"
RENDER_TIMEOUT_S = 120
# A blank 1280x2000 screenshot, or chromium's page for an unreachable server, is about
# 12 KB; the shortest page of this site about 100 KB.
MIN_PAGE_PNG_BYTES = 40_000
# Headless, and nothing that would contact any address but the local server.
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    # every host name but the local server's address resolves to nothing
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
)
# Bold opened or closed inside a word: ``2**24 + 1`` read as bold by Markdown.
BOLD_IN_A_WORD = re.compile(r"\w<strong>|</strong>\w")
SENTENCE_BREAK = re.compile(r"[.!?]\s+[A-Z]")
STRONG = re.compile(r"<strong>(.*?)</strong>", re.S)
TAG = re.compile(r"<[^>]+>")


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


class _PageParser(HTMLParser):
    """A page's visible text (outside ``script`` and ``style``) and the local files it refers to."""

    REFERENCES = {"img": "src", "script": "src", "link": "href", "a": "href"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.text: list[str] = []
        self.references: list[tuple[str, str]] = []  # (tag, url)
        self._hidden = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style"):
            self._hidden += 1
        url = dict(attrs).get(self.REFERENCES.get(tag, ""))
        if url:
            self.references.append((tag, url))

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._hidden = max(0, self._hidden - 1)

    def handle_data(self, data: str) -> None:
        if not self._hidden:
            self.text.append(data)


def _target(site_dir: Path, html: Path, url: str) -> Path | None:
    """The file in the site a local ``url`` of page ``html`` names; None for another site's."""
    parts = urlsplit(url)
    if parts.scheme or parts.netloc or not parts.path:
        return None
    path = (html.parent / unquote(parts.path)).resolve()
    return path / "index.html" if url.endswith("/") or path.is_dir() else path


def page_faults(site_dir: Path, html: Path) -> list[str]:
    """What would not render right on one built page, one line per fault."""
    source = html.read_text(encoding="utf-8")
    parser = _PageParser()
    parser.feed(source)
    name = html.relative_to(site_dir).as_posix()
    faults = []
    if "``" in "".join(parser.text):
        faults.append(f"{name}: raw RST double backticks in the text")
    for tag, url in parser.references:
        target = _target(site_dir, html, url)
        if target is not None and not target.is_file():
            kind = {"img": "image", "a": "link"}.get(tag, tag)
            faults.append(f"{name}: broken {kind} {url}")
    for match in STRONG.finditer(source):
        bold = TAG.sub("", match.group(1)).replace("\n", " ")
        if BOLD_IN_A_WORD.search(source[max(0, match.start() - 1):match.end() + 1]):
            faults.append(f"{name}: bold opened or closed inside a word: {bold[:80]}")
        elif SENTENCE_BREAK.search(bold):
            faults.append(f"{name}: bold across sentences: {bold[:80]}")
    return faults


def site_faults(site_dir: Path, pages: list[str] | None = None) -> list[str]:
    """The rendering faults of the built site's ``pages`` (default: all of them), and
    each page asked for that the site lacks."""
    faults = []
    for page in site_pages(site_dir) if pages is None else pages:
        html = site_dir / page / "index.html" if not page.endswith(".html") else site_dir / page
        if not html.is_file():
            faults.append(f"{page or '/'}: missing page (no {html.relative_to(site_dir)})")
        else:
            faults += page_faults(site_dir, html)
    return faults


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


def _rendered_faults(base: str, page: str, png: Path, profile: Path) -> list[str]:
    """Renders one served page; a page the server lacks or a blank render is a fault."""
    try:
        urllib.request.urlopen(base + page, timeout=10).close()
    except urllib.error.HTTPError as error:
        return [f"{page or '/'}: missing page (the server answered {error.code})"]
    render(base + page, png, profile)
    print(png, flush=True)
    if (size := png.stat().st_size) < MIN_PAGE_PNG_BYTES:
        return [f"{page or '/'}: rendered blank ({png}: {size} bytes, under {MIN_PAGE_PNG_BYTES})"]
    return []


def main(argv: list[str]) -> int:
    static = "--static" in argv
    argv = [arg for arg in argv if arg != "--static"]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if not static and not Path(CHROMIUM).exists():
        print(f"no chromium at {CHROMIUM}: run scripts/screenshots.sh (installs it), or pass --static",
              file=sys.stderr)
        return 2
    out = Path(argv[0]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="shardstore-site-") as tmp:
        site_dir = Path(tmp) / "site"
        build_site(site_dir)
        pages = argv[1:] or site_pages(site_dir)
        faults = site_faults(site_dir, pages)
        if not static:
            with serving(site_dir) as base:
                for number, page in enumerate(pages):
                    faults += _rendered_faults(base, page, out / png_name(page), Path(tmp) / f"profile-{number}")
    for fault in faults:
        print(f"FAULT {fault}", file=sys.stderr)
    if faults:
        print(f"{len(faults)} rendering fault(s) on the site", file=sys.stderr)
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
