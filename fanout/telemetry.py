"""OpenTelemetry, when the ``otel`` extra is installed; without it every call here does nothing.

- A span per run, ``fanout.run <definition>``, from the run's creation to its end. A run outlives
  the processes that work on it, so its span is recorded when it ends, with ids derived from the
  run: every worker knows them in advance, and a run reopened by a retry gets a new span (same
  trace) each time it ends.
- A span per item attempt, ``fanout.item <definition>``, a root span of its own that links to
  its run's span, so a million-item run is not a million-span trace. Items are sampled by key
  (``FANOUT_OTEL_ITEM_SAMPLE_RATE``; the same items in every process and on every attempt), and
  every attempt whose handler raised is recorded as well.
- Metrics: ``fanout.items.finished`` (items that succeeded or failed for good, by definition and
  status: the ``item_finished`` signal's events), ``fanout.claim.duration`` (seconds a worker's
  claim or hand-over took, by definition), and, in a process that called ``observe_rows()``,
  gauges read from the rows: ``fanout.items`` (items of open runs by definition and status),
  ``fanout.pool.in_flight`` and ``fanout.pool.limit``; ``fanout.counter_drift`` (in-flight
  counters the supervisor's audit found different from their rows and corrected, by ``kind``,
  run or pool, and ``name``, the run's definition or the pool: anything but 0 is a bug);
  ``fanout.spend`` (what calls reported they cost, by definition and unit; item spans carry
  it as ``fanout.cost.<unit>``), and gauges ``fanout.budget.spent``, ``.reserved`` and
  ``.limit`` (every pool's budget and every open run's, by kind, name and unit).

Spans and metrics go to the global tracer and meter providers (the application's SDK
configuration), or to those given to ``configure()``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import DatabaseError, connection
from django.db.models import Count, Q, Sum

from . import __version__
from .clock import db_now
from .conf import conf
from .join import status_counts
from .models import (
    TERMINAL_RUN_STATUSES,
    BatchRun,
    CapacityPool,
    ItemClaim,
    ItemStatus,
    RunStatus,
    SpendAccount,
)
from .spend import period_end
from .transitions import FAILED, RETRY, SUCCEEDED, ClaimedItem, ExecutionOutcome

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics as otel_metrics
    from opentelemetry import trace as otel_trace
except ImportError:  # pragma: no cover - the otel extra is not installed
    otel_context = otel_metrics = otel_trace = None  # type: ignore[assignment]

logger = logging.getLogger("fanout")

# Whether opentelemetry-api is importable: checked once, so the hot path pays one test.
available = otel_trace is not None

OPEN_RUN_STATUSES = (
    RunStatus.PENDING,
    RunStatus.RUNNING,
    RunStatus.JOINING,
    RunStatus.COMPENSATING,
)
# Outcomes whose span is recorded whatever the sample: the handler raised.
ALWAYS_TRACED = (FAILED, RETRY)
ERROR_RUN_STATUSES = (
    RunStatus.FAILED,
    RunStatus.COMPENSATED,
    RunStatus.COMPENSATION_FAILED,
)
CLAIM_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


# --- figures read from the rows (also what fanout.prometheus serves) ----------------------


def item_counts() -> dict[tuple[str, str], int]:
    """Items of open runs by (definition, status), with 0 for each status of a definition that
    has an open run: series do not come and go while a run goes on."""
    definitions = (
        BatchRun.objects.filter(status__in=OPEN_RUN_STATUSES)
        .order_by()
        .values_list("definition", flat=True)
        .distinct()
    )
    counts = {(d, s.value): 0 for d in definitions for s in ItemStatus}
    rows = (
        ItemClaim.objects.filter(run__status__in=OPEN_RUN_STATUSES)
        .order_by()
        .values_list("run__definition", "status")
        .annotate(n=Count("pk"))
    )
    for definition, status, n in rows:
        counts[(definition, status)] = n
    return counts


def pool_figures() -> list[tuple[str, int, int]]:
    """(name, items in flight, max_concurrency) of every pool."""
    return list(
        CapacityPool.objects.order_by("name").values_list("name", "in_flight", "max_concurrency")
    )


def budget_figures() -> list[tuple[str, str, str, float, float, float]]:
    """(kind, name, unit, spent, reserved, budget) of every pool's budget and every open run's."""
    open_runs = BatchRun.objects.exclude(status__in=TERMINAL_RUN_STATUSES).values("pk")
    rows = SpendAccount.objects.filter(Q(pool__isnull=False) | Q(run__in=open_runs)).order_by(
        "pool", "run_id", "unit"
    )
    now = db_now()
    figures = []
    for pool, run_id, unit, spent, reserved, budget, period, calendar, started in rows.values_list(
        "pool", "run_id", "unit", "spent", "reserved", "budget", *_PERIOD_FIELDS
    ):
        # A pool's period that has passed is spent from zero, as the admin and the report
        # read it (only a claim writes the roll over).
        ends = period_end(period, calendar, started)
        if ends is not None and now >= ends:
            spent = 0.0
        kind, name = ("pool", pool) if pool is not None else ("run", str(run_id))
        figures.append((kind, name, unit, spent, max(reserved, 0.0), budget))
    return figures


_PERIOD_FIELDS = ("period", "calendar", "period_started_at")


def read_rows(read: Callable[[], Any], default: Any) -> Any:
    """Read for an exporter or a scrape: a database error is logged, not raised, and a
    connection this call opened (on an exporter's thread) is closed again."""
    opened = connection.connection is None
    try:
        return read()
    except DatabaseError as exc:
        logger.warning("fanout metrics: could not read the rows: %s", exc)
        opened = True
        return default
    finally:
        if opened and not connection.in_atomic_block:
            connection.close()


# --- sampling and the run span's identity ----------------------------------------------------


def item_sampled(run_id: int, key: str, rate: float) -> bool:
    """Whether an item's attempts are traced: decided by its run and key, so every process and
    every attempt answers the same."""
    if rate >= 1:
        return True
    if rate <= 0:
        return False
    digest = hashlib.blake2b(f"{run_id}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest) < rate * 2**64


def run_span_ids(run_id: int, run_key: str, created_at: datetime, reopened: int) -> tuple[int, int]:
    """(trace id, span id) of a run's span: the trace is the run's, the span its
    ``reopened``-th end. Derived from what the run's row holds, so any process knows them."""
    micros = (created_at - _EPOCH) // timedelta(microseconds=1)
    seed = f"fanout.run:{run_id}:{run_key}:{micros}".encode()
    trace_id = int.from_bytes(hashlib.blake2b(seed, digest_size=16).digest()) or 1
    span_seed = seed + f":{reopened}".encode()
    span_id = int.from_bytes(hashlib.blake2b(span_seed, digest_size=8).digest()) or 1
    return trace_id, span_id


def _ns(moment: datetime | None) -> int:
    if moment is None:
        return time.time_ns()
    return (moment - _EPOCH) // timedelta(microseconds=1) * 1000


# --- providers ---------------------------------------------------------------------------------


class _State:
    """The providers in use, and what was made from them (remade when they change)."""

    tracer_provider: Any = None  # None: the global one
    meter_provider: Any = None
    tracer: tuple[Any, Any] = (None, None)  # (provider, tracer)
    instruments: tuple[Any, _Instruments | None] = (None, None)  # (provider, instruments)


_state = _State()
_lock = threading.Lock()


def configure(tracer_provider: Any = None, meter_provider: Any = None) -> None:
    """Send fanout's spans and metrics to these providers instead of the global ones (None:
    the global one again)."""
    with _lock:
        _state.tracer_provider = tracer_provider
        _state.meter_provider = meter_provider
        _state.tracer = (None, None)
        _state.instruments = (None, None)


def _tracer() -> Any:
    """fanout's tracer, or None while no SDK is configured (spans would record nothing)."""
    if not available:
        return None
    provider = _state.tracer_provider
    if provider is None:
        provider = otel_trace.get_tracer_provider()
    cached_provider, tracer = _state.tracer
    if provider is cached_provider:
        return tracer
    if isinstance(provider, otel_trace.ProxyTracerProvider | otel_trace.NoOpTracerProvider):
        tracer = None
    else:
        tracer = provider.get_tracer("fanout", __version__)
        if hasattr(tracer, "id_generator"):
            _fix_ids(tracer)
    _state.tracer = (provider, tracer)
    return tracer


class _Instruments:
    def __init__(self, meter: Any) -> None:
        self.finished = meter.create_counter(
            "fanout.items.finished",
            unit="{item}",
            description="Items that succeeded or failed for good, by definition and status.",
        )
        self.claim = meter.create_histogram(
            "fanout.claim.duration",
            unit="s",
            description="How long a worker's claim (or hand-over) of items took, by definition.",
            explicit_bucket_boundaries_advisory=CLAIM_BUCKETS,
        )
        self.drift = meter.create_counter(
            "fanout.counter_drift",
            unit="{correction}",
            description="In-flight counters found different from their rows and corrected, "
            "by kind (run or pool) and name (the run's definition, or the pool).",
        )
        self.spend = meter.create_counter(
            "fanout.spend",
            unit="1",
            description="What items' calls reported they cost, by definition and unit "
            "(report_cost or cost_from).",
        )
        self.attributes: dict[tuple[str, str, str], dict[str, str]] = {}

    def labels(self, definition: str, name: str, value: str) -> dict[str, str]:
        """One attributes dict per figure, made once: the hot path allocates none. Keyed by
        the attribute's name too: a unit may be called as a status is ("failed")."""
        key = (definition, name, value)
        found = self.attributes.get(key)
        if found is None:
            found = self.attributes[key] = {"definition": definition, name: value}
        return found


def _instruments() -> _Instruments | None:
    if not available:
        return None
    provider = _state.meter_provider
    if provider is None:
        provider = otel_metrics.get_meter_provider()
    cached_provider, instruments = _state.instruments
    if provider is cached_provider:
        return instruments
    with _lock:
        if _state.instruments[0] is not provider:
            _state.instruments = (provider, _Instruments(provider.get_meter("fanout", __version__)))
        return _state.instruments[1]


# --- the run span ------------------------------------------------------------------------------

# The ids the next span started on this thread takes (see _RunIds).
_fixed = threading.local()


class _RunIds:
    """An SDK tracer's id generator that gives a run's span the ids derived from its run, and
    every other span the ids its own generator makes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def generate_trace_id(self) -> int:
        ids = getattr(_fixed, "ids", None)
        return ids[0] if ids else int(self.inner.generate_trace_id())

    def generate_span_id(self) -> int:
        ids = getattr(_fixed, "ids", None)
        return ids[1] if ids else int(self.inner.generate_span_id())

    def is_trace_id_random(self) -> bool:
        return bool(getattr(self.inner, "is_trace_id_random", lambda: False)())


def _fix_ids(tracer: Any) -> None:
    """Let fanout choose the ids of its run spans. Tracers of other SDKs have no
    ``id_generator``: their run spans get ids of their own, and item links lead nowhere."""
    with _lock:
        if not isinstance(tracer.id_generator, _RunIds):
            tracer.id_generator = _RunIds(tracer.id_generator)


def record_run(run: BatchRun) -> None:
    """Record the span of a run that just ended."""
    tracer = _tracer()
    if tracer is None:
        return
    attributes = _run_attributes(run)
    links = []
    parent = _parent_run(run)
    if parent is not None:
        attributes["fanout.parent_run_id"] = parent[0]
        links.append(otel_trace.Link(_remote(*run_span_ids(*parent))))
    _fixed.ids = run_span_ids(run.pk, run.run_key, run.created_at, run.reopened)
    try:
        span = tracer.start_span(
            f"fanout.run {run.definition}",
            context=otel_context.Context(),
            attributes=attributes,
            links=links,
            start_time=_ns(run.created_at),
        )
    finally:
        _fixed.ids = None
    if run.status in ERROR_RUN_STATUSES:
        span.set_status(otel_trace.StatusCode.ERROR, (run.error or run.status).splitlines()[0])
    span.end(end_time=_ns(run.finished_at))


def _run_attributes(run: BatchRun) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "fanout.run_id": run.pk,
        "fanout.definition": run.definition,
        "fanout.run_key": run.run_key,
        "fanout.status": run.status,
        "fanout.executor": run.executor,
        "fanout.items.total": run.total_items,
        "fanout.reopened": run.reopened,
    }
    for status, n in status_counts(run.pk).items():
        if n:
            attributes[f"fanout.items.{status}"] = n
    return attributes


def _parent_run(run: BatchRun) -> tuple[int, str, datetime, int] | None:
    """What the parent run's span ids derive from, for a child run; None for a root run."""
    if run.parent_item_id is None:
        return None
    return (
        BatchRun.objects.filter(items=run.parent_item_id)
        .values_list("pk", "run_key", "created_at", "reopened")
        .first()
    )


def on_run_finished(sender: Any, run: BatchRun, **kwargs: Any) -> None:
    """The ``run_finished`` receiver (connected by the app when opentelemetry is installed)."""
    record_run(run)


def _remote(trace_id: int, span_id: int) -> Any:
    return otel_trace.SpanContext(
        trace_id,
        span_id,
        is_remote=True,
        trace_flags=otel_trace.TraceFlags(otel_trace.TraceFlags.SAMPLED),
    )


# --- item spans and worker metrics -----------------------------------------------------------


class ItemSpans:
    """A drain's item spans: each a root span linked to the run's span."""

    def __init__(self, run_id: int, definition: str) -> None:
        self.run_id = run_id
        self.definition = definition
        self.name = f"fanout.item {definition}"
        self._link: Any = None

    def execute(self, item: ClaimedItem, call: Callable[[], ExecutionOutcome]) -> ExecutionOutcome:
        """Call the handler (through ``call``), in a span if the item is sampled or raised."""
        tracer = _tracer()
        if tracer is None:
            return call()
        began = time.time_ns()
        if not item_sampled(self.run_id, item.key, float(conf.OTEL_ITEM_SAMPLE_RATE)):
            outcome = call()
            if outcome.kind in ALWAYS_TRACED:
                span = self._start(tracer, item, began)
                self._end(span, outcome)
            return outcome
        # Sampled: the span is current while the handler runs, so that its spans nest in it.
        span = self._start(tracer, item, began)
        result: ExecutionOutcome | None = None
        try:
            with otel_trace.use_span(span, end_on_exit=False):
                result = call()
        finally:
            self._end(span, result)
        assert result is not None
        return result

    def _start(self, tracer: Any, item: ClaimedItem, began: int) -> Any:
        attributes: dict[str, Any] = {
            "fanout.run_id": self.run_id,
            "fanout.definition": self.definition,
            "fanout.item_key": item.key,
            "fanout.attempt": item.attempt,
        }
        if item.pool:
            attributes["fanout.pool"] = item.pool
        link = self.link()
        return tracer.start_span(
            self.name,
            context=otel_context.Context(),
            attributes=attributes,
            links=[link] if link is not None else (),
            start_time=began,
        )

    def _end(self, span: Any, outcome: ExecutionOutcome | None) -> None:
        if outcome is not None:
            span.set_attribute("fanout.status", outcome.kind)
            if outcome.kind != SUCCEEDED and outcome.error_class:
                span.set_attribute("error.type", outcome.error_class)
            if outcome.kind in ALWAYS_TRACED:
                span.add_event(
                    "exception",
                    {"exception.type": outcome.error_class, "exception.stacktrace": outcome.error},
                )
                span.set_status(otel_trace.StatusCode.ERROR, outcome.error_class)
            for unit, amount in (outcome.cost or {}).items():
                span.set_attribute(f"fanout.cost.{unit}", amount)
        span.end()

    def link(self) -> Any:
        """The link to the run's span, read once per drain (a reopened run is drained anew)."""
        if self._link is None:
            try:
                row = (
                    BatchRun.objects.filter(pk=self.run_id)
                    .values_list("run_key", "created_at", "reopened")
                    .first()
                )
            except DatabaseError:
                return None  # the drain's next query finds the database gone and rides it out
            if row is None:
                return None
            self._link = otel_trace.Link(_remote(*run_span_ids(self.run_id, *row)))
        return self._link


def item_spans(run_id: int, definition: str) -> ItemSpans | None:
    """A drain's item spans; None without opentelemetry (the drain then calls handlers as is)."""
    return ItemSpans(run_id, definition) if available else None


def items_finished(definition: str, outcomes: Sequence[ExecutionOutcome]) -> None:
    """Count outcomes that finished their items (called once they are committed)."""
    instruments = _instruments()
    if instruments is None:
        return
    for o in outcomes:
        if o.terminal:
            status = "succeeded" if o.kind == SUCCEEDED else "failed"
            instruments.finished.add(1, instruments.labels(definition, "status", status))
        for unit, amount in (o.cost or {}).items():
            instruments.spend.add(amount, instruments.labels(definition, "unit", unit))


def claim_took(definition: str, path: str, seconds: float) -> None:
    """Record how long a claim (``path`` "claim") or hand-over ("hand_over") took."""
    instruments = _instruments()
    if instruments is not None:
        instruments.claim.record(seconds, instruments.labels(definition, "path", path))


def counter_drifted(kind: str, name: str) -> None:
    """Count one counter the audit corrected: a ``kind`` ("run" or "pool") and its ``name``."""
    instruments = _instruments()
    if instruments is not None:
        instruments.drift.add(1, {"kind": kind, "name": name})


def drift_figures() -> list[tuple[str, str, int]]:
    """(kind, name, corrections) so far: every pool's, and runs' summed by definition."""
    runs = (
        BatchRun.objects.filter(counter_drift__gt=0)
        .order_by()
        .values("definition")
        .annotate(n=Sum("counter_drift"))
        .values_list("definition", "n")
    )
    pools = CapacityPool.objects.order_by("name").values_list("name", "counter_drift")
    return [("run", d, int(n)) for d, n in sorted(runs)] + [("pool", p, n) for p, n in pools]


# --- gauges read from the rows --------------------------------------------------------------

_observed: list[Any] = []  # meter providers observe_rows() registered its gauges with


def observe_rows(meter_provider: Any = None) -> None:
    """Report the gauges read from the rows (items of open runs, pools) from this process.

    Every process would report the same figures: call it in one (a web process, say). Each
    collection runs a query per gauge on the exporter's thread.
    """
    if not available:
        return
    provider = meter_provider if meter_provider is not None else _state.meter_provider
    if provider is None:
        provider = otel_metrics.get_meter_provider()
    with _lock:
        if any(p is provider for p in _observed):
            return
        _observed.append(provider)
    _observe(provider.get_meter("fanout", __version__))


def _observe(meter: Any) -> None:
    meter.create_observable_gauge(
        "fanout.items",
        callbacks=[_observe_items],
        unit="{item}",
        description="Items of open runs, by definition and status.",
    )
    meter.create_observable_gauge(
        "fanout.pool.in_flight",
        callbacks=[_observe_pools(1)],
        unit="{item}",
        description="Items of each pool running now, across every run and host.",
    )
    meter.create_observable_gauge(
        "fanout.pool.limit",
        callbacks=[_observe_pools(2)],
        unit="{item}",
        description="Each pool's max_concurrency.",
    )
    for column, name, description in (
        (3, "spent", "What each budget's items spent (a pool's: in its period), by unit."),
        (4, "reserved", "Estimates held against each budget by items running now, by unit."),
        (5, "limit", "Each budget: a pool's, and an open run's max_spend, by unit."),
    ):
        meter.create_observable_gauge(
            f"fanout.budget.{name}",
            callbacks=[_observe_budgets(column)],
            unit="1",
            description=description,
        )


def _observe_items(options: Any) -> Iterator[Any]:
    counts = read_rows(item_counts, {})
    for (definition, status), n in sorted(counts.items()):
        yield otel_metrics.Observation(n, {"definition": definition, "status": status})


def _observe_budgets(column: int) -> Callable[[Any], Iterable[Any]]:
    def observe(options: Any) -> Iterator[Any]:
        for row in read_rows(budget_figures, []):
            attributes = {"kind": row[0], "name": row[1], "unit": row[2]}
            yield otel_metrics.Observation(row[column], attributes)

    return observe


def _observe_pools(column: int) -> Callable[[Any], Iterable[Any]]:
    def observe(options: Any) -> Iterator[Any]:
        for row in read_rows(pool_figures, []):
            yield otel_metrics.Observation(row[column], {"pool": row[0]})

    return observe
