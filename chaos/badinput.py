"""Bad input: handlers that raise, hang past their lease, return non-JSON or kill their worker;
malformed params; a work list that breaks part-way through being written.

Each bad item ends with the outcome it deserves, none erases a sibling's, the join sees every
outcome once, and bad input given to run_fanout is refused before any run exists.
"""

from __future__ import annotations

import json

from .harness import Harness, Result

# key -> (behaviour, expected status, error class, executions)
BAD = {
    "c00001": ("raise", "failed", "RuntimeError", 2),  # max_attempts=2
    "c00002": ("permanent", "failed", "PermanentError", 1),
    "c00003": ("nonjson", "failed", "ResultNotJSON", 1),
    "c00004": ("hang", "succeeded", "", 2),  # timeout=1: reclaimed while it still hangs
    "c00005": ("exit", "failed", "WorkerLost", 2),  # crash_budget=1
    "c00006": ("exit_once", "succeeded", "", 2),
}


def bad_handlers(h: Harness, result: Result) -> None:
    from fanout.definition import get_definition
    from fanout.models import BatchRun, ItemClaim

    n = h.scale(40, 16)
    key = h.run_key("bad-handlers")
    bad = {k: v[0] for k, v in BAD.items()}
    args = ["run_fanout", "chaos_bad", "--executor", "rq", "--param", f"n={n}"]
    args += ["--param", "sleep=[0.02,0.05]", "--param", f"bad={json.dumps(bad)}"]
    args += ["--param", "hang_seconds=6", "--run-key", key, "--json"]
    parent = h.parent(args, "bad-handlers")
    report = h.report_parent(result, "parent", parent.finish(180), "failed")
    run_id = BatchRun.objects.get(run_key=key).pk
    h.wait_handlers([run_id])
    definition = get_definition("chaos_bad")
    fig = h.ledger([run_id])
    h.judge(result, fig, lease=definition.lease_seconds)
    items = {i.key: i for i in ItemClaim.objects.filter(run_id=run_id)}
    calls = fig_calls(run_id)
    died = unfinished_calls(run_id)
    wrong = []
    for k, (behaviour, status, error_class, runs) in BAD.items():
        item = items[k]
        extra = 0
        if behaviour in ("raise", "permanent", "nonjson"):
            # A worker runs several items at once: one whose worker a neighbour's os._exit
            # killed mid-call, or after its handler returned but before its outcome was
            # recorded, runs again; each such loss counted a crash.
            extra = max(died.get(k, 0), item.crashes)
        got = (item.status, item.error_class, calls.get(k, 0))
        if got[:2] == ("failed", "WorkerLost") and item.crashes > definition.crash_budget:
            continue  # a neighbour's os._exit (and its own, for exit_once) spent its budget
        if got[:2] != (status, error_class) or not runs <= got[2] <= runs + extra:
            expected = runs if not extra else f"{runs}..{runs + extra}"
            wrong.append(f"{behaviour} ended {got}, expected {(status, error_class, expected)}")
    for text in wrong:
        result.check(False, text)
    good = [i for k, i in items.items() if k not in BAD]
    intact = sum(1 for i in good if i.status == "succeeded" and i.result and "exec" in i.result)
    # A good item whose worker a neighbour's os._exit killed more often than its crash budget
    # allows (mid-call, or claimed and not yet started) fails with WorkerLost: it must never
    # have finished a call.
    budget = definition.crash_budget
    collateral = [
        i.key
        for i in good
        if i.status == "failed"
        and i.error_class == "WorkerLost"
        and i.crashes > budget
        and died.get(i.key, 0) == calls.get(i.key, 0)
    ]
    result.check(
        intact + len(collateral) == len(good),
        f"only {intact} of {len(good)} good items succeeded ({len(collateral)} lost to neighbours)",
    )
    allowed = {k for k, v in BAD.items() if v[0] in ("hang", "exit", "exit_once")}
    # Items whose worker a neighbour's os._exit killed mid-item run again; nothing else may.
    allowed |= {k for k, why in fig.duplicates.items() if all("died" in r for r in why)}
    extra = set(fig.duplicates) - allowed
    result.check(not extra, f"items {sorted(extra)} ran more than once")
    joined = (report or {}).get("join_result") or {}
    result.check(joined.get("count") == n, f"the join saw {joined.get('count')} of {n} outcomes")
    result.figures["bad ok"] = f"{len(BAD) - len(wrong)}/{len(BAD)}"
    result.figures["good ok"] = f"{intact}/{len(good)}" + (
        f" ({len(collateral)} killed by neighbours past the crash budget)" if collateral else ""
    )
    result.figures["run"] = (report or {}).get("status")


