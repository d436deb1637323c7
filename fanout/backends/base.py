"""The portable backend: what every database Django supports can do, and no fast path."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from django.db import connection
from django.db.models import Model, QuerySet


class HandOverRow(NamedTuple):
    """What the hand-over routine answers: whether the outcome was written, and the next item
    that took over the slot (all None when none did)."""

    done: bool
    pk: int | None
    key: str | None
    index: int | None
    payload: Any
    pool: str | None
    attempt: int | None
    started_at: datetime | None


class Backend:
    """Portable defaults. Subclasses override what their database does better or differently."""

    vendor = "portable"
    # The statement that reads the database server's clock; None: this host's clock is the
    # server's (SQLite runs in this process).
    select_now: str | None = None

    @property
    def has_row_locks(self) -> bool:
        return bool(connection.features.has_select_for_update)

    def take_write_lock(self, rows: QuerySet[Any]) -> None:
        """Make this transaction a writer before it reads (SQLite); a no-op with row locks."""

    @contextlib.contextmanager
    def session_lock(self, name: str, wait_seconds: float) -> Iterator[bool]:
        """Hold a named lock of this session around the block; yields whether it was taken
        (SQLite serialises every writer already, so there is nothing to take)."""
        yield True

    @contextlib.contextmanager
    def ordered_picks(self) -> Iterator[None]:
        """Plan the claim's picks so that they walk the claim index in work-list order."""
        yield

    def bucket(self, expression: Any, edges: Sequence[Any]) -> Any:
        """The index i of the bucket [edges[i-1], edges[i]) that ``expression`` falls in (0
        below the first edge, len(edges) from the last), or None: fanout.charts then uses a
        portable CASE."""
        return None

    @contextlib.contextmanager
    def aggregating(self) -> Iterator[None]:
        """Plan the block's large aggregates (the admin's charts) for one pass over many rows."""
        yield

    @property
    def hands_over(self) -> bool:
        """Whether a finished item can hand its slot on in one statement here."""
        return False

    def hand_over(self, params: Sequence[Any]) -> HandOverRow:
        raise NotImplementedError("no one-statement hand-over on this database")

    @property
    def hands_over_groups(self) -> bool:
        """Whether the hand-overs of several items of one run can go in one statement here."""
        return False

    def hand_over_group(self, params: Sequence[Any]) -> list[HandOverRow]:
        """The hand-overs of several items of one run, one statement: ``params`` are the
        hand-over's, each but the run and the lease a list with one element per item; one
        answer per item, in their order."""
        raise NotImplementedError("no grouped hand-over on this database")

    def hand_over_spending(self, params: Sequence[Any]) -> tuple[HandOverRow, bool] | None:
        """The hand-over and the spend it moves in one round trip, and whether a budget refused
        the next item; None where there is none (fanout.spend moves the spend after it)."""
        return None

    def succeed_held(
        self, token: Any, done: Sequence[tuple[int, datetime | None, str | None]]
    ) -> list[tuple[int, int, str]] | None:
        """Items held under ``token`` succeed, each with its (pk, finished_at, result as JSON
        text), in one statement that locks, fences and writes them; answers (pk, run, pool) of
        those written. None where there is no such statement (transitions.settle then locks
        the rows first and writes them by kind)."""
        return None

    def lock_run_freeing(
        self, run_id: int, freed: int, fields: Sequence[str]
    ) -> dict[str, Any] | None:
        """Give the run's counter back ``freed`` slots and lock its row, answering ``fields``,
        in one statement; None where there is none (claim.lock_run then updates, and reads
        under the lock it took)."""
        return None

    def start_held(
        self,
        run_id: int,
        pks: Sequence[int],
        owner: str,
        token: Any,
        lease_seconds: float,
        now: datetime,
    ) -> int | None:
        """Pending items the caller has locked go running under ``token``, and their run's
        ``in_flight`` counts them, in one statement that names them by one array (no
        parameter per item); how many went. None where there is no such statement."""
        return None

    def update_rows(
        self,
        model: type[Model],
        rows: list[Model],
        fields: list[str],
        constants: dict[str, Any] | None = None,
    ) -> None:
        """Per-row values of ``fields`` (and the same ``constants`` for every row) for locked
        rows, in as few statements as it can: here Django's CASE WHEN per row and field."""
        manager = model._default_manager
        if constants:
            manager.filter(pk__in=[r.pk for r in rows]).update(**constants)
        manager.bulk_update(rows, fields)

    @property
    def copies(self) -> bool:
        """Whether new items are streamed with COPY (else bulk_create)."""
        return False

    def copy_rows(self, table: str, columns: list[str], rows: Any) -> None:
        raise NotImplementedError("no COPY on this database")

    def estimated_rows(self, table: str) -> int | None:
        """The planner's estimate of a table's rows, where it is cheap; None elsewhere."""
        return None
