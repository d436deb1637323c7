"""The live counter audit: a supervisor recounts runs' and pools' in_flight from their rows.

Drift is made the only way a bug would make it, by writing a counter behind the transitions'
back (a raw UPDATE); the audit must find it, correct it, log it, count it in the metrics and show
it in the admin. And while real workers move items, a counter read under its lock always equals
its rows: the audit reports nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.urls import reverse
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

from fanout import FanOut, compensate, telemetry
from fanout.audit import audit, audit_pool, audit_run, take_pools
from fanout.claim import claim
from fanout.definition import get_definition
from fanout.dispatch import dispatch
from fanout.models import BatchRun, CapacityPool, ItemClaim
from fanout.supervise import sweep
from tests.conftest import prepare
from tests.procs import wait_until
from tests.testapp.fanouts_pools import BUSY_POOL
from tests.testapp.fanouts_slots import charge, refund

pytestmark = pytest.mark.django_db(transaction=True)

OPEN = ("pending", "running", "joining", "compensating")
COMP_POOL = "audit-compensations"
# Charges that are refunded when the run fails: items and then compensations in one pool.
FanOut(
    "audit_compensated",
    over=lambda p: range(int(p["n"])),
    key=lambda i: f"s{i:05d}",
    do=charge,
    compensate=refund,
    pool=COMP_POOL,
    failure_policy="collect",
    max_parallel=6,
    compensate_order="parallel",
    compensate_max_parallel=3,
    max_attempts=3,
    retry_backoff=0.02,
    lease_seconds=5,
)


@pytest.fixture
def reader() -> Iterator[InMemoryMetricReader]:
    """fanout's metrics, read in memory."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    telemetry.configure(meter_provider=provider)
    yield reader
    telemetry.configure()
    provider.shutdown()


def drift_points(reader: InMemoryMetricReader) -> dict[tuple[str, str], int]:
    data = reader.get_metrics_data()
    if data is None:
        return {}
    return {
        (p.attributes["kind"], p.attributes["name"]): p.value
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "fanout.counter_drift"
        for p in metric.data.data_points
    }


def scraped_drift(client: Any) -> dict[tuple[str, str], float]:
    """The scrape's fanout_counter_drift_total series: every pool's, 0 included."""
    response = client.get(reverse("fanout-metrics"))
    assert response.status_code == 200
    return {
        (s.labels["kind"], s.labels["name"]): s.value
        for family in text_string_to_metric_families(response.content.decode())
        for s in family.samples
        if s.name == "fanout_counter_drift_total"
    }


def set_counter(table: str, pk: int, value: int) -> None:
    """Write a counter behind every transition's back, as a buggy path would."""
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET in_flight = %s WHERE id = %s", [value, pk])


def pool_run(n: int = 5, held: int = 2) -> tuple[BatchRun, CapacityPool]:
    """A run of ``n`` items in a pool of three, ``held`` of them claimed and running."""
    pool = CapacityPool.objects.create(name=BUSY_POOL, max_concurrency=3)
    run = prepare("pools_busy", {"n": n})
    assert len(claim(run.pk, "holder", held, 30, 3, BUSY_POOL).items) == held
    return run, pool


