"""Following the README and the docs into a brand-new project, as a user would, works from the
first step, and every example they show runs as it is written.

The wheel is built once and installed into a fresh virtualenv (with the Django this suite runs
on); `django-admin startproject` makes the project, with a fresh PostgreSQL database and this
session's Redis. Then the README and every page of docs/, in the order of their table of
contents: every ```python block goes where its first line says (the app's `fanouts.py`, the
settings, the URLconf), every ```sh (or console) block runs in bash as written (its
`pip install` lines install the built wheel, with no index), every definition they show runs
to success, `check` says nothing, and every fanout admin page answers 200 to a superuser. An
example that breaks fails here; the few blocks that cannot run in a test say why, right above
them.
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
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dj_database_url
import django
import psycopg
import pytest
from redis import Redis
from redis.exceptions import RedisError

from tests.procs import ROOT

pytestmark = pytest.mark.install

ADMIN_DATABASE_URL = "postgres://root@127.0.0.1:5432/postgres"


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


@dataclass(frozen=True)
class Installed:
    bin: Path  # the virtualenv's bin directory
    wheels: Path  # the directory that holds the built wheel, and nothing else


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """One virtualenv with the wheel, shared by this module's projects."""
    return venv_with_the_wheel(tmp_path_factory.mktemp("install"))


def venv_with_the_wheel(tmp_path: Path) -> Installed:
    """A fresh virtualenv holding the built wheel with every extra that the docs install (so
    that their `pip install "django-batch-fanout[...]"` lines need no index), its dependencies and
    this suite's Django."""
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, ROOT], ROOT)
    (wheel,) = dist.glob("django_batch_fanout-*.whl")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], tmp_path)
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    extras = "mysql,otel,prometheus"
    run([*pip, f"{wheel}[{extras}]", f"Django=={django.get_version()}"], tmp_path, timeout=600)
    return Installed(venv / "bin", dist)


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


def project_env(bin_dir: Path, project: Path) -> dict[str, str]:
    """The environment a user's shell has in the project: its virtualenv first on PATH."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "PYTHON"))},
        "DJANGO_SETTINGS_MODULE": "mysite.settings",
        "PYTHONPATH": str(project),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    }


DOCS = ROOT / "docs"
# Blocks that are examples, and run: Python placed in the project, shell run in bash.
PYTHON_BLOCKS = {"python"}
SHELL_BLOCKS = {"sh", "bash", "shell", "console"}
# Blocks that are not examples: output, syntax, a JSON report (which must parse).
NOT_EXAMPLES = {"text", "json"}
EXAMPLES = PYTHON_BLOCKS | SHELL_BLOCKS
NOT_RUN = re.compile(r"<!-- not run: (?P<why>.*?) -->")
# A block that cannot run in a test is the exception: raise this only with a reason to.
NOT_RUN_AT_MOST = 3
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
DEFINED = re.compile(r"\b(?:FanOut|Group)\(\s*\"([^\"]+)\"")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it is, its language, its text, and why it does not
    run if its page says so."""

    page: str
    line: int
    language: str
    code: str
    not_run: str | None

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"


def doc_pages() -> list[Path]:
    """The README, then the pages of docs/ in the order of its table of contents."""
    index = (DOCS / "index.md").read_text()
    toctree = re.search(r"^```\{toctree\}\n(.*?)^```", index, re.S | re.M)
    assert toctree, "docs/index.md has no {toctree}"
    names = [
        line.strip()
        for line in toctree.group(1).splitlines()
        if line.strip() and not line.lstrip().startswith(":")
    ]
    return [ROOT / "README.md", *(DOCS / f"{name}.md" for name in names)]


def code_blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page`` but MyST's directives ({toctree}, {include}); a
    {code-block} is read as the language it names."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        end = next(
            (
                j
                for j in range(i + 1, len(lines))
                if set(lines[j].strip()) == {fence[0]} and len(lines[j].strip()) >= len(fence)
            ),
            len(lines),
        )
        info = opening["info"].strip()
        language = info.split()[0] if info else ""
        if language.startswith("{"):
            directive, _, argument = info[1:].partition("}")
            language = argument.strip() if directive in ("code-block", "code", "sourcecode") else ""
            if not language:
                i = end + 1
                continue
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marked = NOT_RUN.search(before)
        # A block in a list item is indented with its fence: its code is not.
        code = "\n".join(
            line[indent:] if not line[:indent].strip() else line for line in lines[i + 1 : end]
        )
        blocks.append(
            Block(
                page=str(page.relative_to(ROOT)),
                line=i + 1,
                language=language,
                code=code + "\n",
                not_run=marked["why"].strip() if marked else None,
            )
        )
        i = end + 1
    return blocks


