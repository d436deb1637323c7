"""The claim's and the hand-over's pick walk an index in work-list order, whatever the statistics.

A long-lived table is full of finished runs, and autoanalyze gathered its statistics before the
newest run's items were written: the planner then believes a new run has almost no pending
items. With only the plain indexes it chose to read every pending row of the run through a lease
index and sort them (3-15 ms a pick instead of 0.1). These tests build exactly that state on
real PostgreSQL and read the plans: the claim's query through EXPLAIN, the PL/pgSQL hand-over's
own statement through auto_explain, generic plan and custom plan alike.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

from fanout.backends.postgresql import SUCCEED_HELD
from fanout.claim import claim, walking_indexes
from fanout.clock import db_now
from fanout.models import BatchRun, ItemClaim
from tests.conftest import prepare

pytestmark = pytest.mark.django_db(transaction=True)

FINISHED_RUNS = 8
ITEMS_PER_RUN = 4000


def _finished_table() -> None:
    """Runs whose items all succeeded, then statistics gathered: a year of use, in short."""
    for i in range(FINISHED_RUNS):
        run = BatchRun.objects.create(
            definition="t_ledger", run_key=f"old:{i}", status="succeeded", max_parallel=8
        )
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO fanout_itemclaim (key, index, payload, pool, status, owner, attempt,"
                " crashes, next_attempt_at, error, error_class, run_id, compensation_attempt)"
                " SELECT 'k' || g, g, NULL, '', 'succeeded', '', 1, 0, now(), '', '', %s, 0"
                " FROM generate_series(0, %s) AS g",
                [run.pk, ITEMS_PER_RUN - 1],
            )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE fanout_itemclaim")


@pytest.fixture
def new_run() -> Iterator[BatchRun]:
    if connection.vendor != "postgresql":
        pytest.skip("the plans read here are PostgreSQL's")
    _finished_table()
    # Written after the statistics, as the next run of a long-lived table is.
    run = prepare("t_ledger", {"n": ITEMS_PER_RUN})
    BatchRun.objects.filter(pk=run.pk).update(status="running")
    assert ItemClaim.objects.filter(run=run, status="pending").count() == ITEMS_PER_RUN
    yield run


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from _nodes(child)


def _ordered_scan(plan: dict[str, Any]) -> None:
    """The plan reads a pending index in order and sorts nothing."""
    nodes = list(_nodes(plan))
    kinds = [n["Node Type"] for n in nodes]
    assert "Sort" not in kinds, json.dumps(plan, indent=1)
    scans = {n.get("Index Name", "") for n in nodes if n["Node Type"].startswith("Index")}
    assert scans & {"fanout_item_pending_idx", "fanout_item_claim_idx"}, json.dumps(plan)


def test_the_claims_pick_of_a_run_unseen_by_statistics_walks_an_index_in_work_list_order(
    new_run: BatchRun,
) -> None:
    query = (
        ItemClaim.objects.pending_due(db_now())
        .filter(run_id=new_run.pk)
        .order_by("index")
        .select_for_update(skip_locked=True)
        .values("pk", "key", "index")[:8]
    )
    with transaction.atomic(), walking_indexes():  # as the claim plans its picks
        plan = json.loads(query.explain(format="json"))[0]["Plan"]
    _ordered_scan(plan)


@pytest.mark.parametrize("mode", ["force_generic_plan", "force_custom_plan"])
def test_the_hand_overs_pick_of_a_run_unseen_by_statistics_walks_an_index_in_work_list_order(
    new_run: BatchRun, mode: str
) -> None:
    plans = _hand_over_plans(new_run.pk, mode)
    picks = [n for p in plans for n in _nodes(p["Plan"]) if n.get("Subplan Name") == "CTE pick"]
    assert len(picks) == 1, plans
    (pick,) = picks
    _ordered_scan(pick)


def _hand_over_plans(run_id: int, mode: str) -> list[dict[str, Any]]:
    """The plans of the statements the hand-over function runs, as auto_explain logs them."""
    notices: list[str] = []
    raw: Any = connection.connection
    handler = lambda diag: notices.append(diag.message_primary or "")  # noqa: E731
    raw.add_notice_handler(handler)
    try:
        with connection.cursor() as cursor:
            cursor.execute("LOAD 'auto_explain'")
            for setting, value in (
                ("auto_explain.log_min_duration", "0"),
                ("auto_explain.log_nested_statements", "on"),
                ("auto_explain.log_level", "notice"),
                ("auto_explain.log_format", "json"),
                ("client_min_messages", "notice"),
                ("plan_cache_mode", mode),
            ):
                cursor.execute(f"SET {setting} = {value}")
            # An item of the run finishes, so that the function goes on to pick the next.
            taken = claim(run_id, "plans", 1, 30.0, 3, None)
            assert taken.token is not None and len(taken.items) == 1
            cursor.execute(
                "SELECT * FROM fanout_hand_over(%s, %s, NULL, 0.0, %s, '', 'plans', %s, 30.0)",
                [taken.items[0].pk, taken.token, run_id, uuid.uuid4()],
            )
            cursor.fetchall()
            cursor.execute("RESET ALL")
    finally:
        raw.remove_notice_handler(handler)
    # Each notice: "duration: … ms  plan:" and the plan as JSON.
    return [json.loads(n.split("plan:", 1)[1]) for n in notices if "plan:" in n]


def test_a_batch_of_successes_reads_its_arrays_once_whatever_the_statistics(
    new_run: BatchRun,
) -> None:
    BatchRun.objects.filter(pk=new_run.pk).update(max_parallel=200)
    held = claim(new_run.pk, "probe", 200, 30, 3, None)
    assert len(held.items) == 200
    pks = sorted(i.pk for i in held.items)
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + SUCCEED_HELD,
                [held.token, pks, [timezone.now()] * len(pks), [None] * len(pks)],
            )
            plan = cursor.fetchone()[0][0]["Plan"]
        transaction.set_rollback(True)
    assert plan["Actual Rows"] == 200
    arrays = [n for n in _nodes(plan) if n["Node Type"] == "Function Scan"]
    # Read once, and each held row found by its id: not the arrays again for every held row.
    assert [n["Actual Loops"] for n in arrays] == [1], json.dumps(plan, indent=1)
