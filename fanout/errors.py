"""Exceptions a handler raises to steer its item, and errors fanout reports."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from django.db import InterfaceError, OperationalError, connection

logger = logging.getLogger("fanout")


class PermanentError(Exception):
    """Raised by a handler: fail this item now, without further attempts."""


class Throttled(Exception):  # noqa: N818 - the name a handler author reads in the provider's terms
    """Raised by a handler when the provider says "slow down".

    The item goes back to pending without using an attempt and the item's pool
    admits nothing until ``retry_after`` seconds have passed.
    """

    def __init__(self, retry_after: float = 1.0, message: str = "") -> None:
        if retry_after < 0:
            raise ValueError("retry_after must be >= 0")
        self.retry_after = float(retry_after)
        super().__init__(message or f"throttled: retry after {self.retry_after:g}s")


class FanoutError(Exception):
    """A usage or configuration error, reported to the user as is."""


class DefinitionNotFound(FanoutError):
    pass


class MaterializeError(FanoutError):
    """The work list could not be turned into items; nothing was run."""


class HostLockBusy(OperationalError):
    """A claimer could not take its host's lock (the host limit) in time: it claimed nothing,
    and may try again."""


# MySQL/MariaDB error codes that a retry may outlast: the server going away or restarting, a
# transaction rolled back by a deadlock or a lock wait, a connection killed or refused.
_MYSQL_TRANSIENT = frozenset(
    {
        1040,  # too many connections
        1053,  # server shutdown in progress
        1205,  # lock wait timeout exceeded
        1213,  # deadlock found
        1317,  # query execution was interrupted
        1927,  # connection was killed (MariaDB)
        2002,  # cannot connect through the socket
        2003,  # cannot connect to the server
        2006,  # server has gone away
        2013,  # lost connection to the server during a query
        2055,  # lost connection to the server at a system call
        4031,  # disconnected by the server for inactivity (MySQL 8)
    }
)
# PostgreSQL SQLSTATEs (by prefix) that a retry may outlast: connection exceptions, a
# transaction rolled back (serialization failure, deadlock), too many connections or out of
# resources, an administrator's or a crash's shutdown, a server not accepting connections yet.
_POSTGRES_TRANSIENT = ("08", "40", "53", "55P03", "57P01", "57P02", "57P03")


def is_transient(exc: BaseException) -> bool:
    """Whether a database error may go away by itself (the server restarts, a deadlock).

    Anything else (a missing procedure, an illegal mix of collations, an unknown column)
    fails the same way however often it is retried: a worker must stop and say so.
    """
    if isinstance(exc, InterfaceError | HostLockBusy):
        return True  # the connection is closed, or the lock is held: a new try may work
    if not isinstance(exc, OperationalError):
        return False
    cause = exc.__cause__ or exc
    sqlstate = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if sqlstate is not None:
        return str(sqlstate).startswith(_POSTGRES_TRANSIENT)
    code = cause.args[0] if cause.args else None
    if isinstance(code, int):
        # 2000-2999 are the client library's own: it could not reach or lost the server.
        return code in _MYSQL_TRANSIENT or 2000 <= code < 3000
    # No code at all: a driver that lost its connection (psycopg's "server closed the
    # connection unexpectedly" has no SQLSTATE).
    return True


class EmptyWorkList(MaterializeError):
    """The work list was empty and its definition refuses that (``allow_empty=False``)."""


def ride_out[T](
    op: Callable[[], T], stop: threading.Event, what: str, give_up_after: float | None = None
) -> T | None:
    """Run ``op`` (a transaction of its own) until it is not cut by a transient error: a
    deadlock's victim or a restarting server is tried again, a new connection each time.

    None once ``stop`` is set or ``give_up_after`` seconds have passed; an error that will
    never go away (is_transient) is raised.
    """
    started = time.monotonic()
    pause = 0.1
    while True:
        try:
            return op()
        except (OperationalError, InterfaceError) as exc:
            if not is_transient(exc):
                raise
            logger.warning("%s: database unavailable (%s); retrying", what, exc)
            connection.close()
            if give_up_after is not None and time.monotonic() - started > give_up_after:
                return None
            if stop.wait(pause):
                return None
            pause = min(pause * 2, 2.0)
