"""The documentation site builds: ``mkdocs build --strict`` (mkdocs.yml, docs/) turns
every warning into an error, so a broken link or anchor between pages, a page left out
of the navigation and a docstring the API reference cannot render all fail here. And
the built site has none of the rendering faults ``scripts/screenshots.py`` looks for
(raw RST backticks, broken images and links, bold across words), and
``scripts/screenshots.sh`` renders its pages with headless Chromium and fails on a
page that does not render (slow; skipped without Debian's chromium). Below them,
concrete claims of the pages (an exit status, a name, a number, another library's
behaviour) checked against what the code and that library do."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.script_support import load_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as ``mkdocs build --strict`` builds it; the build's failure fails each user."""
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return out


def test_the_site_builds_with_warnings_as_errors(site: Path) -> None:
    assert (site / "index.html").exists()
    assert (site / "reference" / "api" / "index.html").exists()


def test_no_page_shows_raw_double_backticks(site: Path) -> None:
    """A docstring's RST literal (two backticks) inside an indented block is shown as
    typed: the reference pages render docstrings as Markdown, so a table in a block
    names code without them."""
    pages = sorted(site.rglob("*.html"))
    shown = [str(page.relative_to(site)) for page in pages if "``" in page.read_text(encoding="utf-8")]
    assert pages and not shown, f"raw `` on {shown}"


def _prose(markdown: str) -> str:
    """The text of a page outside fenced blocks, indented lines (code blocks, and list
    items' continuations with them) and code spans."""
    outside_fences = re.sub(r"^[ \t]*```.*?^[ \t]*```", "", markdown, flags=re.S | re.M)
    unindented = "\n".join(line for line in outside_fences.splitlines() if not line.startswith("    "))
    return re.sub(r"`[^`\n]*`", "", unindented)


def test_no_power_is_written_where_markdown_reads_bold() -> None:
    """``2**24 + 1`` outside a code span opens bold text that runs across the sentence."""
    found = [
        f"{page.relative_to(ROOT)}: {match.group(0)}"
        for page in sorted((ROOT / "docs").rglob("*.md"))
        for match in re.finditer(r"[\w)]\*\*[\w(]", _prose(page.read_text(encoding="utf-8")))
    ]
    assert not found, "write powers as code spans:\n" + "\n".join(found)


CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
# A blank 1280x2000 screenshot, or chromium's page for an unreachable server, is 12 KB;
# a page of this site 115-600 KB.
MIN_PAGE_PNG_BYTES = 50_000


def _png_size(png: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    header = png.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR", f"{png} is not a PNG"
    return struct.unpack(">II", header[16:24])


def test_the_built_site_has_no_rendering_faults(site: Path) -> None:
    """The static half of ``scripts/screenshots.sh``: what a reader would see wrong."""
    faults = load_script("screenshots").site_faults(site)
    assert not faults, "\n".join(faults)


def test_the_site_check_finds_each_kind_of_rendering_fault(tmp_path: Path) -> None:
    page = tmp_path / "guide" / "a" / "index.html"
    page.parent.mkdir(parents=True)
    (tmp_path / "guide" / "fine.svg").write_text("<svg/>")
    page.write_text(
        "<html><head><script>var s = '``';</script></head><body>"
        "<p>Call <code>``save``</code> first.</p>"
        '<img src="../fine.svg"><img src="../gone.svg">'
        '<a href="../../nowhere/#x">a</a><a href="../a/">self</a><a href="https://example.org/">out</a>'
        "<p>Up to 2<strong>24 + 1 elements, and 2</strong>25 after.</p>"
        "<p><strong>Save first. Then load.</strong> <strong>A sentence in bold.</strong></p>"
        "</body></html>"
    )
    faults = load_script("screenshots").site_faults(tmp_path, ["guide/a/", "guide/b/"])
    assert faults == [
        "guide/a/index.html: raw RST double backticks in the text",
        "guide/a/index.html: broken image ../gone.svg",
        "guide/a/index.html: broken link ../../nowhere/#x",
        "guide/a/index.html: bold opened or closed inside a word: 24 + 1 elements, and 2",
        "guide/a/index.html: bold across sentences: Save first. Then load.",
        "guide/b/: missing page (no guide/b/index.html)",
    ]


def _screenshots(out: Path, *pages: str) -> subprocess.CompletedProcess:
    """``scripts/screenshots.sh out pages...`` with this interpreter."""
    return subprocess.run(
        [str(ROOT / "scripts" / "screenshots.sh"), str(out), *pages],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "PYTHON": sys.executable},
    )


