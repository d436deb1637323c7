"""MariaDB/MySQL: the database's clock is UTC, whatever time zone a session is on.

Django's MySQL backend leaves the session's ``time_zone`` alone, and the DATETIME columns hold
UTC: a clock read in the session's zone (``NOW()``, ``CURRENT_TIMESTAMP``) would put leases and
rate buckets hours off, and hosts whose sessions are on different zones would steal each
other's live leases or never reclaim a dead owner's.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.utils import timezone

from fanout.claim import ClaimResult, claim
from fanout.clock import db_now
from fanout.definition import get_definition
from fanout.models import BatchRun, CapacityPool, ItemClaim
from fanout.transitions import SUCCEEDED, ExecutionOutcome, hand_over
from tests import procs
from tests.conftest import items, prepare
from tests.procs import wait_until
from tests.testapp.fanouts_pools import RATE_POOL

pytestmark = [
    pytest.mark.skipif("connection.vendor != 'mysql'", reason="MariaDB/MySQL's session zone"),
    pytest.mark.django_db,
]

EAST = "+05:00"  # a session five hours ahead of UTC
UTC_ZONE = "+00:00"


@pytest.fixture
def zone() -> Iterator[Callable[[str], None]]:
    """Put this test's database session on a time zone; the session's own again at the end."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT @@session.time_zone")
        was = cursor.fetchone()[0]

    def set_zone(name: str) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION time_zone = %s", [name])

    yield set_zone
    set_zone(was)


def utc_now() -> datetime:
    """The server's time by UTC, whatever the session's zone."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT UTC_TIMESTAMP(6)")
        return timezone.make_aware(cursor.fetchone()[0], UTC)


def take(run: BatchRun, owner: str, limit: int = 1, lease_seconds: float = 30) -> ClaimResult:
    definition = get_definition(run.definition)
    return claim(run.pk, owner, limit, lease_seconds, definition.crash_budget, None)


def test_a_lease_taken_on_a_session_five_hours_east_of_utc_ends_lease_seconds_later_by_utc(
    zone: Callable[[str], None],
) -> None:
    run = prepare("t_ledger", {"n": 3})
    zone(EAST)
    before = utc_now()
    clock = db_now()
    first = take(run, "owner-a", lease_seconds=30)
    item = first.items[0]
    assert first.token is not None
    # The hand-over (the stored procedure) takes the next item's lease on the same clock.
    outcome = ExecutionOutcome(item.pk, item.key, SUCCEEDED, pool=item.pool, result={"i": 0})
    done = hand_over(run.pk, first.token, outcome, "owner-a", uuid.uuid4(), 30)
    after = utc_now()

    assert done.written and done.next is not None
    assert before <= clock <= after
    rows = items(run.pk)
    for key in (item.key, done.next.key):
        row = rows[key]
        assert before <= row.claimed_at <= after, key
        assert before <= row.started_at <= after, key
    assert before <= rows[item.key].finished_at <= after
    lease = rows[done.next.key].lease_expires_at
    assert before + timedelta(seconds=30) <= lease <= after + timedelta(seconds=30)


@pytest.mark.parametrize(
    ("taker", "reclaimer"),
    [(EAST, UTC_ZONE), (UTC_ZONE, EAST)],
    ids=["taken-east-reclaimed-on-utc", "taken-on-utc-reclaimed-east"],
)
def test_a_lease_taken_on_one_zone_is_reclaimed_on_another_when_it_expires_and_not_before(
    zone: Callable[[str], None], taker: str, reclaimer: str
) -> None:
    lease = 6.0
    run = prepare("t_ledger", {"n": 1})
    zone(taker)
    taken_at = utc_now()
    assert take(run, "dead-owner", lease_seconds=lease).items
    zone(reclaimer)

    asked_at = utc_now()
    early = take(run, "live-owner")
    assert asked_at < taken_at + timedelta(seconds=lease), "the machine is too slow for this"
    assert not early.items, "a live lease was taken from its owner"

    # Its owner never renews it: it is reclaimed once it runs out, by the server's clock.
    wait_until(lambda: take(run, "live-owner").items, lease + 20, "the expired lease reclaimed")
    reclaimed_at = utc_now()
    assert reclaimed_at >= taken_at + timedelta(seconds=lease)
    assert ItemClaim.objects.get(run=run).owner == "live-owner"


@pytest.mark.parametrize(
    ("spender", "claimer"),
    [(UTC_ZONE, EAST), (EAST, UTC_ZONE)],
    ids=["spent-on-utc-claimed-east", "spent-east-claimed-on-utc"],
)
def test_a_rate_limits_tokens_refill_at_its_rate_whichever_zone_reads_the_bucket(
    zone: Callable[[str], None], spender: str, claimer: str
) -> None:
    # Two admissions per ten seconds: one token comes back every five seconds.
    CapacityPool.objects.create(name=RATE_POOL, max_concurrency=50, rate_count=2, rate_period=10.0)
    run = prepare("pools_rate", {"n": 10})
    zone(spender)
    spent_at = utc_now()
    assert len(take(run, "spender", limit=4).items) == 2
    zone(claimer)

    asked_at = utc_now()
    early = take(run, "claimer", limit=4)
    assert asked_at < spent_at + timedelta(seconds=5), "the machine is too slow for this"
    assert not early.items, "the bucket refilled before its time"

    admitted = wait_until(lambda: take(run, "claimer", limit=4).items, 30, "a token back")
    refilled_at = utc_now()
    assert len(admitted) == 1
    assert refilled_at >= spent_at + timedelta(seconds=5)
    # Slack for a loaded machine: the poll and the claims themselves take time.
    assert refilled_at <= spent_at + timedelta(seconds=5 + 10)


WEST = "-05:00"  # a server five hours behind UTC: a clock read in its zone lies in the past


@pytest.fixture
def server_zone() -> Iterator[Callable[[str], None]]:
    """Put the server's default time zone (what every new session starts on) on a zone; its own
    again at the end. This test's session reconnects to take it up."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT @@global.time_zone")
        was = cursor.fetchone()[0]

    def set_zone(name: str) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SET GLOBAL time_zone = %s", [name])
        connection.close()

    yield set_zone
    set_zone(was)


