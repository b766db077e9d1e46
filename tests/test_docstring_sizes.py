"""Docstrings state a contract in a few lines: a class's at most 30 lines, a public
function's at most 120 words. The long contracts live in the guide pages.

``LONGER`` names the docstrings that are longer today; it may only shrink: a name on
it whose docstring now fits fails the test too, so that it leaves the list.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "shardstore"
MAX_CLASS_LINES = 30
MAX_FUNCTION_WORDS = 120

LONGER = {
    "execution/pipeline.py:SavePipeline",
    "format/records/commit_record.py:CommitRecord",
    "format/records/array_record.py:ArrayRecord",
    "engine/save.py:save",
    "engine/load.py:load",
    "stores/kv_chunks.py:share_from",
    "planning/plans/array_storage.py:in_block_sharded_record",
    "planning/plans/read_plans.py:plan_reads",
    "planning/plans/array_storage.py:sharded_record",
    "planning/plans/save_plans.py:plan_gathered_writes",
    "format/dtypes.py:cast_checked",
    "compat/megatron/entry_points.py:install",
    "compat/megatron/entry_points.py:save",
    "protocol/plan_stage.py:gather_and_plan",
    "protocol/stage.py:run_stage",
    "dict_utils.py:nest",
    "protocol/common_state.py:check_common_state_consistency",
    "format/records/names.py:check_key",
    "format/records/markers.py:own_markers",
    "format/records/commit_record.py:from_json",
    "format/chunks.py:write",
    "stores/base.py:share_from",
    "cross_rank_checks.py:validate_sharding_integrity",
    "other_formats/safetensors.py:write_safetensors",
    "compat/megatron/strategies/shard_exchange.py:distribute_shards_to_ranks",
    "format/sharding.py:read_boxes_into",
    "engine/zarr_strategies.py:remove_sharded_tensors",
}


def _too_long() -> set[str]:
    found = set()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                doc = ast.get_docstring(node, clean=False)
                if doc and len(doc.splitlines()) > MAX_CLASS_LINES:
                    found.add(f"{rel}:{node.name}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc.split()) > MAX_FUNCTION_WORDS:
                    found.add(f"{rel}:{node.name}")
    return found


def test_no_new_docstring_is_longer_than_a_contract() -> None:
    assert _too_long() - LONGER == set(), "state the contract in a few lines; the rest goes to the guide"


def test_the_list_of_longer_docstrings_only_shrinks() -> None:
    assert LONGER - _too_long() == set(), "these fit now: take them off LONGER"
