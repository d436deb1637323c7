"""Spans and metrics as OpenTelemetry's in-memory exporters receive them, and the Prometheus view.

Every figure is compared with the rows it describes; the providers are the SDK's own, given
to fanout by ``telemetry.configure`` (a process has one global provider, set once).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.checks import run_checks
from django.test import override_settings
from django.urls import reverse
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client.parser import text_string_to_metric_families

from fanout import FanOut, Item, telemetry
from fanout.actions import retry_failed
from fanout.claim import claim
from fanout.clock import db_now
from fanout.compensate import retry_failed_compensations
from fanout.dispatch import resume
from fanout.models import BatchRun, CapacityPool, ItemClaim, ItemStatus, SpendAccount
from fanout.spend import budget_rows
from tests.conftest import keys, prepare, start
from tests.testapp.fanouts_pools import BUSY_POOL

pytestmark = pytest.mark.django_db(transaction=True)


def current_span_id(item: Item) -> str:
    """The id of the span current while the handler runs."""
    return format(trace.get_current_span().get_span_context().span_id, "016x")


FanOut("otel_current_span", over=lambda p: range(int(p["n"])), do=current_span_id)


@dataclass
class Exported:
    spans: InMemorySpanExporter
    reader: InMemoryMetricReader
    meter_provider: MeterProvider

    def run_spans(self) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.name.startswith("fanout.run ")]

    def item_spans(self) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.name.startswith("fanout.item ")]

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        assert data is not None
        return [
            point
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]

    def values(self, name: str, *labels: str) -> dict[tuple[str, ...], Any]:
        return {tuple(p.attributes[label] for label in labels): p.value for p in self.points(name)}


@pytest.fixture
def otel() -> Iterator[Exported]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    telemetry.configure(tracer_provider, meter_provider)
    yield Exported(spans, reader, meter_provider)
    telemetry.configure()
    meter_provider.shutdown()
    tracer_provider.shutdown()


def ns(moment: datetime) -> int:
    return (moment - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1) * 1000


def by_key(spans: list[ReadableSpan]) -> dict[tuple[str, int], ReadableSpan]:
    found: dict[tuple[str, int], ReadableSpan] = {}
    for s in spans:
        attributes = s.attributes or {}
        found[(str(attributes["fanout.item_key"]), int(attributes["fanout.attempt"]))] = s
    assert len(found) == len(spans), "one span per item attempt"
    return found


# --- spans ---------------------------------------------------------------------------------


def test_a_run_is_one_span_from_its_creation_to_its_end(otel: Exported) -> None:
    run = start("t_collect", {"n": 4, "permanent": ["k00002"]}, workers=2)

    (span,) = otel.run_spans()
    assert run.finished_at is not None
    assert span.name == "fanout.run t_collect"
    assert span.parent is None
    assert span.start_time == ns(run.created_at) and span.end_time == ns(run.finished_at)
    assert span.end_time > span.start_time
    assert dict(span.attributes or {}) == {
        "fanout.run_id": run.pk,
        "fanout.definition": "t_collect",
        "fanout.run_key": run.run_key,
        "fanout.status": "failed",
        "fanout.executor": "inline",
        "fanout.items.total": 4,
        "fanout.reopened": 0,
        "fanout.items.succeeded": 3,
        "fanout.items.failed": 1,
    }
    assert span.status.status_code == StatusCode.ERROR
    assert span.context is not None
    ids = (span.context.trace_id, span.context.span_id)
    assert ids == telemetry.run_span_ids(run.pk, run.run_key, run.created_at, 0)


@override_settings(FANOUT_OTEL_ITEM_SAMPLE_RATE=1.0)
def test_item_spans_are_roots_of_their_own_that_link_to_the_runs_span(otel: Exported) -> None:
    run = start("t_collect", {"n": 4, "permanent": ["k00002"], "flaky": {"k00001": 1}}, workers=2)

    (run_span,) = otel.run_spans()
    assert run_span.context is not None
    spans = by_key(otel.item_spans())
    assert set(spans) == {("k00000", 1), ("k00001", 1), ("k00001", 2), ("k00002", 1), ("k00003", 1)}
    for span in spans.values():
        assert span.name == "fanout.item t_collect"
        assert span.parent is None
        assert span.context is not None
        assert span.context.trace_id != run_span.context.trace_id
        (link,) = span.links
        assert (link.context.trace_id, link.context.span_id) == (
            run_span.context.trace_id,
            run_span.context.span_id,
        )
        attributes = span.attributes or {}
        assert attributes["fanout.run_id"] == run.pk
        assert attributes["fanout.definition"] == "t_collect"
        assert span.start_time is not None and span.end_time is not None
        assert span.end_time >= span.start_time
    statuses = {k: (s.attributes or {})["fanout.status"] for k, s in spans.items()}
    assert statuses == {
        ("k00000", 1): "succeeded",
        ("k00001", 1): "retry",
        ("k00001", 2): "succeeded",
        ("k00002", 1): "failed",
        ("k00003", 1): "succeeded",
    }
    failed = spans[("k00002", 1)]
    assert failed.status.status_code == StatusCode.ERROR
    assert (failed.attributes or {})["error.type"] == "PermanentError"
    (event,) = failed.events
    assert event.name == "exception"
    assert "k00002 is broken for good" in str((event.attributes or {})["exception.stacktrace"])
    assert (spans[("k00001", 1)].attributes or {})["error.type"] == "RuntimeError"
    assert spans[("k00000", 1)].status.status_code == StatusCode.UNSET


@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_the_items_traced_are_those_sampled_by_key_and_every_attempt_that_raised(
    otel: Exported, rate: float
) -> None:
    broken = ["k00005", "k00017"]
    with override_settings(FANOUT_OTEL_ITEM_SAMPLE_RATE=rate):
        run = start("t_quiet", {"n": 40, "permanent": broken}, workers=4)

    traced = {key for key, _ in by_key(otel.item_spans())}
    sampled = {k for k in keys(40) if telemetry.item_sampled(run.pk, k, rate)}
    assert traced == sampled | set(broken)
    if rate == 0:
        assert sampled == set()
    else:
        assert 0 < len(sampled) < 40  # the rule keeps some and drops some (p < 1e-6 otherwise)


@override_settings(FANOUT_OTEL_ITEM_SAMPLE_RATE=1.0)
def test_a_sampled_items_span_is_current_while_its_handler_runs(otel: Exported) -> None:
    run = start("otel_current_span", {"n": 3})

    spans = by_key(otel.item_spans())
    results = dict(ItemClaim.objects.filter(run=run).values_list("key", "result"))
    assert len(results) == 3
    for key, result in results.items():
        context = spans[(key, 1)].context
        assert context is not None
        assert result == format(context.span_id, "016x")


@override_settings(FANOUT_OTEL_ITEM_SAMPLE_RATE=1.0)
def test_a_reopened_run_ends_in_a_second_span_of_the_same_trace(otel: Exported) -> None:
    params = {"n": 2, "permanent_once": ["k00000"]}
    run = start("t_collect", params)
    retry_failed(run)
    run = start("t_collect", params)

    first, second = sorted(otel.run_spans(), key=lambda s: s.end_time or 0)
    assert (first.attributes or {})["fanout.status"] == "failed"
    assert (second.attributes or {})["fanout.status"] == "succeeded"
    assert (second.attributes or {})["fanout.reopened"] == 1 == run.reopened
    assert first.context is not None and second.context is not None
    assert first.context.trace_id == second.context.trace_id
    assert first.context.span_id != second.context.span_id
    # The item run after the reopening links to the second span, its first attempt to the first.
    k0 = sorted(
        (s for s in otel.item_spans() if (s.attributes or {})["fanout.item_key"] == "k00000"),
        key=lambda s: s.start_time or 0,
    )
    assert [(s.attributes or {})["fanout.status"] for s in k0] == ["failed", "succeeded"]
    assert [s.links[0].context.span_id for s in k0] == [
        first.context.span_id,
        second.context.span_id,
    ]


def test_a_run_whose_compensations_are_retried_ends_in_a_second_span(otel: Exported) -> None:
    # Its refund bounces 3 times (max_attempts=3), so the run ends compensation_failed.
    params = {"n": 3, "failing": ["s00002"], "refund_fail": {"s00001": 3}}
    run = start("comp_reverse", params, workers=4)
    assert retry_failed_compensations(run) == 1
    run, handle = resume(run.pk)
    assert handle is not None
    handle.join(30)
    run.refresh_from_db()

    assert (run.status, run.reopened) == ("compensated", 1)
    spans = sorted(otel.run_spans(), key=lambda s: s.end_time or 0)
    assert [(s.attributes or {})["fanout.status"] for s in spans] == [
        "compensation_failed",
        "compensated",
    ]
    assert [(s.context.trace_id, s.context.span_id) for s in spans if s.context] == [
        telemetry.run_span_ids(run.pk, run.run_key, run.created_at, n) for n in (0, 1)
    ]


def test_a_child_runs_span_links_to_its_parent_runs_span(otel: Exported) -> None:
    # One org with one repo of two files: the run of each spawns the next level's.
    root = start("nest_orgs", {"orgs": 1, "repos": 1, "files": 2})
    assert root.status == "succeeded", root.error

    spans = {(s.attributes or {})["fanout.definition"]: s for s in otel.run_spans()}
    assert set(spans) == {"nest_orgs", "nest_repos", "nest_files"}
    for child, parent in (("nest_repos", "nest_orgs"), ("nest_files", "nest_repos")):
        parent_context = spans[parent].context
        assert parent_context is not None
        (link,) = spans[child].links
        assert (link.context.trace_id, link.context.span_id) == (
            parent_context.trace_id,
            parent_context.span_id,
        )
        parent_run_id = (spans[parent].attributes or {})["fanout.run_id"]
        assert (spans[child].attributes or {})["fanout.parent_run_id"] == parent_run_id
    assert spans["nest_orgs"].links == ()


# --- metrics -----------------------------------------------------------------------------------


def test_finished_items_are_counted_by_definition_and_status_and_claims_are_timed(
    otel: Exported,
) -> None:
    start("t_collect", {"n": 5, "permanent": ["k00002"], "flaky": {"k00003": 1}}, workers=2)
    start("t_quiet", {"n": 3})

    rows = Counter(
        ItemClaim.objects.filter(run__definition__in=["t_collect", "t_quiet"]).values_list(
            "run__definition", "status"
        )
    )
    assert rows == {
        ("t_collect", "succeeded"): 4,
        ("t_collect", "failed"): 1,
        ("t_quiet", "succeeded"): 3,
    }
    assert otel.values("fanout.items.finished", "definition", "status") == dict(rows)

    claims = [
        p for p in otel.points("fanout.claim.duration") if p.attributes["definition"] == "t_collect"
    ]
    assert {p.attributes["path"] for p in claims} <= {"claim", "hand_over"}
    assert sum(p.count for p in claims) > 0
    assert all(p.sum >= 0 and p.count == sum(p.bucket_counts) for p in claims)


def open_pool_run() -> BatchRun:
    """A run of five items in a pool of three, two of them claimed and running."""
    CapacityPool.objects.create(name=BUSY_POOL, max_concurrency=3)
    run = prepare("pools_busy", {"n": 5})
    taken = claim(run.pk, "holder", 2, 30, 3, BUSY_POOL)
    assert len(taken.items) == 2
    return run


def row_figures(run: BatchRun) -> tuple[dict[tuple[str, str], int], dict[str, int], dict[str, int]]:
    """Items of the run by status, and every pool's in-flight count and limit, from the rows."""
    items = {(run.definition, s.value): 0 for s in ItemStatus}
    statuses = ItemClaim.objects.filter(run=run).values_list("status", flat=True)
    for status, n in Counter(statuses).items():
        items[(run.definition, status)] = n
    pools = list(CapacityPool.objects.values_list("name", "in_flight", "max_concurrency"))
    return items, {n: f for n, f, _ in pools}, {n: m for n, _, m in pools}