NEEDS_CHROMIUM = pytest.mark.skipif(not CHROMIUM.exists(),
                                    reason=f"no chromium at {CHROMIUM} (scripts/screenshots.sh installs it)")


@pytest.mark.slow
@NEEDS_CHROMIUM
def test_the_screenshot_check_fails_on_a_page_the_site_lacks(tmp_path: Path) -> None:
    result = _screenshots(tmp_path, "", "no/such/page/")
    assert result.returncode == 1, f"{result.stdout}\n{result.stderr}"
    assert result.stdout.split() == [str(tmp_path / "index.png")]
    assert "FAULT no/such/page/: missing page (the server answered 404)" in result.stderr


@pytest.mark.slow
@NEEDS_CHROMIUM
def test_the_screenshot_script_renders_the_pages_it_is_given(tmp_path: Path) -> None:
    result = _screenshots(tmp_path, "", "reference/api/")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    pngs = [tmp_path / "index.png", tmp_path / "reference-api.png"]
    assert result.stdout.split() == [str(png) for png in pngs]
    for png in pngs:
        assert _png_size(png) == (1280, 2000), png
        assert png.stat().st_size > MIN_PAGE_PNG_BYTES, f"{png}: {png.stat().st_size} bytes, a blank or error page?"
    assert pngs[0].read_bytes() != pngs[1].read_bytes()


# ------------------------------------------------ what the pages claim, checked


def _record_of_format_version(checkpoint: Path, version: int) -> None:
    """``checkpoint``'s commit record rewritten as a newer shardstore would write it."""
    record = checkpoint / "zarr.json"
    node = json.loads(record.read_text())
    node["attributes"]["shardstore"]["format_version"] = version
    record.write_text(json.dumps(node))


def test_verify_of_a_root_with_a_newer_format_step_is_an_error_not_damage(tmp_path: Path) -> None:
    """docs/guide/cli.md: a record of a format version this shardstore cannot read is not
    damage, exit status 2 saying to upgrade, "whether the checkpoint is verified alone or
    as a step under a root". Before, a root's verify (and ``CheckpointManager.verify``)
    listed such a step as a damaged ``zarr.json``, exit status 1: the answer a script may
    act on by deleting the step."""
    from click.testing import CliRunner

    from shardstore import ShardedTensor, save
    from shardstore.errors import CheckpointingException
    from shardstore.tools.cli import main
    from shardstore.tools.root_verify import verify_root

    for step in ("iter_0000001", "iter_0000002"):
        save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}, tmp_path / step)
    _record_of_format_version(tmp_path / "iter_0000002", 99)
    result = CliRunner().invoke(main, ["--no-progress", "verify", str(tmp_path)])
    assert (result.exit_code, result.stdout) == (2, ""), result.stdout
    assert "format version 99 is not supported" in result.stderr and "upgrade" in result.stderr, result.stderr
    assert "iter_0000002" in result.stderr, result.stderr
    with pytest.raises(CheckpointingException, match="upgrade shardstore"):
        verify_root(tmp_path)


