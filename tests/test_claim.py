"""Claim: one owner per item, fenced outcomes, leases that live while the owner does."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from fanout.claim import ClaimResult, claim
from fanout.definition import get_definition
from fanout.dispatch import dispatch
from fanout.models import BatchRun, ItemClaim, ItemStatus, RunStatus
from fanout.record import FAILED, SUCCEEDED, ExecutionOutcome, record
from tests.conftest import executions, items, keys, prepare, start
from tests.procs import wait_until
from tests.testapp.models import Observation


def take(run: BatchRun, owner: str, limit: int = 1, lease_seconds: float = 30) -> ClaimResult:
    definition = get_definition(run.definition)
    return claim(run.pk, owner, limit, lease_seconds, definition.crash_budget, None)


def expire_leases(run: BatchRun) -> int:
    """What a dead owner leaves behind: running items whose lease has run out."""
    return ItemClaim.objects.filter(run=run, status=ItemStatus.RUNNING).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )


@pytest.mark.django_db
def test_a_claim_sets_owner_a_fresh_token_and_a_lease() -> None:
    run = prepare("t_ledger", {"n": 5})
    before = timezone.now()

    first = take(run, "owner-a", limit=2, lease_seconds=30)
    second = take(run, "owner-b", limit=2, lease_seconds=30)

    after = timezone.now()
    assert [i.key for i in first.items] == ["k00000", "k00001"]
    assert [i.key for i in second.items] == ["k00002", "k00003"]
    assert first.token is not None and second.token is not None
    assert first.token != second.token
    rows = items(run.pk)
    for key, result, owner in [
        ("k00000", first, "owner-a"),
        ("k00001", first, "owner-a"),
        ("k00002", second, "owner-b"),
    ]:
        row = rows[key]
        assert row.status == ItemStatus.RUNNING
        assert row.owner == owner
        assert row.claim_token == result.token
        assert row.attempt == 1
        assert before + timedelta(seconds=30) <= row.lease_expires_at
        assert row.lease_expires_at <= after + timedelta(seconds=30)
        assert before <= row.claimed_at <= after
    assert rows["k00004"].status == ItemStatus.PENDING
    assert rows["k00004"].claim_token is None


@pytest.mark.django_db
def test_an_item_under_a_live_lease_is_not_claimable_by_another_worker() -> None:
    run = prepare("t_ledger", {"n": 1})
    held = take(run, "owner-a")

    other = take(run, "owner-b")

    assert other.items == []
    assert other.token is None
    assert other.reason == "nothing claimable"
    # The other worker knows when to look again: when the lease runs out.
    assert other.retry_at == items(run.pk)["k00000"].lease_expires_at
    assert items(run.pk)["k00000"].claim_token == held.token


@pytest.mark.django_db
def test_an_expired_lease_makes_the_item_claimable_by_anyone() -> None:
    run = prepare("t_ledger", {"n": 1})
    dead = take(run, "owner-dead")
    expire_leases(run)

    assert list(ItemClaim.objects.claimable(timezone.now()).values_list("key", flat=True)) == [
        "k00000"
    ]
    taken = take(run, "owner-b")

    assert [i.key for i in taken.items] == ["k00000"]
    row = items(run.pk)["k00000"]
    assert row.owner == "owner-b"
    assert row.claim_token == taken.token != dead.token
    assert row.lease_expires_at > timezone.now()
    assert row.crashes == 1
    assert row.attempt == 1  # a crash is not the handler's fault: no attempt used


@pytest.mark.django_db
def test_a_worker_that_lost_its_lease_cannot_record_an_outcome() -> None:
    run = prepare("t_ledger", {"n": 1})
    old = take(run, "owner-old")
    pk = old.items[0].pk
    expire_leases(run)
    new = take(run, "owner-new")
    assert new.token is not None and old.token is not None

    late = record(
        run.pk, old.token, [ExecutionOutcome(pk, "k00000", SUCCEEDED, result="old")], "collect"
    )

    assert (late.written, late.dropped) == (0, 1)
    row = items(run.pk)["k00000"]
    assert (row.status, row.owner, row.claim_token, row.result) == (
        ItemStatus.RUNNING,
        "owner-new",
        new.token,
        None,
    )

    current = record(
        run.pk, new.token, [ExecutionOutcome(pk, "k00000", SUCCEEDED, result="new")], "collect"
    )
    later = record(
        run.pk,
        old.token,
        [ExecutionOutcome(pk, "k00000", FAILED, error="late", error_class="X")],
        "collect",
    )

    assert (current.written, current.dropped) == (1, 0)
    assert (later.written, later.dropped) == (0, 1)
    row = items(run.pk)["k00000"]
    assert (row.status, row.result, row.error) == (ItemStatus.SUCCEEDED, "new", "")


@pytest.mark.django_db
def test_an_owner_that_dies_more_than_the_crash_budget_fails_its_item_as_worker_lost() -> None:
    run = prepare("t_budget", {"n": 1})  # crash_budget=2
    assert get_definition("t_budget").crash_budget == 2

    for crashes in range(3):
        result = take(run, f"owner-{crashes}")
        assert [i.key for i in result.items] == ["k00000"]
        assert items(run.pk)["k00000"].crashes == crashes
        assert result.crashed_out == 0
        expire_leases(run)

    result = take(run, "owner-3")

    assert result.crashed_out  # the worker is told, so it can try the join
    assert result.items == []
    row = items(run.pk)["k00000"]
    assert row.status == ItemStatus.FAILED
    assert row.error_class == "WorkerLost"
    assert row.crashes == 3
    assert row.claim_token is None
    assert "crash budget 2" in row.error


@pytest.mark.django_db
def test_an_item_that_spends_its_crash_budget_is_counted_once() -> None:
    run = prepare("t_fail_fast_budget", {"n": 1})  # crash_budget=0
    take(run, "owner-dead")
    expire_leases(run)

    result = take(run, "owner-b")

    assert items(run.pk)["k00000"].crashes == 1
    assert result.crashed_out == 1


@pytest.mark.django_db
def test_an_item_failed_for_worker_lost_cancels_unclaimed_items_of_a_fail_fast_run() -> None:
    run = prepare("t_fail_fast_budget", {"n": 3})  # fail_fast, crash_budget=0
    take(run, "owner-dead")
    expire_leases(run)

    # Room for every item, so this claim looks at the dead owner's item whatever its order.
    result = take(run, "owner-b", limit=3)

    assert result.crashed_out
    rows = items(run.pk)
    assert rows["k00000"].error_class == "WorkerLost"
    assert result.items == []
    assert rows["k00001"].status == ItemStatus.CANCELLED
    assert rows["k00002"].status == ItemStatus.CANCELLED


@pytest.mark.django_db(transaction=True)
def test_the_handler_runs_outside_the_claim_transaction() -> None:
    run = start("t_ledger", {"n": 4, "probe": True}, workers=2)

    assert run.status == RunStatus.SUCCEEDED
    seen = dict(
        Observation.objects.filter(run_id=run.pk, name="in_atomic_block").values_list(
            "key", "value"
        )
    )
    assert seen == dict.fromkeys(keys(4), False)


@pytest.mark.django_db(transaction=True)
def test_a_lease_is_renewed_while_a_handler_runs_longer_than_the_lease() -> None:
    definition = get_definition("t_lease")
    # Renewed every 2/3 s: a lease that outlived the handler without renewal would need 5 s.
    assert definition.lease_seconds == 2
    run = prepare("t_lease", {"n": 1, "sleep": 5})
    # Two workers: the idle one would take the item over the moment its lease lapsed.
    handle = dispatch(run, definition, "inline", workers=2)
    assert handle is not None
    leases = set()

    def observe() -> bool:
        now = timezone.now()
        row = ItemClaim.objects.get(run=run, key="k00000")
        if row.status == ItemStatus.RUNNING:
            assert row.lease_expires_at > now, "the lease of a live owner ran out"
            leases.add(row.lease_expires_at)
        return row.status == ItemStatus.SUCCEEDED

    wait_until(observe, 20, "the long item to finish", every=0.1)
    handle.join(timeout=20)

    row = items(run.pk)["k00000"]
    assert len(leases) >= 4  # renewed, not just granted once
    assert (row.status, row.attempt, row.crashes) == (ItemStatus.SUCCEEDED, 1, 0)
    assert executions(run.pk) == {"k00000": 1}
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_an_item_reclaimed_after_its_owner_died_still_runs_when_max_attempts_is_1() -> None:
    definition = get_definition("t_crash")
    assert definition.max_attempts == 1
    run = prepare("t_crash", {"n": 2})
    claim(run.pk, "owner-dead", 1, 30, definition.crash_budget, None)
    expire_leases(run)

    handle = dispatch(run, definition, "inline", workers=2)
    assert handle is not None
    handle.join(timeout=30)

    run.refresh_from_db()
    row = items(run.pk)["k00000"]
    assert run.status == RunStatus.SUCCEEDED
    assert (row.status, row.attempt, row.crashes) == (ItemStatus.SUCCEEDED, 1, 1)
    assert executions(run.pk) == {"k00000": 1, "k00001": 1}


# The hot path's cost: a plan that uses the partial index, a query count that does not grow.


def add_items(run: BatchRun, count: int, status: str, first_index: int) -> None:
    """Insert ``count`` items quickly with one statement."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO fanout_itemclaim (run_id, key, index, pool, status, owner, attempt, "
            "crashes, next_attempt_at, error, error_class) "
            "SELECT %s, 'x' || i, i, '', %s, '', 1, 0, now() - interval '1 minute', '', '' "
            "FROM generate_series(%s, %s) AS i",
            [run.pk, status, first_index, first_index + count - 1],
        )


