"""A deploy: every worker SIGKILLed at once mid-run, with no parent, then new workers started.

The run was started with ``--no-wait`` (what a web view calling ``start(executor="rq")`` does),
so no process watches it. The new workers' supervisors find it: they refill its drain slots
and the items of the dead workers are reclaimed once their leases run out. Nothing is lost and
no item whose outcome was recorded runs again; nobody types a command.
"""

from __future__ import annotations

import time

from .crash import SLEEP, _died_mid_item
from .harness import Harness, Result

# The new workers start (a few seconds), then their supervisors look within a period.
RESTART_SLACK = 15.0


def deploy(h: Harness, result: Result) -> None:
    from fanout.conf import conf
    from fanout.definition import get_definition

    assert h.workers is not None
    n = h.items(0.75)
    key = h.run_key("deploy")
    args = ["run_fanout", "chaos_crash", "--executor", "rq", "--no-wait", "--param", f"n={n}"]
    code, out, err = h.manage([*args, "--param", SLEEP, "--run-key", key], "deploy-start")
    result.check(code == 0, f"run_fanout --no-wait exited {code}: {err.strip()[-300:]}")
    run_id = h.run_id(key)
    reached = h.wait_progress(run_id, 0.3, timeout=180)
    result.check(reached, "the run never reached 30% before the deploy")
    killed = h.workers.redeploy()
    started = time.monotonic()
    finished = h.wait_finished([run_id], timeout=300)
    result.check(finished, "the run did not finish after the deploy")
    lease = get_definition("chaos_crash").lease_seconds
    fig = h.ledger([run_id])
    h.judge(result, fig, lease=lease + float(conf.SUPERVISE_SECONDS) + RESTART_SLACK)
    result.figures["workers killed"] = killed
    result.figures["died mid-item"] = _died_mid_item(fig.duplicates)
    result.figures["healed in"] = f"{time.monotonic() - started:.0f}s"
    failed = fig.statuses.get("failed", 0)
    result.check(failed == 0, f"{failed} items failed (a crash used their only attempt?)")