def test_the_manager_does_not_resume_past_a_step_of_a_newer_format(tmp_path: Path) -> None:
    """docs/guide/manager.md: a record that cannot be read is not taken for damage, so
    that no resume goes by an older step; docs/format.md: a reader refuses a format
    version it does not know. Before, a step a newer shardstore wrote counted as
    damaged (a WARNING): ``latest_step()`` skipped it and ``resume`` restarted training
    from the step before it (or from step 0), as if the newer step did not exist."""
    from shardstore import CheckpointManager, ShardedTensor
    from shardstore.errors import CheckpointingException

    def state() -> dict:
        return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}

    manager = CheckpointManager(tmp_path)
    manager.save(1, state())
    manager.save(2, state())
    manager.close()
    _record_of_format_version(tmp_path / "iter_0000002", 99)
    manager = CheckpointManager(tmp_path)
    try:
        for call in (manager.latest_step, manager.all_steps, lambda: manager.resume(state())):
            with pytest.raises(CheckpointingException, match="format version 99 .*upgrade shardstore"):
                call()
    finally:
        manager.close()


def _megatron_saves_twice(rank: int, world: int, ckpt: str) -> list[str]:
    """Megatron-Core's own torch_dist save, twice into one directory (on a CPU torch its
    CUDA calls are no-ops); the keys the directory holds after."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    Path(ckpt).mkdir()
    for key in ("first", "second"):
        dist_checkpointing.save({key: ShardedTensor.from_rank_offsets(key, torch.arange(4.0))}, ckpt)
    return sorted(dist_checkpointing.load_tensors_metadata(ckpt))


def _differences_row(topic: str) -> list[str]:
    """The cells of docs/differences.md's table row on ``topic``."""
    for line in (ROOT / "docs" / "differences.md").read_text().splitlines():
        if line.startswith(f"| [{topic}]"):
            return [cell.strip() for cell in line.strip("|").split("|")]
    raise AssertionError(f"no row on {topic!r}")


