"""``scripts/draw_charts.py`` draws a bench JSON's ratios as an SVG that parses and
names each bar (a JSON made here: the benchmark does not run)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.script_support import load_script

SVG = "{http://www.w3.org/2000/svg}"


def test_the_chart_parses_and_names_each_bar(tmp_path: Path) -> None:
    ratios = {"large.save.vs_dcp": 1.25, "large.save.vs_raw": 0.9, "large.load.vs_torch": 2.6,
              "small.save.vs_dcp": 7.0}  # another case's ratio: not drawn
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"world": 2, "reps": 3, "gib": 0.5, "ratios": ratios, "results": []}))
    out = load_script("draw_charts").draw(bench, tmp_path / "chart.svg")

    root = ET.parse(out).getroot()
    assert root.tag == f"{SVG}svg"
    bars = {r.find(f"{SVG}title").text for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None}
    assert bars == {"save vs DCP: 1.25x", "save vs raw disk write: 0.90x", "load vs torch.load: 2.60x"}
    texts = {t.text for t in root.iter(f"{SVG}text")}
    assert {"save vs DCP", "save vs raw disk write", "load vs torch.load"} <= texts
    assert {"1.25x", "0.90x", "2.60x", "1.0 = as fast"} <= texts
    widths = {r.find(f"{SVG}title").text: float(r.get("width")) for r in root.iter(f"{SVG}rect")
              if r.find(f"{SVG}title") is not None}
    assert widths["save vs raw disk write: 0.90x"] < widths["save vs DCP: 1.25x"] < widths["load vs torch.load: 2.60x"]


def test_a_json_without_the_large_case_is_refused(tmp_path: Path) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"ratios": {"small.save.vs_dcp": 1.0}}))
    with pytest.raises(ValueError, match="large case"):
        load_script("draw_charts").draw(bench, tmp_path / "chart.svg")
