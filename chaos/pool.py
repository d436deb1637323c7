"""An exhausted pool: concurrency 2 and 10 admissions/s, two runs, eight workers, Throttled.

The pool binds, not the workers: in flight never exceeds 2 (from the ledger and from live
leases), admissions in any 1 s window never exceed the token bucket's bound (burst + rate),
a Throttled item uses no attempt, and the items held back are visible with their reason.
"""

from __future__ import annotations

import time

from .harness import Harness, Result, durable

POOL = "chaos-pool"
CONCURRENCY, RATE, PERIOD = 2, 10, 1.0


def exhausted_pool(h: Harness, result: Result) -> None:
    from django.utils import timezone

    from fanout.models import CapacityPool, ItemClaim
    from fanout.report import held_back

    CapacityPool.objects.update_or_create(
        name=POOL,
        defaults=dict(
            max_concurrency=CONCURRENCY,
            rate_count=RATE,
            rate_period=PERIOD,
            burst=None,
            paused=False,
            tokens=None,
            tokens_at=None,
            backoff_until=None,
            waiters={},
        ),
    )
    n = h.scale(60, 20)
    parents, keys = [], []
    for name in ("a", "b"):
        keys.append(h.run_key(f"pool-{name}"))
        args = ["run_fanout", "chaos_pool", "--executor", "rq", "--param", f"n={n}"]
        args += ["--param", "sleep=[0.02,0.08]", "--param", "throttle_every=9"]
        args += ["--param", "admissions=true", "--run-key", keys[-1], "--json"]
        parents.append(h.parent(args, f"pool-{name}"))
    run_ids = [h.run_id(k) for k in keys]
    # Watch the runs: why items wait, and the pool's live leases.
    reasons: dict[str, int] = {}
    max_leases = 0
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        now = timezone.now()
        for run_id in run_ids:
            for why, count in durable(lambda r=run_id, t=now: held_back(r, t)).items():
                label = why.split(": ", 1)[-1].split(" (")[0]
                reasons[label] = max(reasons.get(label, 0), count)
        leases = durable(lambda t=now: ItemClaim.objects.in_flight(t).filter(pool=POOL).count())
        max_leases = max(max_leases, leases)
        if h.wait_finished(run_ids, timeout=0):
            break
        time.sleep(0.25)
    for name, proc in zip(("a", "b"), parents, strict=True):
        h.report_parent(result, f"parent {name}", proc.finish(60), "succeeded")
    limits = {"concurrency": CONCURRENCY, "rate": RATE, "burst": RATE, "period": PERIOD}
    fig = h.ledger(run_ids, pools={POOL: limits})
    h.judge(result, fig, pools={POOL: limits})
    throttled = _throttled(run_ids)
    attempts = sorted(
        set(ItemClaim.objects.filter(run_id__in=run_ids).values_list("attempt", flat=True))
    )
    result.figures["leases"] = f"{max_leases}/{CONCURRENCY}"
    result.figures["throttled"] = throttled
    result.figures["attempts"] = ",".join(map(str, attempts))
    result.figures["waiting seen"] = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
    result.check(max_leases <= CONCURRENCY, f"{max_leases} live leases in a pool of {CONCURRENCY}")
    result.check(throttled > 0, "no handler raised Throttled")
    result.check(attempts == [1], f"attempts {attempts}: waiting or Throttled used an attempt")
    result.check(bool(reasons), "no item was ever seen waiting with a reason")
    result.details["waiting"] = reasons


def _throttled(run_ids: list[int]) -> int:
    from tests.testapp.models import Observation

    return sum(
        1
        for v in Observation.objects.filter(run_id__in=run_ids, name="chaos").values_list(
            "value", flat=True
        )
        if v.get("ending") == "throttled"
    )
