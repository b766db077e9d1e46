"""Counts of issue 31.1 (how many doors compose the save protocol themselves).

* ``open_location(`` calls outside its definition;
* imports by the doors (``shardstore/tools/``, ``shardstore/megatron.py``, PyTorch
  DCP's dialect ``shardstore/compat/dcp/``) of a module inside a package below the api
  (``from shardstore.format.records import ...``) rather than of the package, their
  entry (``from shardstore.format import ...``; issue 43.3);
* probes of location subclasses: ``getattr(<location>, "record", ...)`` and
  ``isinstance(<x>, <Location or a subclass>)`` (outside ``stores/``, which knows its own classes).

Run from the repository root: ``python scripts/count_doors.py`` prints each count over
every module (``--verbose``: every hit). Measured at the start of issue 31: 38, 15, 13;
after phase A: 28, 12, 2; after phase B (the DCP writer and reader and the Megatron
plug-in on ``SavePipeline``/``open_read``): 26, 10, 0; with one caller's-directory
composition (``ZarrSaveShardedStrategy.into_callers_directory``/``plan_into``), the DCP
writer speaking only the pipeline's vocabulary (``plan_gathered``, ``RankSave``) and dead
openings removed: 24, 4, 0; with the common-state readers opening a path through
``opened.read_location`` (checked against the record): 22, 4, 0; with every other door
reaching a caller's place through ``opened.bare_location`` (as it is) or
``opened.write_location`` (the seed's writers; a committed checkpoint refused): 7, 4, 0.
With the save's options one object (issue 43.1: ``SaveOptions.opened`` takes the opener):
6, 4, 0. The 6: the save pipeline's entries (``SavePipeline.open`` with the reuse source
through ``SaveOptions.opened``, ``into_callers_directory``),
``open_read`` and ``bare_location`` in ``opened``, and ``maybe_load_config`` (Megatron's
name) and ``verify``, public functions of the format layer that take a path. With
``open_read`` and the save pipeline's entries taking a Location (issue 66.1: a door
converts once, by ``bare_location``): 3. With Megatron-Core's ``maybe_load_config`` in
its dialect (``compat.megatron.core``, through ``bare_location``; the format reads the
config at a Location): 2. The count says which entry each call uses, not how many
conversions run (tests/test_entries.py pins the counts). The second count was then redefined (issue 43.3, as above; until then
it counted tools' imports of ``execution``, ``planning``, ``protocol`` and
``format.commit`` modules): 34 imports, 0 once every lower package's ``__init__`` offered
the doors' names.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "shardstore"
LOCATION_CLASSES = ("Location", "ChecksummedLocation", "PendingCheckpoint", "LocalStore", "S3Store", "MemoryStore",
                    "FsspecStore", "DirectoryPublishing")
OPEN_CALL = re.compile(r"\bopen_location\(")
DOORS = ("tools/", "megatron.py", "compat/dcp/")
TOOL_IMPORT = re.compile(
    r"^\s*(from|import) shardstore\.(stores|format|planning|protocol|execution|other_formats)\.\w")
PROBE = re.compile(
    r"getattr\([^,]+,\s*[\"']record[\"']|isinstance\([^,]+,\s*\(?(" + "|".join(LOCATION_CLASSES) + r")\b"
)


def counts(excluded: tuple[str, ...] = ()) -> dict[str, int]:
    found = {"open_location calls": 0, "tools imports of lower layers": 0, "location subclass probes": 0}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in excluded:
            continue
        for line in path.read_text().splitlines():
            if OPEN_CALL.search(line) and "def open_location" not in line:
                found["open_location calls"] += 1
            if rel.startswith(DOORS) and TOOL_IMPORT.match(line):
                found["tools imports of lower layers"] += 1
            if PROBE.search(line) and not rel.startswith("stores/"):
                found["location subclass probes"] += 1
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="list every hit")
    args = parser.parse_args()
    print("; ".join(f"{k} {v}" for k, v in counts().items()))
    if args.verbose:
        for path in sorted(ROOT.rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if (OPEN_CALL.search(line) and "def open_location" not in line) or (
                        rel.startswith(DOORS) and TOOL_IMPORT.match(line)) or (
                        PROBE.search(line) and not rel.startswith("stores/")):
                    print(f"  {rel}:{n}: {line.strip()}")


if __name__ == "__main__":
    main()
