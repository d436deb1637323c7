"""Following the README into a brand-new project, as a user would, works from the first step.

The wheel is built and installed into a fresh virtualenv (with the Django this suite runs on);
`django-admin startproject` makes a project; the README's settings block is applied as it is,
plus a fresh PostgreSQL database and this session's Redis; a tiny app defines a fan-out. Then
`migrate` and `check` pass, every fanout admin page answers 200 to a superuser, and the
definition runs inline and through one real `rqworker` process.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import dj_database_url
import django
import psycopg
import pytest
from redis import Redis
from redis.exceptions import RedisError

from tests.procs import ROOT, finish, spawn_manage

pytestmark = pytest.mark.install

ADMIN_DATABASE_URL = "postgres://root@127.0.0.1:5432/postgres"
ITEMS = 7

MODELS = """
from django.db import models


class Invoice(models.Model):
    amount = models.IntegerField()
    charged_by = models.CharField(max_length=20, blank=True)
"""

FANOUTS = """
from fanout import FanOut, Item

from .models import Invoice


def charge(item: Item) -> dict:
    Invoice.objects.filter(pk=item.payload["id"]).update(charged_by=item.params["by"])
    return {"amount": item.payload["amount"]}


FanOut(
    "charge_invoices",
    over=lambda params: Invoice.objects.order_by("pk"),
    key=lambda invoice: f"invoice-{invoice.pk}",
    payload=lambda invoice: {"id": invoice.pk, "amount": invoice.amount},
    do=charge,
    pool="payments",
    max_parallel=4,
    params={"by": str},
    join=lambda outcomes: {"charged": sum(o.result["amount"] for o in outcomes)},
)
"""

# Run in the new project's virtualenv, as its settings say: pages a superuser opens.
ADMIN_PAGES = """
import json, sys

import django
from django.test.utils import setup_test_environment

django.setup()
setup_test_environment()  # lets the test client's host in

from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from fanout.models import BatchRun, CapacityPool, ItemClaim

user = get_user_model().objects.create_superuser("admin", "admin@example.com", "pw")
client = Client()
client.force_login(user)
run = BatchRun.objects.get(run_key="inline")
item = ItemClaim.objects.filter(run=run).order_by("index").first()
pool = CapacityPool.objects.get(name="payments")
pages = [
    reverse("admin:index"),
    reverse("admin:fanout_batchrun_changelist"),
    reverse("admin:fanout_batchrun_change", args=[run.pk]),
    reverse("admin:fanout_itemclaim_changelist"),
    reverse("admin:fanout_itemclaim_changelist") + f"?run={run.pk}&status=succeeded",
    reverse("admin:fanout_itemclaim_change", args=[item.pk]),
    reverse("admin:fanout_capacitypool_changelist"),
    reverse("admin:fanout_capacitypool_change", args=[pool.pk]),
]
print(json.dumps({page: client.get(page).status_code for page in pages}))
"""

REPORT = """
import json

import django

django.setup()
from fanout.models import BatchRun
from shop.models import Invoice

print(json.dumps({
    "runs": {r.run_key: [r.status, r.join_result] for r in BatchRun.objects.all()},
    "charged_by": sorted(set(Invoice.objects.values_list("charged_by", flat=True))),
}))
"""


def readme_settings() -> str:
    """The settings block of the README's "Install into your project" section."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- install-settings[^>]*-->\s*```python\n(.*?)```", readme, re.S)
    assert found, "README.md has no <!-- install-settings --> python block"
    return found.group(1)


def reachable(database_url: str, redis_url: str) -> str:
    """Why a service the test needs is unreachable, or ""."""
    try:
        psycopg.connect(database_url, connect_timeout=3).close()
    except psycopg.Error as exc:
        return f"PostgreSQL at {database_url}: {exc}"
    try:
        Redis.from_url(redis_url, socket_connect_timeout=3).ping()
    except RedisError as exc:
        return f"Redis at {redis_url}: {exc}"
    return ""


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A Redis database that no other session's install test uses (8..6, held by a file lock)."""
    base = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0").rsplit("/", 1)[0]
    for db in (8, 7, 6):
        with open(Path(tempfile.gettempdir()) / f"fanout-install-redis-{db}", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            yield f"{base}/{db}"
            return
    pytest.fail("Redis databases 8, 7 and 6 are all taken by other install tests")


@pytest.fixture
def services(redis_url: str) -> Iterator[tuple[str, str]]:
    """A fresh PostgreSQL database and a Redis database, dropped and flushed at the end."""
    admin_url = os.environ.get("DATABASE_URL", "")
    if not admin_url.startswith(("postgres://", "postgresql://")):
        admin_url = ADMIN_DATABASE_URL
    why = reachable(admin_url, redis_url)
    if why:
        pytest.skip(f"the install test needs its services: {why}")
    name = f"fanout_install_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    redis = Redis.from_url(redis_url)
    redis.flushdb()
    try:
        yield admin_url.rsplit("/", 1)[0] + f"/{name}", redis_url
    finally:
        redis.flushdb()
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def venv_with_the_wheel(tmp_path: Path) -> Path:
    """A fresh virtualenv holding the built wheel, its dependencies and this suite's Django."""
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, ROOT], ROOT)
    (wheel,) = dist.glob("django_fanout-*.whl")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], tmp_path)
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run([*pip, wheel, f"Django=={django.get_version()}"], tmp_path, timeout=600)
    return venv / "bin"


