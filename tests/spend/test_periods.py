"""A pool's budget over a calendar period ("day", "month", ...) starts again from zero at the
period's boundary in UTC, by the database's clock, not a fixed length after its first use."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import override_settings

from fanout.claim import claim
from fanout.clock import calendar_end, calendar_start, db_now
from fanout.definition import get_definition
from fanout.errors import FanoutError
from fanout.models import CapacityPool, ItemClaim, RunStatus, SpendAccount
from fanout.pools import parse_budget
from tests.conftest import prepare
from tests.testapp.fanouts_spend import SPEND_POOL

pytestmark = pytest.mark.django_db(transaction=True)


def day_start(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def month_start(moment: datetime) -> datetime:
    return day_start(moment).replace(day=1)


def spent_pool(calendar: str, started: datetime) -> SpendAccount:
    """The pool's budget, all spent, in a period that began at ``started``."""
    CapacityPool.objects.create(name=SPEND_POOL, max_concurrency=10)
    return SpendAccount.objects.create(
        pool=SPEND_POOL,
        unit="usd",
        budget=1.0,
        spent=1.0,
        calendar=calendar,
        period_started_at=started,
    )


def claim_one() -> int:
    run = prepare("spend_pooled", {"n": 2, "estimate": 0.1})
    return len(claim(run.pk, "w:1", 1, 30, 3, SPEND_POOL, spend=True).items)


@pytest.mark.parametrize(("calendar", "start"), [("day", day_start), ("month", month_start)])
def test_a_calendar_budget_spent_in_the_last_period_admits_again_from_its_boundary(
    calendar: str, start: object
) -> None:
    now = db_now()
    boundary = start(now)  # type: ignore[operator]
    # Spent one second before this period began: a rolling day or 30 days would still hold.
    account = spent_pool(calendar, boundary - timedelta(seconds=1))
    assert claim_one() == 1
    account.refresh_from_db()
    assert account.spent == 0.0 and account.reserved == pytest.approx(0.1)
    assert account.period_started_at == boundary


@pytest.mark.parametrize(("calendar", "start"), [("day", day_start), ("month", month_start)])
def test_a_calendar_budget_spent_in_this_period_holds_until_its_end(
    calendar: str, start: object
) -> None:
    boundary = start(db_now())  # type: ignore[operator]
    account = spent_pool(calendar, boundary)
    assert claim_one() == 0
    account.refresh_from_db()
    assert (account.spent, account.reserved) == (1.0, 0.0)


def test_a_new_calendar_budget_counts_from_the_start_of_its_period_not_its_first_use() -> None:
    CapacityPool.objects.create(name=SPEND_POOL, max_concurrency=10)
    account = SpendAccount.objects.create(pool=SPEND_POOL, unit="usd", budget=5, calendar="month")
    assert claim_one() == 1
    account.refresh_from_db()
    assert account.period_started_at == month_start(db_now())


@pytest.mark.parametrize("period", ["day", "week", "month", "year"])
def test_a_pool_budget_takes_a_calendar_period_by_name(period: str) -> None:
    assert parse_budget("p", {"usd": 50, "period": period}) == ({"usd": 50.0}, period)


def test_a_pool_budget_refuses_a_period_that_is_neither_a_length_nor_a_calendar_one() -> None:
    with pytest.raises(FanoutError, match="'fortnight'.*day, week, month or year"):
        parse_budget("p", {"usd": 50, "period": "fortnight"})


@override_settings(FANOUT_POOLS={"llm-monthly": {"budget": {"usd": 50, "period": "month"}}})
def test_fanout_pools_sync_makes_a_calendar_budget() -> None:
    call_command("fanout_pools", "--sync", verbosity=0)
    account = SpendAccount.objects.get(pool="llm-monthly")
    assert (account.calendar, account.period, account.budget) == ("month", None, 50.0)


@pytest.mark.parametrize(
    ("period", "start", "end"),
    [
        ("day", datetime(2026, 12, 31, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC)),
        ("week", datetime(2026, 12, 28, tzinfo=UTC), datetime(2027, 1, 4, tzinfo=UTC)),
        ("month", datetime(2026, 12, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC)),
        ("year", datetime(2026, 1, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC)),
    ],
)
def test_calendar_periods_are_bounded_in_utc_whatever_the_moments_zone(
    period: str, start: datetime, end: datetime
) -> None:
    # 2026-12-31 23:30 UTC, said in UTC+2 (where it is already 2027): a Thursday in UTC.
    moment = datetime(2027, 1, 1, 1, 30, tzinfo=timezone(timedelta(hours=2)))
    assert calendar_start(moment, period) == start
    assert calendar_end(moment, period) == end


