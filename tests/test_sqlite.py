"""The embedded path: SQLite and the inline executor, end to end in a separate process."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from collections import Counter
from pathlib import Path

from tests import procs

N = 120
EXPECTED = {f"k{i:05d}": 1 for i in range(N)}


def sqlite_env(path: Path, settings: str) -> dict[str, str]:
    return procs.child_env(f"sqlite:///{path}", DJANGO_SETTINGS_MODULE=settings)


def run_on_sqlite(
    path: Path, settings: str, name: str, *params: str
) -> subprocess.CompletedProcess[str]:
    """Migrate a fresh SQLite file, then run N items of ``name`` on 8 inline workers."""
    env = sqlite_env(path, settings)
    migrated = procs.manage(["migrate", "--noinput", "-v0"], env, timeout=120)
    assert migrated.returncode == 0, migrated.stderr
    command = ["run_fanout", name, "--param", f"n={N}", "--param", "sleep=0.005"]
    for param in params:
        command += ["--param", param]
    return procs.manage([*command, "--workers", "8", "--json"], env, timeout=120)


def assert_run_succeeded(path: Path, done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["status"] == "succeeded"
    assert report["counts"]["succeeded"] == N
    assert report["join_result"] == {"count": N, "succeeded": N, "sum": sum(range(N))}
    with sqlite3.connect(path) as db:
        run = db.execute("SELECT status, join_runs, total_items FROM fanout_batchrun").fetchall()
        attempts = db.execute("SELECT DISTINCT attempt FROM fanout_itemclaim").fetchall()
    assert run == [("succeeded", 1, N)]
    assert attempts == [(1,)]


def journal_mode(path: Path) -> str:
    with sqlite3.connect(path) as db:
        return db.execute("PRAGMA journal_mode").fetchone()[0]


def test_a_run_on_sqlite_with_eight_inline_workers_runs_every_item_exactly_once(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fanout.sqlite3"

    done = run_on_sqlite(path, "tests.settings", "t_ledger")

    assert_run_succeeded(path, done)
    assert journal_mode(path) == "wal"
    with sqlite3.connect(path) as db:
        ran = Counter(
            dict(db.execute("SELECT key, count(*) FROM testapp_execution GROUP BY key").fetchall())
        )
        workers = {w for (w,) in db.execute("SELECT DISTINCT worker FROM testapp_execution")}
    assert ran == EXPECTED
    assert len(workers) > 1  # the workers really ran side by side
    assert "database is locked" not in done.stderr, done.stderr


def test_a_run_on_sqlite_with_djangos_default_options_runs_every_item_exactly_once(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fanout.sqlite3"
    # The ledger is a file here: on these options the handler's own writes to the database
    # could time out (5 s) and be retried, which is the handler's failure, not fanout's.
    ledger = tmp_path / "ledger.txt"

    done = run_on_sqlite(path, "tests.sqlite_default_settings", "t_quiet", f"file_ledger={ledger}")

    assert_run_succeeded(path, done)
    assert journal_mode(path) == "delete"  # rollback journal: Django's default, not WAL
    lines = [line.split() for line in ledger.read_text().splitlines()]
    assert Counter(key for key, _, _ in lines) == EXPECTED
    assert len({worker for _, _, worker in lines}) > 1
    # fanout's own lock waits may still time out and be retried here ("database is locked" in
    # its log, seconds of stall): see the system check test below. But no transaction of its
    # own reads and then writes, which fails at once on these options instead of waiting.
    assert "supervision round failed" not in done.stderr, done.stderr


def test_djangos_default_sqlite_options_are_reported_by_a_system_check(tmp_path: Path) -> None:
    env = sqlite_env(tmp_path / "fanout.sqlite3", "tests.sqlite_default_settings")

    done = procs.manage(["check"], env)

    output = done.stdout + done.stderr
    assert "(fanout." in output, output
    assert "IMMEDIATE" in output, output


def test_the_projects_sqlite_options_pass_the_system_checks(tmp_path: Path) -> None:
    env = sqlite_env(tmp_path / "fanout.sqlite3", "tests.settings")

    done = procs.manage(["check"], env)

    assert done.returncode == 0, done.stderr
    assert "(fanout." not in done.stdout + done.stderr
