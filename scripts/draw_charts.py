"""Draws the measurement pages' charts as SVG, each from its benchmark's JSON.

Each chart belongs to one page of ``docs/measurements/`` and reads the JSON next to it,
``docs/measurements/data/<page>.json``, in the form ``scripts/bench.py --json`` writes
(its ``ratios`` table: ``large.save.vs_dcp`` and the like). One horizontal bar per
ratio of shardstore's throughput over a peer's, saves and loads in their own colours,
with a dashed line at 1.0 (as fast as the peer); a ratio missing from the JSON has no
bar. The SVG is written by hand with the standard library, so a rerun of the benchmark
redraws it without a plotting package. ``--table performance`` prints the performance
page's table from the same JSON as its chart.

Usage::

    python scripts/bench.py --cases large --gib 0.5 --reps 2 --world 2 \\
        --json docs/measurements/data/performance.json
    python scripts/draw_charts.py              # redraws every chart
    python scripts/draw_charts.py performance  # redraws one page's chart
    python scripts/draw_charts.py --table performance
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

__all__ = ["Bar", "CHARTS", "Chart", "data_path_bars", "dcp_bars", "draw", "large_bars", "large_table", "main", "render_svg",
           "row_bars", "small_tensor_bars"]

MEASUREMENTS = Path(__file__).resolve().parent.parent / "docs" / "measurements"
DATA = MEASUREMENTS / "data"
OPS = ("save", "load")
IO = {"save": "write", "load": "read"}
COLOURS = {"save": "#4c72b0", "load": "#dd8452"}

LABEL_W, BAR_W, VALUE_W = 250, 360, 70  # columns, in px
ROW_H, BAR_H, TOP, BOTTOM = 30, 18, 74, 34
FONT = 'font-family="sans-serif" font-size="13"'


@dataclass(frozen=True)
class Bar:
    """One ratio: shardstore's throughput over a peer's (above 1.0: shardstore is faster)."""

    label: str
    op: str  # "save" or "load": picks the bar's colour
    value: float


def _ratio_bars(payload: dict, rows: tuple[tuple[str, str], ...]) -> list[Bar]:
    """A bar per (ratio key, label) present in the JSON's ``ratios``, saves first; ``{op}``
    in both reads ``save`` or ``load``, and ``{io}`` in a label ``write`` or ``read``."""
    ratios = payload.get("ratios", {})
    return [
        Bar(f"{op} {label.format(op=op, io=IO[op])}", op, float(ratios[key]))
        for op in OPS
        for template, label in rows
        if (key := template.format(op=op)) in ratios
    ]


def large_bars(payload: dict) -> list[Bar]:
    """The large case against DCP, ``torch.save``/``torch.load`` and the raw disk."""
    return _ratio_bars(payload, (("large.{op}.vs_dcp", "vs DCP"), ("large.{op}.vs_torch", "vs torch.{op}"),
                                 ("large.{op}.vs_raw", "vs raw disk {io}")))


def small_tensor_bars(payload: dict) -> list[Bar]:
    """The ``tiny`` case's layouts, and the zip floor, against ``torch.save``/``torch.load``."""
    return _ratio_bars(payload, (("tiny.{op}.vs_torch", "default (packs <= 256 KiB)"),
                                 ("tiny.per-array.{op}.vs_torch", "an array per tensor"),
                                 ("tiny.consolidated.{op}.vs_torch", "consolidated_only"),
                                 ("tiny.packed.{op}.vs_torch", "packs <= 64 KiB"),
                                 ("tiny.zip-pack-floor.{op}.vs_torch", "zip floor (no checks)")))


def data_path_bars(payload: dict) -> list[Bar]:
    """The large case against the raw disk, one bar per run of ``runs`` (a list of bench
    JSONs) or of the JSON itself: saves first."""
    runs = payload.get("runs", [payload])
    return [
        Bar(f"{op} vs raw, run {number} ({run.get('gib', '?')} GiB)", op, float(run["ratios"][key]))
        for op in OPS
        for number, run in enumerate(runs, 1)
        if (key := f"large.{op}.vs_raw") in run.get("ratios", {})
    ]


