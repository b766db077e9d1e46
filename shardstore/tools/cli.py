"""The ``shardstore`` command: inspect, verify, convert and diff checkpoints.

Exit status: 0 success (``verify``: no damage; ``diff``: identical), 1 a finding
(``verify``: damage; ``diff``: differences), 2 an error (no checkpoint there, an
incomplete one or another tool's, a bad argument), with one line on standard error that says
what to do, in the command's own words (``CLI_WORDS``: ``--overwrite``, not the
library's ``overwrite=True``), and 141 (``EXIT_CLOSED_OUTPUT``, as for a program that
SIGPIPE ended) when standard output is closed before the output is written whole
(``shardstore inspect CKPT | head -1``), without a word. Every command that reports takes
``--json``: one JSON document on standard output, also on failure
(``{"error": "...", "exit_status": 2}``; an unexpected error, a bug, exits 2 too, its
traceback on standard error). Progress bars (standard error) show when it is a terminal
(``--progress`` / ``--no-progress`` decide otherwise); ``-v`` logs each operation's
duration and bytes, ``-vv`` each stage's.
"""

from __future__ import annotations

__all__ = ["EXIT_CLOSED_OUTPUT", "EXIT_ERROR", "EXIT_FINDING", "main", "parse_size"]

import io
import json
import logging
import os
import re
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any, NoReturn

import click

from shardstore.errors import CheckpointingException
from shardstore.progress import format_bytes, progress_shown

if TYPE_CHECKING:
    from shardstore.tools.inspection import RootSummary

EXIT_FINDING = 1
EXIT_ERROR = 2
EXIT_CLOSED_OUTPUT = 128 + signal.SIGPIPE
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)  # "i" only after a unit letter
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """``5GB`` (10^9), ``1GiB`` (2^30), ``500MB``, ``4096``: a size in bytes."""
    match = _SIZE.match(text)
    if not match:
        raise click.BadParameter(f"{text!r} is not a size (e.g. 5GB, 1GiB, 4096)")
    unit = (match.group(2) or "").lower()
    return int(float(match.group(1)) * _UNITS[unit])


class Size(click.ParamType):
    name = "size"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        return value if isinstance(value, int) else parse_size(str(value))


# The library's phrases that name its keyword arguments, and what a user of the command
# does instead; most specific first.
CLI_WORDS = (
    ("save this one again (overwrite=True) or to a new directory",
     "run the command again with --overwrite, or convert into a new directory"),
    ("pass overwrite=True to replace it", "pass --overwrite to replace it"),
    ("or save to a new directory", "or convert into a new directory"),
    ("If you trust this checkpoint, admit it with", "If you trust this checkpoint, in Python admit it with"),
    ("load with common_strategy=", "load with shardstore.load(..., common_strategy="),
    ("(allow_unsafe_pickle=True).", "(allow_unsafe_pickle=True)); the shardstore command runs no code from a file."),
)


def in_cli_words(message: str) -> str:
    """``message`` as one line, with the library's keyword arguments replaced by the
    command's flags (or by what to do in Python where the command has none). The
    command is one process, whose errors the stages raise as they are
    (``protocol.stage``), with no rank to name."""
    for library, cli in CLI_WORDS:
        message = message.replace(library, cli)
    return " ".join(line.strip() for line in message.splitlines())


class CommandError(click.ClickException):
    """An error the command reports in one line on stderr (and, with ``--json``, as a
    JSON document on stdout: ``ShardstoreGroup.invoke``), with exit status 2."""

    exit_code = EXIT_ERROR

    def show(self, file: Any = None) -> None:
        click.echo(f"shardstore: error: {self.format_message()}", err=True)


@contextmanager
def _reported_errors() -> Iterator[None]:
    """Turns the library's errors into a ``CommandError`` in the command's words. Nothing
    in such a block writes to stdout, so a ``BrokenPipeError`` there is the storage's."""
    try:
        yield
    except (CheckpointingException, OSError) as exc:
        raise CommandError(in_cli_words(str(exc))) from exc


