"""scripts/house_metrics.py measures this tree (issue 43's before/after table)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _house_metrics():
    spec = importlib.util.spec_from_file_location("house_metrics", ROOT / "scripts" / "house_metrics.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_metrics_of_this_tree_count_what_is_there(capsys) -> None:
    house_metrics = _house_metrics()
    metrics = house_metrics.measure(ROOT)
    assert metrics.modules > 0 and metrics.lines > metrics.modules
    assert 0 < metrics.modules_with_all <= metrics.modules
    assert metrics.public_names > 0 and metrics.median_function_lines > 0
    assert "SavePipeline" in metrics.save_state_classes
    assert house_metrics.main(["--tree", str(ROOT)]) == 0
    printed = capsys.readouterr().out
    assert f"| modules | {metrics.modules} |" in printed