@pytest.mark.django_db(transaction=True)
def test_a_run_on_a_server_whose_time_zone_is_not_utc_runs_to_the_end_through_its_rate_limit(
    server_zone: Callable[[str], None], database_url: str
) -> None:
    # Items are written with the host's UTC time; a claim that read the server's clock in its
    # own zone would find none of them due for five hours, and a bucket five hours stale.
    CapacityPool.objects.create(name=RATE_POOL, max_concurrency=4, rate_count=20, rate_period=1.0)
    server_zone(WEST)
    with connection.cursor() as cursor:
        cursor.execute("SELECT @@session.time_zone")
        assert cursor.fetchone()[0] == WEST
    started = utc_now()

    done = procs.manage(
        ["run_fanout", "pools_rate", "--param", "n=30", "--workers", "4", "--json"],
        procs.child_env(database_url),
        timeout=120,
    )

    assert done.returncode == 0, done.stderr
    run = BatchRun.objects.get(definition="pools_rate")
    rows = list(ItemClaim.objects.filter(run=run))
    assert run.status == "succeeded" and len(rows) == 30
    finished = utc_now()
    for row in rows:
        assert started <= row.started_at <= row.finished_at <= finished, row.key
    # Its tokens were spent at UTC times, and 30 admissions at 20/s with a burst of 20 took
    # at least half a second by the server's clock.
    pool = CapacityPool.objects.get(name=RATE_POOL)
    assert pool.tokens_at is not None and started <= pool.tokens_at <= finished
    assert max(r.started_at for r in rows) - min(r.started_at for r in rows) >= timedelta(
        seconds=0.45
    )