@override_settings(FANOUT_POOLS={"llm-daily": {"budget": {"usd": 50, "period": "day"}}})
def test_a_budget_made_when_day_was_a_rolling_period_counts_calendar_days_after_sync() -> None:
    # "day" meant a rolling 86400 s before: a row made then must not keep rolling while the
    # settings, the docs and the changelog say it is a calendar day now.
    CapacityPool.objects.create(name="llm-daily", max_concurrency=4)
    SpendAccount.objects.create(pool="llm-daily", unit="usd", budget=50, period=86400.0)
    call_command("fanout_pools", "--sync", verbosity=0)
    account = SpendAccount.objects.get(pool="llm-daily")
    assert (account.calendar, account.period, account.budget) == ("day", None, 50.0)


def test_spend_of_items_admitted_after_a_period_rolled_over_stays_in_the_new_period() -> None:
    # Hand-overs settle and admit without rolling the pool's period: spend that items admitted
    # in a new period piled onto the old one, and the next claim's roll wiped it out.
    CapacityPool.objects.create(name=SPEND_POOL, max_concurrency=1)
    account = SpendAccount.objects.create(pool=SPEND_POOL, unit="usd", budget=1000, period=2.0)
    other = prepare("spend_pooled", {"n": 1})  # another run of the pool, claimed after
    run = get_definition("spend_pooled").start({"n": 50, "sleep": 0.08}, workers=1)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert len(claim(other.pk, "w:1", 1, 30, 3, SPEND_POOL, spend=True).items) == 1
    account.refresh_from_db()
    started = sorted(ItemClaim.objects.filter(run=run).values_list("started_at", flat=True))
    assert started[-1] - started[0] > timedelta(seconds=4)  # the run outlasted two periods
    # Items that began inside the period in force (a margin for the boundary itself): their
    # whole cost was spent in it.
    since = account.period_started_at + timedelta(seconds=0.1)
    inside = ItemClaim.objects.filter(run=run, started_at__gte=since)
    expected = sum(i.cost["usd"] for i in inside)
    assert account.spent >= expected - 1e-9, (account.spent, expected, inside.count())


@pytest.mark.parametrize(("calendar", "period"), [("month", None), ("", 3600.0)])
def test_a_budgets_first_claim_keeps_what_was_spent_since_it_was_made(
    calendar: str, period: float | None
) -> None:
    # Made (fanout_pools --sync) while items of the pool ran: they reserved against it and
    # settled $0.30 before any claim used it. The first claim starts its period: that spend
    # happened in it, and stays spent.
    CapacityPool.objects.create(name=SPEND_POOL, max_concurrency=10)
    account = SpendAccount.objects.create(
        pool=SPEND_POOL, unit="usd", budget=1.0, spent=0.3, calendar=calendar, period=period
    )
    assert claim_one() == 1
    account.refresh_from_db()
    assert account.period_started_at is not None
    assert (account.spent, account.reserved) == (pytest.approx(0.3), pytest.approx(0.1))


def test_a_run_whose_costs_are_read_from_answers_rolls_its_pools_period_over() -> None:
    # Neither cost= nor max_spend: its answers' costs count against the pool's budget, so its
    # claims must start the pool's new period, or today's spend piles onto yesterday's.
    boundary = day_start(db_now())
    account = spent_pool("day", boundary - timedelta(hours=1))
    account.spent = 0.9
    account.save(update_fields=["spent"])
    run = get_definition("spend_billed_pooled").start({"n": 5}, workers=1)
    assert run.status == RunStatus.SUCCEEDED, run.error
    account.refresh_from_db()
    assert account.period_started_at == boundary
    costs = [i.cost["usd"] for i in ItemClaim.objects.filter(run=run) if i.cost]
    assert account.spent == pytest.approx(sum(costs))


@pytest.mark.parametrize("session_zone", ["+05:00", "-11:00"])
def test_a_calendar_day_starts_at_utc_midnight_whatever_the_mariadb_sessions_zone(
    session_zone: str,
) -> None:
    if connection.vendor != "mysql":
        pytest.skip("MariaDB/MySQL's session time_zone")
    with connection.cursor() as cursor:
        cursor.execute("SELECT @@session.time_zone")
        was = cursor.fetchone()[0]
        cursor.execute("SET SESSION time_zone = %s", [session_zone])
    try:
        boundary = day_start(db_now())
        account = spent_pool("day", boundary - timedelta(seconds=1))
        assert claim_one() == 1
        account.refresh_from_db()
        assert account.period_started_at == boundary
        assert (account.spent, account.reserved) == (0.0, pytest.approx(0.1))
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION time_zone = %s", [was])
