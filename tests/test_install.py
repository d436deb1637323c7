"""Following the README into a brand-new project, as a user would, works from the first step.

The wheel is built and installed once into a fresh virtualenv (with the Django this suite runs
on); `django-admin startproject` makes each project; the README's settings block is applied as
it is, plus a fresh PostgreSQL database and this session's Redis.

- A tiny app defines a fan-out: `migrate` and `check` pass, every fanout admin page answers 200
  to a superuser, and the definition runs inline and through one real `rqworker` process.
- The README itself: every ```python block goes where its first line says (the app's
  `fanouts.py`, the settings, the URLconf), the commands marked as tested run as written in
  bash, and every definition it shows runs to success. A README example that breaks fails here.
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
import time
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


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin directory of one virtualenv with the wheel, shared by this module's projects."""
    return venv_with_the_wheel(tmp_path_factory.mktemp("install"))


def venv_with_the_wheel(tmp_path: Path) -> Path:
    """A fresh virtualenv holding the built wheel (with the prometheus extra that the README's
    metrics example needs), its dependencies and this suite's Django."""
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, ROOT], ROOT)
    (wheel,) = dist.glob("django_fanout-*.whl")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], tmp_path)
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run([*pip, f"{wheel}[prometheus]", f"Django=={django.get_version()}"], tmp_path, timeout=600)
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


def project_env(bin_dir: Path, project: Path) -> dict[str, str]:
    """The environment a user's shell has in the project: its virtualenv first on PATH."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "PYTHON"))},
        "DJANGO_SETTINGS_MODULE": "mysite.settings",
        "PYTHONPATH": str(project),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def test_a_new_project_that_follows_the_readme_migrates_checks_serves_the_admin_and_runs(
    tmp_path: Path, bin_dir: Path, services: tuple[str, str]
) -> None:
    database_url, redis_url = services
    project = new_project(bin_dir, tmp_path / "project", database_url, redis_url)
    env = project_env(bin_dir, project)
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


# ---------------------------------------------------------------------- the README's examples

README = ROOT / "README.md"
TESTED_COMMANDS = "<!-- tested:"

# What the README's examples take as the user's own code: their models and a payments client.
README_MODELS = """
from django.db import models


class Invoice(models.Model):
    month = models.CharField(max_length=7)
    amount = models.IntegerField()


class Org(models.Model):
    name = models.CharField(max_length=50)


class Repo(models.Model):
    org = models.ForeignKey(Org, on_delete=models.CASCADE)
    name = models.CharField(max_length=50)
"""

README_PAYMENTS = """
from dataclasses import dataclass


class CardDeclined(Exception):
    pass


class TooManyRequests(Exception):
    retry_after = 1.0


@dataclass
class Receipt:
    id: str


def charge(invoice_id: int, idempotency_key: str) -> Receipt:
    return Receipt(id=f"receipt-{invoice_id}")
"""

# Rows the examples work on, written by `migrate` (the README's first command) like any data.
README_DATA = """
from django.db import migrations


def rows(apps, schema_editor):
    Invoice, Org, Repo = (apps.get_model("myapp", m) for m in ("Invoice", "Org", "Repo"))
    Invoice.objects.bulk_create(Invoice(month="2026-11", amount=i) for i in range(1, 6))
    for o in range(1, 4):
        org = Org.objects.create(name=f"org-{o}")
        Repo.objects.bulk_create(Repo(org=org, name=f"repo-{o}-{r}") for r in range(3))


class Migration(migrations.Migration):
    dependencies = [("myapp", "0001_initial")]
    operations = [migrations.RunPython(rows)]
"""

# The definitions the README shows besides the quick start's, run as its text says, in one
# process (each `manage.py` costs a Django start-up); then a mistyped month, which the README
# says exits 3 (an empty work list that charge_invoices refuses), and what every run became.
README_RUNS = """
import json, sys

import django

django.setup()
from io import StringIO

from django.core.management import CommandError, call_command

from fanout.models import BatchRun

codes = {}
for args in (["sync_orgs"], ["onboard_org", "--param", "org=1"],
             ["charge_month", "--param", "month=2026-11"],
             ["charge_invoices", "--param", "month=2026-1"]):
    try:
        call_command("run_fanout", *args, stdout=StringIO(), stderr=StringIO())
        codes[args[0]] = 0
    except CommandError as exc:
        codes[args[0]] = exc.returncode