def unfinished_calls(run_id: int) -> dict[str, int]:
    """Calls per key that never ended: their worker died mid-call."""
    from collections import Counter

    from tests.testapp.models import Execution

    rows = Execution.objects.filter(run_id=run_id, ended__isnull=True)
    return Counter(rows.values_list("key", flat=True))


def fig_calls(run_id: int) -> dict[str, int]:
    from collections import Counter

    from tests.testapp.models import Execution

    return Counter(Execution.objects.filter(run_id=run_id).values_list("key", flat=True))


def bad_input(h: Harness, result: Result) -> None:
    """Malformed params are refused; a work list that breaks leaves nothing behind."""
    from fanout.models import BatchRun, ItemClaim
    from tests.testapp.models import Execution

    runs_before = BatchRun.objects.filter(definition="chaos_bad").count()
    malformed = {
        "not an int": ["--param", "n=abc"],
        "unknown param": ["--param", "n=5", "--param", "bogus=1"],
        "not key=value": ["--param", "nonsense"],
        "not a mapping": ["--param", "n=5", "--param", "bad=[1,2]"],
    }
    procs = {
        why: h.parent(["run_fanout", "chaos_bad", "--executor", "rq", *args], "malformed")
        for why, args in malformed.items()
    }
    refused = 0
    for why, proc in procs.items():
        code, _, err = proc.finish(60)
        ok = code == 2 and "Traceback" not in err
        refused += ok
        result.check(ok, f"a param {why} gave exit {code}: {err.strip()[-120:]}")
    runs_after = BatchRun.objects.filter(definition="chaos_bad").count()
    result.check(runs_after == runs_before, "a malformed param created a run")
    result.figures["malformed refused"] = f"{refused}/{len(malformed)}"

    # The work list breaks after its first chunk of items was committed.
    n, fail_at = h.scale(2300, 300), h.scale(2200, 250)
    key = h.run_key("bad-over")
    ledger_before = Execution.objects.count()
    args = ["run_fanout", "chaos_over", "--run-key", key, "--param", f"n={n}", "--json"]
    code, _, err = h.manage([*args, "--param", f"fail_at={fail_at}"], "over-breaks", 120)
    left = BatchRun.objects.filter(run_key=key).count()
    leftover = ItemClaim.objects.filter(run__run_key=key).count()
    result.check(code == 2 and "Traceback" not in err, f"a broken work list gave exit {code}")
    result.check(f"element {fail_at}" in err, "the error does not say where the work list broke")
    result.check(
        left == 0 and leftover == 0, f"a broken work list left {left} runs, {leftover} items"
    )
    result.check(Execution.objects.count() == ledger_before, "items of a broken work list ran")
    result.figures["broken list"] = f"exit {code}, {left} runs left"

    # Fixed, the same run key starts clean and runs every item once.
    fixed = h.manage(
        [*args, "--executor", "rq", "--max-parallel", "8", "--param", "fail_at=-1"], "over-fixed"
    )
    h.report_parent(result, "fixed run", fixed, "succeeded")
    run = BatchRun.objects.filter(run_key=key).first()
    if run is None:
        result.check(False, "the fixed work list made no run")
        return
    fig = h.ledger([run.pk])
    h.judge(result, fig)
    result.check(fig.once == n, f"the fixed run ran {fig.once} of {n} items once")
