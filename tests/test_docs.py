"""The documentation site builds: ``mkdocs build --strict`` (mkdocs.yml, docs/) turns
every warning into an error, so a broken link or anchor between pages, a page left out
of the navigation and a docstring the API reference cannot render all fail here. And
``scripts/screenshots.sh`` renders its pages with headless Chromium (slow; skipped
without Debian's chromium), the screenshots a reader of the site looks at."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "reference" / "api" / "index.html").exists()


CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
# A blank 1280x2000 screenshot, or chromium's page for an unreachable server, is 12 KB;
# a page of this site 115-600 KB.
MIN_PAGE_PNG_BYTES = 50_000


def _png_size(png: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    header = png.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR", f"{png} is not a PNG"
    return struct.unpack(">II", header[16:24])


@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no chromium at {CHROMIUM} (scripts/screenshots.sh installs it)")
def test_the_screenshot_script_renders_the_pages_it_is_given(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(ROOT / "scripts" / "screenshots.sh"), str(tmp_path), "", "reference/api/"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "PYTHON": sys.executable},
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    pngs = [tmp_path / "index.png", tmp_path / "reference-api.png"]
    assert result.stdout.split() == [str(png) for png in pngs]
    for png in pngs:
        assert _png_size(png) == (1280, 2000), png
        assert png.stat().st_size > MIN_PAGE_PNG_BYTES, f"{png}: {png.stat().st_size} bytes, a blank or error page?"
    assert pngs[0].read_bytes() != pngs[1].read_bytes()