def doc_blocks() -> list[Block]:
    return [block for page in doc_pages() for block in code_blocks(page)]


def test_every_page_of_the_docs_is_read_by_the_examples_test() -> None:
    pages = {p.name for p in doc_pages()[1:]}

    assert pages == {p.name for p in DOCS.glob("*.md")} - {"index.md"}


def test_every_block_of_the_docs_names_its_language_and_the_few_not_run_say_why() -> None:
    blocks = doc_blocks()
    unknown = [b.where for b in blocks if b.language not in EXAMPLES | NOT_EXAMPLES]
    not_run = [b for b in blocks if b.not_run is not None]

    assert len(blocks) > 20
    assert not unknown, (
        f"blocks without a language this test knows: {unknown}; mark an example python or sh, "
        "anything else text"
    )
    assert all(b.not_run for b in not_run), [b.where for b in not_run if not b.not_run]
    assert all(b.language in EXAMPLES for b in not_run), [b.where for b in not_run]
    assert len(not_run) <= NOT_RUN_AT_MOST, (
        f"{len(not_run)} blocks are not run ({', '.join(b.where for b in not_run)}): make them "
        "runnable rather than raise NOT_RUN_AT_MOST"
    )


def test_every_json_block_of_the_docs_parses() -> None:
    for block in doc_blocks():
        if block.language == "json":
            try:
                json.loads(block.code)
            except ValueError as exc:
                pytest.fail(f"{block.where}: {exc}")


# What the examples take as the user's own code: their models and a payments client.
DOCS_MODELS = """
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

DOCS_PAYMENTS = """
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
DOCS_DATA = """
from django.db import migrations


def rows(apps, schema_editor):
    Invoice, Org, Repo = (apps.get_model("myapp", m) for m in ("Invoice", "Org", "Repo"))
    Invoice.objects.bulk_create(Invoice(month="2026-11", amount=i) for i in range(1, 6))
    Invoice.objects.bulk_create(Invoice(month="2026-12", amount=i) for i in range(1, 4))
    for o in range(1, 4):
        org = Org.objects.create(name=f"org-{o}")
        Repo.objects.bulk_create(Repo(org=org, name=f"repo-{o}-{r}") for r in range(3))


class Migration(migrations.Migration):
    dependencies = [("myapp", "0001_initial")]
    operations = [migrations.RunPython(rows)]
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
run = BatchRun.objects.filter(definition="charge_invoices").order_by("pk").first()
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
    "/fanout/metrics",  # the docs' URLconf block, answering a staff user
]
print(json.dumps({page: client.get(page).status_code for page in pages}))
"""

# The definitions that no shell example runs, run as the docs say, in one process (each
# `manage.py` costs a Django start-up); then a mistyped month, which the docs say exits 3 (an
# empty work list that charge_invoices refuses); then every run there is.
EXTRA_RUNS = {
    "onboard_org": ["onboard_org", "--param", "org=1"],
    "charge_month": ["charge_month", "--param", "month=2026-11"],
    "mistyped month": ["charge_invoices", "--param", "month=2026-1", "--run-key", "mistyped"],
}
DOCS_RUNS = f"""
import json

import django

django.setup()
from io import StringIO

from django.core.management import CommandError, call_command

from fanout.models import BatchRun

codes = {{}}
for name, args in {EXTRA_RUNS!r}.items():
    try:
        call_command("run_fanout", *args, stdout=StringIO(), stderr=StringIO())
        codes[name] = 0
    except CommandError as exc:
        codes[name] = exc.returncode
runs = [
    [r.definition, r.run_key, r.status, r.join_result, r.parent_item_id is None]
    for r in BatchRun.objects.order_by("pk")
]
print(json.dumps({{"codes": codes, "runs": runs}}, default=str))
"""


def project_files(blocks: list[Block]) -> dict[str, str]:
    """The Python blocks by where they go: the app's fanouts.py, the settings, the URLconf."""
    files = {"fanouts": "", "settings": "", "urls": ""}
    for block in blocks:
        if block.language not in PYTHON_BLOCKS or block.not_run is not None:
            continue
        first = block.code.lstrip().splitlines()[0]
        if first.startswith("# myapp/fanouts.py"):
            files["fanouts"] += f"# ---- {block.where}\n{block.code}\n\n"
        elif first.startswith("# urls.py") or "urlpatterns" in block.code:
            files["urls"] += f"# ---- {block.where}\n{block.code}\n"
        elif first.startswith("# settings.py") or re.match(r"[A-Z][A-Z0-9_]* \+?=", first):
            files["settings"] += f"# ---- {block.where}\n{block.code}\n"
        else:
            pytest.fail(
                f"{block.where}: a python block this test cannot place; begin it with "
                "'# myapp/fanouts.py', '# settings.py' (or a setting) or '# urls.py'"
            )
    return files


