"""Materialize: create (or find) the run and write one ItemClaim per element of its work list.

The work list is paged in its own order and inserted in chunks, each chunk in one transaction
that also advances ``materialized_upto``, so a materializer that dies is resumed where it
stopped and nothing is inserted twice. One materializer at a time holds a lease on the run (the
definition's ``lease_seconds``); once a dead one's lease runs out, a worker's supervisor finishes
the writing. Only the definition's own errors drop the run (a child run's end failed instead,
so that its parent item is decided); a database that went away keeps it, and so does one whose
error no retry mends, which the supervisor says on the run and retries with backoff.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime
from itertools import islice
from typing import Any, NamedTuple, cast

from django.db import (
    DatabaseError,
    DataError,
    IntegrityError,
    NotSupportedError,
    ProgrammingError,
    connection,
    transaction,
)
from django.db.models import Field, Q, QuerySet

from . import transitions
from .backends import backend
from .clock import DbNow, db_now, db_now_plus
from .conf import conf
from .cost import as_units
from .definition import FanOut, Item
from .errors import EmptyWorkList, FanoutError, MaterializeError, is_transient
from .join import settle_up
from .lease import keep_alive
from .models import BatchRun, ItemClaim, RunStatus
from .pools import ensure_pools
from .signals import run_finished, run_started, send
from .spend import open_run_budget, unfit
from .transitions import runs

logger = logging.getLogger("fanout")


def create_run(
    definition: FanOut,
    params: dict[str, Any] | None,
    run_key: str | None,
    max_parallel: int | None = None,
    executor: str = "inline",
    parent_item_id: int | None = None,
    max_spend: Mapping[str, float] | float | None = None,
) -> tuple[BatchRun, bool]:
    """Return the run for ``run_key`` (default: name + params), creating it if it is new."""
    clean = definition.clean_params(params)
    _check_run_options(max_parallel, run_key)
    if definition.static_pool:
        ensure_pools([definition.static_pool])
    key = run_key or definition.default_run_key(clean)
    budget = as_units(max_spend, "max_spend") if max_spend is not None else definition.max_spend
    try:
        with transaction.atomic():
            run = BatchRun.objects.create(
                definition=definition.name,
                run_key=key,
                params=clean,
                max_parallel=max_parallel or definition.max_parallel,
                failure_policy=definition.failure_policy,
                join_mode=definition.join_mode,
                executor=executor,
                parent_item_id=parent_item_id,
            )
            if budget:
                # With the run, never later: workers read once whether a run has a budget.
                open_run_budget(run.pk, budget)
        return run, True
    except IntegrityError:
        # Another process created it first (the unique run key decided): use theirs.
        return _theirs(definition, key), False


def _check_run_options(max_parallel: int | None, run_key: str | None) -> None:
    if max_parallel is not None and (
        isinstance(max_parallel, bool) or not isinstance(max_parallel, int) or max_parallel < 1
    ):
        raise FanoutError(f"max_parallel must be an integer >= 1, got {max_parallel!r}")
    if run_key is not None and (not isinstance(run_key, str) or not run_key or len(run_key) > 255):
        raise FanoutError("a run key must be 1 to 255 characters")


def _theirs(definition: FanOut, key: str) -> BatchRun:
    """The run another process created under ``key``, if it is a run of ``definition``."""
    run = BatchRun.objects.get(run_key=key)
    if run.definition != definition.name:
        raise FanoutError(
            f"run key {key!r} belongs to a run of {run.definition!r}, not {definition.name!r}"
        ) from None
    return run


def _elements(definition: FanOut, params: dict[str, Any]) -> Iterator[Any]:
    source = definition.over(params)
    if isinstance(source, QuerySet):
        # Read in chunks: a million rows must not be loaded at once.
        return source.iterator(chunk_size=conf.MATERIALIZE_CHUNK)
    if not isinstance(source, Iterable):
        raise MaterializeError(
            f"fan-out {definition.name!r}: over(params) returned "
            f"{type(source).__name__}, not an iterable"
        )
    return iter(source)


class WritingInterrupted(MaterializeError):
    """Writing the items failed for a reason outside the definition (the database went away):
    the run is kept, and the next writer (a worker's supervisor, a resume) finishes it.

    ``transient`` is False for a database error that no retry mends (see
    fanout.errors.is_transient): the supervisor says it on the run and backs off."""

    def __init__(self, run_id: int, exc: BaseException) -> None:
        self.run_id = run_id
        self.transient = is_transient(exc)
        then = (
            f"a worker finishes writing it, or run_fanout --resume {run_id}"
            if self.transient
            else "the database refuses it in a way that retrying will not mend: workers retry "
            "it with backoff, and the run says why, until the database is fixed"
        )
        super().__init__(
            f"run {run_id}: writing its items was interrupted ({type(exc).__name__}: {exc}); "
            f"the run is kept: {then}"
        )


class _Overtaken(Exception):
    """Another writer took the run over (this one's lease ran out): it finishes the writing."""


def writer_lease_seconds(definition: FanOut) -> float:
    """How long a writer that stopped renewing keeps the run: a dead one is replaced after it."""
    return float(definition.lease_seconds)


def materialize(run: BatchRun, definition: FanOut, wait: bool = True) -> BatchRun:
    """Write the run's items if nobody else is; wait for whoever is (unless not ``wait``).

    Return the run, refreshed.
    """
    while True:
        run.refresh_from_db()
        if run.status != RunStatus.PENDING:
            return run
        token = _take_writing(run, definition)
        if token is not None and _write(run, definition, token):
            return run
        if not wait:
            return run
        # Another process is writing the items: wait for it, or for its lease to run out.
        time.sleep(0.2)
        if not BatchRun.objects.filter(pk=run.pk).exists():
            raise MaterializeError(
                f"run {run.pk} was abandoned: writing its items failed in another process"
            )


def _take_writing(run: BatchRun, definition: FanOut) -> uuid.UUID | None:
    """Become the run's writer if nobody is (or its writer's lease ran out); the token or None."""
    token = uuid.uuid4()
    won = (
        BatchRun.objects.filter(pk=run.pk, status=RunStatus.PENDING)
        .filter(Q(materialize_token__isnull=True) | Q(materialize_lease_expires_at__lte=DbNow()))
        .update(
            materialize_token=token,
            materialize_lease_expires_at=db_now_plus(writer_lease_seconds(definition)),
        )
    )
    return token if won else None


def _write(run: BatchRun, definition: FanOut, token: uuid.UUID) -> bool:
    """Write the items as the run's writer and start the run; False if another writer took
    over meanwhile (it finishes the writing)."""
    lease = writer_lease_seconds(definition)

    def renew() -> None:
        BatchRun.objects.filter(pk=run.pk, materialize_token=token).update(
            materialize_lease_expires_at=db_now_plus(lease)
        )

    try:
        with keep_alive(renew, lease / 3):
            total = _write_items(run, definition, token)
    except _Overtaken:
        return False
    except Exception as exc:
        if _interrupted(exc):
            _let_go(run, token)
            raise WritingInterrupted(run.pk, exc) from exc
        # The definition's own error (its work list raised, a duplicate key, a payload that is
        # not JSON): nothing has run yet, so drop the run and a fixed definition starts clean;
        # a child run ends failed instead, since its parent item may be waiting for it.
        error = (
            exc
            if isinstance(exc, FanoutError)
            else MaterializeError(
                f"fan-out {definition.name!r}: the work list failed: {type(exc).__name__}: {exc}"
            )
        )
        if run.parent_item_id is None:
            BatchRun.objects.filter(pk=run.pk, materialize_token=token).delete()
        else:
            _fail_child(run, token, error)
        if error is exc:
            raise
        raise error from exc
    _start(run, token, total)
    return True


def _interrupted(exc: BaseException) -> bool:
    """Whether writing failed because of the database, not of the definition: a lost or
    killed connection, a restart, a lock or serialization failure, or one that no retry mends
    (WritingInterrupted.transient tells which). A constraint, a value that does not fit or a
    bad query is the definition's own error."""
    return isinstance(exc, DatabaseError) and not isinstance(
        exc, IntegrityError | DataError | ProgrammingError | NotSupportedError
    )


def _fail_child(run: BatchRun, token: uuid.UUID, error: Exception) -> None:
    """A child run's work list failed: it ends failed, saying why, instead of being dropped.

    Its parent item may be waiting for it already (this is a writer that took over from one
    the database interrupted): the failed child decides that item by its run's failure policy,
    as any failed child does. A rerun of the parent item writes the child afresh
    (dispatch.start_child)."""
    if not runs.end_writing(run.pk, token, str(error)):
        return  # cancelled meanwhile (with its parent, say), or another writer took over
    send(run_finished, BatchRun, run=BatchRun.objects.get(pk=run.pk))
    settle_up(run.pk)


def _let_go(run: BatchRun, token: uuid.UUID) -> None:
    """Give the writing up at once, so that the next writer need not wait for the lease."""
    try:
        BatchRun.objects.filter(pk=run.pk, materialize_token=token).update(
            materialize_token=None, materialize_lease_expires_at=None
        )
    except DatabaseError:
        logger.warning("run %s: its writer's lease runs out by itself", run.pk)


def _start(run: BatchRun, token: uuid.UUID, total: int) -> None:
    written = dict(total_items=total, materialize_token=None, materialize_lease_expires_at=None)
    if not runs.open(run.pk, token, **written):
        # Cancelled (say, with its parent) while its items were being written: the cancel
        # stands, and the items written since are cancelled with the others.
        BatchRun.objects.filter(pk=run.pk, materialize_token=token).update(**written)
        run.refresh_from_db()
        transitions.cancel_pending(ItemClaim.objects.filter(run_id=run.pk), run.error)
    run.refresh_from_db()
    logger.info("run %s: %d items written", run.pk, total)
    if run.status == RunStatus.RUNNING:
        send(run_started, BatchRun, run=run)


def _write_items(run: BatchRun, definition: FanOut, token: uuid.UUID) -> int:
    start = run.materialized_upto
    chunk_size = conf.MATERIALIZE_CHUNK
    elements = enumerate(_elements(definition, run.params))
    index = 0
    known_pools = {definition.static_pool} if definition.static_pool else set()
    # Due from now by the database's clock, not this host's (which may run ahead).
    due = db_now()
    while True:
        # With DEBUG on, Django keeps every query's SQL: a million items must not pile up there.
        connection.queries_log.clear()
        chunk = list(islice(elements, chunk_size))
        if not chunk and index == 0 and not definition.allow_empty:
            raise EmptyWorkList(
                f"the work list of {definition.name!r} is empty, and the definition refuses an "
                "empty work list (allow_empty=False): no run was made; check the params"
            )
        if not chunk:
            return index
        index = chunk[-1][0] + 1
        if index <= start:
            continue  # committed by an earlier materializer of this run
        rows = _rows(run, definition, [(i, e) for i, e in chunk if i >= start])
        _admit_pools(definition, rows, known_pools)
        _write_chunk(run, definition, token, rows, index, due)


def _admit_pools(definition: FanOut, rows: list[_Row], known_pools: set[str]) -> None:
    """Make the pools the rows name that are new to this writer; refuse an item that a pool
    could never admit."""
    new_pools = {r.pool for r in rows if r.pool} - known_pools
    if new_pools:
        ensure_pools(new_pools)
        known_pools |= new_pools
    if new_pools or definition.costing is not None:
        # A pool whose rate counts tokens refuses, before any item is written, an item
        # it could never admit.
        why = unfit(definition.name, ((r.key, r.pool, r.estimate) for r in rows))
        if why:
            raise MaterializeError(why)


def _write_chunk(
    run: BatchRun,
    definition: FanOut,
    token: uuid.UUID,
    rows: list[_Row],
    end: int,
    due: datetime,
) -> None:
    """Write one chunk's rows, and the run's progress up to ``end``, fenced on the token."""
    copy = backend().copies
    first = rows[0].position
    try:
        with transaction.atomic():
            # Fenced on the token, and a write first (SQLite then holds the write lock
            # throughout). The fence also makes every chunk's rows new: a chunk commits with
            # materialized_upto, and a second materializer waits for this one's row lock.
            if not BatchRun.objects.filter(pk=run.pk, materialize_token=token).update(
                materialized_upto=end
            ):
                raise _Overtaken()
            if copy:
                _copy_rows(run, rows, due)
            else:
                _insert_rows(run, definition, rows, first, end, due)
    except IntegrityError:
        if not copy:
            raise
        # COPY has no ON CONFLICT: a key that an earlier chunk already wrote lands here.
        raise MaterializeError(_duplicate_message(run, definition, rows, first)) from None


def _insert_rows(
    run: BatchRun, definition: FanOut, rows: list[_Row], first: int, end: int, due: datetime
) -> None:
    ItemClaim.objects.bulk_create(
        [
            ItemClaim(
                run=run,
                key=r.key,
                index=r.position,
                payload=r.payload,
                pool=r.pool,
                estimate=r.estimate,
                next_attempt_at=due,
            )
            for r in rows
        ],
        ignore_conflicts=True,
    )
    written = ItemClaim.objects.filter(run=run, index__gte=first, index__lt=end).count()
    if written != len(rows):
        raise MaterializeError(_duplicate_message(run, definition, rows, first))


class _Row(NamedTuple):
    """One item to write: a plain tuple, far cheaper to build than a model instance."""

    position: int  # the item's index (a NamedTuple cannot name a field "index")
    key: str
    payload: Any
    payload_json: str | None  # None for a None payload: stored as SQL NULL, as the field does
    pool: str
    estimate: dict | None = None  # what one call is expected to cost (a definition's cost=)


def _copy_rows(run: BatchRun, rows: list[_Row], due: datetime) -> None:
    """Stream the chunk with COPY (PostgreSQL): no model instances, no per-row SQL compiling."""
    meta = ItemClaim._meta
    # Estimates only where a definition declares cost=: other runs copy what they always did.
    costed = any(r.estimate is not None for r in rows)
    given: tuple[str, ...] = ("run", "key", "index", "payload", "pool")
    if costed:
        given = (*given, "estimate")
    template = ItemClaim(run=run, next_attempt_at=due)  # every other column takes its model default
    defaults = [
        f
        for f in meta.concrete_fields
        if not f.primary_key and f.name not in given and getattr(template, f.attname) is not None
    ]
    constants = tuple(
        f.get_db_prep_save(getattr(template, f.attname), connection) for f in defaults
    )
    fields = [cast(Field, meta.get_field(n)) for n in given] + defaults
    run_id = run.pk

    def values() -> Iterator[tuple]:
        for r in rows:
            head = (run_id, r.key, r.position, r.payload_json, r.pool)
            if costed:
                head = (*head, None if r.estimate is None else json.dumps(r.estimate))
            yield (*head, *constants)

    backend().copy_rows(meta.db_table, [str(f.column) for f in fields], values())


def _rows(run: BatchRun, definition: FanOut, chunk: list[tuple[int, Any]]) -> list[_Row]:
    rows = []
    seen: dict[str, int] = {}
    dumps = json.dumps
    pool_fn = definition.pool if callable(definition.pool) else None
    static_pool = definition.static_pool or ""
    costing = definition.costing
    for index, element in chunk:
        try:
            key = definition.key_for(element)
            payload = definition.payload_for(element)
            # JSON null is stored as SQL NULL, as the JSONField stores None.
            payload_json = None if payload is None else dumps(payload)
        except FanoutError:
            raise
        except (TypeError, ValueError) as exc:
            raise MaterializeError(
                f"fan-out {definition.name!r}: the payload of item {index} is not JSON ({exc}); "
                "give the definition a payload= function that returns JSON"
            ) from None
        if key in seen:
            raise MaterializeError(
                f"fan-out {definition.name!r}: duplicate key {key!r} "
                f"at items {seen[key]} and {index}; "
                "keys must identify items uniquely (give the definition a key= function)"
            )
        seen[key] = index
        if pool_fn is None and costing is None:
            rows.append(_Row(index, key, payload, payload_json, static_pool))
            continue
        item = Item(key, index, payload, 1, run.pk, pool=static_pool, params=run.params)
        pool = static_pool if pool_fn is None else definition.pool_for(item)
        estimate = definition.estimate_for(item) if costing is not None else None
        rows.append(_Row(index, key, payload, payload_json, pool, estimate))
    return rows


def _duplicate_message(run: BatchRun, definition: FanOut, rows: list[_Row], first: int) -> str:
    keys = {r.key: r.position for r in rows}
    clash = (
        ItemClaim.objects.filter(run=run, key__in=list(keys))
        .exclude(index__gte=first)
        .values_list("key", "index")
        .first()
    )
    if clash is None:  # pragma: no cover - the count said otherwise
        return f"fan-out {definition.name!r}: duplicate keys in the work list"
    return (
        f"fan-out {definition.name!r}: duplicate key {clash[0]!r} "
        f"at items {clash[1]} and {keys[clash[0]]}; "
        "keys must identify items uniquely (give the definition a key= function)"
    )
