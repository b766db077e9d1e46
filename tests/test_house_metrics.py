"""scripts/house_metrics.py measures this tree (issue 43's before/after table)."""

from __future__ import annotations

from pathlib import Path

from tests.script_support import load_script

ROOT = Path(__file__).resolve().parent.parent


def test_the_metrics_of_this_tree_count_what_is_there(capsys) -> None:
    house_metrics = load_script("house_metrics")
    metrics = house_metrics.measure(ROOT)
    assert metrics.modules > 0 and metrics.lines > metrics.modules
    assert 0 < metrics.modules_with_all <= metrics.modules
    assert metrics.public_names > 0 and metrics.median_function_lines > 0
    assert "SavePipeline" in metrics.save_state_classes
    assert house_metrics.main(["--tree", str(ROOT)]) == 0
    printed = capsys.readouterr().out
    assert f"| modules | {metrics.modules} |" in printed