def dcp_bars(payload: dict) -> list[Bar]:
    """shardstore through DCP's API and its own, against DCP's own writer and reader."""
    return _ratio_bars(payload, (("dcp-api.{op}.vs_dcp", "DTensors, dcp.{op}"),
                                 ("dcp-api.{op}.ss_api_vs_dcp", "DTensors, shardstore.{op}"),
                                 ("dcp-plain.{op}.vs_dcp", "plain tensors, dcp.{op}")))


def row_bars(payload: dict) -> list[Bar]:
    """A bar per op of each of the JSON's ``rows`` (``{"label": ..., "save": ..., "load":
    ...}``, either op optional), saves first: figures a page gathers from several runs."""
    return [Bar(f"{op} {row['label']}", op, float(row[op])) for op in OPS for row in payload.get("rows", [])
            if op in row]


@dataclass(frozen=True)
class Chart:
    """A measurement page's chart: its bars from ``data/<page>.json``, its SVG next to the page.

    ``subtitle`` is formatted with the JSON's top-level values (``world``, ``reps``,
    ``gib``); a value the JSON lacks reads ``?``. ``value_format`` writes a bar's value
    (``"{:.2f}x"``, a ratio; ``"{:g} s"``, seconds); ``reference`` None draws no line.
    """

    page: str
    svg: str
    bars: Callable[[dict], list[Bar]]
    title: str
    subtitle: str
    reference: float | None = 1.0  # where the dashed line goes
    reference_label: str = "1.0 = as fast"
    value_format: str = "{:.2f}x"
    label_w: int = LABEL_W  # px for the bars' labels


CHARTS: dict[str, Chart] = {chart.page: chart for chart in (
    Chart("performance", "large-ratios.svg", large_bars, "shardstore's throughput over each peer",
          "large case: {gib} GiB at {world} ranks, medians of {reps} rounds; above 1.0 shardstore is faster"),
    Chart("small-tensors", "small-tensors.svg", small_tensor_bars,
          "10,000 small tensors: throughput over torch.save / torch.load",
          "{world} process, medians of {reps}; above 1.0 faster than torch"),
    Chart("data-path", "data-path.svg", data_path_bars, "shardstore's throughput over the raw disk, run by run",
          "large case at 2 ranks, medians per run; the bar: 0.9x the raw bound or better",
          reference=0.9, reference_label="0.9 = the bar"),
    Chart("dcp", "dcp.svg", dcp_bars, "shardstore's throughput over DCP's own writer and reader",
          "{world} ranks, medians; above 1.0 shardstore is faster"),
    Chart("planning", "planning.svg", row_bars, "the coordinator's CPU for one plan, in seconds",
          "first save (later saves reuse the plan) and load, full size, simulated on 2 cores",
          reference=None, value_format="{:g} s"),
    Chart("scale", "scale.svg", row_bars, "on S3: shardstore's throughput over DCP (fsspec)",
          "{world} ranks, a local S3 server (moto), medians; above 1.0 shardstore is faster", label_w=320),
    Chart("incremental", "incremental.svg", row_bars, "a save reusing step 1: its time over a full save's",
          "step 2 at {world} ranks, medians; below 1.0 cheaper than writing everything",
          reference_label="1.0 = a full save"),
)}


def _tick_step(top: float) -> float:
    """Ticks every half up to 5; above, a step of 1, 2 or 5 times a power of ten that
    makes at most 10 ticks."""
    if top <= 5:
        return 0.5
    magnitude = 1.0
    while True:
        for step in (magnitude, 2 * magnitude, 5 * magnitude):
            if top / step <= 10:
                return step
        magnitude *= 10


def _scale(bars: list[Bar]) -> float:
    """The axis's upper end: a tick step above the largest value, and at least 1.5."""
    largest = max(b.value for b in bars)
    half = max(1.5, (int(largest * 2) + 1) / 2)
    if half <= 5:
        return half
    step = _tick_step(largest)
    return (int(largest / step) + 1) * step


