"""Live progress of a run on a terminal: counts per status, rate, ETA and why items wait."""

from __future__ import annotations

import time
from typing import Any

from .models import ItemStatus
from .report import Snapshot

_ORDER = (
    ItemStatus.SUCCEEDED,
    ItemStatus.FAILED,
    ItemStatus.RUNNING,
    ItemStatus.PENDING,
    ItemStatus.CANCELLED,
)


class Progress:
    """Rewrites one line on a TTY; elsewhere prints a line every few seconds."""

    def __init__(self, out: Any, isatty: bool, every: float = 2.0) -> None:
        self.out = out
        self.isatty = isatty
        self.every = every
        self._last_print = 0.0
        self._first: tuple[float, int] | None = None
        self._width = 0

    def line(self, snap: Snapshot) -> str:
        now = time.monotonic()
        done = snap.done
        if self._first is None:
            self._first = (now, done)
        elapsed = now - self._first[0]
        rate = (done - self._first[1]) / elapsed if elapsed > 0.5 else 0.0
        total = snap.total or snap.run.total_items
        pct = 100.0 * done / total if total else 100.0
        parts = [f"run {snap.run.pk} {snap.run.status}: {done}/{total} ({pct:.0f}%)"]
        parts.append(
            " ".join(f"{s.label.lower()} {snap.counts[s]}" for s in _ORDER if snap.counts[s])
        )
        if rate > 0:
            remaining = total - done
            parts.append(f"{rate:.1f} items/s, ETA {_duration(remaining / rate)}")
        if snap.waiting:
            parts.append("waiting: " + ", ".join(f"{n} {why}" for why, n in snap.waiting.items()))
        return " | ".join(parts)

    def show(self, snap: Snapshot, final: bool = False) -> None:
        text = self.line(snap)
        if self.isatty:
            pad = max(0, self._width - len(text))
            self._width = len(text)
            self.out.write("\r" + text + " " * pad, ending="\n" if final else "")
            self.out.flush()
            return
        now = time.monotonic()
        if final or now - self._last_print >= self.every:
            self._last_print = now
            self.out.write(text)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
