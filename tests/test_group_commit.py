"""Group commit: the hand-overs of a process's threads that finish items of one run while one
is in flight go together in the next statement, each fenced by its own claim, and a thread
that finds none in flight goes at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.db import DataError, connection, connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from fanout import group_commit
from fanout.claim import claim
from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.lease import LeaseKeeper
from fanout.models import BatchRun, CapacityPool, ItemClaim, ItemStatus
from fanout.transitions import SUCCEEDED, ExecutionOutcome, Handing, HandOver, hand_over_group
from fanout.transitions.items import settle
from tests import procs
from tests.conftest import executions
from tests.procs import wait_until
from tests.testapp.models import Execution

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL groups hand-overs"),
]

LEASE, CRASH_BUDGET = 30, 1


def prepared(name: str, **params: Any) -> BatchRun:
    return prepare_run(get_definition(name), params, f"{name}-{uuid.uuid4().hex[:8]}")


def succeeded(item: Any, pool: str = "") -> ExecutionOutcome:
    return ExecutionOutcome(item.pk, item.key, SUCCEEDED, result={"ok": item.key}, pool=pool)


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


def waiting_for_a_lock(pids: list[int]) -> int:
    """How many of these sessions wait for a lock."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE pid = ANY(%s) AND wait_event_type = 'Lock'",
            [pids],
        )
        return int(cursor.fetchone()[0])


class Thread(threading.Thread):
    """A worker thread that hands one item over and keeps the SQL its own session sent."""

    def __init__(self, run: BatchRun, token: uuid.UUID, item: Any, owner: str) -> None:
        super().__init__()
        self.args_ = (run.pk, token, succeeded(item), owner, uuid.uuid4(), LEASE)
        self.answer: HandOver | None = None
        self.error: Exception | None = None
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
                try:
                    self.answer = group_commit.shared_hand_over(*self.args_)
                except Exception as exc:
                    self.error = exc
            self.sent = [q["sql"] for q in queries.captured_queries]
        finally:
            connections["default"].close()


def test_hand_overs_that_come_while_two_are_in_flight_go_together_in_the_next_statement() -> None:
    run = prepared("slots_run", n=4)
    owners = ["host:1:a", "host:1:b", "host:1:c", "host:1:d"]
    taken = claimed_one_each(run, owners)
    threads = [Thread(run, t, i, o) for (t, i), o in zip(taken, owners, strict=True)]
    leading, later = threads[:2], threads[2:]
    before = dict(group_commit.counts)
    # Nothing is left to hand the slots to: each hand-over gives its slot up on the run's row,
    # which this holder keeps locked until the others have queued behind the first two.
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
    holder.start()
    try:
        assert locked.wait(30)
        for n, thread in enumerate(leading, 1):
            thread.start()
            assert thread.ready.wait(30)
            pids = [t.pid for t in leading[:n] if t.pid is not None]
            wait_until(
                lambda pids=pids: waiting_for_a_lock(pids) == len(pids),
                30,
                "the hand-overs in flight to wait",
            )
        for thread in later:
            thread.start()
        joined = before.get("joined", 0) + 2
        wait_until(lambda: group_commit.counts["joined"] >= joined, 30, "the others to queue")
    finally:
        release.set()
        holder.join()
        for thread in threads:
            thread.join(90)

    answers = [t.answer for t in threads]
    assert all(a is not None and a.written and a.next is None for a in answers)
    # Three statements in all: the first two alone (the plain hand-over), then the two that
    # queued behind them, together.
    statements = [sql for t in threads for sql in t.sent]
    assert len(statements) == 3, statements
    assert [len(t.sent) for t in leading] == [1, 1]
    assert all("fanout_hand_over(" in t.sent[0] for t in leading)
    assert sorted(len(t.sent) for t in later) == [0, 1]
    [shared] = [t.sent[0] for t in later if t.sent]
    assert "fanout_hand_over_group(" in shared
    assert group_commit.counts["statements"] - before.get("statements", 0) == 3
    assert group_commit.counts["shared"] - before.get("shared", 0) == 2
    assert set(ItemClaim.objects.filter(run=run).values_list("status", flat=True)) == {
        ItemStatus.SUCCEEDED
    }
    run.refresh_from_db()
    assert run.in_flight == 0


