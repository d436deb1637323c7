"""manage.py run_fanout: start, resume or retry a fan-out run and watch it finish."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import InterfaceError, OperationalError, connection

from fanout.actions import cancel_run, check_retryable, release, retry_failed
from fanout.checks import DRIFT_SAID_BY_COMMAND, pools_named_by
from fanout.definition import EXECUTORS, FanOut, get_definition, registered
from fanout.dispatch import dispatch, prepare_run
from fanout.errors import EmptyWorkList, FanoutError
from fanout.materialize import materialize
from fanout.models import BatchRun, CapacityPool, ItemStatus, RunStatus
from fanout.pools import settings_drift
from fanout.report import final_report, snapshot
from fanout.supervise import tend
from fanout.watch import Progress

T = TypeVar("T")

# Exit codes besides 0 (succeeded) and 2 (a usage error); docs/run-fanout.md has the table.
EXIT_FAILED = 1  # failed, cancelled, compensation failed, or interrupted
EXIT_EMPTY = 3  # the work list was empty and the definition refuses that
EXIT_COMPENSATED = 4  # the run failed or was cancelled, and what succeeded was undone
_EXIT_BY_STATUS = {RunStatus.COMPENSATED: EXIT_COMPENSATED}


class RunEnded(CommandError):
    """How a run ended, other than succeeded: said in a plain line with its exit code, since
    the command itself did not break (callers of call_command still get a CommandError)."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def param(text: str) -> tuple[str, str]:
    """key=value, the value kept as text until the definition says how to read it."""
    name, sep, raw = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not of the form key=value")
    return name.strip(), raw


def spend_limit(text: str) -> tuple[str, float]:
    """unit=amount, e.g. usd=20 or tokens=2000000."""
    unit, sep, raw = text.partition("=")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not sep or not unit.strip() or not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not of the form unit=amount (usd=20)")
    return unit.strip(), value


def read_params(definition: FanOut, given: list[tuple[str, str]]) -> dict[str, Any]:
    """Keep a param declared ``str`` as the exact text given; read the others as JSON
    when they parse as JSON (42, true, [1]), else as text."""
    declared = definition.params or {}
    params: dict[str, Any] = {}
    for name, raw in given:
        spec = declared.get(name)
        if (spec[0] if isinstance(spec, tuple) else spec) is str:
            params[name] = raw
            continue
        try:
            params[name] = json.loads(raw)
        except ValueError:
            params[name] = raw
    return params


