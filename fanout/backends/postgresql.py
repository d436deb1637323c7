"""PostgreSQL: the hand-over function, advisory locks, COPY, UPDATE ... FROM (VALUES ...)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any, cast

from django.db import connection, transaction
from django.db.models import Field, Func, IntegerField, Model
from django.db.models.expressions import RawSQL

from .base import Backend, HandOverRow

# clock_timestamp(), not now(): now() is frozen at the start of the transaction, and stale
# after a lock wait.
NOW = "clock_timestamp()"
# A PL/pgSQL function (migrations 0003, 0006, 0015), so that PostgreSQL plans it once per session:
# planning the statement cost more than running it.
HAND_OVER = "SELECT * FROM fanout_hand_over(%s, %s, %s::jsonb, %s, %s, %s, %s, %s, %s)"
# Several items' hand-overs, one statement and one commit (migration 0024): arrays, one element
# per item, but for the run and the lease.
HAND_OVER_GROUP = (
    "SELECT * FROM fanout_hand_over_group(%s::bigint[], %s::uuid[], %s::text[], "
    "%s::float8[], %s, %s::text[], %s::text[], %s::uuid[], %s)"
)
# The hand-over and the spend it moves (migrations 0013, 0015, 0018, 0020, 0021).
HAND_OVER_SPEND = (
    "SELECT * FROM fanout_hand_over_spend(%s, %s, %s::jsonb, %s, %s, %s, %s, %s, %s, %s::jsonb, %s)"
)
# A batch's successes: one statement, three arrays. It locks the rows still held under the
# claim token (EvalPlanQual re-checks the token after a lock wait, so a writer that lost its
# lease writes nothing), writes every outcome, and answers what the counters need. The arrays
# are sorted by id, so writers lock in one order. The fence is a join clause on the arrays' side
# (OFFSET 0 keeps its constants there): as a restriction on the table, statistics that saw no
# running item made the planner walk the running items and rescan the arrays for each of them,
# 200 × 200 rows a batch.
SUCCEED_HELD = """
UPDATE fanout_itemclaim AS i
SET status = 'succeeded', claim_token = NULL, lease_expires_at = NULL,
    result = v.result::jsonb, error = '', error_class = '', finished_at = v.finished_at
