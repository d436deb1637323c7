"""Compensation: a fail-fast run undoes what succeeded while its workers are killed mid-undo.

Two runs with ``compensate=`` start with ``--no-wait``: one compensates in strict reverse finish
order, one in parallel (at most 2 at once). In each, item ``bad`` fails for good after several
items succeeded, while others are still running and succeed after it. Once compensations are
under way, the worker running one compensation of each run is SIGKILLed; later, with the
reverse run's next compensation running, every worker at once (a deploy); new workers start.
Each run must end ``compensated`` with every item that succeeded compensated exactly once (a
compensation runs again only when a kill cut it off), nothing else compensated, a compensation
recorded before a kill never run again, the reverse run's compensations one at a time in
reverse finish order, the parallel run's at most 2 at once.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from typing import Any

from .harness import Harness, Result, durable
from .ledger import Exec, calls, cut_off, max_overlap, span_end

SLEEP = "sleep=[0.1,0.25]"
# The parallel run's compensations take longer, so that kills find them under way too.
UNDO_SLEEP = {"reverse": "[0.25,0.4]", "parallel": "[0.6,0.9]"}
BUDGET = {"reverse": 1, "parallel": 2}  # compensate_max_parallel of chaos_comp_parallel


def compensation(h: Harness, result: Result) -> None:
    from fanout.conf import conf
    from fanout.definition import get_definition
    from fanout.models import BatchRun, ItemClaim

    from .deploy import RESTART_SLACK

    assert h.workers is not None
    n = h.scale(40, 16)
    bad = f"c{n // 2:05d}"
    ids: dict[str, int] = {}
    # While this file exists, the reverse run's compensations that start wait for it to go.
    hold = h.logs / f"{h.run_key('comp')}.hold"
    for mode in BUDGET:
        key = h.run_key(f"comp-{mode}")
        args = ["run_fanout", f"chaos_comp_{mode}", "--executor", "rq", "--no-wait"]
        args += ["--param", f"n={n}", "--param", SLEEP, "--param", f"undo_sleep={UNDO_SLEEP[mode]}"]
        args += ["--param", f"bad={json.dumps({bad: 'permanent'})}", "--run-key", key]
        if mode == "reverse":
            args += ["--param", f"undo_hold={json.dumps(str(hold))}"]
        code, _, err = h.manage(args, f"comp-{mode}-start")
        result.check(code == 0, f"run_fanout --no-wait exited {code}: {err.strip()[-300:]}")
    for mode in BUDGET:
        ids[mode] = h.run_id(h.run_key(f"comp-{mode}"))

    def state(run_id: int) -> tuple[set[str], list[int]]:
        """Keys compensated so far, and the live workers running one of its compensations."""
        done = set(
            ItemClaim.objects.filter(run_id=run_id, status="compensated").values_list(
                "key", flat=True
            )
        )
        running = calls([run_id], "undo:")
        live = h.workers.pids() if h.workers else []
        return done, [c.pid for c in running if c.ended is None and c.pid in live]

    # Kill one compensation's worker in each run, then every worker once the reverse run has
    # compensated one more and runs the next. Before each kill, note what was compensated.
    recorded: list[tuple[float, int, set[str]]] = []
    single = {mode: False for mode in BUDGET}
    after_single = 0
    healed_from = None
    deadline = time.monotonic() + 180
    while healed_from is None and time.monotonic() < deadline:
        now = {mode: durable(lambda r=rid: state(r)) for mode, rid in ids.items()}
        for mode, (done, busy) in now.items():
            if not single[mode] and done and busy:
                recorded.append((time.time(), ids[mode], done))
                single[mode] = h.workers.kill(busy[0]) is not None
                if mode == "reverse":
                    after_single = len(done)
        done, busy = now["reverse"]
        if single["reverse"] and len(done) > after_single and not hold.exists():
            # The reverse run compensated one more since its kill: the next one it starts
            # stays under way until the deploy. A loaded host could otherwise see it finish
            # every compensation before the parallel run's first kill landed.
            hold.touch()
        # Every worker goes once each run lost one compensation's worker (its threads serve
        # both runs, so the parallel run's first kill may come after the reverse run's).
        if all(single.values()) and len(done) > after_single and busy:
            for mode, rid in ids.items():
                recorded.append((time.time(), rid, now[mode][0]))
            h.workers.redeploy()
            healed_from = time.monotonic()
            break
        if h.wait_finished(list(ids.values()), timeout=0):
            break
        time.sleep(0.05)
    hold.unlink(missing_ok=True)  # the compensations taken over run to their end
    for mode, hit in single.items():
        result.check(hit, f"no kill landed on a compensation of the {mode} run")
    result.check(healed_from is not None, "the compensations ended before every worker was killed")
    finished = h.wait_finished(list(ids.values()), timeout=240)
    healed = time.monotonic() - healed_from if healed_from is not None else None
    result.check(finished, "the runs did not finish compensating after the kills")
    h.wait_handlers(list(ids.values()))

    # A run compensates once its forward items are all finished, but a worker's threads serve
    # every run: one killed for a compensation may also be running the other run's forward
    # items, which are then reclaimed like any dead worker's, within their lease.
    fig = h.ledger(list(ids.values()))
    lease = get_definition("chaos_comp_parallel").lease_seconds
    h.judge(result, fig, lease=lease + float(conf.SUPERVISE_SECONDS) + RESTART_SLACK)
    deaths = h.all_deaths()
    figures: dict[str, list[str]] = defaultdict(list)
    for mode, run_id in ids.items():
        run = durable(lambda r=run_id: BatchRun.objects.get(pk=r))
        result.check(
            run.status == "compensated", f"the {mode} run ended {run.status}: {run.error[:200]}"
        )
        undo = durable(lambda r=run_id: calls([r], "undo:"))
        items = durable(lambda r=run_id: list(ItemClaim.objects.filter(run_id=r)))
        forward = durable(lambda r=run_id: calls([r]))
        text = _check_run(result, mode, bad, items, forward, undo, recorded, deaths)
        figures["comp"].append(text)
    result.figures["comp"] = "; ".join(figures["comp"])
    result.figures["kills"] = f"{sum(single.values())}+{h.workers.size}"
    result.figures["healed in"] = f"{healed:.0f}s" if healed is not None else "-"


def _check_run(
    result: Result,
    mode: str,
    bad: str,
    items: list[Any],
    forward: list[Exec],
    undo: list[Exec],
    recorded: list[tuple[float, int, set[str]]],
    deaths: dict[int, Any],
) -> str:
    """Check one run's compensations; return its figures."""
    by_key = {i.key: i for i in items}
    run_id = items[0].run_id
    failed = by_key[bad]
    ran = {c.key for c in forward if c.ended is not None} - {bad}
    compensated = {i.key for i in items if i.status == "compensated"}
    others = {i.status for i in items if i.key not in compensated} - {"failed", "cancelled"}
    after = sum(1 for k in ran if by_key[k].finished_at > failed.finished_at)
    result.check(failed.status == "failed", f"{mode}: {bad} ended {failed.status}, not failed")
    result.check(len(ran) - after >= 2, f"{mode}: only {len(ran) - after} items succeeded first")
    # A kill meant for the other run's compensation may cut off this run's bad item (threads
    # serve both runs): taken over a lease later, it fails after every other item finished.
    # Cut off mid-call, or after its call ended but before its outcome was written: it ran
    # twice.
    bad_calls = [c for c in forward if c.key == bad]
    bad_cut = len(bad_calls) > 1 or any(c.ended is None for c in bad_calls)
    result.check(after >= 1 or bad_cut, f"{mode}: no item succeeded after {bad} failed")
    result.check(not others, f"{mode}: items ended {sorted(others)}")
    result.check(
        compensated == ran,
        f"{mode}: compensated {sorted(compensated ^ ran)[:5]} differ from the items that succeeded",
    )

    by_undo: dict[str, list[Exec]] = defaultdict(list)
    for c in undo:
        by_undo[c.key].append(c)
    extra = set(by_undo) - ran
    result.check(not extra, f"{mode}: items that never succeeded were compensated: {extra}")
    cut_total, twice, used = 0, [], []
    for key, mine in by_undo.items():
        cut = [cut_off(c, deaths) for c in mine[:-1]]
        cut_total += sum(cut)
        # Every call but the last was cut off by a kill; the last finished (and was recorded).
        if mine[-1].ended is None or not all(cut):
            twice.append(f"{key} {len(mine)} calls, {sum(cut)} cut off")
        used += [key for prev, c in zip(mine, mine[1:], strict=False) if c.attempt != prev.attempt]
    result.check(not twice, f"{mode}: compensations not run exactly once: {twice[:4]}")
    result.check(not used, f"{mode}: a crash used a compensation attempt: {used[:4]}")
    again = [
        key
        for at, rid, seen in recorded
        if rid == run_id
        for key in seen
        if any(c.started > at for c in by_undo.get(key, []))
    ]
    result.check(not again, f"{mode}: compensations recorded before a kill ran again: {again}")

    now = time.time()
    overlap = max_overlap([(c.started, span_end(c, deaths, now)) for c in undo])
    limit = BUDGET[mode]
    result.check(overlap <= limit, f"{mode}: {overlap} compensations at once (limit {limit})")
    order = ""
    if mode == "reverse":
        # The call that completed each compensation, in the order they ran, against the items
        # latest finished first.
        done = [mine[-1].key for mine in sorted(by_undo.values(), key=lambda m: m[-1].started)]
        want = sorted(ran, key=lambda k: (by_key[k].finished_at, by_key[k].index), reverse=True)
        ok = result.check(
            done == want,
            f"reverse: compensated in the order {done}, not reverse finish order {want}",
        )
        order = ", order " + ("reversed" if ok else "WRONG")
    return (
        f"{mode} {len(compensated)}/{len(ran)} compensated in {len(undo)} calls "
        f"({cut_total} cut off), {after} succeeded after the failure, "
        f"at once {overlap}/{limit}{order}"
    )


