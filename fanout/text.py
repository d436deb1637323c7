"""How fanout words durations, rates, counts and errors for people: one formatter of each, for
the admin, run_fanout's progress and its reports alike."""

from __future__ import annotations

from datetime import timedelta


def human_duration(value: timedelta | float | None) -> str:
    """ "4.2s", "42s", "3m 05s", "2h 07m", "1d 04h": two units at most; "" for None."""
    if value is None:
        return ""
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds < 0:
        seconds = 0.0
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"


def precise_duration(value: timedelta | None) -> str:
    """A duration that may be under a second: "0.4ms", "35ms", "1.2s"; "" for None."""
    if value is None:
        return ""
    ms = value.total_seconds() * 1000
    if ms < 10:
        return f"{ms:.1f}ms"
    if ms < 1000:
        return f"{ms:.0f}ms"
    return human_duration(value)


def human_rate(rate: float | None) -> str:
    """Items per second with the precision its size deserves; "" for None."""
    if rate is None:
        return ""
    if rate >= 100:
        return f"{rate:,.0f}/s"
    if rate >= 1:
        return f"{rate:.1f}/s"
    return f"{rate:.2f}/s"


def plural(n: int, word: str) -> str:
    """ "1 item", "3,000 items"."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def last_line(text: str | None) -> str:
    """The line of a traceback that says what went wrong: its last non-blank one."""
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def without_class(error: str, error_class: str) -> str:
    """An error's message without the class a traceback's last line begins with, so that it
    follows its class once: "card declined" of "fanout.errors.PermanentError: card declined"."""
    head, sep, message = error.partition(": ")
    if sep and error_class and (head == error_class or head.endswith("." + error_class)):
        return message
    return error
