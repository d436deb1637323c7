"""MariaDB/MySQL: the hand-over procedure, GET_LOCK, and the clock read as UTC."""

from __future__ import annotations

import contextlib
import hashlib
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

from django.db import connection
from django.utils import timezone

from .base import Backend, HandOverRow

# UTC_TIMESTAMP(6), not NOW(6): NOW() is in the session's time zone, which Django's MySQL
# backend leaves as the server's, while DATETIME columns hold UTC.
NOW = "UTC_TIMESTAMP(6)"
# A stored procedure (migrations 0005, 0008, 0015): one CALL, one round trip, one commit.
HAND_OVER = "CALL fanout_hand_over(%s, %s, %s, %s, %s, %s, %s, %s, %s)"
# The same, with the spend it moves (migrations 0017, 0018, 0020, 0021): the cost and whether the
# run has a budget.
HAND_OVER_SPEND = "CALL fanout_hand_over_spend(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"


def aware(value: datetime | None) -> datetime | None:
    """A DATETIME read back: naive, and UTC, as every DATETIME column here holds."""
    if value is not None and timezone.is_naive(value):
        return timezone.make_aware(value, UTC)
    return value


class MySQL(Backend):
    vendor = "mysql"
    select_now = f"SELECT {NOW}"

    @staticmethod
    def lock_name(name: str) -> str:
        """GET_LOCK's name for ``name``. Its locks are the server's, not a database's: the
        database's name goes in, or two projects on one server would wait on each other. At
        most 64 characters: a longer name keeps its start and a digest of the whole, so two
        names alike in their first 64 characters are two locks."""
        full = f"{connection.settings_dict['NAME']}:{name}"
        if len(full) <= 64:
            return full
        return f"{full[:47]}~{hashlib.sha1(full.encode()).hexdigest()[:16]}"

    @contextlib.contextmanager
    def session_lock(self, name: str, wait_seconds: float) -> Iterator[bool]:
        name = self.lock_name(name)
        with connection.cursor() as cursor:
            # 1: taken; 0: the wait ran out; NULL: an error. Without it the limit is not exact.
            cursor.execute("SELECT GET_LOCK(%s, %s)", [name, wait_seconds])
            taken = cursor.fetchone()[0] == 1
        try:
            yield taken
        finally:
            if taken:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT RELEASE_LOCK(%s)", [name])

    @property
    def hands_over(self) -> bool:
        return True

    def hand_over(self, params: Sequence[Any]) -> HandOverRow:
        done, pk, key, index, payload, pool, attempt, started_at = _call(HAND_OVER, params)
        return HandOverRow(bool(done), pk, key, index, payload, pool, attempt, aware(started_at))

    def hand_over_spending(self, params: Sequence[Any]) -> tuple[HandOverRow, bool] | None:
        done, pk, key, index, payload, pool, attempt, started_at, refused = _call(
            HAND_OVER_SPEND, params
        )
        row = HandOverRow(bool(done), pk, key, index, payload, pool, attempt, aware(started_at))
        return row, bool(refused)


def _call(procedure: str, params: Sequence[Any]) -> tuple[Any, ...]:
    """CALL a procedure that answers one row; return it."""
    # MySQL's UUIDField is CHAR(32): tokens go as hex.
    args = [p.hex if isinstance(p, uuid.UUID) else p for p in params]
    with connection.cursor() as cursor:
        cursor.execute(procedure, args)
        row = cursor.fetchone()
        # A CALL answers with its status too: read every result, or the connection refuses
        # the next statement.
        while cursor.nextset():
            pass
    return tuple(row)