def new_run(run_key: str) -> BatchRun:
    return BatchRun.objects.create(
        definition="t_ledger",
        run_key=run_key,
        status=RunStatus.RUNNING,
        max_parallel=100,
        failure_policy="collect",
        join_mode="all",
    )


def claim_queries(run: BatchRun, limit: int) -> list[str]:
    with CaptureQueriesContext(connection) as ctx:
        result = claim(run.pk, "probe", limit, 30, 3, None)
    assert len(result.items) == limit
    return [q["sql"] for q in ctx.captured_queries if "SAVEPOINT" not in q["sql"]]


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL SQL")
def test_the_pending_claim_query_is_served_by_the_claim_index() -> None:
    run = new_run("explained")
    add_items(run, 20_000, ItemStatus.SUCCEEDED, 0)
    add_items(run, 50, ItemStatus.PENDING, 20_000)
    other = new_run("other")
    add_items(other, 5_000, ItemStatus.SUCCEEDED, 0)
    with connection.cursor() as cursor:
        # Committed rows and fresh statistics, as autovacuum keeps them on a live database.
        cursor.execute("VACUUM ANALYZE fanout_itemclaim")

    sql = [
        q for q in claim_queries(run, 5) if "SKIP LOCKED" in q and "'pending'" in q.replace('"', "")
    ]

    assert len(sql) == 1, sql
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql[0])
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "fanout_item_claim_idx" in plan, plan
    assert "Seq Scan" not in plan, plan