def shell_script(block: Block) -> str:
    """What a shell block runs: itself, or a console block's commands without their prompt."""
    if block.language != "console":
        return block.code
    return "".join(line[2:] + "\n" for line in block.code.splitlines() if line.startswith("$ "))


def docs_project(bin_dir: Path, where: Path, database_url: str, redis_url: str) -> Path:
    """startproject, every settings block, the app `myapp` from the fanouts.py blocks (with the
    models and the payments client they name), and the URLconf blocks."""
    where.mkdir(parents=True, exist_ok=True)
    run([bin_dir / "django-admin", "startproject", "mysite", where], where.parent)
    files = project_files(doc_blocks())
    app = where / "myapp"
    (app / "migrations").mkdir(parents=True)
    for name, text in {
        "__init__.py": "",
        "migrations/__init__.py": "",
        "models.py": DOCS_MODELS,
        "payments.py": DOCS_PAYMENTS,
        "fanouts.py": files["fanouts"],
    }.items():
        (app / name).write_text(text)
    settings = where / "mysite" / "settings.py"
    settings.write_text(
        settings.read_text()
        + "\n# ---- from the README and docs/, as they are\n"
        + files["settings"]
        + "\n# ---- this test's own: the app, a fresh database, its Redis database\n"
        + 'INSTALLED_APPS += ["myapp"]\n'
        + f"DATABASES = {{'default': {dj_database_url.parse(database_url)!r}}}\n"
        + f'RQ_QUEUES["fanout"]["URL"] = {redis_url!r}\n'
    )
    urls = where / "mysite" / "urls.py"
    urls.write_text(urls.read_text() + "\n# ---- from the README and docs/\n" + files["urls"])
    return where


def run_commands(code: str, project: Path, env: dict[str, str], log: Path) -> tuple[int, str]:
    """Run a shell block in bash as a user would; stop what it left in the background."""
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


def test_every_example_of_the_readme_and_the_docs_runs_as_written_in_a_new_project(
    tmp_path: Path, installed: Installed, services: tuple[str, str]
) -> None:
    database_url, redis_url = services
    blocks = doc_blocks()
    fanouts = project_files(blocks)["fanouts"]
    defined = DEFINED.findall(fanouts)
    assert len(defined) == len(set(defined)), f"a definition's name is used twice: {defined}"
    project = docs_project(installed.bin, tmp_path / "docs", database_url, redis_url)
    env = project_env(installed.bin, project)
    python = installed.bin / "python"
    run([python, "manage.py", "makemigrations", "myapp", "-v0"], project, env)
    (project / "myapp" / "migrations" / "0002_rows.py").write_text(DOCS_DATA)
    # The docs' own `pip install django-batch-fanout` installs it, from the wheel and nothing else.
    run([python, "-m", "pip", "uninstall", "-q", "-y", "django-batch-fanout"], project, env)
    shell_env = {**env, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(installed.wheels)}
    commands = [b for b in blocks if b.language in SHELL_BLOCKS and b.not_run is None]
    assert any("pip install django-batch-fanout" in b.code for b in commands), "no install line ran"

    for block in commands:
        log = tmp_path / f"{block.page.replace('/', '-')}-{block.line}.log"
        exit_code, output = run_commands(shell_script(block), project, shell_env, log)
        assert exit_code == 0, f"{block.where} exited {exit_code}:\n{block.code}\n{output}"
        assert not re.search(r"fanout\.[EW]\d{3}", output), output  # check said nothing
        assert "does not provide the extra" not in output, output

    ran = json.loads(run([python, "-c", DOCS_RUNS], project, env).splitlines()[-1])
    assert ran["codes"] == {"onboard_org": 0, "charge_month": 0, "mistyped month": 3}, ran
    runs = ran["runs"]
    assert {definition for definition, *_ in runs} == set(defined), (
        "every definition the docs show runs: give it a shell example, or an entry in EXTRA_RUNS"
    )
    assert {status for _, _, status, _, _ in runs} == {"succeeded"}, runs
    joins = {(d, key): join for d, key, _, join, root in runs if root}
    assert joins["charge_invoices", 'charge_invoices:{"month":"2026-11"}'] == {
        "charged": 5,
        "of": 5,
    }, joins
    assert joins["charge_invoices", 'charge_invoices:{"month":"2026-12"}'] == {
        "charged": 3,
        "of": 3,
    }, joins
    assert joins["onboard_org", 'onboard_org:{"org":1}']["crm"] == {"crm": 1}, joins

    statuses = json.loads(run([python, "-c", ADMIN_PAGES], project, env))
    assert statuses and set(statuses.values()) == {200}, statuses