def render_svg(bars: list[Bar], title: str, subtitle: str = "", reference: float | None = 1.0,
               reference_label: str = "1.0 = as fast", value_format: str = "{:.2f}x", label_w: int = LABEL_W) -> str:
    """The chart as SVG text, a dashed line at ``reference`` (None: none); every bar
    carries a ``<title>`` naming its label and its value, written by ``value_format``;
    ``label_w``: the labels' column, in px."""
    if not bars:
        raise ValueError("no ratios to draw: run scripts/bench.py with the page's cases and --json")
    top = _scale(bars)
    width = label_w + BAR_W + VALUE_W
    height = TOP + ROW_H * len(bars) + BOTTOM
    x0 = label_w

    def x(value: float) -> float:
        return round(x0 + BAR_W * value / top, 1)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="10" y="22" {FONT} font-weight="bold">{escape(title)}</text>',
        f'<text x="10" y="40" {FONT} fill="#555555">{escape(subtitle)}</text>',
    ]
    for i, bar in enumerate(bars):
        y = TOP + i * ROW_H
        mid = y + BAR_H / 2 + 4
        name, value = bar.label, value_format.format(bar.value)
        parts += [
            f'<text x="{x0 - 8}" y="{mid}" {FONT} text-anchor="end">{escape(name)}</text>',
            f'<rect x="{x0}" y="{y}" width="{round(x(bar.value) - x0, 1)}" height="{BAR_H}" fill="{COLOURS[bar.op]}">'
            f"<title>{escape(name)}: {escape(value)}</title></rect>",
            f'<text x="{x(bar.value) + 6}" y="{mid}" {FONT}>{escape(value)}</text>',
        ]
    axis_y = TOP + ROW_H * len(bars)
    parts.append(f'<line x1="{x0}" y1="{TOP - 4}" x2="{x0}" y2="{axis_y}" stroke="#333333"/>')
    step = _tick_step(top)
    ticks = [t * step for t in range(int(round(top / step)) + 1)]
    for tick in ticks:
        parts.append(f'<text x="{x(tick)}" y="{axis_y + 16}" {FONT} text-anchor="middle" '
                     f'fill="#555555">{tick:g}</text>')
    if reference is not None:
        parts += [
            f'<line x1="{x(reference)}" y1="{TOP - 4}" x2="{x(reference)}" y2="{axis_y}" stroke="#333333" '
            f'stroke-dasharray="4 3"><title>{escape(reference_label)}</title></line>',
            f'<text x="{x(reference) + 4}" y="{TOP - 8}" {FONT} fill="#333333">{escape(reference_label)}</text>',
        ]
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


class _Unknown(dict):
    """The JSON's top-level values for a subtitle; a missing one reads ``?``."""

    def __missing__(self, key: str) -> str:
        return "?"


def draw(chart: Chart, json_path: Path | None = None, out: Path | None = None) -> Path:
    """Reads ``json_path`` (default ``data/<page>.json``) and writes the chart to ``out``
    (default: the SVG next to the page); raises ``ValueError`` when it holds none of the
    chart's ratios."""
    json_path = json_path or DATA / f"{chart.page}.json"
    out = out or MEASUREMENTS / chart.svg
    payload = json.loads(json_path.read_text(encoding="utf-8"))
    subtitle = chart.subtitle.format_map(_Unknown(payload))
    out.write_text(render_svg(chart.bars(payload), chart.title, subtitle, chart.reference, chart.reference_label,
                              chart.value_format, chart.label_w),
                   encoding="utf-8")
    return out


def large_table(payload: dict) -> str:
    """The large case's times of a bench JSON as a Markdown table, the chart's ratios' source."""
    rows = [r for r in payload.get("results", []) if r["case"] == "large"]
    lines = ["| method | op | seconds | GB/s | peak extra RSS (MiB, max over ranks) |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['method']} | {r['op']} | {r['median_seconds']:.3f} | {r['gbps']:.2f} | "
              f"{r['extra_rss'] / 2**20:.0f} |" for r in rows]
    return "\n".join(lines)


TABLES: dict[str, Callable[[dict], str]] = {"performance": large_table}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pages", nargs="*", metavar="PAGE",
                        help=f"the pages whose charts to redraw (default: all of {', '.join(CHARTS)})")
    parser.add_argument("--table", choices=sorted(TABLES), help="print this page's table instead")
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.pages) - set(CHARTS)):
        parser.error(f"no chart for {unknown}: the pages with one are {', '.join(CHARTS)}")
    if args.table:
        print(TABLES[args.table](json.loads((DATA / f"{args.table}.json").read_text(encoding="utf-8"))))
        return
    for page in args.pages or CHARTS:
        print(f"wrote {draw(CHARTS[page])}")


if __name__ == "__main__":
    main()
