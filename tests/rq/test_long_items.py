"""Items may run for hours: no RQ job timeout cuts one off or makes it loop."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from fanout.models import BatchRun, RunStatus
from tests.rq.support import report
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_item_that_outlives_its_drain_jobs_budget_many_times_runs_once(
    processes: Any,
) -> None:
    processes.workers(1, FANOUT_DRAIN_SECONDS=1, FANOUT_STOP_GRACE_SECONDS=1)
    parent = processes.manage(
        ["run_fanout", "slots_long", "--param", "n=3", "--param", 'slow={"s00000": 8}']
        + ["--executor", "rq", "--json"]
    )

    code, log = parent.finish(timeout=120)

    assert code == 0, log
    assert report(parent.stdout())["status"] == RunStatus.SUCCEEDED
    run = BatchRun.objects.get(definition="slots_long")
    calls = Counter(Execution.objects.filter(run_id=run.pk).values_list("key", flat=True))
    assert calls == {"s00000": 1, "s00001": 1, "s00002": 1}
    # Drain jobs carry no RQ timeout that could fire inside a long item.
    jobs = [processes.redis.hgetall(k) for k in processes.redis.keys("rq:job:fanout-drain-*")]
    assert jobs, "no drain job was kept in Redis"
    assert {int(j[b"timeout"]) for j in jobs if b"timeout" in j} == {-1}
