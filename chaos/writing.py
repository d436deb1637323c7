"""A work list interrupted while it is being written: its writer SIGKILLed, or PostgreSQL
restarted under it.

The writer is ``run_fanout --executor rq``, started with settings that write items in chunks of
ten, so that writing lasts a few seconds. Nothing else carries the run: it must finish by
itself (the workers find a pending run whose writer's lease ran out and write the rest; keys
make that idempotent), every item once, and an outage must delete nothing.
"""

from __future__ import annotations

import time

from .harness import Harness, Result, durable, postgres_outage

SLEEP = "sleep=[0.0,0.01]"
WRITER_SETTINGS = "chaos.writer_settings"


def _writer_lease() -> float:
    """How long a dead writer's claim on the work list lasts (materialize's lease)."""
    from fanout import materialize

    return float(getattr(materialize, "_MATERIALIZE_LEASE_SECONDS", 60.0))


def _wait_writing(h: Harness, key: str, written: int, timeout: float = 60) -> tuple[int, int]:
    """(run id, items written) once the run is pending with ``written`` items written or more."""
    from fanout.models import BatchRun

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = durable(
            lambda: (
                BatchRun.objects.filter(run_key=key)
                .values_list("pk", "status", "materialized_upto")
                .first()
            )
        )
        if row is not None:
            if row[1] != "pending":
                raise RuntimeError(
                    f"the work list was written before it could be interrupted "
                    f"(run {row[0]} {row[1]})"
                )
            if row[2] >= written:
                return row[0], row[2]
        time.sleep(0.01)
    raise RuntimeError(f"no run {key} writing its work list after {timeout:g}s")


def _judge_run(h: Harness, result: Result, run_id: int, n: int, waited: float) -> None:
    """The run finished by itself, succeeded, with its n items, each run once."""
    from fanout.conf import conf
    from fanout.models import BatchRun, ItemClaim

    timeout = _writer_lease() + 2 * float(conf.SUPERVISE_SECONDS) + waited
    begun = time.monotonic()
    finished = h.wait_finished([run_id], timeout=timeout)
    run = durable(lambda: BatchRun.objects.filter(pk=run_id).first())
    if run is None:
        result.check(False, f"run {run_id} was deleted")
        return
    stored = durable(lambda: ItemClaim.objects.filter(run_id=run_id).count())
    result.figures["healed in"] = f"{time.monotonic() - begun:.0f}s" if finished else "-"
    result.check(
        finished,
        f"run {run_id} still {run.status} {timeout:.0f}s later, {run.materialized_upto} of {n} "
        f"items written, {stored} stored",
    )
    result.check(run.status == "succeeded", f"run {run_id} ended {run.status}: {run.error[:200]}")
    result.check(run.total_items == n and stored == n, f"{stored} items stored, not {n}")
    fig = h.ledger([run_id])
    h.judge(result, fig)
    result.check(fig.once == n, f"{fig.once} of {n} items ran exactly once")


def writer_killed(h: Harness, result: Result) -> None:
    """``run_fanout --no-wait`` SIGKILLed with a third of its work list written."""
    n = h.scale(3000, 1000)
    key = h.run_key("writer-killed")
    args = ["run_fanout", "chaos_crash", "--executor", "rq", "--no-wait", "--param", f"n={n}"]
    env = {**h.env, "DJANGO_SETTINGS_MODULE": WRITER_SETTINGS}
    writer = h.parent([*args, "--param", SLEEP, "--run-key", key], "writer", env=env)
    run_id, _ = _wait_writing(h, key, n // 3)
    h.kill_parent(writer)
    from fanout.models import BatchRun

    written = durable(lambda: BatchRun.objects.get(pk=run_id).materialized_upto)
    result.figures["killed at"] = f"{written}/{n} written"
    _judge_run(h, result, run_id, n, waited=30)


def pg_restart_writing(h: Harness, result: Result) -> None:
    """PostgreSQL restarted (or this database's sessions cut) mid-work-list."""
    from fanout.models import BatchRun

    n = h.scale(3000, 1000)
    key = h.run_key("pg-restart-writing")
    args = ["run_fanout", "chaos_infra", "--executor", "rq", "--param", f"n={n}"]
    env = {**h.env, "DJANGO_SETTINGS_MODULE": WRITER_SETTINGS}
    writer = h.parent([*args, "--param", SLEEP, "--run-key", key, "--json"], "writer", env=env)
    run_id, written = _wait_writing(h, key, n // 3)
    outage = postgres_outage(h.opts.database_url, h.opts.pg_fault)
    result.details["outage"] = outage
    result.figures["fault"] = f"{outage['how']} at {written}/{n} written"
    survived = durable(lambda: BatchRun.objects.filter(pk=run_id).exists())
    result.check(survived, f"run {run_id} was deleted by the outage")
    if not survived:
        writer.finish(30)
        return
    _judge_run(h, result, run_id, n, waited=30)
    code, _, err = writer.finish(30)
    # The writer may carry on, or give up and leave the rest to the workers: either is fine.
    result.figures["writer"] = "finished" if code == 0 else f"exited {code}"
    result.details["writer stderr"] = err[-1500:]
