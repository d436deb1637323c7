"""Infrastructure faults mid-run: Redis flushed, Redis stopped for 10 s, PostgreSQL restarted.

PostgreSQL is the source of truth: whatever Redis loses, the run finishes; after a database
restart the workers reconnect and carry on. Nobody dies here, so no item may run twice, and
with ``max_attempts=1`` an outage that leaked into a handler's attempt would fail its item.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .harness import Harness, Result, postgres_outage

SLEEP = "sleep=[0.02,0.1]"


def _under_fault(
    h: Harness, result: Result, name: str, n: int, faults: list[tuple[float, Callable[[], str]]]
) -> None:
    from tests.testapp.models import Execution

    assert h.workers is not None
    key = h.run_key(name)
    args = ["run_fanout", "chaos_infra", "--executor", "rq", "--workers", "8"]
    args += ["--param", f"n={n}"]
    parent = h.parent([*args, "--param", SLEEP, "--run-key", key, "--json"], name)
    run_id = h.run_id(key)
    deaths_before = set(h.workers.deaths)
    notes, fault_times = [], []
    for share, fault in faults:
        if h.progress(run_id) >= 1.0:
            break  # the run is done: later faults would find nothing to disturb
        if not h.wait_progress(run_id, share, timeout=180):
            result.check(False, f"the run stalled before {share:.0%}")
            break
        begun = time.time()
        notes.append(fault())
        fault_times.append((begun, time.time()))
    outcome = parent.finish(300)
    h.report_parent(result, "parent", outcome, "succeeded")
    if outcome[0] != 0 and not h.wait_finished([run_id], timeout=1):
        # The parent gave up: pick the run up again, as its operator would, to count its items.
        h.manage(["run_fanout", "--resume", str(run_id), "--json"], f"{name}-resume", 240)
    fig = h.ledger([run_id])
    h.judge(result, fig)
    exits = [d for pid, d in h.workers.deaths.items() if pid not in deaths_before]
    failed = fig.statuses.get("failed", 0)
    result.figures["fault"] = "; ".join(notes)
    result.figures["worker exits"] = len(exits)
    result.check(failed == 0, f"{failed} items failed (the outage used their only attempt?)")
    result.check(not exits, f"{len(exits)} workers exited ({exits[0].how})" if exits else "")
    if fault_times:
        # Workers that ran items before the first fault and again after it ended.
        rows = Execution.objects.filter(run_id=run_id).values_list("worker", "started")
        before = {w for w, s in rows if s < fault_times[0][0]}
        after = {w for w, s in rows if s > fault_times[0][1]}
        carried = len(before & after)
        if after:
            result.figures["workers on after"] = f"{carried}/{len(before)}"
            result.check(carried > 0, "no worker that ran items before the fault ran any after")
        else:
            result.figures["workers on after"] = "- (the run ended during the fault)"


def redis_flush(h: Harness, result: Result) -> None:
    def flush() -> str:
        h.redis.flush()
        h.redis_reset_at = time.time()
        return "flushed"

    n = h.items(0.4)
    _under_fault(h, result, "redis-flush", n, [(0.25, flush), (0.6, flush)])
    flushes = result.figures["fault"].count("flushed")
    result.figures["fault"] = f"Redis flushed {flushes}x (planned at 25%, 60%)"


def redis_stop(h: Harness, result: Result) -> None:
    def stop() -> str:
        h.redis.stop()
        time.sleep(10)
        h.redis.start()
        h.redis_reset_at = time.time()
        return "stopped"

    # Mid-run, so the run must go on after Redis is back; and near the end, so that drain jobs
    # finish while Redis is down.
    _under_fault(h, result, "redis-stop", h.items(0.75), [(0.2, stop), (0.8, stop)])
    stops = result.figures["fault"].count("stopped")
    result.figures["fault"] = f"Redis stopped for 10s {stops}x (planned at 20%, 80%)"


def pg_restart(h: Harness, result: Result) -> None:
    def restart() -> str:
        outage = postgres_outage(h.opts.database_url, h.opts.pg_fault)
        result.details["outage"] = outage
        return f"{outage['how']} at 30% ({outage['down_seconds']}s)"

    _under_fault(h, result, "pg-restart", h.items(0.5), [(0.3, restart)])
