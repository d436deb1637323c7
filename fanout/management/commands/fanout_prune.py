"""manage.py fanout_prune: delete finished runs with their items, attempts and child runs."""

from __future__ import annotations

import json
import math
from argparse import ArgumentTypeError
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from fanout.errors import FanoutError
from fanout.models import TERMINAL_RUN_STATUSES
from fanout.prune import BATCH_ROWS, PAUSE_SECONDS, Pruned, parse_age, parse_statuses, prune
from fanout.text import plural


def _age(text: str) -> timedelta:
    try:
        return parse_age(text)
    except FanoutError as exc:
        raise ArgumentTypeError(str(exc)) from None


def _statuses(text: str) -> list[str]:
    try:
        return parse_statuses(text)
    except FanoutError as exc:
        raise ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < math.inf:  # NaN and infinity too: a rest that never ends
        raise ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _add_which_runs(parser: CommandParser) -> None:
    parser.add_argument(
        "--older-than",
        type=_age,
        required=True,
        metavar="AGE",
        help="How long ago a run (and every run of its tree) must have finished: "
        "30d, 12h, 90m, 45s or 2w. Required.",
    )
    parser.add_argument(
        "--status",
        type=_statuses,
        default=list(TERMINAL_RUN_STATUSES),
        metavar="S1,S2",
        help="Only roots that ended so, comma-separated. "
        f"Default: every finished status ({','.join(TERMINAL_RUN_STATUSES)}).",
    )
    parser.add_argument(
        "--definition", metavar="NAME", help="Only runs of this definition. Default: all."
    )


class Command(BaseCommand):
    help = (
        "Delete finished runs older than --older-than, with their items, attempt history and "
        "child runs. A tree goes with its root, never a part of it; open runs, runs with an "
        "open descendant and younger runs are never touched."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        _add_which_runs(parser)
        parser.add_argument(
            "--dry-run", action="store_true", help="Say what would go; delete nothing."
        )
        parser.add_argument(
            "--keep-runs",
            action="store_true",
            help="Keep the run rows (final counts, join result, timings); delete only their "
            "items and attempts. Default: delete the runs too.",
        )
        parser.add_argument(
            "--batch",
            type=_positive,
            default=BATCH_ROWS,
            help=f"Rows deleted per transaction (default {BATCH_ROWS}).",
        )
        parser.add_argument(
            "--pause",
            type=_seconds,
            default=PAUSE_SECONDS,
            metavar="SECONDS",
            help="Rest this long after each batch, so live runs keep their pace; 0 to prune "
            f"flat out (default {PAUSE_SECONDS:g}).",
        )
        parser.add_argument("--json", action="store_true", help="Print the report as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        pruned = prune(
            options["older_than"],
            options["status"],
            definition=options["definition"],
            dry_run=options["dry_run"],
            keep_runs=options["keep_runs"],
            batch=options["batch"],
            pause=options["pause"],
        )
        if options["json"]:
            self.stdout.write(json.dumps({"dry_run": options["dry_run"], **pruned.as_dict()}))
            return
        self.stdout.write(self._sentence(pruned, options["dry_run"], options["keep_runs"]))
        if pruned.held:
            self.stdout.write(
                f"skipped {plural(len(pruned.held), 'tree')} that another pruner is deleting "
                f"(runs {', '.join(map(str, pruned.held))})"
            )

    @staticmethod
    def _sentence(pruned: Pruned, dry_run: bool, keep_runs: bool) -> str:
        if not pruned.roots:
            return (
                "nothing pruned" if pruned.held else "nothing to prune: no finished run is that old"
            )
        verb = "would delete" if dry_run else "deleted"
        runs = "kept " + plural(pruned.runs, "run") if keep_runs else plural(pruned.runs, "run")
        statuses = ", ".join(f"{n} {s}" for s, n in sorted(pruned.by_status.items()))
        return (
            f"{verb} {plural(len(pruned.roots), 'tree')} ({statuses}): {runs}, "
            f"{plural(pruned.items, 'item')}, {plural(pruned.attempts, 'attempt')}"
        )