class Command(BaseCommand):
    help = (
        "Run a fan-out registered in a fanouts.py (see --list): create the run, or find the "
        "one with the same run key, dispatch its items, show progress and report every "
        "outcome. Exit status: 0 succeeded, 1 failed, cancelled or interrupted, 2 usage "
        "error, 3 empty work list refused, 4 compensated (docs/run-fanout.md)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        _add_what_to_run(parser)
        _add_how_to_run(parser)
        _add_an_existing_run(parser)

    def run_from_argv(self, argv: list[str]) -> None:
        self._from_argv = True
        super().run_from_argv(argv)

    def execute(self, *args: Any, **options: Any) -> Any:
        said = DRIFT_SAID_BY_COMMAND.set(True)  # the start line says a pool's drift
        try:
            return super().execute(*args, **options)
        except RunEnded as ended:
            if not getattr(self, "_from_argv", False):
                raise
            self.stderr.write(str(ended))
            sys.exit(ended.returncode)
        finally:
            DRIFT_SAID_BY_COMMAND.reset(said)

    def handle(self, *args: Any, **options: Any) -> None:
        if options["list"]:
            return self._list()
        if options["compensate"] and not options["cancel"]:
            raise CommandError("--compensate goes with --cancel RUN_ID", returncode=2)
        if options["cancel"]:
            return self._cancel(options["cancel"], options["json"], options["compensate"])
        run = self._start(options)
        notes = [_already_finished(run)] if run.is_terminal else []
        executor = options["executor"] or run.executor
        handle = self._dispatch(run, executor, options)
        if options["no_wait"]:
            self.stdout.write(
                str(run.pk) if not options["json"] else json.dumps({"run_id": run.pk})
            )
            return None
        progress = None if options["json"] else Progress(self.stdout, isatty=self.stdout.isatty())
        interrupted = self._watch(run, handle, executor, options["workers"], progress)
        report = final_report(run)
        if not sum(report["counts"].values()):
            notes.append("the work list was empty: 0 items")
        report["notes"] = notes
        if options["json"]:
            self.stdout.write(json.dumps(report, default=str))
        else:
            self._print_report(report)
        _end(run, report, executor, interrupted)
        return None

    def _start(self, options: dict[str, Any]) -> BatchRun:
        """The run to dispatch, its items written; a bad request is a usage error."""
        try:
            return self._prepare(options)
        except EmptyWorkList as exc:
            if options["json"]:  # scripts read one object, whatever the ending
                empty = {"run_id": None, "status": "empty", "error": str(exc)}
                self.stdout.write(json.dumps(empty))
            raise RunEnded(str(exc), returncode=EXIT_EMPTY) from None
        except FanoutError as exc:
            raise CommandError(str(exc), returncode=2) from None

    def _dispatch(self, run: BatchRun, executor: str, options: dict[str, Any]) -> Any:
        definition = get_definition(run.definition)
        for drift in _settings_drift(definition):
            self.stderr.write(
                f"{drift}: this run uses the row's limits "
                "(manage.py fanout_pools --sync applies FANOUT_POOLS)"
            )
        if executor == "inline" and options["no_wait"]:
            raise CommandError(
                "--no-wait needs --executor rq: inline workers live in this process", returncode=2
            )
        try:
            return dispatch(run, definition, executor, options["workers"])
        except FanoutError as exc:
            raise CommandError(str(exc), returncode=2) from None

    def _prepare(self, options: dict[str, Any]) -> BatchRun:
        if options["resume"] and options["retry_failed"]:
            raise FanoutError("give --resume or --retry-failed, not both")
        if options["resume"] or options["retry_failed"]:
            return self._again(options)
        if not options["name"]:
            raise FanoutError("name a definition to run (see run_fanout --list)")
        definition = get_definition(options["name"])
        return prepare_run(
            definition,
            read_params(definition, options["param"]),
            options["run_key"],
            executor=options["executor"] or "inline",
            max_parallel=options["max_parallel"],
            max_spend=dict(options["max_spend"]) or None,
        )

    def _again(self, options: dict[str, Any]) -> BatchRun:
        """The run named by --resume or --retry-failed, its failed items pending on the latter."""
        run_id = options["resume"] or options["retry_failed"]
        try:
            run = BatchRun.objects.get(pk=run_id)
        except BatchRun.DoesNotExist:
            raise FanoutError(f"there is no run {run_id}") from None
        if options["name"] and options["name"] != run.definition:
            raise FanoutError(
                f"run {run_id} is a run of {run.definition!r}, not {options['name']!r}"
            )
        definition = get_definition(run.definition)
        if options["retry_failed"]:
            check_retryable(run)
            count = retry_failed(run)
            self.stderr.write(f"run {run.pk}: {count} failed items back to pending")
        return materialize(run, definition)

    def _cancel(self, run_id: int, as_json: bool, compensate: bool = False) -> None:
        run = BatchRun.objects.filter(pk=run_id).first()
        if run is None:
            raise CommandError(f"there is no run {run_id}", returncode=2)
        if run.is_terminal:
            raise CommandError(f"run {run_id} is already {run.status}", returncode=2)
        try:
            cancelled = cancel_run(run, compensate=compensate)
        except FanoutError as exc:
            raise CommandError(str(exc), returncode=2) from None
        if compensate:
            self.stdout.write(
                f"run {run_id} compensating: {cancelled} pending items cancelled; its "
                "succeeded items are being undone (follow it with run_fanout --resume "
                f"{run_id})"
            )
            return
        running = run.items.filter(status=ItemStatus.RUNNING).count()
        if as_json:
            self.stdout.write(json.dumps(final_report(run), default=str))
            return
        self.stdout.write(
            f"run {run_id} cancelled: {cancelled} pending items cancelled; "
            f"{running} running items finish and are recorded"
        )

    def _watch(
        self,
        run: BatchRun,
        handle: Any,
        executor: str,
        workers: int | None,
        progress: Progress | None,
    ) -> bool:
        """Show progress until the run is finished; True if interrupted by Ctrl-C."""
        ctrl_c = _CtrlC(self.stderr, run, handle, executor)
        previous = signal.signal(signal.SIGINT, ctrl_c) if _main_thread() else None
        try:
            self._follow(run, handle, progress, ctrl_c)
        finally:
            if handle is not None:
                handle.shutdown()
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            if progress is not None:
                progress.show(snapshot(run), final=True)
        return ctrl_c.interrupted

    def _follow(
        self, run: BatchRun, handle: Any, progress: Progress | None, ctrl_c: _CtrlC
    ) -> None:
        last_tended = time.monotonic()
        while True:
            snap = self._unless_db_down(lambda: snapshot(run))
            if snap is None:
                continue
            if progress is not None:
                progress.show(snap)
            alive = handle is not None and handle.alive
            if (run.is_terminal or ctrl_c.interrupted) and not alive:
                break
            if time.monotonic() - last_tended > 2.0:
                # What every worker's supervisor does, sooner while someone watches: join
                # if the last worker died first, put back lost drain jobs (idempotent).
                self._unless_db_down(lambda: tend(run.pk))
                last_tended = time.monotonic()
            if alive:
                handle.join(timeout=0.5)
            else:
                # Workers elsewhere (RQ, or another parent) hold the last items.
                time.sleep(0.25)

    def _unless_db_down(self, op: Callable[[], T]) -> T | None:
        """Run ``op``; if the database is restarting, say so, wait a moment, return None."""
        try:
            return op()
        except (OperationalError, InterfaceError) as exc:
            self.stderr.write(f"database unavailable ({exc}); the run lives on, retrying")
            connection.close()
            time.sleep(1.0)
            return None

    def _print_report(self, report: dict[str, Any]) -> None:
        out = self.stdout
        out.write(
            f"run {report['run_id']} ({report['definition']}, key {report['run_key']}): "
            f"{report['status'].upper()}"
        )
        out.write("  " + "  ".join(f"{k} {v}" for k, v in report["counts"].items() if v))
        for note in report["notes"]:
            out.write(note)
        if report["failed"]:
            out.write(f"failed items ({len(report['failed'])}):")
            for f in report["failed"][:20]:
                out.write(f"  {f['key']}: {f['error']}")
            if len(report["failed"]) > 20:
                out.write(f"  ... and {len(report['failed']) - 20} more (see --json or the admin)")
        if report["error"]:
            out.write(f"error: {report['error'].strip().splitlines()[0]}")
        if report["join_result"] is not None:
            out.write("join result: " + json.dumps(report["join_result"], default=str)[:2000])

    def _list(self) -> None:
        definitions = registered()
        if not definitions:
            self.stdout.write(
                "no fan-outs registered (define them in an installed app's fanouts.py)"
            )
        for name, d in definitions.items():
            pool = d.static_pool or ("per item" if d.pool else "-")
            self.stdout.write(
                f"{name}: pool {pool}, max_parallel {d.max_parallel}, "
                f"max_attempts {d.max_attempts}, "
                f"failure_policy {d.failure_policy}, join_mode {d.join_mode} ({d.module})"
            )


class _CtrlC:
    """What Ctrl-C does while the command watches a run."""

    def __init__(self, stderr: Any, run: BatchRun, handle: Any, executor: str) -> None:
        self.stderr, self.run, self.handle, self.executor = stderr, run, handle, executor
        self.interrupted = False

    def __call__(self, signum: int, frame: Any) -> None:
        run, handle = self.run, self.handle
        if self.executor == "rq":
            # The run is the workers': this process only watched it. Say so and let go.
            self.interrupted = True
            self.stderr.write(
                f"\ndetached: the workers go on with run {run.pk}. Follow it with "
                f"run_fanout --resume {run.pk}, or stop it with run_fanout --cancel {run.pk}"
            )
            return
        if self.interrupted and handle is not None:
            # Second Ctrl-C: give the items back now instead of waiting for them.
            released = release(handle.keeper.held())
            self.stderr.write(
                f"\nreleased {released} running items; resume with run_fanout --resume {run.pk}"
            )
            os._exit(130)
        self.interrupted = True
        self.stderr.write("\nstopping: running items finish (Ctrl-C again to release them)")
        if handle is not None:
            handle.stop.set()


def _add_what_to_run(parser: CommandParser) -> None:
    parser.add_argument(
        "name",
        nargs="?",
        help="The fan-out to run, as registered in a fanouts.py (see --list). Not needed "
        "with --resume, --retry-failed or --cancel.",
    )
    parser.add_argument(
        "--param",
        action="append",
        type=param,
        default=[],
        metavar="KEY=VALUE",
        help="A run param; repeat for more. A param the definition declares as str "
        "keeps the exact text; other values are JSON when they parse as JSON, text "
        "otherwise. Default: none.",
    )
    parser.add_argument(
        "--run-key",
        metavar="KEY",
        help="Identity of the run: starting the same key again "
        "returns the same run. Default: the definition's name and params.",
    )
    parser.add_argument(
        "--max-parallel",
        type=positive_int,
        default=None,
        metavar="N",
        help="Items of a new run running at once (a resumed run keeps its own). "
        "Default: the definition's max_parallel.",
    )
    parser.add_argument(
        "--max-spend",
        type=spend_limit,
        action="append",
        default=[],
        metavar="UNIT=AMOUNT",
        help="A new run's budget, repeatable (--max-spend usd=20). Default: the definition's "
        "max_spend, if any.",
    )


def _add_how_to_run(parser: CommandParser) -> None:
    parser.add_argument(
        "--executor",
        choices=EXECUTORS,
        default=None,
        help="Where items run: 'inline' threads in this process, or 'rq' "
        "workers. Default: inline (or the run's own on --resume).",
    )
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=None,
        metavar="N",
        help="Worker threads (inline) or drain jobs (rq). Default: max_parallel, at most 16.",
    )
    parser.add_argument(
        "--no-wait",
        action="store_true",
        help="Return once dispatched, printing the run id (needs --executor rq). Default: "
        "wait, showing progress.",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="Print one JSON report at the end instead of text. Default: text.",
    )


