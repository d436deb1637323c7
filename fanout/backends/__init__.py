"""What differs by database, in one module per vendor; everything else is portable Django.

``backend()`` answers for the current connection: the clock's SQL, the hand-over's one
round trip, a host's session lock, COPY and ``UPDATE ... FROM (VALUES ...)`` on PostgreSQL,
SQLite's write lock taken first. A vendor that has no fast path for something says so with
``None`` or ``False``, and the portable path is taken.
"""

from __future__ import annotations

from django.db import connection

from . import mysql, postgresql, sqlite
from .base import Backend, HandOverRow

__all__ = ["Backend", "HandOverRow", "backend"]

_BY_VENDOR: dict[str, Backend] = {
    "postgresql": postgresql.PostgreSQL(),
    "mysql": mysql.MySQL(),
    "sqlite": sqlite.SQLite(),
}
_PORTABLE = Backend()


def backend() -> Backend:
    """The backend of the current thread's default connection."""
    return _BY_VENDOR.get(connection.vendor, _PORTABLE)
