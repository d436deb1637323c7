"""manage.py fanout_runs: the runs console — what runs now, or one run close up."""

from __future__ import annotations

import json
import shutil
import time
from argparse import ArgumentTypeError
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import close_old_connections
from django.utils import timezone

from fanout.console import as_json, render_detail, render_lines, run_detail, runs_now
from fanout.errors import FanoutError
from fanout.prune import parse_age


def _age(text: str) -> timedelta:
    try:
        return parse_age(text)
    except FanoutError as exc:
        raise ArgumentTypeError(str(exc)) from None


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise ArgumentTypeError(f"must be above 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


class Command(BaseCommand):
    help = (
        "List open and recent runs (status, progress, rate, ETA, what they wait on), or with "
        "RUN_ID show one run's tree, pools and latest failures. --watch redraws it like top."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "run_id",
            nargs="?",
            type=int,
            help="Show this run close up: its child runs, the pools its items use and its "
            "latest failures. Default: list open and recent runs.",
        )
        parser.add_argument(
            "--since",
            type=_age,
            default=timedelta(hours=24),
            metavar="AGE",
            help="Also list runs finished this recently: 30m, 12h, 7d (default 24h).",
        )
        parser.add_argument(
            "--limit",
            type=_positive(int),
            default=30,
            metavar="N",
            help="Runs listed at most, open ones first (default 30).",
        )
        parser.add_argument(
            "--json",
            action="store_true",
            help="Print JSON instead of text, for scripts: a list of runs, or the one run.",
        )
        parser.add_argument(
            "--watch", action="store_true", help="Redraw every --interval seconds until Ctrl-C."
        )
        parser.add_argument(
            "--interval",
            type=_positive(float),
            default=2.0,
            metavar="SECONDS",
            help="Seconds between redraws with --watch (default 2).",
        )
        parser.add_argument(
            "--count",
            type=_positive(int),
            default=None,
            metavar="N",
            help="With --watch, stop after this many redraws (default: until Ctrl-C).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        tty = self.stdout.isatty()
        if not options["watch"]:
            self._show(options, tty, first=True)
            return
        shown = 0
        try:
            while True:
                self._show(options, tty, first=shown == 0)
                shown += 1
                if options["count"] is not None and shown >= options["count"]:
                    return
                time.sleep(options["interval"])
                close_old_connections()
        except KeyboardInterrupt:
            return

    def _show(self, options: dict[str, Any], tty: bool, first: bool) -> None:
        width = shutil.get_terminal_size((80, 24)).columns if tty else None
        if options["run_id"] is not None:
            detail = run_detail(options["run_id"])
            if detail is None:
                raise CommandError(f"no run {options['run_id']}", returncode=2)
            value: Any = detail
            lines = render_detail(detail, width)
        else:
            value = runs_now(options["since"], options["limit"])
            lines = render_lines(value, width) if value else ["no open or recent runs"]
        if options["json"]:
            self.stdout.write(json.dumps(as_json(value)))
            return
        if options["watch"]:
            if tty:  # redraw in place, like top
                self.stdout.write("\x1b[H\x1b[2J", ending="")
            elif not first:
                self.stdout.write("")
            self.stdout.write(f"-- {timezone.now():%H:%M:%S}")
        self.stdout.write("\n".join(lines))