def run(
    command: list[object], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> str:
    done = subprocess.run(
        [str(c) for c in command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, (
        f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout


def new_project(bin_dir: Path, where: Path, database_url: str, redis_url: str) -> Path:
    """`django-admin startproject site`, the README's settings, and an app with a fan-out."""
    where.mkdir(parents=True, exist_ok=True)  # Django before 6.0 wants it to exist
    run([bin_dir / "django-admin", "startproject", "mysite", where], where.parent)
    (where / "shop" / "migrations").mkdir(parents=True)
    for name, text in {
        "__init__.py": "",
        "migrations/__init__.py": "",
        "models.py": MODELS,
        "fanouts.py": FANOUTS,
    }.items():
        (where / "shop" / name).write_text(textwrap.dedent(text))
    settings = where / "mysite" / "settings.py"
    settings.write_text(
        settings.read_text()
        + "\n# ---- from README.md, as it is\n"
        + readme_settings()
        + "\n# ---- this test's own: its app, a fresh database, its Redis database\n"
        + 'INSTALLED_APPS += ["shop"]\n'
        + f"DATABASES = {{'default': {dj_database_url.parse(database_url)!r}}}\n"
        + f'RQ_QUEUES["fanout"]["URL"] = {redis_url!r}\n'
    )
    return where


def test_a_new_project_that_follows_the_readme_migrates_checks_serves_the_admin_and_runs(
    tmp_path: Path, services: tuple[str, str]
) -> None:
    database_url, redis_url = services
    bin_dir = venv_with_the_wheel(tmp_path)
    project = new_project(bin_dir, tmp_path / "project", database_url, redis_url)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "PYTHON"))},
        "DJANGO_SETTINGS_MODULE": "mysite.settings",
        "PYTHONPATH": str(project),
    }
    python = bin_dir / "python"

    def manage(*args: str) -> str:
        return run([python, "manage.py", *args], project, env)

    manage("makemigrations", "shop", "-v0")
    manage("migrate", "--noinput", "-v0")
    checked = subprocess.run(
        [python, "manage.py", "check"], cwd=project, env=env, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stderr
    assert "fanout." not in checked.stdout + checked.stderr
    manage(
        "shell",
        "-c",
        f"from shop.models import Invoice\n"
        f"Invoice.objects.bulk_create(Invoice(amount=i) for i in range(1, {ITEMS + 1}))",
    )

    inline = json.loads(
        manage(
            "run_fanout", "charge_invoices", "--param", "by=inline", "--run-key", "inline", "--json"
        )
    )
    assert (inline["status"], inline["counts"]["succeeded"]) == ("succeeded", ITEMS)

    worker = spawn_manage(["rqworker", "fanout"], env, python=python, cwd=project)
    try:
        by_rq = json.loads(
            run(
                [python, "manage.py", "run_fanout", "charge_invoices", "--param", "by=rq"]
                + ["--run-key", "rq", "--executor", "rq", "--json"],
                project,
                env,
                timeout=120,
            )
        )
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        _, _, worker_log = finish(worker)
    assert (by_rq["status"], by_rq["counts"]["succeeded"]) == ("succeeded", ITEMS), worker_log

    statuses = json.loads(run([python, "-c", ADMIN_PAGES], project, env))
    assert statuses and set(statuses.values()) == {200}, statuses

    ran = json.loads(run([python, "-c", REPORT], project, env))
    total = ITEMS * (ITEMS + 1) // 2
    assert ran["runs"] == {
        "inline": ["succeeded", {"charged": total}],
        "rq": ["succeeded", {"charged": total}],
    }
    assert ran["charged_by"] == ["rq"]  # the rq run charged every invoice, in the worker