@override_settings(FANOUT_GROUP_COMMIT_LANES=1)
def test_an_outcome_the_database_refuses_fails_its_own_hand_over_not_its_groups() -> None:
    run = prepared("slots_run", n=3)
    owners = ["host:1:a", "host:1:b", "host:1:c"]
    taken = claimed_one_each(run, owners)
    first, good, bad = (Thread(run, t, i, o) for (t, i), o in zip(taken, owners, strict=True))
    # A float PostgreSQL's jsonb refuses (the handler's answer is checked before; this stands
    # for any outcome that fails the group's statement for good).
    bad.args_[2].result = {"v": float("nan")}
    before = dict(group_commit.counts)
    with RowHolder("fanout_batchrun", "id", run.pk):
        first.start()
        assert first.ready.wait(30)
        assert first.pid is not None
        wait_until(lambda: waiting_for_a_lock([first.pid]), 30, "the first hand-over to wait")
        good.start()
        bad.start()
        joined = before.get("joined", 0) + 2
        wait_until(lambda: group_commit.counts["joined"] >= joined, 30, "the others to queue")
    for thread in (first, good, bad):
        thread.join(90)

    assert first.answer is not None and first.answer.written
    # Their shared statement failed; each then went alone, and only the refused one failed.
    assert good.error is None and good.answer is not None and good.answer.written
    assert isinstance(bad.error, DataError) and bad.answer is None
    statuses = dict(ItemClaim.objects.filter(run=run).values_list("key", "status"))
    assert statuses == {
        "s00000": ItemStatus.SUCCEEDED,
        "s00001": ItemStatus.SUCCEEDED,
        "s00002": ItemStatus.RUNNING,
    }


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


def hand_overs_waiting(run_id: int, grouped: bool = False) -> list[int]:
    """Sessions whose hand-over (``grouped``: of several items) waits for a lock."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND query LIKE %s",
            ["%fanout_hand_over_group(%" if grouped else "%fanout_hand_over%"],
        )
        return [pid for (pid,) in cursor.fetchall()]


def hand_overs_in_flight() -> bool:
    """Whether any hand-over statement still runs in this database (a dead worker's too)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND state = 'active' AND query LIKE %s AND pid <> pg_backend_pid()",
            ["%fanout_hand_over%"],
        )
        return bool(cursor.fetchone()[0])


class RowHolder(threading.Thread):
    """Holds one row's lock in a transaction of its own until released."""

    def __init__(self, table: str, where: str, value: Any) -> None:
        super().__init__()
        self.sql = f"SELECT 1 FROM {table} WHERE {where} = %s FOR UPDATE"
        self.value = value
        self.locked, self.release = threading.Event(), threading.Event()

    def run(self) -> None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(self.sql, [self.value])
                self.locked.set()
                self.release.wait(90)
        finally:
            connections["default"].close()

    def __enter__(self) -> RowHolder:
        self.start()
        assert self.locked.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.join(30)


