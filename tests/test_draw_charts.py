"""``scripts/draw_charts.py`` draws a bench JSON's ratios as an SVG that parses and
names each bar (a JSON made here: the benchmark does not run), and every measurement
page's chart and table are what its JSON in ``docs/measurements/data/`` draws."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.script_support import load_script

SVG = "{http://www.w3.org/2000/svg}"
MEASUREMENTS = Path(__file__).resolve().parent.parent / "docs" / "measurements"


def _bars(svg: Path) -> dict[str, float]:
    """Each bar's title and width."""
    root = ET.parse(svg).getroot()
    assert root.tag == f"{SVG}svg"
    return {r.find(f"{SVG}title").text: float(r.get("width")) for r in root.iter(f"{SVG}rect")
            if r.find(f"{SVG}title") is not None}


def test_the_chart_parses_and_names_each_bar(tmp_path: Path) -> None:
    ratios = {"large.save.vs_dcp": 1.25, "large.save.vs_raw": 0.9, "large.load.vs_torch": 2.6,
              "small.save.vs_dcp": 7.0}  # another case's ratio: not drawn
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"world": 2, "reps": 3, "gib": 0.5, "ratios": ratios, "results": []}))
    charts = load_script("draw_charts")
    out = charts.draw(charts.CHARTS["performance"], bench, tmp_path / "chart.svg")

    widths = _bars(out)
    assert set(widths) == {"save vs DCP: 1.25x", "save vs raw disk write: 0.90x", "load vs torch.load: 2.60x"}
    texts = {t.text for t in ET.parse(out).getroot().iter(f"{SVG}text")}
    assert {"save vs DCP", "save vs raw disk write", "load vs torch.load"} <= texts
    assert {"1.25x", "0.90x", "2.60x", "1.0 = as fast"} <= texts
    assert "large case: 0.5 GiB at 2 ranks, medians of 3 rounds; above 1.0 shardstore is faster" in texts
    assert widths["save vs raw disk write: 0.90x"] < widths["save vs DCP: 1.25x"] < widths["load vs torch.load: 2.60x"]


def test_a_json_without_the_charts_ratios_is_refused(tmp_path: Path) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"ratios": {"small.save.vs_dcp": 1.0}}))
    charts = load_script("draw_charts")
    with pytest.raises(ValueError, match="--json"):
        charts.draw(charts.CHARTS["performance"], bench, tmp_path / "chart.svg")


@pytest.mark.parametrize("page", sorted(load_script("draw_charts").CHARTS))
def test_each_pages_chart_is_drawn_from_its_json_and_shown_on_the_page(page: str, tmp_path: Path) -> None:
    """A rerun of ``scripts/draw_charts.py`` leaves the committed SVG as it is, and the
    page shows it and says how its JSON is regenerated."""
    charts = load_script("draw_charts")
    chart = charts.CHARTS[page]
    redrawn = charts.draw(chart, out=tmp_path / chart.svg)
    assert redrawn.read_text() == (MEASUREMENTS / chart.svg).read_text(), (
        f"docs/measurements/{chart.svg} is not what data/{page}.json draws: run scripts/draw_charts.py {page}")
    text = (MEASUREMENTS / f"{page}.md").read_text(encoding="utf-8")
    assert f"]({chart.svg})" in text and f"data/{page}.json" in text


def test_the_performance_table_is_the_charts_run() -> None:
    charts = load_script("draw_charts")
    table = charts.large_table(json.loads((MEASUREMENTS / "data" / "performance.json").read_text()))
    assert table in (MEASUREMENTS / "performance.md").read_text(encoding="utf-8"), (
        "performance.md's table is not data/performance.json's: paste scripts/draw_charts.py --table performance")


def test_the_data_path_chart_draws_each_run_against_the_bar(tmp_path: Path) -> None:
    runs = [{"gib": 0.5, "ratios": {"large.save.vs_raw": 0.95, "large.load.vs_raw": 0.85}},
            {"gib": 2, "ratios": {"large.save.vs_raw": 1.1}}]
    data = tmp_path / "data-path.json"
    data.write_text(json.dumps({"runs": runs}))
    charts = load_script("draw_charts")
    out = charts.draw(charts.CHARTS["data-path"], data, tmp_path / "chart.svg")
    assert list(_bars(out)) == ["save vs raw, run 1 (0.5 GiB): 0.95x", "save vs raw, run 2 (2 GiB): 1.10x",
                                "load vs raw, run 1 (0.5 GiB): 0.85x"]
    assert "0.9 = the bar" in {t.text for t in ET.parse(out).getroot().iter(f"{SVG}text")}


def test_a_chart_of_rows_draws_seconds_on_round_ticks_without_a_reference(tmp_path: Path) -> None:
    """Figures gathered from several runs (``rows``) in seconds: each op's bars, the value
    written in seconds, ticks of a round step, no dashed line."""
    rows = [{"label": "FSDP2", "save": 42, "load": 17}, {"label": "sharded", "save": 87}]
    data = tmp_path / "planning.json"
    data.write_text(json.dumps({"rows": rows}))
    charts = load_script("draw_charts")
    out = charts.draw(charts.CHARTS["planning"], data, tmp_path / "chart.svg")
    assert list(_bars(out)) == ["save FSDP2: 42 s", "save sharded: 87 s", "load FSDP2: 17 s"]
    root = ET.parse(out).getroot()
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert texts[-10:] == [str(tick) for tick in range(0, 100, 10)]
    assert not [line for line in root.iter(f"{SVG}line") if line.get("stroke-dasharray")]
