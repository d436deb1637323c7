"""Per-item pools: one pool row per partition, made on demand from a FANOUT_POOLS template."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
from django.test import override_settings

from fanout import FanoutError
from fanout.definition import get_definition
from fanout.models import BatchRun, CapacityPool, ItemClaim, RunStatus

from .ledger import Span, max_in_flight, spans
from .workers import finished

pytestmark = pytest.mark.django_db(transaction=True)


@override_settings(FANOUT_POOLS={"account-*": {"max_concurrency": 1}})
def test_each_account_gets_its_own_pool_of_one_while_accounts_run_in_parallel(
    inline: Any,
) -> None:
    params = {"accounts": ["a", "b", "c"], "per_account": 4, "sleep": 0.1}

    run = finished(inline("pools_accounts", params, "accounts", 6))

    assert run.status == RunStatus.SUCCEEDED
    created = CapacityPool.objects.filter(name__startswith="account-")
    assert sorted(created.values_list("name", "max_concurrency")) == [
        ("account-a", 1),
        ("account-b", 1),
        ("account-c", 1),
    ]
    calls = spans(run_id=run.pk)
    assert len(calls) == 12
    by_pool: dict[str, list[Span]] = defaultdict(list)
    for call in calls:
        by_pool[call.pool].append(call)
        assert call.pool == f"account-{call.key.split('-')[0]}"
    assert {pool: max_in_flight(c) for pool, c in by_pool.items()} == {
        "account-a": 1,
        "account-b": 1,
        "account-c": 1,
    }
    print(f"accounts in flight at once: {max_in_flight(calls)}")
    assert max_in_flight(calls) >= 2


@override_settings(FANOUT_POOLS={"account-*": {"max_concurrency": 1}})
def test_an_accounts_own_pool_row_wins_over_the_template(inline: Any) -> None:
    CapacityPool.objects.create(name="account-vip", max_concurrency=3)
    params = {"accounts": ["vip", "d"], "per_account": 3}

    run = finished(inline("pools_accounts", params, "vip", 2))

    assert run.status == RunStatus.SUCCEEDED
    assert CapacityPool.objects.get(name="account-vip").max_concurrency == 3
    assert CapacityPool.objects.get(name="account-d").max_concurrency == 1


@override_settings(FANOUT_POOLS={"account-*": {"max_concurrency": 1}})
@pytest.mark.parametrize(
    ("name", "pool"), [("pools_nowhere", "pools-nowhere"), ("pools_ghosts", "ghost-a")]
)
def test_a_pool_nobody_configured_is_refused_at_start_and_leaves_nothing_behind(
    name: str, pool: str
) -> None:
    pools_before = set(CapacityPool.objects.values_list("name", flat=True))

    with pytest.raises(FanoutError) as error:
        get_definition(name).start({"accounts": ["a", "b"], "n": 3}, "nowhere")

    assert f"pool {pool!r} does not exist" in str(error.value)
    assert "FANOUT_POOLS" in str(error.value)
    assert not BatchRun.objects.exists()
    assert not ItemClaim.objects.exists()
    assert set(CapacityPool.objects.values_list("name", flat=True)) == pools_before