@pytest.mark.parametrize("ending", ["session ended", "statement finished"])
def test_a_worker_killed_while_a_shared_hand_over_is_in_flight_loses_all_of_it_or_none(
    children: list[subprocess.Popen[str]], tmp_path: Path, database_url: str, ending: str
) -> None:
    from tests.testapp.fanouts_group import GROUP_POOL, GROUP_POOL_FIRST

    for name in (GROUP_POOL_FIRST, GROUP_POOL):
        CapacityPool.objects.create(name=name, max_concurrency=8)
    cues, log = tmp_path / "cues", tmp_path / "worker.log"
    cues.mkdir()
    env = procs.child_env(database_url, FANOUT_LOG_LEVEL="DEBUG")
    command = ["run_fanout", "group_kill", "--param", f"cue_dir={cues}", "--workers", "4"]
    with open(log, "w") as stderr:
        worker = subprocess.Popen(
            [procs.PYTHON, "manage.py", *command],
            cwd=procs.ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
    children.append(worker)
    # Four threads each run one of the four items, until cued.
    procs.wait_until(lambda: Execution.objects.count() == 4, 60, "four items to start")
    run = BatchRun.objects.get(definition="group_kill")
    *first, a, b = ItemClaim.objects.filter(run=run).order_by("index")
    rest = [a, b]
    assert {i.pool for i in first} == {GROUP_POOL_FIRST} and {a.pool, b.pool} == {GROUP_POOL}

    # Each finished item gives its slot up (nothing is pending): on the run's row, then on
    # its pool's. The run's row held here keeps the first two items' hand-overs in flight (as
    # many as a process sends at once) while the two others finish and queue behind them; the
    # second pool's row then keeps their shared one in flight, with the first of the two
    # written and the second not yet.
    pool_row = RowHolder("fanout_capacitypool", "name", GROUP_POOL).__enter__()
    try:
        with RowHolder("fanout_batchrun", "id", run.pk):
            for n, item in enumerate(first, 1):
                (cues / item.key).touch()
                procs.wait_until(
                    lambda n=n: len(hand_overs_waiting(run.pk)) == n, 30, "a hand-over in flight"
                )
            for item in rest:
                (cues / item.key).touch()
            procs.wait_until(
                lambda: log.read_text().count("joins the next one in flight") == 2,
                30,
                "the two others to queue behind them",
            )
        # The first hand-overs commit now, unless the shared one, sent as soon as the first
        # of them committed, took the run's row before the second (PostgreSQL's row-lock
        # waiters are not served in order): then the second waits behind the shared one, and
        # dies with the worker or commits after it, as any hand-over in flight may.
        [backend] = procs.wait_until(
            lambda: hand_overs_waiting(run.pk, grouped=True),
            30,
            "the shared hand-over to be in flight",
        )

        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        if ending == "session ended":
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(%s)", [backend])
    finally:
        pool_row.__exit__()

    def settled() -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [backend])
            if cursor.fetchone()[0]:
                return False
        return not hand_overs_in_flight()

    procs.wait_until(settled, 30, "the dead worker's sessions to end")
    first_recorded = set(
        ItemClaim.objects.filter(
            pk__in=[i.pk for i in first], status=ItemStatus.SUCCEEDED
        ).values_list("pk", flat=True)
    )
    statuses = {i.status for i in ItemClaim.objects.filter(pk__in=[i.pk for i in rest])}
    # Never half: both outcomes were committed, or neither was.
    assert len(statuses) == 1, statuses
    recorded = statuses == {ItemStatus.SUCCEEDED}
    if ending == "session ended":
        assert not recorded, "a statement whose session was ended committed"

    # What was not recorded runs again once its lease runs out; what was, does not.
    procs.wait_until(
        lambda: (
            not ItemClaim.objects.filter(run=run, status=ItemStatus.RUNNING)
            .exclude(lease_expires_at__lte=timezone.now())
            .exists()
        ),
        30,
        "the dead worker's leases to run out",
    )
    done = procs.manage(["run_fanout", "--resume", str(run.pk), "--workers", "2", "--json"], env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["status"] == "succeeded"
    assert set(ItemClaim.objects.filter(run=run).values_list("status", flat=True)) == {
        ItemStatus.SUCCEEDED
    }
    again = 1 if recorded else 2
    assert executions(run.pk) == {
        **{i.key: 1 if i.pk in first_recorded else 2 for i in first},
        **{i.key: again for i in rest},
    }
    run.refresh_from_db()
    assert run.in_flight == 0
    assert set(CapacityPool.objects.values_list("in_flight", flat=True)) == {0}


def physical_places(run_id: int) -> list[tuple[int, tuple[int, int]]]:
    """Where each item of the run lies in its table: (id, (page, line))."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT id, ctid::text FROM fanout_itemclaim WHERE run_id = %s", [run_id])
        rows = cursor.fetchall()
    return [(pk, tuple(int(n) for n in ctid.strip("()").split(","))) for pk, ctid in rows]


class Renewal(threading.Thread):
    """A lease keeper's round over these items, in a session of its own."""

    def __init__(self, held: list[tuple[uuid.UUID, Any]]) -> None:
        super().__init__()
        self.keeper = LeaseKeeper(LEASE)
        for token, item in held:
            self.keeper.hold(token, [item.pk])
        self.pid: int | None = None
        self.ready = threading.Event()
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SET lock_timeout = '60s'")
            self.pid = backend_pid()
            self.ready.set()
            try:
                self.keeper.renew_now()
            except Exception as exc:
                self.error = exc
        finally:
            connections["default"].close()


class Group(threading.Thread):
    """One grouped hand-over statement, in a session of its own."""

    def __init__(self, run: BatchRun, group: list[Handing]) -> None:
        super().__init__()
        self.run_id, self.group = run.pk, group
        self.answers: list[HandOver] = []
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SET lock_timeout = '60s'")
            try:
                self.answers = hand_over_group(self.run_id, self.group, LEASE)
            except Exception as exc:
                self.error = exc
        finally:
            connections["default"].close()


def test_a_lease_renewal_and_a_group_whose_pools_sort_against_its_ids_do_not_deadlock() -> None:
    from tests.testapp.fanouts_group import GROUP_POOL_EARLY_NAME, GROUP_POOL_LATE_NAME

    for name in (GROUP_POOL_LATE_NAME, GROUP_POOL_EARLY_NAME):
        CapacityPool.objects.create(name=name, max_concurrency=8)
    run = prepared("group_pools_against_ids", n=4)
    owners = ["host:1:a", "host:1:b", "host:1:c", "host:1:d"]
    taken = claimed_one_each(run, owners)
    # A renewal locks its rows in the order it finds them, by id or where they lie in the
    # table; a group, by pool and then id. Two items whose pools sort against both orders:
    where = dict(physical_places(run.pk))
    (ta, a), (tb, b) = next(
        (x, y)
        for x in taken
        for y in taken
        if x[1].pool > y[1].pool and x[1].pk < y[1].pk and where[x[1].pk] < where[y[1].pk]
    )
    taken = [(ta, a), (tb, b)]
    group = Group(
        run,
        [
            Handing(ta, succeeded(a, pool=a.pool), "host:1:a", uuid.uuid4()),
            Handing(tb, succeeded(b, pool=b.pool), "host:1:b", uuid.uuid4()),
        ],
    )
    renewal = Renewal(taken)
    # Nothing is left to hand the slots to: the group writes b, then waits for the run's row.
    with RowHolder("fanout_batchrun", "id", run.pk):
        group.start()
        wait_until(lambda: hand_overs_waiting(run.pk, grouped=True), 30, "the group to wait")
        renewal.start()
        assert renewal.ready.wait(30)
        assert renewal.pid is not None
        pid = renewal.pid
        wait_until(
            lambda: not renewal.is_alive() or waiting_for_a_lock([pid]),
            30,
            "the renewal to wait or end",
        )
    group.join(60)
    renewal.join(60)

    # Neither is chosen as a deadlock's victim: the statement that records both outcomes, or
    # the round that keeps every lease of the process alive, would fail.
    assert group.error is None, group.error
    assert renewal.error is None, renewal.error
    assert [x.written for x in group.answers] == [True, True]
    assert set(ItemClaim.objects.filter(pk__in=[a.pk, b.pk]).values_list("status", flat=True)) == {
        ItemStatus.SUCCEEDED
    }
    run.refresh_from_db()
    assert run.in_flight == 2
    pools = CapacityPool.objects.filter(name__in=[a.pool, b.pool])
    assert sorted(pools.values_list("in_flight", flat=True)) == [1, 1]


class Settle(threading.Thread):
    """A stopping worker's main thread records one finished item (fanout.rq._give_back), in a
    session of its own."""

    def __init__(self, run: BatchRun, token: uuid.UUID, item: Any) -> None:
        super().__init__()
        self.args_ = (run.pk, token, [succeeded(item, pool=item.pool)])
        self.pid: int | None = None
        self.ready = threading.Event()
        self.written: list[int] | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SET lock_timeout = '60s'")
            self.pid = backend_pid()
            self.ready.set()
            try:
                self.written = settle(*self.args_)
            except Exception as exc:
                self.error = exc
        finally:
            connections["default"].close()


def test_a_group_takes_its_items_before_the_runs_row_as_a_record_of_one_of_them_does() -> None:
    from tests.testapp.fanouts_group import GROUP_POOL_EARLY_NAME, GROUP_POOL_LATE_NAME

    for name in (GROUP_POOL_LATE_NAME, GROUP_POOL_EARLY_NAME):
        CapacityPool.objects.create(name=name, max_concurrency=8)
    run = prepared("group_pools_against_ids", n=4)
    taken = claimed_one_each(run, ["host:1:a", "host:1:b", "host:1:c", "host:1:d"])
    # The group goes by pool: b, whose slot it gives up on the run's row, and then a.
    (ta, a), (tb, b) = next((x, y) for x in taken for y in taken if x[1].pool > y[1].pool)
    group = Group(
        run,
        [
            Handing(ta, succeeded(a, pool=a.pool), "host:1:a", uuid.uuid4()),
            Handing(tb, succeeded(b, pool=b.pool), "host:1:b", uuid.uuid4()),
        ],
    )
    # Meanwhile the process stops, and its main thread records a for the thread that waits
    # for the group: a's row, then the run's.
    record = Settle(run, ta, a)
    with RowHolder("fanout_batchrun", "id", run.pk):
        group.start()
        wait_until(lambda: hand_overs_waiting(run.pk, grouped=True), 30, "the group to wait")
        record.start()
        assert record.ready.wait(30)
        assert record.pid is not None
        pid = record.pid
        wait_until(lambda: waiting_for_a_lock([pid]), 30, "the record to wait")
    group.join(60)
    record.join(60)

    # Neither is a deadlock's victim; b is recorded once, and a once, by one of them.
    assert group.error is None, group.error
    assert record.error is None, record.error
    assert [x.written for x in group.answers].count(True) + len(record.written or []) == 2
    assert set(ItemClaim.objects.filter(pk__in=[a.pk, b.pk]).values_list("status", flat=True)) == {
        ItemStatus.SUCCEEDED
    }
    run.refresh_from_db()
    assert run.in_flight == 2
    pools = CapacityPool.objects.filter(name__in=[a.pool, b.pool])
    assert sorted(pools.values_list("in_flight", flat=True)) == [1, 1]
