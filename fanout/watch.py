"""Live progress of a run on a terminal: rate, ETA, what holds the run up, counts per status.

Rendering is rich's: on a TTY a line fitted to the terminal's width and redrawn in place, whose
reason wraps onto the lines below rather than being cut; elsewhere (a log, a pipe) the same
line as plain text, once per interval.
"""

from __future__ import annotations

import time
from typing import IO, cast

from django.core.management.base import OutputWrapper
from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.progress import BarColumn, ProgressColumn, TextColumn
from rich.progress import Progress as Bar
from rich.table import Column
from rich.text import Text

from . import report
from .models import ItemStatus
from .text import human_duration

_UNCUT = 100_000  # columns: wider than any line
_ORDER = (
    ItemStatus.SUCCEEDED,
    ItemStatus.FAILED,
    ItemStatus.RUNNING,
    ItemStatus.PENDING,
    ItemStatus.CANCELLED,
)


class _Stream:
    """A file for rich over a Django OutputWrapper, which would end every write with a newline."""

    def __init__(self, out: OutputWrapper) -> None:
        self.out = out

    def write(self, text: str) -> int:
        self.out.write(text, ending="")
        return len(text)

    def flush(self) -> None:
        self.out.flush()


class Progress:
    """Redraws its line in place on a TTY; elsewhere prints a plain line every ``every`` s."""

    def __init__(
        self, out: OutputWrapper, isatty: bool, every: float = 2.0, width: int | None = None
    ) -> None:
        self.console = Console(
            file=cast(IO[str], _Stream(out)),
            force_terminal=isatty,
            force_interactive=isatty,
            width=width or (None if isatty else _UNCUT),  # a log's lines are never cut
            highlight=False,
        )
        self.isatty = isatty
        self.every = every
        self._last_print = float("-inf")
        self._last_line = ""
        fixed = Column(no_wrap=True)
        columns: list[ProgressColumn] = [
            TextColumn("{task.description}: {task.completed}/{task.total}", table_column=fixed),
            TextColumn("({task.percentage:.0f}%)", table_column=fixed),
        ]
        if isatty:
            columns.append(BarColumn(bar_width=20, table_column=fixed))
        columns += [
            TextColumn("{task.fields[rate]}", table_column=fixed),
            TextColumn("{task.fields[eta]}", table_column=fixed),
        ]
        self.bar = Bar(*columns, console=self.console, auto_refresh=False)
        self._task = self.bar.add_task("", total=None, rate="", eta="")
        self._detail = ""
        self._live: Live | None = None

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """The bar's columns, then what holds the run up and the counts: one line where they
        fit; on a narrower terminal the text goes on below at the full width, never cut."""
        head = console.render_lines(
            self.bar.get_renderable(), options.update(width=_UNCUT), pad=False
        )[0]
        line = Text.assemble(*((s.text, s.style or "") for s in head if not s.control))
        line.rstrip()
        if self._detail:
            line.append(" " + self._detail)
        line.no_wrap, line.overflow = False, "fold"
        yield line

    def show(self, snap: report.Progress, final: bool = False) -> None:
        """Show ``snap``; ``final`` leaves the last line on the screen, once."""
        self._update(snap)
        if self.isatty:
            if self._live is None:
                self._live = Live(self, console=self.console, auto_refresh=False, transient=False)
                self._live.start()
            if final:
                self._live.stop()  # draws the last state once and ends the line
                self._live = None
            else:
                self._live.refresh()
            return
        now = time.monotonic()
        with self.console.capture() as line:
            self.console.print(self)
        if (final and line.get() != self._last_line) or now - self._last_print >= self.every:
            self._last_print, self._last_line = now, line.get()
            self.console.file.write(line.get())

    def _update(self, snap: report.Progress) -> None:
        total = snap.total or snap.run.total_items
        counts = " ".join(f"{s.label.lower()} {snap.counts[s]}" for s in _ORDER if snap.counts[s])
        self._detail = " | ".join(part for part in (*holds(snap), counts) if part)
        self.bar.update(
            self._task,
            description=f"run {snap.run.pk} {snap.run.status}",
            completed=snap.done,
            total=total,
        )
        speed = self.bar.tasks[0].speed
        self.bar.update(
            self._task, rate=f"{speed:.1f} items/s" if speed else "", eta=eta(snap, speed)
        )


def eta(snap: report.Progress, speed: float | None) -> str:
    """ "eta 3m 05s" at the recent speed, unless a pool's rate admits the pending items later:
    "eta 46m 12s (paced by pool payments)"; "" when nothing says yet."""
    seconds, pool = snap.eta(speed)
    if seconds is None:
        return ""
    return f"eta {human_duration(seconds)}" + (f" (paced by pool {pool})" if pool else "")


def holds(snap: report.Progress) -> list[str]:
    """What holds the run up, the limit that binds first: why its claimable items are not
    running (max_parallel, busy workers, a stall), then the held items per reason, the largest
    group first (a pool full or rate limited, a retry not yet due)."""
    out = [snap.why] if snap.why else []
    if snap.held_back:
        held = sorted(snap.held_back.items(), key=lambda reason_n: -reason_n[1])
        out.append("waiting: " + ", ".join(f"{n} {why}" for why, n in held))
    return out