def compensate_killed(h: Harness, result: Result) -> None:
    """Cancelled with compensation (``run_fanout --cancel RUN --compensate``) while items run,
    then every worker SIGKILLed at once and new ones started, with nobody watching the run.

    The items the dead workers held are left with leases that run out while the run
    compensates; the run must still end ``compensated``, every item that succeeded undone once
    (again only when a kill cut its compensation off), nothing else undone.
    """
    from fanout.conf import conf
    from fanout.definition import get_definition
    from fanout.models import BatchRun, ItemClaim

    from .deploy import RESTART_SLACK

    assert h.workers is not None
    n = h.scale(40, 24)
    key = h.run_key("compensate-killed")
    args = ["run_fanout", "chaos_comp_parallel", "--executor", "rq", "--no-wait"]
    args += ["--param", f"n={n}", "--param", "sleep=[2.0,3.0]", "--param", "undo_sleep=[0.05,0.1]"]
    code, _, err = h.manage([*args, "--run-key", key], "compensate-killed-start")
    result.check(code == 0, f"run_fanout --no-wait exited {code}: {err.strip()[-300:]}")
    run_id = h.run_id(key)

    def counts() -> dict[str, int]:
        rows = ItemClaim.objects.filter(run_id=run_id).values_list("status", flat=True)
        found: dict[str, int] = defaultdict(int)
        for status in rows:
            found[status] += 1
        return found

    # The cancel waits at a barrier with Django set up, so that it lands while items run.
    ready, go = h.logs / f"{key}.ready", h.logs / f"{key}.go"
    cancel = ["run_fanout", "--cancel", str(run_id), "--compensate"]
    canceller = h.parent(cancel, "cancel", barrier=(ready, go))
    h.wait_files([ready], [canceller])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = durable(counts)
        if now["succeeded"] >= 4 and now["running"] >= 2:
            break
        time.sleep(0.1)
    else:
        raise RuntimeError("the run never had 4 items done and 2 running")
    go.touch()
    # Kill as soon as the cancel is committed, not once its process has exited (seconds later
    # on a busy host: the items it cancelled under would be over).
    deadline = time.monotonic() + 60
    while durable(lambda: BatchRun.objects.get(pk=run_id).status) == "running":
        if canceller.popen.poll() is not None or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    held = durable(counts)["running"]
    killed = h.workers.redeploy()
    code, _, err = canceller.finish(60)
    result.check(code == 0, f"run_fanout --cancel --compensate exited {code}: {err[-300:]}")
    result.figures["at the kill"] = f"{held} running, {killed} workers killed"
    result.check(held >= 1, "no item was running when every worker was killed")

    lease = get_definition("chaos_comp_parallel").lease_seconds
    timeout = lease + 2 * float(conf.SUPERVISE_SECONDS) + RESTART_SLACK + 30
    begun = time.monotonic()
    finished = h.wait_finished([run_id], timeout=timeout)
    h.wait_handlers([run_id])
    run = durable(lambda: BatchRun.objects.get(pk=run_id))
    items = durable(lambda: list(ItemClaim.objects.filter(run_id=run_id)))
    by_status: dict[str, int] = defaultdict(int)
    for item in items:
        by_status[item.status] += 1
    done = by_status["compensated"]
    result.figures["healed in"] = f"{time.monotonic() - begun:.0f}s" if finished else "-"
    result.figures["items"] = ", ".join(f"{k} {v}" for k, v in sorted(by_status.items()))
    result.check(
        finished,
        f"run {run_id} still {run.status} {timeout:.0f}s after the deploy "
        f"({done} compensated; items {dict(by_status)})",
    )
    result.check(run.status == "compensated", f"the run ended {run.status}: {run.error[:200]}")
    others = set(by_status) - {"compensated", "cancelled"}
    result.check(not others, f"items ended {sorted(others)}")

    fig = h.ledger([run_id])
    fig.join_runs.pop(run_id, None)  # a cancelled run is compensated, never joined
    h.judge(result, fig, lease=lease + float(conf.SUPERVISE_SECONDS) + RESTART_SLACK)
    deaths = h.all_deaths()
    forward = durable(lambda: calls([run_id]))
    ran = {c.key for c in forward if c.ended is not None}
    compensated = {i.key for i in items if i.status == "compensated"}
    result.check(compensated <= ran, f"undone without having run: {sorted(compensated - ran)[:5]}")
    undo: dict[str, list[Exec]] = defaultdict(list)
    for c in durable(lambda: calls([run_id], "undo:")):
        undo[c.key].append(c)
    extra = set(undo) - compensated
    result.check(not extra, f"compensations called for items not compensated: {sorted(extra)[:5]}")
    twice = [
        f"{k} {len(mine)} calls"
        for k, mine in undo.items()
        if mine[-1].ended is None or not all(cut_off(c, deaths) for c in mine[:-1])
    ]
    result.check(not twice, f"compensations not run exactly once: {twice[:4]}")
