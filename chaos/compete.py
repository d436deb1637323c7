"""Competing parents: three run_fanout processes start the same run at the same instant.

Two dispatch to RQ and one runs its own threads, while the RQ workers drain the run: every
item must still have one owner at a time, run once, and the join must run once.
"""

from __future__ import annotations

from .harness import Harness, Result


def competing_parents(h: Harness, result: Result) -> None:
    from fanout.models import BatchRun
    from tests.testapp.models import Execution

    n = h.items(0.5)
    key = h.run_key("compete")
    args = ["run_fanout", "chaos_compete", "--param", f"n={n}", "--param", "sleep=[0.02,0.1]"]
    args += ["--run-key", key, "--json"]
    executors = (
        ["--executor", "rq"],
        ["--executor", "rq"],
        ["--executor", "inline", "--workers", "4"],
    )
    go = h.logs / "compete.go"
    parents = []
    for i, executor in enumerate(executors, 1):
        ready = h.logs / f"compete-{i}.ready"
        parents.append(h.parent([*args, *executor], f"compete-{i}", barrier=(ready, go)))
    h.wait_files([h.logs / f"compete-{i}.ready" for i in (1, 2, 3)], parents)
    go.touch()
    reports = [
        h.report_parent(result, f"parent {i}", p.finish(timeout=240), "succeeded")
        for i, p in enumerate(parents, 1)
    ]
    runs = list(BatchRun.objects.filter(run_key=key).values_list("pk", flat=True))
    seen = {r.get("run_id") for r in reports if r}
    result.check(len(runs) == 1, f"{len(runs)} runs for one run key")
    result.check(seen == set(runs), f"the parents reported runs {sorted(seen, key=str)}")
    if not runs:
        return
    fig = h.ledger(runs)
    h.judge(result, fig)
    result.check(fig.items == n, f"{fig.items} items written for a work list of {n}")
    result.check(fig.once == n, f"only {fig.once} of {n} items ran exactly once")
    # Who ran the items: the inline parent's threads and the RQ workers both took part.
    pids = Execution.objects.filter(run_id=runs[0]).values_list("worker", flat=True)
    inline_pid = parents[2].pid
    by_parent = sum(1 for w in pids if int(w.rsplit(":", 1)[-1]) == inline_pid)
    result.figures["parents reported"] = f"{sum(1 for r in reports if r)}/3"
    result.figures["ran by"] = f"inline parent {by_parent}, rq workers {len(pids) - by_parent}"