class ShardstoreGroup(click.Group):
    """The ``shardstore`` command group: every command's failure is a JSON document
    when it was asked for ``--json``, and a closed standard output ends it quietly with
    ``EXIT_CLOSED_OUTPUT`` (module docstring)."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        _retry_short_writes_to_stdout()
        return super().main(*args, **kwargs)

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        with _quiet_when_output_closes():  # --help and --version write here
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: click.Context) -> Any:
        as_json = "--json" in ctx.args  # the subcommand's arguments, not parsed yet
        with _quiet_when_output_closes():
            try:
                return super().invoke(ctx)
            except click.ClickException as exc:  # ours and click's usage errors
                if as_json:
                    _echo_json({"error": exc.format_message(), "exit_status": exc.exit_code})
                raise
            except (BrokenPipeError, click.exceptions.Exit, click.Abort):  # no failure, or not one to print
                raise
            except Exception as exc:  # a bug: not a finding, whatever it is
                _unexpected_error(exc, as_json)


def _unexpected_error(exc: Exception, as_json: bool) -> NoReturn:
    """Ends a command that failed with an error shardstore did not foresee (a bug): its
    traceback on standard error and ``EXIT_ERROR``. Left to Python, it exited 1, which
    means a finding (``verify``: damage), and a script may answer that by deleting a
    checkpoint that was never found damaged."""
    if as_json:
        _echo_json({"error": f"unexpected {type(exc).__name__}: {exc}", "exit_status": EXIT_ERROR})
    traceback.print_exception(exc, file=sys.stderr)
    click.echo(
        f"shardstore: unexpected {type(exc).__name__} (a bug in shardstore, not a finding about the checkpoint; "
        "please report it with the traceback above)", err=True,
    )
    sys.exit(EXIT_ERROR)


@contextmanager
def _quiet_when_output_closes() -> Iterator[None]:
    """Exits with ``EXIT_CLOSED_OUTPUT`` and no message when writing stdout finds its
    reader gone (``| head``), before click's own handler (exit status 1, a finding's)."""
    try:
        yield
    except BrokenPipeError:
        _exit_as_closed_output()


def _retry_short_writes_to_stdout() -> None:
    """Python run unbuffered (``PYTHONUNBUFFERED``, ``-u``) writes stdout through a raw
    file whose text layer ignores a short write: when the reader closes the pipe in the
    middle of one, the rest of the output is dropped and the command exits 0. A buffered
    writer (over the same descriptor, which it does not close) writes the rest or raises
    ``BrokenPipeError``; ``click.echo`` flushes each line it writes anyway."""
    if isinstance(getattr(sys.stdout, "buffer", None), io.RawIOBase):
        sys.stdout = open(  # noqa: SIM115  (stdout for the rest of the process)
            sys.stdout.fileno(), "w", encoding=sys.stdout.encoding, errors=sys.stdout.errors, closefd=False
        )


def _exit_as_closed_output() -> NoReturn:
    """Exits with ``EXIT_CLOSED_OUTPUT``, stdout pointed at ``/dev/null`` first so that
    flushing what is left of the output at exit raises nothing (Python's own advice for
    SIGPIPE)."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):  # an in-memory stream (click's test runner)
        descriptor = None
    if descriptor is not None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, descriptor)
        os.close(devnull)
    sys.exit(EXIT_CLOSED_OUTPUT)


def package_version() -> str:
    """The installed shardstore's version; "unknown" when run from a source tree that is
    not installed. (``shardstore.format.records`` knows it too, but importing that loads torch.)"""
    try:
        return version("shardstore")
    except PackageNotFoundError:
        return "unknown"


def _echo_json(document: Any) -> None:
    click.echo(json.dumps(document, indent=1))


