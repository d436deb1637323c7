"""A pool whose rate counts tokens: each admission takes its item's estimate from the bucket, so
in any window of T seconds the estimates admitted stay within burst + rate × T."""

from __future__ import annotations

import json

import pytest

from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.errors import FanoutError
from fanout.models import BatchRun, CapacityPool, ItemClaim
from fanout.pools import limits_from_config
from tests.pools.workers import Workers
from tests.procs import finish
from tests.testapp.fanouts_spend import TOKEN_POOL

pytestmark = pytest.mark.django_db(transaction=True)

RATE, PERIOD, BURST = 1000, 1.0, 1000  # "1000 tokens/s"


def token_pool() -> CapacityPool:
    limits = limits_from_config(TOKEN_POOL, {"max_concurrency": 16, "rate": "1000 tokens/s"})
    assert (limits["rate_count"], limits["rate_period"], limits["rate_unit"]) == (
        RATE,
        PERIOD,
        "tokens",
    )
    return CapacityPool.objects.create(name=TOKEN_POOL, **limits)


def test_a_token_rate_pool_admits_no_more_tokens_than_its_bucket_allows_in_any_window(
    workers: Workers,
) -> None:
    token_pool()
    n = 60  # estimates of 100, 150, 200 tokens: 9,000 in all, about 8 s at 1,000 a second
    args = ["run_fanout", "spend_tokens", "--run-key", "tokens", "--workers", "4"]
    args += ["--param", f"n={json.dumps(n)}", "--param", "sleep=0.01"]
    procs = workers([args] * 2)
    for proc in procs:
        code, out, err = finish(proc, timeout=120)
        assert code == 0, f"worker exited {code}:\n{out}\n{err}"
    run = BatchRun.objects.get(run_key="tokens")
    items = sorted(ItemClaim.objects.filter(run=run), key=lambda i: i.claimed_at)
    assert len(items) == n and all(i.status == "succeeded" for i in items)
    assert len({i.owner.split(":")[1] for i in items}) == 2
    times = [i.claimed_at.timestamp() for i in items]
    taken = [i.estimate["tokens"] for i in items]
    worst = 0.0
    for first in range(n):
        admitted = 0.0
        for last in range(first, n):
            admitted += taken[last]
            allowed = BURST + RATE * (times[last] - times[first]) / PERIOD
            worst = max(worst, admitted - allowed)
    assert worst <= 1e-6, f"{worst:.1f} tokens admitted beyond the bucket's bound"
    # The bucket bound the run: all of it could not have been admitted at once.
    assert times[-1] - times[0] >= (sum(taken) - BURST) / RATE * PERIOD - 0.05


def test_an_item_estimated_above_the_bucket_is_refused_at_start_not_held_forever() -> None:
    token_pool()
    definition = get_definition("spend_tokens")
    with pytest.raises(FanoutError, match="more than pool 'spend-tokens'.s bucket holds"):
        prepare_run(definition, {"n": 3, "tokens": 1000})  # 1,000 to 1,100 tokens each
    assert not ItemClaim.objects.exists()
