"""FANOUT_POOLS: how limits are written, how mistakes are reported, how rows follow settings."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings
from django.utils import timezone

from fanout import FanoutError
from fanout.models import CapacityPool
from fanout.pools import ensure_pools, headroom, limits_from_config, parse_rate, refill


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("100/m", (100, 60.0)),
        ("20/s", (20, 1.0)),
        ("5/10s", (5, 10.0)),
        ("3/h", (3, 3600.0)),
        ("1000/day", (1000, 86400.0)),
        (" 7 / 2min ", (7, 120.0)),
    ],
)
def test_a_rate_is_a_count_per_period(text: str, parsed: tuple[int, float]) -> None:
    assert parse_rate(text) == parsed


@pytest.mark.parametrize("text", ["100", "0/s", "-1/s", "ten/s", "5/0s", "5/fortnight", "5/", ""])
def test_a_malformed_rate_is_refused_by_name(text: str) -> None:
    with pytest.raises(FanoutError, match="rate") as error:
        parse_rate(text)
    assert repr(text) in str(error.value)


@pytest.mark.django_db(transaction=True)
def test_the_burst_defaults_to_the_rates_count() -> None:
    with override_settings(FANOUT_POOLS={"payments": {"max_concurrency": 10, "rate": "100/m"}}):
        ensure_pools(["payments"])
    pool = CapacityPool.objects.get(name="payments")
    assert (pool.max_concurrency, pool.rate_count, pool.rate_period) == (10, 100, 60.0)
    assert pool.capacity == 100
    # A fresh bucket is full; an empty one says until when it is rate limited.
    now = timezone.now()
    refill(pool, now)
    assert pool.tokens == 100.0
    assert headroom(pool, 0, now).count == 10
    pool.tokens = 0.0
    assert headroom(pool, 0, now).reason.startswith("rate limited until ")


def test_an_explicit_burst_sizes_the_bucket() -> None:
    limits = limits_from_config("p", {"max_concurrency": 2, "rate": "100/m", "burst": 20})
    pool = CapacityPool(name="p", **limits)
    refill(pool, timezone.now())
    assert (pool.capacity, pool.tokens) == (20, 20.0)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"max_concurrency": -1}, "max_concurrency must be an integer >= 0"),
        ({"max_concurrency": 2.5}, "max_concurrency must be an integer >= 0"),
        ({"max_concurrency": True}, "max_concurrency must be an integer >= 0"),
        ({"rate": "10/s", "burst": 0}, "burst must be an integer >= 1"),
        ({"burst": 5}, "burst needs a rate"),
        ({"max_concurency": 3}, "unknown keys: max_concurency"),
    ],
)
def test_bad_pool_limits_are_refused_with_the_pools_name(
    config: dict[str, Any], message: str
) -> None:
    with pytest.raises(FanoutError) as error:
        limits_from_config("payments", config)
    assert str(error.value).startswith("FANOUT_POOLS['payments']")
    assert message in str(error.value)


def test_a_bad_rate_in_fanout_pools_is_refused_with_the_pools_name() -> None:
    with pytest.raises(FanoutError) as error:
        limits_from_config("payments", {"rate": "lots"})
    assert str(error.value).startswith("FANOUT_POOLS['payments']")
    assert "rate 'lots' is not of the form N/s" in str(error.value)


@pytest.mark.django_db(transaction=True)
def test_manage_py_check_reports_a_bad_fanout_pools_as_an_error() -> None:
    with override_settings(FANOUT_POOLS={"payments": {"max_concurrency": -1}}):
        with pytest.raises(SystemCheckError) as error:
            call_command("check")
    assert "fanout.E002" in str(error.value)
    assert "FANOUT_POOLS['payments']: max_concurrency must be an integer >= 0" in str(error.value)

    with override_settings(FANOUT_POOLS={"payments": {"max_concurrency": 1, "rate": "5/s"}}):
        call_command("check", stdout=StringIO())


SYNCED = {"pools-sync": {"max_concurrency": 4, "rate": "10/s"}}


@pytest.mark.django_db(transaction=True)
@override_settings(FANOUT_POOLS=SYNCED)
def test_migrate_creates_missing_pools_but_only_fanout_pools_sync_overwrites_admin_edits() -> None:
    call_command("migrate", verbosity=0)
    pool = CapacityPool.objects.get(name="pools-sync")
    assert (pool.max_concurrency, pool.rate_count, pool.rate_period, pool.paused) == (
        4,
        10,
        1.0,
        False,
    )
    # Edited in the admin: a later migrate keeps the edit.
    CapacityPool.objects.filter(name="pools-sync").update(max_concurrency=9, paused=True)
    call_command("migrate", verbosity=0)
    pool.refresh_from_db()
    assert (pool.max_concurrency, pool.paused) == (9, True)

    out = StringIO()
    call_command("fanout_pools", "--sync", stdout=out)

    pool.refresh_from_db()
    assert (pool.max_concurrency, pool.rate_count, pool.paused) == (4, 10, False)
    assert "updated from FANOUT_POOLS: pools-sync" in out.getvalue()
    assert "pools-sync: in flight 0/4" in out.getvalue()
