"""Crashes: workers SIGKILLed every few seconds, parents SIGKILLed and resumed.

An item whose worker died mid-execution is reclaimed once its lease runs out and runs again
(the only duplicates allowed); a crash uses no attempt (``max_attempts=1`` here, so a charged
crash fails the item); a completed item never runs again, whoever resumes the run.
"""

from __future__ import annotations

import random
import time

from .harness import Harness, Result

SLEEP = "sleep=[0.02,0.1]"


def _died_mid_item(duplicates: dict[str, list[str]]) -> int:
    return sum(1 for reasons in duplicates.values() if any("died" in r for r in reasons))


def crash_workers(h: Harness, result: Result) -> None:
    from fanout.definition import get_definition

    assert h.workers is not None
    n = h.items(1.0)
    key = h.run_key("crash-workers")
    args = ["run_fanout", "chaos_crash", "--executor", "rq", "--workers", "8", "--param", f"n={n}"]
    parent = h.parent([*args, "--param", SLEEP, "--run-key", key, "--json"], "crash-rq-parent")
    run_id = h.run_id(key)
    kills = 0
    resumed = None
    killed_at = 0.0
    deadline = time.monotonic() + 420
    next_kill = time.monotonic() + random.uniform(1.0, 2.5)
    while time.monotonic() < deadline:
        done = h.progress(run_id)
        if done >= 1.0:
            break  # the join is left alone: it is short, and its own lease covers it
        if resumed is None and done >= 0.35:
            h.kill_parent(parent)
            killed_at = done
            resumed = h.parent(["run_fanout", "--resume", str(run_id), "--json"], "crash-resume")
        if time.monotonic() >= next_kill:
            if h.workers.kill_one(prefer=h.busy_workers(run_id)) is not None:
                kills += 1
            next_kill = time.monotonic() + random.uniform(1.5, 3.0)
        time.sleep(0.1)
    result.check(resumed is not None, "the run finished before its parent could be killed")
    h.report_parent(result, "resumed parent", (resumed or parent).finish(180), "succeeded")
    lease = get_definition("chaos_crash").lease_seconds
    fig = h.ledger([run_id])
    h.judge(result, fig, lease=lease)
    died = _died_mid_item(fig.duplicates)
    result.figures["kills"] = kills
    result.figures["died mid-item"] = died
    result.figures["parent killed at"] = f"{killed_at:.0%}"
    result.check(kills >= 2, f"only {kills} workers were killed")
    result.check(died >= 1, "no kill landed on an item in flight")
    failed = fig.statuses.get("failed", 0)
    result.check(failed == 0, f"{failed} items failed (a crash used their only attempt?)")


def crash_parent(h: Harness, result: Result) -> None:
    """The parent runs the items on 32 threads of its own; it is killed twice and resumed."""
    from fanout.definition import get_definition

    n = h.items(0.75)
    key = h.run_key("crash-parent")
    args = ["run_fanout", "chaos_crash", "--executor", "inline", "--max-parallel", "32"]
    args += ["--workers", "32"]
    # Longer items: the parent dies with many items held and many still pending.
    args += ["--param", f"n={n}", "--param", "sleep=[0.05,0.2]", "--run-key", key, "--json"]
    parent = h.parent(args, "inline-parent")
    run_id = h.run_id(key)
    in_flight = []
    for i, share in enumerate((0.2, 0.55), 1):
        if not h.wait_progress(run_id, share, timeout=180):
            break
        in_flight.append(len(h.busy_workers(run_id)))
        h.kill_parent(parent)
        parent = h.parent(["run_fanout", "--resume", str(run_id), "--json"], f"inline-resume-{i}")
    result.check(len(in_flight) == 2, "the parent could not be killed twice mid-run")
    h.report_parent(result, "last parent", parent.finish(180), "succeeded")
    lease = get_definition("chaos_crash").lease_seconds
    fig = h.ledger([run_id])
    h.judge(result, fig, lease=lease)
    died = _died_mid_item(fig.duplicates)
    result.figures["kills"] = len(in_flight)
    result.figures["held at kills"] = "+".join(map(str, in_flight))
    result.figures["died mid-item"] = died
    result.check(died >= 1, "no kill landed on an item in flight")
    failed = fig.statuses.get("failed", 0)
    result.check(failed == 0, f"{failed} items failed (a crash used their only attempt?)")