@pytest.mark.django_db
@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL SQL")
def test_claiming_a_batch_takes_the_same_few_queries_whatever_the_run_size() -> None:
    # A run of its own for each measurement: each is the first claim of its run in this process.
    small, small_too = new_run("small"), new_run("small-too")
    add_items(small, 10, ItemStatus.PENDING, 0)
    add_items(small_too, 10, ItemStatus.PENDING, 0)
    large = new_run("large")
    add_items(large, 3_000, ItemStatus.SUCCEEDED, 0)
    add_items(large, 5_000, ItemStatus.PENDING, 3_000)

    one = claim_queries(small, 1)
    batch = claim_queries(small_too, 5)
    large_batch = claim_queries(large, 5)

    assert len(one) == len(batch) == len(large_batch)
    # Two of them plan the picks without sorts (claim.walking_indexes).
    assert len(large_batch) <= 8, large_batch


@pytest.mark.django_db
def test_a_run_at_max_parallel_says_when_a_held_lease_runs_out() -> None:
    # Every slot is held (its owner may be dead): the claimer learns when the first lease
    # runs out, so that an idle drain stays to reclaim it instead of leaving.
    run = prepare("t_ledger", {"n": 5})
    BatchRun.objects.filter(pk=run.pk).update(max_parallel=2)
    held = take(run, "owner-a", limit=2, lease_seconds=30)
    assert len(held.items) == 2

    waiting = take(run, "owner-b", limit=1, lease_seconds=30)

    assert waiting.items == []
    assert waiting.reason == "run at max_parallel (2/2)"
    expires = min(
        ItemClaim.objects.filter(run=run).running().values_list("lease_expires_at", flat=True)
    )
    assert waiting.retry_at == expires
    assert 0 < waiting.retry_in <= 30


@pytest.mark.django_db
@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL's one statement")
def test_a_batch_of_successes_is_locked_fenced_and_written_in_one_statement() -> None:
    run = prepare("t_ledger", {"n": 4})
    old = take(run, "owner-old", limit=4)
    assert old.token is not None
    lost = old.items[2]
    # One of the four was lost: its lease ran out and another worker took it over.
    ItemClaim.objects.filter(pk=lost.pk).update(lease_expires_at=timezone.now())
    new = take(run, "owner-new")
    assert [i.pk for i in new.items] == [lost.pk]
    finished = timezone.now()
    outcomes = [
        ExecutionOutcome(
            i.pk, i.key, SUCCEEDED, result={"n": n} if n else None, finished_at=finished
        )
        for n, i in enumerate(old.items)
    ]

    with CaptureQueriesContext(connection) as ctx:
        done = record(run.pk, old.token, outcomes, "collect")

    assert (done.written, done.dropped, done.terminal) == (3, 1, 3)
    touching = [q["sql"] for q in ctx.captured_queries if "fanout_itemclaim" in q["sql"]]
    assert len(touching) == 1, touching
    rows = items(run.pk)
    assert [(rows[i.key].status, rows[i.key].result) for i in old.items] == [
        (ItemStatus.SUCCEEDED, None),
        (ItemStatus.SUCCEEDED, {"n": 1}),
        (ItemStatus.RUNNING, None),
        (ItemStatus.SUCCEEDED, {"n": 3}),
    ]
    for i in (old.items[0], old.items[1], old.items[3]):
        row = rows[i.key]
        assert (row.claim_token, row.lease_expires_at, row.error, row.error_class) == (
            None,
            None,
            "",
            "",
        )
        assert row.finished_at == finished
    assert rows[lost.key].claim_token == new.token
    assert BatchRun.objects.get(pk=run.pk).in_flight == 1