def test_a_counter_written_behind_the_transitions_back_is_found_corrected_logged_counted_and_shown(
    reader: InMemoryMetricReader, admin_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    run, pool = pool_run()
    set_counter("fanout_batchrun", run.pk, 5)  # high: the run would admit 3 fewer than it may
    set_counter("fanout_capacitypool", pool.pk, 1)  # low: the pool would admit one over

    with caplog.at_level(logging.WARNING, logger="fanout"):
        sweep()  # what every worker's supervisor thread does each period

    run.refresh_from_db()
    pool.refresh_from_db()
    assert (run.in_flight, pool.in_flight) == (2, 2)
    assert (run.counter_drift, pool.counter_drift) == (1, 1)
    assert run.drift_noted_at is not None and pool.drift_noted_at is not None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"run {run.pk}: in_flight was 5 but its rows hold 2 slots; corrected" in warnings[0]
    assert f"pool {BUSY_POOL}: in_flight was 1 but its rows hold 2 slots; corrected" in warnings[1]
    assert len(warnings) == 2
    expected = {("run", "pools_busy"): 1, ("pool", BUSY_POOL): 1}
    assert drift_points(reader) == expected
    scraped = scraped_drift(admin_client)
    assert {k: v for k, v in scraped.items() if v} == expected

    page = admin_client.get(reverse("admin:fanout_batchrun_change", args=[run.pk]))
    assert "Counter audit: " in page.content.decode()
    assert "in_flight differed from the rows and was corrected once" in page.content.decode()
    page = admin_client.get(reverse("admin:fanout_capacitypool_change", args=[pool.pk]))
    assert "in_flight differed from the rows and was corrected once" in page.content.decode()


def test_counters_that_equal_their_rows_are_left_alone_and_shown_as_clean(
    reader: InMemoryMetricReader, admin_client: Any
) -> None:
    run, pool = pool_run()

    assert audit([run.pk]) == []

    run.refresh_from_db()
    pool.refresh_from_db()
    assert (run.in_flight, run.counter_drift, pool.in_flight, pool.counter_drift) == (2, 0, 2, 0)
    assert drift_points(reader) == {}
    scraped = scraped_drift(admin_client)
    assert scraped[("pool", BUSY_POOL)] == 0 and not any(scraped.values())
    page = admin_client.get(reverse("admin:fanout_capacitypool_change", args=[pool.pk]))
    assert "no drift found" in page.content.decode()


def test_drift_found_again_after_a_correction_is_counted_again() -> None:
    run, _ = pool_run()
    for value in (0, 7):
        set_counter("fanout_batchrun", run.pk, value)
        drift = audit_run(run.pk)
        assert drift is not None and (drift.counter, drift.rows) == (value, 2)

    run.refresh_from_db()
    assert (run.in_flight, run.counter_drift) == (2, 2)


def test_a_compensation_under_way_holds_its_pool_slot_in_the_audits_count() -> None:
    run, pool = pool_run(held=1)
    # A compensation claimed in the pool (as claim.claim_compensations leaves it) holds a slot.
    item = ItemClaim.objects.filter(run=run, status="pending").first()
    assert item is not None
    ItemClaim.objects.filter(pk=item.pk).update(
        status="compensating", claim_token="00000000-0000-0000-0000-000000000001"
    )
    set_counter("fanout_capacitypool", pool.pk, 2)

    assert audit_pool(BUSY_POOL) is None


def test_a_compensation_budget_counter_that_differs_from_its_rows_is_corrected_and_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = prepare("comp_parallel", {"n": 3})
    ItemClaim.objects.filter(run=run).update(status="succeeded")
    assert compensate.begin(run.pk, "failed on purpose")
    assert compensate.claim(run.pk, get_definition("comp_parallel"), "holder").items
    # Written behind the transitions' back: the run would start one compensation too many.
    with connection.cursor() as cursor:
        cursor.execute("UPDATE fanout_batchrun SET compensating = 0 WHERE id = %s", [run.pk])

    with caplog.at_level(logging.WARNING, logger="fanout"):
        drift = audit_run(run.pk)

    assert drift is not None and (drift.name, drift.counter, drift.rows) == (
        f"{run.pk} compensating",
        0,
        1,
    )
    run.refresh_from_db()
    assert (run.compensating, run.in_flight, run.counter_drift) == (1, 0, 1)
    assert "compensating: in_flight was 0 but its rows hold 1 slots" in caplog.text
    assert audit_run(run.pk) is None


def test_each_pool_is_audited_by_one_supervisor_per_period() -> None:
    names = {f"audit-{i}" for i in range(30)}
    names |= set(CapacityPool.objects.values_list("name", flat=True))  # FANOUT_POOLS' too
    CapacityPool.objects.bulk_create(CapacityPool(name=n) for n in names if n.startswith("audit-"))
    barrier = threading.Barrier(4)
    taken: list[list[str]] = []

    def supervisor() -> None:
        try:
            barrier.wait(timeout=30)
            taken.append(take_pools(limit=40))
        finally:
            connection.close()

    threads = [threading.Thread(target=supervisor) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    elected = [name for names_ in taken for name in names_]
    assert len(taken) == 4 and sorted(elected) == sorted(names)  # each pool once, by one
    assert take_pools() == []  # nobody audits them again this period
    CapacityPool.objects.filter(name="audit-7").update(audited_until=None)  # its period is over
    assert take_pools() == ["audit-7"]


def audited_until_finished(runs: list[BatchRun], pools: list[str], workers: int) -> int:
    """Run ``runs`` on inline worker threads while an auditor recounts every counter of the runs
    and ``pools`` as fast as it can; assert it found no drift; return how many it recounted."""
    handles = [dispatch(run, get_definition(run.definition), "inline", workers) for run in runs]
    stop = threading.Event()
    audits: list[int] = []
    found: list[Any] = []

    def auditor() -> None:
        try:
            while not stop.is_set():
                found.extend(audit_run(run.pk) for run in runs)
                found.extend(audit_pool(name) for name in pools)
                audits.append(len(runs) + len(pools))
        finally:
            connection.close()

    thread = threading.Thread(target=auditor, name="auditor")
    thread.start()
    try:

        def finished() -> bool:
            return not BatchRun.objects.filter(
                pk__in=[r.pk for r in runs], status__in=OPEN
            ).exists()

        wait_until(finished, 180, "every run to finish")
    finally:
        stop.set()
        thread.join(timeout=30)
        for handle in handles:
            assert handle is not None
            handle.stop.set()
            handle.join(timeout=30)

    assert [d for d in found if d is not None] == []
    drift = list(BatchRun.objects.values_list("counter_drift", flat=True))
    drift += list(CapacityPool.objects.values_list("counter_drift", flat=True))
    assert not any(drift)  # nor did the executors' own supervisors correct anything
    return sum(audits)


def test_no_drift_is_reported_while_real_workers_move_items_through_a_shared_pool() -> None:
    """Two runs share a pool of 3 on 12 inline worker threads (claims, hand-overs, throttled
    releases); an auditor recounts every counter as fast as it can meanwhile."""
    CapacityPool.objects.create(name=BUSY_POOL, max_concurrency=3)
    throttle = {f"k{i:05d}": 0.05 for i in range(0, 150, 25)}  # released, with a backoff
    params = {"n": 150, "sleep": 0.002, "throttle": throttle}
    runs = [prepare("pools_busy", params, f"audit-{i}") for i in range(2)]

    audited = audited_until_finished(runs, [BUSY_POOL], workers=6)

    assert audited > 30, "the auditor hardly ran while the items did"
    assert set(BatchRun.objects.values_list("status", flat=True)) == {"succeeded"}


def test_no_drift_is_reported_while_compensations_take_and_give_back_pool_slots() -> None:
    """A run fails and compensates in its pool (compensations hold pool slots, retried when
    a refund bounces) while an auditor recounts the run's and the pool's counters."""
    CapacityPool.objects.create(name=COMP_POOL, max_concurrency=4)
    failing = [f"s{i:05d}" for i in (3, 17)]
    bounce = {f"s{i:05d}": 1 for i in range(0, 40, 7)}
    params = {"n": 40, "sleep": 0.01, "failing": failing, "refund_sleep": 0.01}
    run = prepare("audit_compensated", {**params, "refund_fail": bounce})

    audited = audited_until_finished([run], [COMP_POOL], workers=6)

    run.refresh_from_db()
    assert run.status == "compensated"
    assert ItemClaim.objects.filter(run=run, status="compensated").count() == 38
    assert audited > 10, "the auditor hardly ran while the compensations did"