def test_the_differences_page_says_what_megatron_core_does_over_a_checkpoint(tmp_path: Path) -> None:
    """docs/differences.md said Megatron-Core refuses to save into a directory holding a
    committed checkpoint ("refused unless empty"). Megatron-Core's save writes into it,
    logging "Overwriting old incomplete / corrupted checkpoint...", and the second
    checkpoint replaces the first; the difference shardstore makes is the refusal."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from tests.dist import run_distributed

    assert run_distributed(_megatron_saves_twice, 1, str(tmp_path / "iter_0000001")) == [["second"]]
    _, megatron, shardstore = _differences_row("saving over a committed checkpoint")
    assert "refused" not in megatron and "warning" in megatron, megatron
    assert "refused unless `overwrite=True`" in shardstore, shardstore


def test_the_small_tensor_the_dcp_page_names_stays_in_the_common_state(tmp_path: Path) -> None:
    """docs/guide/dcp-fsdp2.md: tensors under ``min_array_bytes`` (1 KiB) stay in
    ``common.pt``, e.g. "a bias of 256 floats". 256 float32 are 1 KiB exactly, which
    ``dcp.save`` through ``ShardstoreWriter`` stores as an array."""
    import re

    import torch.distributed.checkpoint as dcp

    from shardstore import ShardstoreWriter, load_common_state_dict, load_tensors_metadata

    text = (ROOT / "docs" / "guide" / "dcp-fsdp2.md").read_text()
    floats = int(re.search(r"a bias of (\d+) floats\) stay in `common.pt`", text).group(1))
    ckpt = tmp_path / "dcp"
    dcp.save({"bias": torch.zeros(floats)}, storage_writer=ShardstoreWriter(ckpt), no_dist=True)
    assert "bias" in load_common_state_dict(ckpt) and "bias" not in load_tensors_metadata(ckpt)


def test_the_trust_page_counts_the_attacks_the_test_plants() -> None:
    """docs/trust.md: "``tests/test_pickle_trust.py`` plants N attacks". It said 18; the
    test plants 17."""
    import re

    from tests.test_pickle_trust import ATTACKS

    text = (ROOT / "docs" / "trust.md").read_text()
    assert int(re.search(r"plants (\d+) attacks", text).group(1)) == len(ATTACKS)


def test_dcp_load_of_an_int_keyed_value_is_as_the_limitations_page_says(tmp_path: Path) -> None:
    """docs/limitations.md said ``dcp.load`` fills the caller's ``{1: ...}`` whatever it
    holds. It fills a tensor there; a plain value under an int key keeps the caller's
    (as with DCP's own ``FileSystemReader``), and only ``load_common_state_dict`` shows
    the saved one, under ``"1"``."""
    import torch.distributed.checkpoint as dcp

    from shardstore import ShardstoreReader, ShardstoreWriter, load_common_state_dict

    ckpt = tmp_path / "dcp"
    dcp.save({"a": {1: 5, 2: torch.ones(300)}}, storage_writer=ShardstoreWriter(ckpt), no_dist=True)
    state = {"a": {1: 0, 2: torch.zeros(300)}}
    dcp.load(state, storage_reader=ShardstoreReader(ckpt), no_dist=True)
    assert torch.equal(state["a"][2], torch.ones(300)) and state["a"][1] == 0, state
    assert load_common_state_dict(ckpt) == {"a": {"1": 5}}
    text = " ".join((ROOT / "docs" / "limitations.md").read_text().split())
    assert "`dcp.load` fills a tensor at the caller's `{1: ...}`" in text
    assert "a plain value there keeps the caller's" in text


# Words that tell how the work was done (an ordinal or "helper" before the word), not
# what the product does. A terminal session, an AWS session token and pytest's
# session scope are the product's words and do not match.
WORK_LOG = re.compile(
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
    r"|[0-9]+th|helper|same|next|previous|earlier|later|this|last|work|gpu|agent) sessions?\b",
    re.IGNORECASE,
)
PROJECT_TEXT = ("docs", "shardstore", "tests", "scripts", "README.md", "mkdocs.yml")


def _project_text_files() -> list[Path]:
    files: list[Path] = []
    for name in PROJECT_TEXT:
        path = ROOT / name
        files += [path] if path.is_file() else sorted(
            p for p in path.rglob("*") if p.is_file() and p.suffix in {".py", ".md", ".sh", ".yml", ".txt", ".toml"}
        )
    return files


def test_the_project_speaks_of_the_product_not_of_work_sessions() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _project_text_files()
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if WORK_LOG.search(line)
    ]
    assert not found, "speak of the product (a date or a version if needed):\n" + "\n".join(found)


def _named_on_the_layout_page(module: Path, named: set[str]) -> bool:
    """A module is named by its path (``format/codecs.py``), or by a sub-package's
    directory that holds it (``tools/manager/``); a layer's own directory names its
    ``__init__.py`` only, so each of its modules is named on its own."""
    relative = module.relative_to(ROOT / "shardstore")
    if relative.as_posix() in named:
        return True
    if relative.name == "__init__.py" and len(relative.parts) == 2:
        return f"{relative.parent.as_posix()}/" in named
    return any(f"{parent.as_posix()}/" in named for parent in relative.parents if len(parent.parts) >= 2)


def test_the_code_layout_page_names_every_module() -> None:
    named = set(re.findall(r"`([^`\n]+)`", (ROOT / "docs" / "code-layout.md").read_text(encoding="utf-8")))
    modules = sorted((ROOT / "shardstore").rglob("*.py"))
    missing = [str(m.relative_to(ROOT)) for m in modules if not _named_on_the_layout_page(m, named)]
    assert modules and not missing, f"docs/code-layout.md does not name {missing}"


# Measurement pages show the current figures of their topic, not a log of runs: the
# history is in git. A page that still holds a log is listed here until rewritten.
MEASUREMENT_LOGS: set[str] = set()
MEASUREMENT_PAGE_WORDS = 1_550
DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b")  # a dated heading, or a run's date in the text


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs" / "measurements").glob("*.md")))
def test_a_measurement_page_shows_current_figures_not_a_log(page: str) -> None:
    text = (ROOT / "docs" / "measurements" / page).read_text(encoding="utf-8")
    is_a_log = len(text.split()) > MEASUREMENT_PAGE_WORDS or bool(DATED.search(text))
    assert is_a_log == (page in MEASUREMENT_LOGS), (
        f"docs/measurements/{page}: at most {MEASUREMENT_PAGE_WORDS} words, no dates"
        if is_a_log else f"docs/measurements/{page} is no longer a log: take it off MEASUREMENT_LOGS")
