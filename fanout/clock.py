"""The database's clock: every lease, admission, rate, backoff and join decision reads it.

Hosts' clocks disagree; the database server is the one clock that every worker shares. In SQL,
``DbNow()`` is the server's time when the expression is evaluated (PostgreSQL's
``clock_timestamp()``, not ``now()``, which is frozen at the start of the transaction and is
stale after a lock wait; MySQL's ``UTC_TIMESTAMP(6)``, not ``NOW()``, which is in the session's
time zone, which Django's MySQL backend leaves as the server's while DATETIME columns hold UTC).
In Python, ``db_now()`` asks the server.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connection
from django.db.models import DateTimeField, DurationField, ExpressionWrapper, Value
from django.db.models.functions import Now
from django.utils import timezone

from .backends import backend, mysql, postgresql


class DbNow(Now):
    """The database server's current time, read when the statement gets to it."""

    def as_postgresql(self, compiler: Any, connection: Any, **extra_context: Any) -> Any:
        return postgresql.NOW, []

    def as_mysql(self, compiler: Any, connection: Any, **extra_context: Any) -> Any:
        # Django's Now() is CURRENT_TIMESTAMP(6) there: the session's zone, not the columns'.
        return mysql.NOW, []


def db_now_plus(seconds: float) -> ExpressionWrapper:
    """``DbNow() + seconds`` as an expression."""
    return ExpressionWrapper(
        DbNow() + Value(timedelta(seconds=seconds), output_field=DurationField()),
        output_field=DateTimeField(),
    )


def db_now() -> datetime:
    """The database server's time now, as an aware datetime (SQLite: this host's, its server)."""
    sql = backend().select_now
    if sql is None:
        return timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(sql)
        value = cursor.fetchone()[0]
    if timezone.is_naive(value):
        # MySQL's UTC_TIMESTAMP() is naive: it is UTC, as the DATETIME columns.
        value = timezone.make_aware(value, UTC)
    return value


# Calendar periods (a pool budget's "month"): their boundaries are in UTC, whatever the hosts'
# or the server's time zone, so every worker agrees on when one ends.
CALENDAR_PERIODS = ("day", "week", "month", "year")


def calendar_start(moment: datetime, period: str) -> datetime:
    """The start of the calendar ``period`` (day, ISO week from Monday, month, year) that holds
    ``moment``, in UTC."""
    day = moment.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "week":
        return day - timedelta(days=day.weekday())
    if period == "month":
        return day.replace(day=1)
    if period == "year":
        return day.replace(month=1, day=1)
    return day


def calendar_end(start: datetime, period: str) -> datetime:
    """When the calendar ``period`` that holds ``start`` ends (the next one's start)."""
    start = calendar_start(start, period)
    if period == "week":
        return start + timedelta(days=7)
    if period == "month":
        return start.replace(year=start.year + start.month // 12, month=start.month % 12 + 1)
    if period == "year":
        return start.replace(year=start.year + 1)
    return start + timedelta(days=1)