def test_gauges_read_the_items_of_open_runs_and_the_pools_from_the_rows(otel: Exported) -> None:
    start("t_quiet", {"n": 3})  # finished: not in the gauge
    run = open_pool_run()
    telemetry.observe_rows(otel.meter_provider)

    items, in_flight, limits = row_figures(run)
    assert items[(run.definition, "running")] == 2 and items[(run.definition, "pending")] == 3
    assert in_flight[BUSY_POOL] == 2 and limits[BUSY_POOL] == 3
    assert otel.values("fanout.items", "definition", "status") == items
    assert otel.values("fanout.pool.in_flight", "pool") == {(n,): v for n, v in in_flight.items()}
    assert otel.values("fanout.pool.limit", "pool") == {(n,): v for n, v in limits.items()}


# --- Prometheus ------------------------------------------------------------------------------


def scrape(client: Any, **headers: str) -> Any:
    return client.get(reverse("fanout-metrics"), headers=headers)


def families(text: str) -> dict[str, dict[tuple[str, ...], float]]:
    found: dict[str, dict[tuple[str, ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sample.labels[k] for k in sorted(sample.labels))
            found.setdefault(sample.name, {})[labels] = sample.value
    return found


def test_the_prometheus_view_serves_the_rows_figures_to_staff(client: Any) -> None:
    run = open_pool_run()
    client.force_login(User.objects.create_user("ops", is_staff=True))

    response = scrape(client)

    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    got = families(response.content.decode())
    items, in_flight, limits = row_figures(run)
    assert got["fanout_items"] == {(d, s): float(n) for (d, s), n in items.items()}
    assert got["fanout_pool_in_flight"] == {(n,): float(v) for n, v in in_flight.items()}
    assert got["fanout_pool_limit"] == {(n,): float(v) for n, v in limits.items()}
    assert got["fanout_pool_in_flight"][(BUSY_POOL,)] == 2.0


def test_the_prometheus_view_refuses_anyone_else(client: Any) -> None:
    assert scrape(client).status_code == 403
    client.force_login(User.objects.create_user("someone"))
    assert scrape(client).status_code == 403
    # Without a token configured, no bearer token is good.
    assert scrape(client, Authorization="Bearer ").status_code == 403


@override_settings(FANOUT_METRICS_TOKEN="s3cret")
def test_the_prometheus_view_takes_the_configured_bearer_token(client: Any) -> None:
    assert scrape(client, Authorization="Bearer s3cret").status_code == 200
    assert scrape(client, Authorization="Bearer s3cre").status_code == 403
    assert scrape(client, Authorization="s3cret").status_code == 403


# --- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [5, -0.1, "0.1", None])
def test_a_sample_rate_that_is_not_a_share_is_an_error(rate: Any) -> None:
    with override_settings(FANOUT_OTEL_ITEM_SAMPLE_RATE=rate):
        errors = [m for m in run_checks() if m.id == "fanout.E006"]
    assert len(errors) == 1 and repr(rate) in errors[0].msg


def test_the_prometheus_view_serves_each_pools_and_open_runs_budget(client: Any) -> None:
    run = open_pool_run()
    CapacityPool.objects.get_or_create(name="llm")
    SpendAccount.objects.create(run=run, unit="usd", budget=50, spent=49.8, reserved=0.6)
    SpendAccount.objects.create(pool="llm", unit="tokens", budget=90000, spent=1200)
    client.force_login(User.objects.create_user("ops", is_staff=True))

    got = families(scrape(client).content.decode())

    # Labels in name order: kind, name, unit.
    assert got["fanout_budget_spent"] == {
        ("run", str(run.pk), "usd"): 49.8,
        ("pool", "llm", "tokens"): 1200.0,
    }
    assert got["fanout_budget_reserved"][("run", str(run.pk), "usd")] == 0.6
    assert got["fanout_budget_limit"][("pool", "llm", "tokens")] == 90000.0


# --- spend -----------------------------------------------------------------------------------


@override_settings(FANOUT_OTEL_ITEM_SAMPLE_RATE=1.0)
def test_item_spans_and_the_spend_counter_carry_what_each_call_cost_by_unit(
    otel: Exported,
) -> None:
    run = start("spend_work", {"n": 12, "estimate": 0.1}, workers=3)
    spent = dict(ItemClaim.objects.filter(run=run).values_list("key", "cost"))
    assert len({c["usd"] for c in spent.values()}) > 1  # reported: not all the estimate

    spans = by_key(otel.item_spans())
    assert {key: (s.attributes or {})["fanout.cost.usd"] for (key, _), s in spans.items()} == {
        key: c["usd"] for key, c in spent.items()
    }
    counted = otel.values("fanout.spend", "definition", "unit")
    assert counted == {("spend_work", "usd"): pytest.approx(sum(c["usd"] for c in spent.values()))}


def billed_as_statuses(item: Item) -> str:
    item.report_cost(succeeded=1, failed=0.5)  # units that share their names with statuses
    return item.key


FanOut("otel_unit_names", over=lambda p: range(int(p["n"])), do=billed_as_statuses)


def test_units_named_as_statuses_are_counted_as_units_and_items_as_statuses(
    otel: Exported,
) -> None:
    start("otel_unit_names", {"n": 4})

    assert otel.values("fanout.spend", "definition", "unit") == {
        ("otel_unit_names", "succeeded"): 4.0,
        ("otel_unit_names", "failed"): 2.0,
    }
    assert otel.values("fanout.items.finished", "definition", "status") == {
        ("otel_unit_names", "succeeded"): 4
    }


def test_budget_gauges_read_each_pools_and_open_runs_budget_from_the_rows(otel: Exported) -> None:
    run = open_pool_run()
    CapacityPool.objects.get_or_create(name="llm")
    SpendAccount.objects.create(run=run, unit="usd", budget=50, spent=49.8, reserved=0.6)
    SpendAccount.objects.create(pool="llm", unit="tokens", budget=90000, spent=1200)
    telemetry.observe_rows(otel.meter_provider)

    labels = ("kind", "name", "unit")
    assert otel.values("fanout.budget.spent", *labels) == {
        ("run", str(run.pk), "usd"): 49.8,
        ("pool", "llm", "tokens"): 1200.0,
    }
    assert otel.values("fanout.budget.reserved", *labels)[("run", str(run.pk), "usd")] == 0.6
    assert otel.values("fanout.budget.limit", *labels)[("pool", "llm", "tokens")] == 90000.0


def test_budget_gauges_read_a_pool_whose_period_has_passed_as_spent_from_zero(
    otel: Exported,
) -> None:
    # Yesterday's spend, not rolled over yet (only a claim writes the roll): the admin and the
    # --json report read it as 0 spent in today's period, and so must the gauges.
    CapacityPool.objects.get_or_create(name="llm")
    today = db_now().astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    SpendAccount.objects.create(
        pool="llm",
        unit="usd",
        budget=50,
        spent=49.8,
        calendar="day",
        period_started_at=today - timedelta(days=1),
    )
    (row,) = budget_rows(SpendAccount.objects.filter(pool="llm"), db_now())
    assert row["spent"] == 0.0
    telemetry.observe_rows(otel.meter_provider)
    spent = otel.values("fanout.budget.spent", "kind", "name", "unit")
    assert spent == {("pool", "llm", "usd"): 0.0}