def _add_an_existing_run(parser: CommandParser) -> None:
    for flag, says in (
        (
            "--resume",
            "Pick up an existing run (after Ctrl-C, a crash, or to follow an rq run): "
            "dispatch what remains and wait for its end.",
        ),
        ("--retry-failed", "Put the run's failed items back to pending and run them again."),
        (
            "--cancel",
            "Cancel the run: nothing more is claimed, pending items are cancelled, running "
            "ones finish and are recorded. Its child runs are cancelled too.",
        ),
    ):
        parser.add_argument(flag, type=positive_int, metavar="RUN_ID", help=says)
    parser.add_argument(
        "--compensate",
        action="store_true",
        help="With --cancel: undo the run's succeeded items with its definition's "
        "compensate= instead of leaving them. Default: off.",
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="List the registered fan-outs with their pool and limits, and exit.",
    )


def _end(run: BatchRun, report: dict[str, Any], executor: str, interrupted: bool) -> None:
    """Say how the run ended, by exit code, unless it succeeded."""
    if interrupted and executor == "rq":
        raise RunEnded(f"detached from run {run.pk}, which goes on", returncode=EXIT_FAILED)
    if interrupted:
        raise RunEnded(
            f"interrupted: run {run.pk} is {run.status}; pick it up with "
            f"run_fanout --resume {run.pk}",
            returncode=EXIT_FAILED,
        )
    if report["status"] != RunStatus.SUCCEEDED:
        raise RunEnded(
            f"run {run.pk} {report['status']}",
            returncode=_EXIT_BY_STATUS.get(report["status"], EXIT_FAILED),
        )


def _already_finished(run: BatchRun) -> str:
    when = f" at {run.finished_at:%Y-%m-%d %H:%M:%S %Z}" if run.finished_at else ""
    params = [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in run.params.items()]
    again = shlex.join([run.definition, *(a for p in params for a in ("--param", p))])
    return (
        f"run {run.pk} had already finished ({run.status}{when}): nothing was run again. "
        f"To start a fresh run, give it a new run key: run_fanout {again} --run-key NEW_KEY"
    )


def _settings_drift(definition: FanOut) -> list[str]:
    """How each pool the definition names differs from FANOUT_POOLS (the row wins)."""
    pools = CapacityPool.objects.filter(name__in=pools_named_by(definition)).order_by("name")
    return [drift for drift in map(settings_drift, pools) if drift]


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread() and sys.platform != "win32"
