"""A run's samples count each item that ended exactly once, whatever the order in which
outcomes are written and whoever samples the run at the same moment."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction

from fanout.actions import retry_failed
from fanout.call import execute
from fanout.charts import run_charts
from fanout.claim import claim
from fanout.clock import db_now
from fanout.definition import get_definition
from fanout.models import BatchRun, ItemClaim, ItemStatus, RunSample
from fanout.record import FAILED, ExecutionOutcome, record
from fanout.sample import sample_run
from tests.conftest import prepare
from tests.procs import wait_until
from tests.test_retry_race import LOCK_POLL, session_id, waits_for_a_lock


def ended_items(run: BatchRun) -> int:
    return ItemClaim.objects.filter(run=run, status=ItemStatus.SUCCEEDED).count()


@pytest.mark.django_db(transaction=True)
def test_an_outcome_written_after_a_sample_of_the_window_it_ended_in_is_still_charted(
    settings: Any,
) -> None:
    # A batch of two: the first item's handler returns at once, the second runs on; a sample
    # is taken meanwhile (its window ends SAMPLE_SECONDS before it), and then the batch is
    # recorded, the first outcome with the time its handler returned.
    settings.FANOUT_SAMPLE_SECONDS = 10
    run = prepare("t_batched", {"n": 4})
    definition = get_definition("t_batched")
    taken = claim(run.pk, "batch", 2, 300, 3, None)
    assert taken.token is not None and len(taken.items) == 2
    outcomes = [execute(definition, run.pk, {}, item) for item in taken.items]
    run.refresh_from_db()

    sample = sample_run(run, db_now() + timedelta(seconds=30))
    assert sample is not None
    record(run.pk, taken.token, outcomes, definition.failure_policy, definition)

    assert ended_items(run) == 2
    charts = run_charts(run, db_now() + timedelta(seconds=31))
    assert sum(charts.finished) == 2, (sample.upto, [o.finished_at for o in outcomes])


@pytest.mark.skipif(connection.vendor != "postgresql", reason="a table lock holds the writes")
@pytest.mark.django_db(transaction=True)
def test_two_supervisors_sampling_a_run_at_once_count_its_ended_items_once(
    settings: Any,
) -> None:
    # run_fanout's watcher tends its run every 2 s outside the supervisors' election, and a
    # sweep that outlasts its period lets a second supervisor take the run: two samplers.
    settings.FANOUT_SAMPLE_SECONDS = 10
    run = prepare("t_collect", {"n": 4})
    definition = get_definition("t_collect")
    taken = claim(run.pk, "done", 2, 300, 3, None)
    assert taken.token is not None
    outcomes = [execute(definition, run.pk, {}, item) for item in taken.items]
    record(run.pk, taken.token, outcomes, definition.failure_policy, definition)
    run.refresh_from_db()
    at = db_now() + timedelta(seconds=30)

    sessions: dict[str, int] = {}
    done: list[str] = []

    def sampler(name: str) -> None:
        try:
            sessions[name] = session_id()
            sample_run(BatchRun.objects.get(pk=run.pk), at)
        finally:
            done.append(name)
            connections["default"].close()

    threads = [threading.Thread(target=sampler, args=(n,)) for n in ("one", "two")]
    with transaction.atomic():
        # Reads go on; each sampler's insert waits here until both have read the last sample.
        with connection.cursor() as cursor:
            cursor.execute("LOCK TABLE fanout_runsample IN SHARE MODE")
        for t in threads:
            t.start()
        wait_until(lambda: len(sessions) == 2, 30, "both samplers to start")
        wait_until(
            lambda: sum(waits_for_a_lock(s) for s in sessions.values()) + len(done) == 2,
            30,
            "both samplers to write or give up",
            LOCK_POLL,
        )
    for t in threads:
        t.join(60)

    windows = list(RunSample.objects.filter(run=run).values_list("finished", flat=True))
    charts = run_charts(run, at)
    assert sum(charts.finished) == ended_items(run) == 2, windows


@pytest.mark.django_db(transaction=True)
def test_an_item_retried_while_its_run_runs_is_charted_by_its_last_end_only(
    settings: Any,
) -> None:
    # A running run's failed item is retried (the run never ended, so it is not "reopened"):
    # a window had counted its failure, and it ends again, succeeding, after that window.
    settings.FANOUT_SAMPLE_SECONDS = 0.001
    run = prepare("t_collect", {"n": 3})
    taken = claim(run.pk, "first", 1, 300, 3, None)
    assert taken.token is not None
    item = taken.items[0]
    failed = ExecutionOutcome(item.pk, item.key, FAILED, error="boom", error_class="Boom")
    failed.finished_at = item.started_at
    record(run.pk, taken.token, [failed], "collect")
    run.refresh_from_db()
    assert sample_run(run) is not None

    assert retry_failed(BatchRun.objects.get(pk=run.pk)) == 1
    again = claim(run.pk, "second", 1, 300, 3, None)
    assert again.token is not None and again.items[0].pk == item.pk
    outcomes = [execute(get_definition("t_collect"), run.pk, {}, again.items[0])]
    record(run.pk, again.token, outcomes, "collect")
    run.refresh_from_db()
    assert run.reopened == 0 and ended_items(run) == 1

    charts = run_charts(run, db_now())
    assert (sum(charts.finished), sum(charts.failed)) == (1, 0)
