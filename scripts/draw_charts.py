"""Draws the large case's throughput ratios from ``scripts/bench.py --json`` as an SVG.

One horizontal bar per ratio in the JSON's ``ratios`` table (``large.save.vs_dcp``
and the like): shardstore's throughput over PyTorch DCP, ``torch.save``/``torch.load``
and the raw disk, for saves and loads, with a dashed line at 1.0 (as fast as the peer).
A ratio missing from the run has no bar. The SVG is written by hand with the standard
library, so a rerun of the benchmark redraws it without a plotting package.

Usage::

    python scripts/bench.py --cases large --gib 0.5 --reps 2 --world 2 --json large.json
    python scripts/draw_charts.py large.json   # writes docs/measurements/large-ratios.svg
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

__all__ = ["Bar", "large_bars", "render_svg", "draw", "main"]

OUT = Path(__file__).resolve().parent.parent / "docs" / "measurements" / "large-ratios.svg"
PEERS = {
    "save": (("dcp", "DCP"), ("torch", "torch.save"), ("raw", "raw disk write")),
    "load": (("dcp", "DCP"), ("torch", "torch.load"), ("raw", "raw disk read")),
}
COLOURS = {"save": "#4c72b0", "load": "#dd8452"}

LABEL_W, BAR_W, VALUE_W = 170, 360, 70  # columns, in px
ROW_H, BAR_H, TOP, BOTTOM = 30, 18, 74, 34
FONT = 'font-family="sans-serif" font-size="13"'


@dataclass(frozen=True)
class Bar:
    """One ratio: shardstore's throughput over a peer's (above 1.0: shardstore is faster)."""

    label: str
    op: str  # "save" or "load": picks the bar's colour
    value: float


def large_bars(payload: dict) -> list[Bar]:
    """The large case's ratios of a bench JSON, saves first, in the order DCP, torch, raw."""
    ratios = payload.get("ratios", {})
    return [
        Bar(f"{op} vs {label}", op, float(ratios[key]))
        for op, peers in PEERS.items()
        for peer, label in peers
        if (key := f"large.{op}.vs_{peer}") in ratios
    ]


def _scale(bars: list[Bar]) -> float:
    """The axis's upper end: a half step above the largest value, and at least 1.5."""
    return max(1.5, (int(max(b.value for b in bars) * 2) + 1) / 2)


def render_svg(bars: list[Bar], title: str, subtitle: str = "") -> str:
    """The chart as SVG text; every bar carries a ``<title>`` naming its label and value."""
    if not bars:
        raise ValueError("no ratios to draw: run scripts/bench.py with the large case and --json")
    top = _scale(bars)
    width = LABEL_W + BAR_W + VALUE_W
    height = TOP + ROW_H * len(bars) + BOTTOM
    x0 = LABEL_W

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
        name = bar.label
        parts += [
            f'<text x="{x0 - 8}" y="{mid}" {FONT} text-anchor="end">{escape(name)}</text>',
            f'<rect x="{x0}" y="{y}" width="{round(x(bar.value) - x0, 1)}" height="{BAR_H}" fill="{COLOURS[bar.op]}">'
            f"<title>{escape(name)}: {bar.value:.2f}x</title></rect>",
            f'<text x="{x(bar.value) + 6}" y="{mid}" {FONT}>{bar.value:.2f}x</text>',
        ]
    axis_y = TOP + ROW_H * len(bars)
    parts.append(f'<line x1="{x0}" y1="{TOP - 4}" x2="{x0}" y2="{axis_y}" stroke="#333333"/>')
    ticks = [t / 2 for t in range(int(top * 2) + 1)]
    for tick in ticks:
        parts.append(f'<text x="{x(tick)}" y="{axis_y + 16}" {FONT} text-anchor="middle" '
                     f'fill="#555555">{tick:g}</text>')
    parts += [
        f'<line x1="{x(1.0)}" y1="{TOP - 4}" x2="{x(1.0)}" y2="{axis_y}" stroke="#333333" '
        f'stroke-dasharray="4 3"><title>1.0: as fast as the peer</title></line>',
        f'<text x="{x(1.0) + 4}" y="{TOP - 8}" {FONT} fill="#333333">1.0 = as fast</text>',
        "</svg>",
    ]
    return "\n".join(parts) + "\n"


def draw(json_path: Path, out: Path = OUT) -> Path:
    """Reads a bench JSON and writes its large-case chart to ``out``."""
    payload = json.loads(json_path.read_text(encoding="utf-8"))
    gib = payload.get("gib", "?")
    subtitle = (f"large case: {gib} GiB at {payload.get('world', '?')} ranks, medians of "
                f"{payload.get('reps', '?')} rounds; above 1.0 shardstore is faster")
    out.write_text(render_svg(large_bars(payload), "shardstore's throughput over each peer", subtitle),
                   encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path, help="the file scripts/bench.py --json wrote")
    parser.add_argument("--out", type=Path, default=OUT, help=f"the SVG to write (default: {OUT.name})")
    args = parser.parse_args(argv)
    print(f"wrote {draw(args.json, args.out)}")


if __name__ == "__main__":
    main()
