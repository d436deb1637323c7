"""Group commit: the hand-overs of a process's threads that finish items of one run while one
is in flight go together in the next statement, each fenced by its own claim, and a thread
that finds none in flight goes at once."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext

from fanout import group_commit
from fanout.claim import claim
from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.models import BatchRun, ItemClaim, ItemStatus
from fanout.transitions import SUCCEEDED, ExecutionOutcome, Handing, HandOver, hand_over_group
from tests.procs import wait_until

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL groups hand-overs"),
]

LEASE, CRASH_BUDGET = 30, 1


def prepared(name: str, **params: Any) -> BatchRun:
    return prepare_run(get_definition(name), params, f"{name}-{uuid.uuid4().hex[:8]}")


def succeeded(item: Any) -> ExecutionOutcome:
    return ExecutionOutcome(item.pk, item.key, SUCCEEDED, result={"ok": item.key})


def claimed_one_each(run: BatchRun, owners: list[str]) -> list[tuple[uuid.UUID, Any]]:
    """Each owner claims one item, as each worker thread does: (token, item) per owner."""
    taken = []
    for owner in owners:
        result = claim(run.pk, owner, 1, LEASE, CRASH_BUDGET, None)
        assert result.token is not None and len(result.items) == 1
        taken.append((result.token, result.items[0]))
    return taken


def backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def waiting_for_a_lock(pids: list[int]) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE pid = ANY(%s) AND wait_event_type = 'Lock'",
            [pids],
        )
        return bool(cursor.fetchone()[0])


class Thread(threading.Thread):
    """A worker thread that hands one item over and keeps the SQL its own session sent."""

    def __init__(self, run: BatchRun, token: uuid.UUID, item: Any, owner: str) -> None:
        super().__init__()
        self.args_ = (run.pk, token, succeeded(item), owner, uuid.uuid4(), LEASE)
        self.answer: HandOver | None = None
        self.sent: list[str] = []
        self.pid: int | None = None
        self.ready = threading.Event()

    def run(self) -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SET lock_timeout = '60s'")  # a wait fails the test, never hangs it
            self.pid = backend_pid()
            self.ready.set()
            with CaptureQueriesContext(connection) as queries:
                self.answer = group_commit.shared_hand_over(*self.args_)
            self.sent = [q["sql"] for q in queries.captured_queries]
        finally:
            connections["default"].close()


def test_hand_overs_that_come_while_one_is_in_flight_go_together_in_the_next_statement() -> None:
    run = prepared("slots_run", n=3)
    owners = ["host:1:a", "host:1:b", "host:1:c"]
    (ta, a), (tb, b), (tc, c) = claimed_one_each(run, owners)
    before = dict(group_commit.counts)
    # Nothing is left to hand the slots to: each hand-over gives its slot up on the run's row,
    # which this holder keeps locked until the others have queued behind the first.
    locked, release = threading.Event(), threading.Event()

    def hold_the_runs_row() -> None:
        try:
            with transaction.atomic():
                list(BatchRun.objects.filter(pk=run.pk).select_for_update())
                locked.set()
                release.wait(60)
        finally:
            connections["default"].close()

    holder = threading.Thread(target=hold_the_runs_row)
    first = Thread(run, ta, a, owners[0])
    later = [Thread(run, tb, b, owners[1]), Thread(run, tc, c, owners[2])]
    holder.start()
    try:
        assert locked.wait(30)
        first.start()
        assert first.ready.wait(30)
        assert first.pid is not None
        wait_until(lambda: waiting_for_a_lock([first.pid]), 30, "the first hand-over to wait")
        for thread in later:
            thread.start()
        joined = before.get("joined", 0) + 2
        wait_until(lambda: group_commit.counts["joined"] >= joined, 30, "the others to queue")
    finally:
        release.set()
        holder.join()
        for thread in (first, *later):
            thread.join(90)

    answers = [t.answer for t in (first, *later)]
    assert all(a is not None and a.written and a.next is None for a in answers)
    # Two statements in all: the first alone, then the two that queued behind it, together.
    statements = [sql for t in (first, *later) for sql in t.sent]
    assert len(statements) == 2, statements
    assert all("fanout_hand_over_group" in sql for sql in statements)
    assert len(first.sent) == 1
    assert sorted(len(t.sent) for t in later) == [0, 1]
    assert group_commit.counts["statements"] - before.get("statements", 0) == 2
    assert group_commit.counts["shared"] - before.get("shared", 0) == 2
    assert set(ItemClaim.objects.filter(run=run).values_list("status", flat=True)) == {
        ItemStatus.SUCCEEDED
    }
    run.refresh_from_db()
    assert run.in_flight == 0


def test_a_lone_hand_over_goes_at_once_in_a_statement_of_its_own() -> None:
    run = prepared("slots_run", n=2)
    [(token, item)] = claimed_one_each(run, ["host:1:a"])
    before = dict(group_commit.counts)

    handed = group_commit.shared_hand_over(
        run.pk, token, succeeded(item), "host:1:a", uuid.uuid4(), LEASE
    )

    assert handed.written and handed.next is not None and handed.next.key == "s00001"
    assert group_commit.counts["statements"] - before.get("statements", 0) == 1
    assert group_commit.counts["joined"] == before.get("joined", 0)
    assert group_commit.counts["shared"] == before.get("shared", 0)


def test_a_grouped_hand_over_fences_each_item_and_takes_a_next_item_for_each_thread() -> None:
    run = prepared("slots_run", n=5)
    owners = ["host:1:a", "host:1:b", "host:1:c"]
    taken = claimed_one_each(run, owners)
    (ta, a), (tb, b), (tc, c) = taken
    group = [
        Handing(ta, succeeded(a), owners[0], uuid.uuid4()),
        # b's claim was lost (its lease ran out and another owner took it): dropped, unwritten.
        Handing(uuid.uuid4(), succeeded(b), owners[1], uuid.uuid4()),
        Handing(tc, succeeded(c), owners[2], uuid.uuid4()),
    ]

    answers = hand_over_group(run.pk, group, LEASE)

    assert [x.written for x in answers] == [True, False, True]
    # The next items in work-list order, each under its thread's new token and name.
    assert [x.next.key if x.next else None for x in answers] == ["s00003", None, "s00004"]
    for handing, answer in zip(group, answers, strict=True):
        if answer.next is not None:
            row = ItemClaim.objects.get(pk=answer.next.pk)
            assert (row.owner, row.claim_token) == (handing.owner, handing.new_token)
    statuses = dict(ItemClaim.objects.filter(run=run).values_list("key", "status"))
    assert statuses == {
        "s00000": ItemStatus.SUCCEEDED,
        "s00001": ItemStatus.RUNNING,
        "s00002": ItemStatus.SUCCEEDED,
        "s00003": ItemStatus.RUNNING,
        "s00004": ItemStatus.RUNNING,
    }
    run.refresh_from_db()
    assert run.in_flight == 3
