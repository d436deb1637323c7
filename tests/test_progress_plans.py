"""The run page's counts read an index of their own, never the rows.

A run's page counts every item of the run on each open: by status and pool for its progress
(report.counted), and its failed items by error class (report.failed_by_class). Read through
the rows, on MariaDB at 200,000 items they cost 0.5 s and 0.1 s (rows found one by one, then
grouped in a temporary table). There both read fanout_item_run_counts_idx alone, the progress
in the order it groups; on PostgreSQL the failures read the partial fanout_item_failed_idx.
These build a long-lived table (finished runs beside the one looked at), gather its statistics
as autovacuum would, and read the plans.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from fanout.models import BatchRun, ItemClaim, ItemStatus
from fanout.report import counted, failed_by_class

pytestmark = pytest.mark.django_db(transaction=True)

# The index each database reads a run's failures from (migration 0019).
FAILED_INDEX = {"mysql": "fanout_item_run_counts_idx", "postgresql": "fanout_item_failed_idx"}
COUNTS_INDEX = "fanout_item_run_counts_idx"  # MariaDB/MySQL
RUNS = 6
ITEMS_PER_RUN = 3000


def _items(run: BatchRun, now: Any) -> Iterator[ItemClaim]:
    """Mostly ended items, in two pools, some failed with one of two errors, a few open."""
    for i in range(ITEMS_PER_RUN):
        status = (
            ItemStatus.FAILED
            if i % 5 == 0
            else ItemStatus.PENDING
            if i % 23 == 0
            else ItemStatus.RUNNING
            if i % 29 == 0
            else ItemStatus.SUCCEEDED
        )
        yield ItemClaim(
            run=run,
            key=f"k{i}",
            index=i,
            pool="pool-a" if i % 2 else "pool-b",
            status=status,
            error_class=("Timeout" if i % 3 else "ValueError") if status == "failed" else "",
            next_attempt_at=now + timedelta(seconds=i % 7 - 3),
            lease_expires_at=now + timedelta(seconds=30) if status == "running" else None,
        )


@pytest.fixture
def run() -> BatchRun:
    if connection.vendor not in ("postgresql", "mysql"):
        pytest.skip("the plans read here are PostgreSQL's and MariaDB's")
    now = timezone.now()
    runs = [
        BatchRun.objects.create(
            definition="t_ledger", run_key=f"plans:{r}", status="running", max_parallel=8
        )
        for r in range(RUNS)
    ]
    for r in runs:
        ItemClaim.objects.bulk_create(_items(r, now), batch_size=1000)
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("VACUUM ANALYZE fanout_itemclaim")
        else:
            cursor.execute("ANALYZE TABLE fanout_itemclaim")
            cursor.fetchall()
    return runs[-1]


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from _nodes(child)


def _postgresql_reads_the_index_alone(explained: str, index: str) -> None:
    plan = json.loads(explained)[0]["Plan"]
    scans = [n for n in _nodes(plan) if "Relation Name" in n or "Index Name" in n]
    found = [(n["Node Type"], n.get("Index Name")) for n in scans]
    assert found == [("Index Only Scan", index)], json.dumps(plan, indent=1)


def _mariadb_reads_the_index_alone(explained: str, index: str, groups_in_order: bool) -> None:
    # One row per table read: id, select_type, table, type, possible_keys, key, ..., Extra.
    [row] = explained.splitlines()
    assert f" {index} " in f" {row} " and "Using index" in row, row
    if groups_in_order:
        assert "Using temporary" not in row and "Using filesort" not in row, row


def test_a_runs_progress_counts_its_items_from_one_index_in_the_order_it_groups_them(
    run: BatchRun,
) -> None:
    if connection.vendor != "mysql":
        # A run's rows are written together: PostgreSQL reads them in order through the index
        # on run_id, faster than a wide index's entries, which every write would pay for.
        pytest.skip("PostgreSQL counts a run's rows through its run_id index")
    explained = counted([run.pk], timezone.now()).explain()
    _mariadb_reads_the_index_alone(explained, COUNTS_INDEX, groups_in_order=True)


def test_a_runs_failures_by_error_class_are_counted_from_one_index(run: BatchRun) -> None:
    failed = failed_by_class(run.pk)
    index = FAILED_INDEX[connection.vendor]
    if connection.vendor == "postgresql":
        _postgresql_reads_the_index_alone(failed.explain(format="json"), index)
    else:
        _mariadb_reads_the_index_alone(failed.explain(), index, groups_in_order=False)


def test_the_counts_read_from_the_index_are_the_items_counts(run: BatchRun) -> None:
    now = timezone.now()
    items = ItemClaim.objects.filter(run=run)

    rows = {(r["status"], r["pool"]): r for r in counted([run.pk], now)}
    failed = {r["error_class"]: r["n"] for r in failed_by_class(run.pk)}

    for (status, pool), r in rows.items():
        mine = items.filter(status=status, pool=pool)
        assert r["n"] == mine.count()
        assert r["later"] == mine.filter(next_attempt_at__gt=now).count()
        assert r["live"] == mine.filter(lease_expires_at__gt=now).count()
    assert sum(r["n"] for r in rows.values()) == ITEMS_PER_RUN
    assert failed == {
        e: items.filter(status="failed", error_class=e).count() for e in ("Timeout", "ValueError")
    }