FROM (
    SELECT u.id, u.finished_at, u.result, %s::uuid AS token, 'running'::varchar AS running
    FROM unnest(%s::bigint[], %s::timestamptz[], %s::text[]) AS u(id, finished_at, result)
    OFFSET 0
) AS v
WHERE i.id = v.id AND i.claim_token = v.token AND i.status = v.running
RETURNING i.id, i.run_id, i.pool
"""
# A claim's items go running, named by one array (a parameter per item cost the client more
# than the statement did), and the run's counter moves by as many in the same statement: the
# claim holds the run's lock, and every round trip under it is one that other claimers wait.
START_HELD = f"""
WITH started AS (
    UPDATE fanout_itemclaim
    SET status = 'running', owner = %s, claim_token = %s,
        lease_expires_at = {NOW} + %s * interval '1 second',
        claimed_at = %s, started_at = %s, finished_at = NULL
    WHERE id = ANY(%s::bigint[])
    RETURNING 1
)
UPDATE fanout_batchrun SET in_flight = in_flight + (SELECT count(*) FROM started)
WHERE id = %s
RETURNING (SELECT count(*) FROM started)
"""
_VALUES_PER_STATEMENT = 1000  # far below PostgreSQL's 65,535 parameters per statement


class PostgreSQL(Backend):
    vendor = "postgresql"
    select_now = f"SELECT {NOW}"

    @contextlib.contextmanager
    def session_lock(self, name: str, wait_seconds: float) -> Iterator[bool]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", [name])
        try:
            yield True
        finally:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", [name])

    @contextlib.contextmanager
    def ordered_picks(self) -> Iterator[None]:
        # Without sorts the planner walks fanout_item_claim_idx in work-list order even when
        # statistics have not seen the run yet (they then make reading and sorting every
        # pending row of the run look as cheap). Only the picks: the rest of the transaction
        # is planned as usual.
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL enable_sort = off")
        try:
            yield
        finally:
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL enable_sort = on")

    def bucket(self, expression: Any, edges: Sequence[Any]) -> Any:
        # width_bucket() over an array of edges is a binary search in C: a third of the
        # portable CASE's time at a million rows.
        if not edges:
            return None
        kind = "interval" if isinstance(edges[0], timedelta) else "timestamptz"
        return Func(
            expression,
            RawSQL(f"%s::{kind}[]", (list(edges),)),
            function="width_bucket",
            output_field=IntegerField(),
        )

    @contextlib.contextmanager
    def aggregating(self) -> Iterator[None]:
        # A chart's bucket is a CASE nested six deep: at a million rows the planner's cost
        # calls for JIT, whose compiling took seconds, three times the query itself. A larger
        # work_mem lets it hash its few thousand groups instead of sorting every row on disk.
        # Inside an outer transaction (an admin page's) both last until it ends: reads only,
        # and no savepoint is needed.
        outer = contextlib.nullcontext() if connection.in_atomic_block else transaction.atomic()
        with outer:
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL jit = off; SET LOCAL work_mem = '64MB'")
            yield

    @property
    def hands_over(self) -> bool:
        return True

    def hand_over(self, params: Sequence[Any]) -> HandOverRow:
        with connection.cursor() as cursor:
            cursor.execute(HAND_OVER, list(params))
            done, *rest = cursor.fetchone()
        return HandOverRow(bool(done), *rest)

    @property
    def hands_over_groups(self) -> bool:
        return True

    def hand_over_group(self, params: Sequence[Any]) -> list[HandOverRow]:
        with connection.cursor() as cursor:
            cursor.execute(HAND_OVER_GROUP, list(params))
            return [HandOverRow(bool(done), *rest) for done, *rest in cursor.fetchall()]

    def hand_over_spending(self, params: Sequence[Any]) -> tuple[HandOverRow, bool] | None:
        with connection.cursor() as cursor:
            cursor.execute(HAND_OVER_SPEND, list(params))
            done, *rest, refused = cursor.fetchone()
        return HandOverRow(bool(done), *rest), bool(refused)

    def succeed_held(
        self, token: Any, done: Sequence[tuple[int, Any, str | None]]
    ) -> list[tuple[int, int, str]]:
        ordered = sorted(done)
        with connection.cursor() as cursor:
            cursor.execute(
                SUCCEED_HELD,
                [token, [d[0] for d in ordered], [d[1] for d in ordered], [d[2] for d in ordered]],
            )
            return [(pk, run_id, pool) for pk, run_id, pool in cursor.fetchall()]

    def lock_run_freeing(
        self, run_id: int, freed: int, fields: Sequence[str]
    ) -> dict[str, Any] | None:
        # The run's lock is what every claimer of the run waits for: giving the slots back
        # and reading what the claim decides from is one round trip under it, not two.
        names = ", ".join(connection.ops.quote_name(f) for f in fields)
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE fanout_batchrun SET in_flight = in_flight - %s WHERE id = %s "
                f"RETURNING {names}",
                [freed, run_id],
            )
            row = cursor.fetchone()
        return dict(zip(fields, row, strict=True)) if row else {}

    def start_held(
        self,
        run_id: int,
        pks: Sequence[int],
        owner: str,
        token: Any,
        lease_seconds: float,
        now: Any,
    ) -> int:
        with connection.cursor() as cursor:
            cursor.execute(START_HELD, [owner, token, lease_seconds, now, now, sorted(pks), run_id])
            row = cursor.fetchone()
        return int(row[0]) if row else 0

    def update_rows(
        self,
        model: type[Model],
        rows: list[Model],
        fields: list[str],
        constants: dict[str, Any] | None = None,
    ) -> None:
        """One UPDATE ... FROM (VALUES ...): per-row values without Django's CASE WHEN per
        field, which at 200 outcomes a batch cost about 1 ms of CPU per item."""
        meta = model._meta
        pk = cast(Field, meta.pk)
        columns = [pk, *(cast(Field, meta.get_field(name)) for name in fields)]
        qn = connection.ops.quote_name
        row_sql = "(" + ", ".join(f"%s::{f.db_type(connection)}" for f in columns) + ")"
        table = qn(meta.db_table)
        sets = [f"{qn(f.column)} = v.{qn(f.column)}" for f in columns[1:]]
        fixed = []
        for name, value in (constants or {}).items():
            field = cast(Field, meta.get_field(name))
            sets.append(f"{qn(field.column)} = %s")
            fixed.append(field.get_db_prep_save(value, connection))
        names = ", ".join(qn(f.column) for f in columns)
        with connection.cursor() as cursor:
            for start in range(0, len(rows), _VALUES_PER_STATEMENT):
                part = rows[start : start + _VALUES_PER_STATEMENT]
                values = [
                    f.get_db_prep_save(getattr(row, f.attname), connection)
                    for row in part
                    for f in columns
                ]
                cursor.execute(
                    f"UPDATE {table} SET {', '.join(sets)} "
                    f"FROM (VALUES {', '.join([row_sql] * len(part))}) "
                    f"AS v({names}) WHERE {table}.{qn(pk.column)} = v.{qn(pk.column)}",
                    [*fixed, *values],
                )

    @property
    def copies(self) -> bool:
        return True

    def copy_rows(self, table: str, columns: list[str], rows: Any) -> None:
        qn = connection.ops.quote_name
        names = ", ".join(qn(c) for c in columns)
        with connection.cursor() as cursor, connection.wrap_database_errors:
            with cursor.copy(f"COPY {qn(table)} ({names}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)

    def estimated_rows(self, table: str) -> int | None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass", [table]
            )
            row = cursor.fetchone()
        return int(row[0]) if row else None
