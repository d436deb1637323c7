"""Budgets hold across worker processes: spend never passes a budget by more than the sum of
(actual - estimate) over the items in flight, and never with upper-bound estimates."""

from __future__ import annotations

import json
import subprocess

import pytest

from fanout.models import BatchRun, CapacityPool, ItemClaim, RunStatus, SpendAccount
from tests.pools.workers import Workers, kill_group
from tests.procs import finish, wait_until
from tests.testapp.fanouts_spend import SPEND_POOL

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 8
PROCESSES = 2


def run_fanout(name: str, run_key: str, workers: int, *extra: str, **params: object) -> list[str]:
    args = ["run_fanout", name, "--run-key", run_key, "--workers", str(workers), *extra]
    for key, value in params.items():
        args += ["--param", f"{key}={json.dumps(value)}"]
    return args


def quiet(run: BatchRun, account: SpendAccount) -> bool:
    """Admission has stopped: nothing runs, nothing is reserved."""
    account.refresh_from_db()
    running = ItemClaim.objects.filter(run=run, status="running").exists()
    return not running and account.reserved < 1e-9


def spent_items(run: BatchRun) -> list[ItemClaim]:
    return [i for i in ItemClaim.objects.filter(run=run) if i.cost]


def all_exit_0(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        code, out, err = finish(proc, timeout=90)
        assert code == 0, f"worker exited {code}:\n{out}\n{err}"


def test_upper_bound_estimates_never_pass_a_budget_under_2x8_workers_and_raising_it_resumes(
    workers: Workers,
) -> None:
    budget = 3.0
    command = run_fanout(
        "spend_work",
        "upper",
        THREADS,
        "--max-spend",
        f"usd={budget}",
        n=120,
        estimate=0.1,
        sleep=0.02,
    )
    procs = workers([command] * PROCESSES)
    run = wait_until(lambda: BatchRun.objects.filter(run_key="upper").first(), 30, "the run")
    account = wait_until(lambda: SpendAccount.objects.filter(run=run).first(), 30, "its budget")
    wait_until(lambda: quiet(run, account) and account.spent > budget - 0.1, 60, "spend")
    items = spent_items(run)
    assert account.spent <= budget + 1e-9
    assert account.spent == pytest.approx(sum(i.cost["usd"] for i in items))
    assert 30 <= len(items) < 120  # costs below estimates let more than budget/estimate run
    assert ItemClaim.objects.filter(run=run, status="pending", attempt=1).count() == 120 - len(
        items
    )
    assert len({i.owner.split(":")[1] for i in items}) == PROCESSES  # both processes spent

    # An operator raises the budget: the waiting workers take the rest of the run.
    SpendAccount.objects.filter(pk=account.pk).update(budget=100)
    all_exit_0(procs)
    run.refresh_from_db()
    account.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert account.spent == pytest.approx(sum(i.cost["usd"] for i in spent_items(run)))
    assert account.reserved == pytest.approx(0.0, abs=1e-9)


def test_a_budget_with_estimates_below_cost_is_passed_by_no_more_than_what_items_in_flight_overran(
    workers: Workers,
) -> None:
    budget, estimate = 3.0, 0.1
    command = run_fanout(
        "spend_work",
        "over",
        THREADS,
        "--max-spend",
        f"usd={budget}",
        n=200,
        estimate=estimate,
        factor=2.0,
    )
    procs = workers([command] * PROCESSES)
    run = wait_until(lambda: BatchRun.objects.filter(run_key="over").first(), 30, "the run")
    account = wait_until(lambda: SpendAccount.objects.filter(run=run).first(), 30, "its budget")
    wait_until(lambda: quiet(run, account) and account.spent > budget - 2 * estimate, 60, "spend")
    for proc in procs:
        kill_group(proc)
    items = spent_items(run)
    overran = sorted((i.cost["usd"] - estimate for i in items), reverse=True)
    # In flight at once: at most every thread of every process.
    bound = sum(max(0.0, o) for o in overran[: THREADS * PROCESSES])
    assert account.spent == pytest.approx(sum(i.cost["usd"] for i in items))
    assert account.spent - budget <= bound + 1e-9
    assert len(items) < 200


def test_a_killed_workers_reservation_is_kept_until_its_item_is_reclaimed_and_then_spent(
    workers: Workers, tmp_path
) -> None:
    CapacityPool.objects.create(name=SPEND_POOL, max_concurrency=10)
    SpendAccount.objects.create(pool=SPEND_POOL, unit="usd", budget=50)
    block = tmp_path / "go-on"
    command = run_fanout(
        "spend_pooled", "killed", 3, "--max-spend", "usd=50", n=3, block_file=str(block)
    )
    (proc,) = workers([command])
    run = wait_until(lambda: BatchRun.objects.filter(run_key="killed").first(), 30, "the run")
    wait_until(
        lambda: ItemClaim.objects.filter(run=run, status="running").count() == 3, 30, "3 running"
    )
    kill_group(proc)
    run_account = SpendAccount.objects.get(run=run)
    pool_account = SpendAccount.objects.get(pool=SPEND_POOL)
    # Dead, but nobody knows what its calls spent: the reservations stay.
    assert run_account.reserved == pytest.approx(0.3)
    assert pool_account.reserved == pytest.approx(0.3)
    block.touch()
    (again,) = workers([run_fanout("spend_pooled", "killed", 3, n=3, block_file=str(block))])
    all_exit_0([again])
    run_account.refresh_from_db()
    pool_account.refresh_from_db()
    items = list(ItemClaim.objects.filter(run=run))
    assert all(i.status == "succeeded" and i.crashes == 1 for i in items)
    # Each item cost its cut-off call's estimate, then what its second call reported.
    for item in items:
        assert item.cost["usd"] == pytest.approx(0.1 + item.result["usd"])
    total = sum(i.cost["usd"] for i in items)
    assert run_account.spent == pytest.approx(total)
    assert pool_account.spent == pytest.approx(total)
    assert run_account.reserved == pytest.approx(0.0, abs=1e-9)
    assert pool_account.reserved == pytest.approx(0.0, abs=1e-9)


def test_a_pool_budget_holds_across_runs_and_processes(workers: Workers) -> None:
    CapacityPool.objects.create(name=SPEND_POOL, max_concurrency=16)
    account = SpendAccount.objects.create(pool=SPEND_POOL, unit="usd", budget=2.0)
    commands = [
        run_fanout("spend_pooled", f"pool-{k}", THREADS, n=60, estimate=0.1, sleep=0.01)
        for k in range(PROCESSES)
    ]
    procs = workers(commands)
    runs = wait_until(
        lambda: (
            list(BatchRun.objects.filter(run_key__startswith="pool-"))
            if BatchRun.objects.filter(run_key__startswith="pool-").count() == 2
            else None
        ),
        30,
        "runs",
    )

    def stopped() -> bool:
        account.refresh_from_db()
        running = ItemClaim.objects.filter(pool=SPEND_POOL, status="running").exists()
        return account.spent > 1.9 and not running and account.reserved < 1e-9

    wait_until(stopped, 120, "the pool's budget to be spent")
    for proc in procs:
        kill_group(proc)
    items = [i for run in runs for i in spent_items(run)]
    assert account.spent <= 2.0 + 1e-9
    assert account.spent == pytest.approx(sum(i.cost["usd"] for i in items))