@click.group(cls=ShardstoreGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_version(), "--version", prog_name="shardstore", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", count=True, help="Log stages (-v) and details (-vv) to stderr.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bars on stderr (default: when stderr is a terminal).")
@click.pass_context
def main(ctx: click.Context, verbose: int, progress: bool | None) -> None:
    """Inspect, verify, convert and compare shardstore checkpoints (local paths or s3://)."""
    if verbose:
        ctx.with_resource(_shardstore_logged(logging.DEBUG if verbose > 1 else logging.INFO))
    ctx.with_resource(progress_shown(sys.stderr.isatty() if progress is None else progress))


@contextmanager
def _shardstore_logged(level: int) -> Iterator[None]:
    """Logs the ``shardstore`` logger's records from ``level`` on to standard error, for
    the command's run. Its logger alone: the root logger's level would turn on every
    library's, and botocore's DEBUG logs every request's headers, an AWS session token
    included, hundreds of lines for one small checkpoint."""
    log = logging.getLogger("shardstore")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    previous = log.level
    log.addHandler(handler)
    log.setLevel(level)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(previous)


# --------------------------------------------------------------------------- inspect


@main.command("inspect")
@click.argument("checkpoint")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def inspect_command(checkpoint: str, as_json: bool) -> None:
    """What CHECKPOINT holds: arrays, sharded objects, common state, format. Given a run
    root (a directory of checkpoints, such as a manager's iter_* steps): its checkpoints."""
    from shardstore.tools.inspection import describe_checkpoint, describe_root

    with _reported_errors():
        root = describe_root(checkpoint)
        summary = describe_checkpoint(checkpoint) if root is None else None
    if root is not None:
        _echo_root(root, as_json)
        return
    assert summary is not None
    if as_json:
        _echo_json(summary.to_json())
        return
    click.echo(f"checkpoint {summary.checkpoint}")
    if summary.kind == "shardstore":
        click.echo(
            f"  format {summary.format_version}, written by shardstore {summary.library_version} from "
            f"{summary.world_size} rank(s), committed {_commit_time(summary.created)}, save {summary.save_id}"
        )
        click.echo(f"  requires {', '.join(summary.requires) if summary.requires else 'no feature beyond the base format'}")
        if summary.layout:
            click.echo(f"  layout {summary.layout}")
        if summary.reused_from:
            shared = summary.reused_from
            click.echo(
                f"  reuses {shared['chunks']} chunk(s), {format_bytes(shared['bytes'])}, unchanged since "
                f"{shared['checkpoint']} (save {shared['save_id']}): shared, not written again; the checkpoint "
                "stands alone"
            )
    else:
        from shardstore.other_formats import named

        click.echo(f"  written by another tool: {named(summary.kind).title}, read as it is; "
                   "no checksums to verify (`shardstore convert` it for those)")
    click.echo(f"arrays: {len(summary.arrays)}, {format_bytes(summary.nbytes)}")
    width = max((len(a.key) for a in summary.arrays), default=0)
    for a in summary.arrays:
        chunking = f"chunks {_dims(a.chunk_shape)} x{a.chunks}" if a.chunk_shape or not a.shape else f"{a.chunks} chunk(s)"
        packed = f"  in {a.pack}" if a.pack else ""
        click.echo(f"  {a.key:<{width}}  {_dims(a.shape):<16} {a.dtype:<14} {chunking}  {format_bytes(a.nbytes)}{packed}")
    click.echo(f"sharded objects: {len(summary.objects)}")
    for key, shards in summary.objects.items():
        click.echo(f"  {key}  {len(shards)} shard(s)")
    click.echo(f"common state: {', '.join(summary.common_keys) or '(empty)'}")


main.add_command(inspect_command, "ls")


def _echo_root(root: RootSummary, as_json: bool) -> None:
    """``inspect`` of a run root: one line per checkpoint under it, from its commit record."""
    if as_json:
        _echo_json(root.to_json())
        return
    readable = [entry.checkpoint for entry in root.checkpoints if not entry.error]
    shown = f"; `shardstore inspect {readable[-1]}` shows one's arrays" if readable else ""
    click.echo(f"run root {root.root}: {len(root.checkpoints)} checkpoint(s){shown}")
    width = max(len(entry.name) for entry in root.checkpoints)
    for entry in root.checkpoints:
        if entry.error:
            click.echo(f"  {entry.name:<{width}}  commit record does not read: {entry.error}")
            continue
        click.echo(f"  {entry.name:<{width}}  committed {_commit_time(entry.created)}, {entry.arrays} arrays, "
                   f"{format_bytes(entry.nbytes)}, {entry.world_size} rank(s), format {entry.format_version}, "
                   f"save {entry.save_id}")
    if root.leftovers:
        click.echo(f"  left by interrupted saves (not checkpoints): {', '.join(root.leftovers)}")


def _commit_time(created: float) -> str:
    """``2026-11-23 08:57:02 UTC``, or ``at an unknown time`` where the record's
    (informational) time is none or no date (``time.gmtime`` refuses it)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(created)) if created else "at an unknown time"
    except (OverflowError, OSError, ValueError):
        return "at an unknown time"


def _dims(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


# --------------------------------------------------------------------------- verify


@main.command("verify")
@click.argument("checkpoint")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def verify_command(checkpoint: str, as_json: bool) -> None:
    """Read every chunk and file of CHECKPOINT and check its checksums.

    CHECKPOINT may also be a root holding checkpoints (a checkpoint manager's directory,
    a run's iter_* directories): each is verified, and a damaged file that several of
    them share (incremental saves hard-link unchanged chunks) is named once, with every
    checkpoint that holds it.

    Exit status 1 and one line per problem (array and chunk) if anything is damaged,
    the commit record included.
    """
    from shardstore.format import is_committed, read_commit_record, verify
    from shardstore.opened import bare_location
    from shardstore.other_formats import detect  # noqa: F401  (importing the registry lets read_commit_record's errors name other formats)
    from shardstore.tools.root_verify import (
        entries_under,
        holds_commit_record,
        refuse_unreadable_version,
        verify_checkpoints,
    )

    with _reported_errors():
        location = bare_location(checkpoint)
        found, leftovers = ({}, ()) if is_committed(location) else entries_under(location)
        if found or leftovers:  # a root: of checkpoints, or only of what interrupted saves left
            root_report = verify_checkpoints(location.describe(), found, leftovers=leftovers)
        else:
            if holds_commit_record(location):  # a damaged record is a finding, as under a root
                refuse_unreadable_version(location)
            else:
                read_commit_record(location)  # no checkpoint at all is an error, not a finding
            report = verify(location)
    if found or leftovers:
        _report_root(root_report, as_json)
    if as_json:
        _echo_json({**asdict(report), "ok": report.ok})
        sys.exit(0 if report.ok else EXIT_FINDING)
    for problem in report.problems:
        click.echo(f"{problem.key} [{problem.part}]: {problem.message}")
    click.echo(
        f"{report.checkpoint}: {report.arrays_checked} arrays, {report.chunks_checked} chunks, "
        f"{report.files_checked} files, {format_bytes(report.bytes_checked)} checked; {report.not_ours_note}"
        + ("no problems" if report.ok else f"{len(report.problems)} problem(s)")
    )
    sys.exit(0 if report.ok else EXIT_FINDING)


def _report_root(report: Any, as_json: bool) -> NoReturn:
    """Prints a ``tools.root_verify.RootVerifyReport`` and exits (1 when damaged)."""
    if as_json:
        _echo_json({"root": report.root, "ok": report.ok, "damage": [asdict(d) for d in report.damage],
                    "leftovers": list(report.leftovers),
                    "checkpoints": {name: {**asdict(r), "ok": r.ok} for name, r in report.reports.items()}})
    else:
        for name, single in report.reports.items():
            click.echo(f"{name}: {'no problems' if single.ok else f'{len(single.problems)} problem(s)'}")
        click.echo(str(report))
    sys.exit(0 if report.ok else EXIT_FINDING)


# --------------------------------------------------------------------------- convert

FORMATS = ("shardstore", "torch", "safetensors")


def target_format(source_kind: str, destination: str, to: str | None) -> str:
    """The format to write: ``--to``, else what DESTINATION's name says (``*.pt``,
    ``*.pth``, ``*.bin``: torch), else a shardstore checkpoint (from another format).
    A name that says another format than ``--to`` is refused, saying what to name it."""
    from shardstore.tools.convert import TORCH_SUFFIXES

    named = "torch" if destination.endswith(TORCH_SUFFIXES) else None
    named = "safetensors" if destination.endswith(".safetensors") else named  # a file: we write a directory
    chosen = to or named
    if chosen is None and source_kind == "shardstore":
        raise CheckpointingException(
            f"Say what to convert {destination} to: --to torch (a file named *.pt) or --to safetensors (a directory)"
        )
    chosen = chosen or "shardstore"
    stem = re.sub(r"(\.pt|\.pth|\.bin|\.safetensors)?/*$", "", destination) or destination
    if chosen == "torch" and named != "torch":
        raise CheckpointingException(
            f"--to torch writes one torch.save file, but {destination} is not named like one: name it {stem}.pt"
        )
    if chosen != "torch" and named is not None:
        what = ("a safetensors model directory (model.safetensors, or shards with model.safetensors.index.json)"
                if chosen == "safetensors" else "a shardstore checkpoint, a directory")
        instead = f" (or --to torch to write {destination})" if named == "torch" else ""
        raise CheckpointingException(
            f"{destination} is named like a file, but the conversion writes {what}: name a directory, "
            f"e.g. {stem}/{instead}"
        )
    return chosen


def _check_destination(destination: str, target: str, overwrite: bool) -> None:
    """Refuses what the writers of a file or directory do not do: S3, replacing."""
    if target == "shardstore":
        return
    from shardstore.opened import bare_location

    if not bare_location(destination).capabilities.is_local_filesystem:
        raise CheckpointingException(
            f"{destination}: torch.save files and safetensors directories are written to local paths only"
        )
    if overwrite:
        raise CheckpointingException(
            f"--overwrite replaces a shardstore checkpoint; a conversion never replaces a {target} output: "
            f"remove {destination} yourself or choose a new path"
        )


@main.command("convert")
@click.argument("source")
@click.argument("destination")
@click.option("--to", type=click.Choice(FORMATS), help="Target format (default: from the paths).")
@click.option("--overwrite", is_flag=True, help="Replace a shardstore checkpoint at DESTINATION.")
@click.option("--max-shard-size", type=Size(), default="5GB", show_default=True,
              help="Largest safetensors file.")
@click.option("--memory", type=Size(), default="1GiB", show_default=True,
              help="Most array bytes held at once while reading a checkpoint.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def convert_command(source: str, destination: str, to: str | None, overwrite: bool, max_shard_size: int,
                    memory: int, as_json: bool) -> None:
    """Convert SOURCE into DESTINATION.

    \b
    SOURCE: a shardstore checkpoint, a PyTorch DCP or Megatron-Core torch_dist / zarr
    checkpoint, a torch.save file, or safetensors (a file or a model directory).
    DESTINATION, in the format --to names, or its name says:
      a torch.save file: DESTINATION *.pt, *.pth or *.bin (or --to torch)
      a safetensors model directory: --to safetensors (sharded by --max-shard-size)
      a shardstore checkpoint (directory): the default from any other format
    A checkpoint written here is verified before the command succeeds; a failed
    conversion leaves nothing at DESTINATION.
    """
    from shardstore.opened import bare_location
    from shardstore.tools import convert

    with _reported_errors():
        source_location = bare_location(source)
        src = convert.source_kind(source_location)
        dst = target_format(src, destination, to)
        # before what the destination's kind says
        convert.refuse_destination_inside(source_location, bare_location(destination))
        _check_destination(destination, dst, overwrite)
        if src == dst and src != "safetensors":  # safetensors to safetensors: sharded anew
            what = "a shardstore checkpoint" if src == "shardstore" else "a torch.save file"
            raise CheckpointingException(f"{source} is {what} already; convert it into another format")
        if dst == "torch":
            result = convert.to_torch_file(source, destination, memory)
        elif dst == "safetensors":
            result = convert.to_safetensors(source, destination, max_shard_size, memory)
        else:
            result = convert.import_checkpoint(source, destination, overwrite)
    if dst == "shardstore":
        _report_checkpoint(source, src, destination, result, as_json)
    else:
        _report_export(source, src, destination, dst, result, as_json)


def _report_export(source: str, src: str, destination: str, dst: str, result: Any, as_json: bool) -> None:
    if as_json:
        _echo_json({"source": source, "source_format": src, "destination": destination, "format": dst,
                    **asdict(result)})
        return
    click.echo(f"wrote {result.tensors} tensors, {format_bytes(result.total_bytes)}, to {destination}"
               + (f" in {len(result.files)} file(s)" if dst == "safetensors" else ""))
    if result.left_out:
        click.echo(f"left out (safetensors holds tensors and JSON values, not sharded objects nor other Python objects): {', '.join(result.left_out)}", err=True)


def _report_checkpoint(source: str, src: str, destination: str, arrays: int, as_json: bool) -> None:
    """Verifies the checkpoint just written (exit status 1 if it is damaged)."""
    from shardstore.format import verify

    report = verify(destination)
    if as_json:
        _echo_json({"source": source, "source_format": src, "destination": destination, "format": "shardstore",
                    "tensors": arrays, "verify": {**asdict(report), "ok": report.ok}})
    elif report.ok:
        click.echo(f"wrote {arrays} arrays to {destination}; verified {report.chunks_checked} chunks")
    else:
        click.echo(str(report), err=True)
    if not report.ok:
        sys.exit(EXIT_FINDING)


# --------------------------------------------------------------------------- diff


@main.command("restore")
@click.argument("checkpoint")
def restore_command(checkpoint: str) -> None:
    """Put back the checkpoint at CHECKPOINT that a save was replacing, beside other
    programs' files, when it was interrupted (the next save into CHECKPOINT does it
    first). Exit status 0 when one was put back or there was nothing to do; 2 when
    CHECKPOINT does not exist (a mistyped path is not "nothing to do")."""
    from shardstore.format import restore_replaced
    from shardstore.opened import bare_location

    with _reported_errors():
        location = bare_location(checkpoint)
        restored = restore_replaced(location)
        local = location.local_path()
        if not restored and (not local.exists() if local is not None else location.is_empty()):
            raise CommandError(f"{checkpoint} does not exist: nothing to put back there; check the path")
    click.echo(f"put back the checkpoint at {checkpoint}" if restored else f"nothing to put back at {checkpoint}")


@main.command("diff")
@click.argument("first")
@click.argument("second")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option("--memory", type=Size(), default="1GiB", show_default=True,
              help="Most array bytes held at once per checkpoint.")
def diff_command(first: str, second: str, as_json: bool, memory: int) -> None:
    """Compare everything two checkpoints load: arrays (keys, shapes, dtypes, values bit
    for bit), sharded objects and the common state.

    One line per difference, naming the array, the object shard or the common-state
    path. Exit status 0 when identical, 1 when they differ.
    """
    from shardstore.tools.inspection import ONLY_IN_FIRST, ONLY_IN_SECOND, diff_checkpoints

    with _reported_errors():
        result = diff_checkpoints(first, second, memory)
    if as_json:
        _echo_json(result.to_json())
    else:
        for key in result.only_in_first:
            click.echo(f"- {key}  (only in {first})")
        for key in result.only_in_second:
            click.echo(f"+ {key}  (only in {second})")
        for a in result.arrays:
            if not a.identical:
                click.echo(f"~ {a.key}  {a.describe()}")
        names = {ONLY_IN_FIRST: ("-", f"(only in {first})"), ONLY_IN_SECOND: ("+", f"(only in {second})")}
        for part, differences in (("object", result.object_differences), ("common state", result.common_differences)):
            for d in differences:
                sign, change = names.get(d.change, ("~", d.change))
                click.echo(f"{sign} {part} {d.path}  {change}")
        click.echo("identical" if result.identical else "checkpoints differ")
    sys.exit(0 if result.identical else EXIT_FINDING)


if __name__ == "__main__":
    main()
