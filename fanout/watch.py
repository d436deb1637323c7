"""Live progress of a run on a terminal: counts per status, rate, ETA and why items wait.

Rendering is rich's: on a TTY one line fitted to the terminal's width and redrawn in place;
elsewhere (a log, a pipe) the same line as plain text, once per interval.
"""

from __future__ import annotations

import time
from typing import IO, cast

from django.core.management.base import OutputWrapper
from rich.console import Console
from rich.live import Live
from rich.progress import (
    BarColumn,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as Bar
from rich.table import Column

from .models import ItemStatus
from .report import Snapshot

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
    """Redraws one line in place on a TTY; elsewhere prints a plain line every ``every`` s."""

    def __init__(
        self, out: OutputWrapper, isatty: bool, every: float = 2.0, width: int | None = None
    ) -> None:
        self.console = Console(
            file=cast(IO[str], _Stream(out)),
            force_terminal=isatty,
            force_interactive=isatty,
            width=width or (None if isatty else 100_000),  # a log's lines are never cut
            highlight=False,
        )
        self.isatty = isatty
        self.every = every
        self._last_print = float("-inf")
        self._last_line = ""
        # Only the last column (counts, why items wait) gives way when the line is too wide.
        fixed = Column(no_wrap=True)
        columns: list[ProgressColumn] = [
            TextColumn("{task.description}: {task.completed}/{task.total}", table_column=fixed),
            TextColumn("({task.percentage:.0f}%)", table_column=fixed),
        ]
        if isatty:
            columns.append(BarColumn(bar_width=20, table_column=fixed))
        columns += [
            TextColumn("{task.fields[rate]}", table_column=fixed),
            TimeRemainingColumn(table_column=fixed),
            TextColumn(
                "{task.fields[detail]}",
                markup=False,
                table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1),
            ),
        ]
        self.bar = Bar(*columns, console=self.console, auto_refresh=False, expand=isatty)
        self._task = self.bar.add_task("", total=None, rate="", detail="")
        self._live: Live | None = None

    def show(self, snap: Snapshot, final: bool = False) -> None:
        """Show ``snap``; ``final`` leaves the last line on the screen, once."""
        self._update(snap)
        if self.isatty:
            if self._live is None:
                self._live = Live(
                    self.bar, console=self.console, auto_refresh=False, transient=False
                )
                self._live.start()
            if final:
                self._live.stop()  # draws the last state once and ends the line
                self._live = None
            else:
                self._live.refresh()
            return
        now = time.monotonic()
        with self.console.capture() as line:
            self.console.print(self.bar.get_renderable())
        if (final and line.get() != self._last_line) or now - self._last_print >= self.every:
            self._last_print, self._last_line = now, line.get()
            self.console.file.write(line.get())

    def _update(self, snap: Snapshot) -> None:
        total = snap.total or snap.run.total_items
        detail = " ".join(f"{s.label.lower()} {snap.counts[s]}" for s in _ORDER if snap.counts[s])
        if snap.waiting:
            waits = ", ".join(f"{n} {why}" for why, n in snap.waiting.items())
            detail += f" | waiting: {waits}"
        if snap.why:
            detail += f" | {snap.why}"
        self.bar.update(
            self._task,
            description=f"run {snap.run.pk} {snap.run.status}",
            completed=snap.done,
            total=total,
            detail=detail,
        )
        speed = self.bar.tasks[0].speed
        self.bar.update(self._task, rate=f"{speed:.1f} items/s" if speed else "")