runs = {r.definition: [r.status, r.join_result] for r in BatchRun.objects.filter(parent_item=None)}
print(json.dumps({"codes": codes, "runs": runs}, default=str))
"""


def readme_blocks(language: str) -> list[tuple[int, str, str]]:
    """Every ```language block of README.md: (line, the text before it, its code)."""
    text = README.read_text()
    pattern = rf"^```{language}\n(.*?)^```"
    return [
        (text.count("\n", 0, m.start()) + 1, text[: m.start()], m.group(1))
        for m in re.finditer(pattern, text, re.S | re.M)
    ]


def readme_python() -> dict[str, str]:
    """The README's Python blocks by where they go: the app's fanouts.py, settings, urls."""
    files = {"fanouts": "", "settings": "", "urls": ""}
    for line, _, code in readme_blocks("python"):
        if code.startswith("# myapp/fanouts.py"):
            files["fanouts"] += code + "\n\n"
        elif code.startswith(("INSTALLED_APPS", "FANOUT_POOLS")):
            files["settings"] += code + "\n"
        elif "urlpatterns" in code:
            files["urls"] += code + "\n"
        else:
            pytest.fail(
                f"README.md line {line}: a python block this test cannot place; begin it with "
                "'# myapp/fanouts.py', a settings name, or make it a urls.py block"
            )
    return files


def readme_commands() -> list[tuple[int, str]]:
    """The shell blocks that the README marks as tested, in order."""
    return [
        (line, code)
        for line, before, code in readme_blocks("sh")
        if before.rstrip().splitlines()[-1].startswith(TESTED_COMMANDS)
    ]


def readme_project(bin_dir: Path, where: Path, database_url: str, redis_url: str) -> Path:
    """startproject, every README settings block, the app `myapp` from the README's fanouts.py
    blocks (with the models and the payments client they name), and its URLconf block."""
    where.mkdir(parents=True, exist_ok=True)
    run([bin_dir / "django-admin", "startproject", "mysite", where], where.parent)
    blocks = readme_python()
    app = where / "myapp"
    (app / "migrations").mkdir(parents=True)
    for name, text in {
        "__init__.py": "",
        "migrations/__init__.py": "",
        "models.py": README_MODELS,
        "payments.py": README_PAYMENTS,
        "fanouts.py": blocks["fanouts"],
    }.items():
        (app / name).write_text(text)
    settings = where / "mysite" / "settings.py"
    settings.write_text(
        settings.read_text()
        + "\n# ---- from README.md, as it is\n"
        + blocks["settings"]
        + "\n# ---- this test's own: the app, a fresh database, its Redis database\n"
        + 'INSTALLED_APPS += ["myapp"]\n'
        + f"DATABASES = {{'default': {dj_database_url.parse(database_url)!r}}}\n"
        + f'RQ_QUEUES["fanout"]["URL"] = {redis_url!r}\n'
    )
    urls = where / "mysite" / "urls.py"
    urls.write_text(urls.read_text() + "\n# ---- from README.md, as it is\n" + blocks["urls"])
    return where


def run_commands(code: str, project: Path, env: dict[str, str], log: Path) -> tuple[int, str]:
    """Run a README shell block in bash as a user would; stop what it left in the background."""
    with open(log, "w") as out:
        shell = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", code],
            cwd=project,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code_ = shell.wait(timeout=180)
        except subprocess.TimeoutExpired:
            code_ = -1
        finally:
            stop_group(shell.pid)
    return code_, log.read_text()


def stop_group(pgid: int) -> None:
    """SIGTERM the process group (an `rqworker &` stops gracefully), SIGKILL what stays."""
    for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def test_every_readme_example_runs_as_written_in_a_new_project(
    tmp_path: Path, bin_dir: Path, services: tuple[str, str]
) -> None:
    database_url, redis_url = services
    project = readme_project(bin_dir, tmp_path / "readme", database_url, redis_url)
    env = project_env(bin_dir, project)
    python = bin_dir / "python"
    run([python, "manage.py", "makemigrations", "myapp", "-v0"], project, env)
    (project / "myapp" / "migrations" / "0002_rows.py").write_text(README_DATA)
    commands = readme_commands()
    assert len(commands) >= 2, "README.md marks fewer shell blocks as tested than expected"

    for line, code in commands:
        exit_code, output = run_commands(code, project, env, tmp_path / f"readme-{line}.log")
        assert exit_code == 0, f"README.md line {line} exited {exit_code}:\n{code}\n{output}"
        assert not re.search(r"fanout\.[EW]\d{3}", output), output  # check said nothing

    ran = json.loads(run([python, "-c", README_RUNS], project, env).splitlines()[-1])
    assert ran["codes"] == {
        "sync_orgs": 0,
        "onboard_org": 0,
        "charge_month": 0,
        "charge_invoices": 3,
    }, ran
    runs = ran["runs"]
    assert runs["charge_invoices"] == ["succeeded", {"charged": 5, "of": 5}], runs
    assert {name: status for name, (status, _) in runs.items()} == dict.fromkeys(
        ("charge_invoices", "sync_orgs", "onboard_org", "charge_month"), "succeeded"
    ), runs
    assert runs["onboard_org"][1]["crm"] == {"crm": 1}, runs
