"""What fanout_pools and the admin say of a budget's period is on the database's clock: a host
whose clock is hours ahead must not show a budget spent in the period in force as empty."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.auth.models import User

from fanout.clock import db_now
from fanout.models import CapacityPool, SpendAccount
from tests import procs
from tests.conftest import prepare
from tests.test_clock_skew import skewed
from tests.testapp.fanouts_spend import SPEND_POOL

pytestmark = pytest.mark.django_db(transaction=True)

# A host two hours ahead of the database: the budget's hour-long period, half gone by the
# database's clock, has ended by the host's.
AHEAD = "+2h"

# The admin's pool page and budgets page as that host renders them (one process, one login).
ADMIN_PAGES = """
import json
from django.contrib.auth.models import User
from django.test import Client
from django.test.utils import setup_test_environment
from django.urls import reverse
from fanout.models import CapacityPool

setup_test_environment()
client = Client()
client.force_login(User.objects.get(username="clock-admin"))
pool = CapacityPool.objects.get(name=%r)
pages = [
    reverse("admin:fanout_capacitypool_change", args=[pool.pk]),
    reverse("admin:fanout_spendaccount_changelist"),
    reverse("admin:fanout_batchrun_change", args=[%d]),
]
print(json.dumps([client.get(url).content.decode() for url in pages]))
"""


@pytest.fixture
def spent_in_this_period() -> SpendAccount:
    CapacityPool.objects.create(name=SPEND_POOL, max_concurrency=10)
    return SpendAccount.objects.create(
        pool=SPEND_POOL,
        unit="usd",
        budget=1.0,
        spent=1.0,
        period=3600.0,
        period_started_at=db_now() - timedelta(minutes=30),
    )


def test_fanout_pools_on_a_host_ahead_of_the_database_shows_the_budget_spent(
    database_url: str, tmp_path: Path, spent_in_this_period: SpendAccount
) -> None:
    env = skewed(procs.child_env(database_url), AHEAD, tmp_path / "shim")
    done = procs.manage(["fanout_pools"], env)
    assert done.returncode == 0, done.stderr
    assert "budget spent ($1.00 of $1.00, $0.00 reserved)" in done.stdout, done.stdout


def test_the_admin_on_a_host_ahead_of_the_database_shows_the_budget_spent(
    database_url: str, tmp_path: Path, spent_in_this_period: SpendAccount
) -> None:
    User.objects.create_superuser("clock-admin", "admin@example.com", "x")
    run = prepare("spend_pooled", {"n": 2})  # waiting for the pool's budget
    env = skewed(procs.child_env(database_url), AHEAD, tmp_path / "shim")
    done = procs.manage(["shell", "-c", ADMIN_PAGES % (SPEND_POOL, run.pk)], env)
    assert done.returncode == 0, done.stderr
    pool_page, budgets_page, run_page = json.loads(done.stdout.strip().splitlines()[-1])
    assert "$1.00 of $1.00" in pool_page
    assert "$1.00 of $1.00" in budgets_page
    assert "budget spent ($1.00 of $1.00, $0.00 reserved)" in run_page  # why the run waits
