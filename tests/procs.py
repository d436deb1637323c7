"""Run fanout in other processes: the helpers the tests call, and the child's entry point.

A child started with ``python -m tests.procs manage --ready R --go G -- ARGS`` sets Django up,
creates R, waits for G to appear and then runs ``manage.py ARGS``: children started this way
race from the same instant, with their start-up cost already paid.
``python -m tests.procs materialize NAME RUN_KEY PARAMS_JSON`` writes a run's items without
running them and prints {"run_id", "total", "maxrss_kb"}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def wait_until[T](condition: Callable[[], T], timeout: float, what: str, every: float = 0.05) -> T:
    """Poll ``condition`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def peak_rss_kb() -> int:
    """This process's peak RSS. Not ru_maxrss: Linux carries that over from the parent that
    forked us, so a child of a big test process would report the parent's size."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


_SCHEMES = {
    "django.db.backends.postgresql": ("postgres", 5432),
    "django.db.backends.mysql": ("mysql", 3306),
}


def database_url_of(settings_dict: dict[str, Any]) -> str | None:
    """The DATABASE_URL of a connection's settings (its test database once set up), for a
    child process; None for a backend whose children could not share it (SQLite in memory)."""
    scheme, default_port = _SCHEMES.get(settings_dict["ENGINE"], (None, 0))
    if scheme is None:
        return None
    user = quote(settings_dict["USER"] or "", safe="")
    password = quote(settings_dict["PASSWORD"] or "", safe="")
    auth = user + (f":{password}" if password else "")
    host = settings_dict["HOST"] or "127.0.0.1"
    port = settings_dict["PORT"] or default_port
    return f"{scheme}://{auth}@{host}:{port}/{quote(settings_dict['NAME'], safe='')}"


def other_sessions() -> int:
    """Sessions open on the test database other than this test's own (PostgreSQL, MariaDB)."""
    from django.db import connection

    if connection.vendor == "mysql":
        query = (
            "SELECT count(*) FROM information_schema.processlist"
            " WHERE db = DATABASE() AND id <> CONNECTION_ID()"
        )
    else:
        query = (
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    with connection.cursor() as cursor:
        cursor.execute(query)
        return cursor.fetchone()[0]


def child_env(database_url: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_url,
        DJANGO_SETTINGS_MODULE="tests.settings",
        DEBUG="0",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def manage(
    args: Sequence[str], env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``manage.py ARGS`` to the end."""
    return subprocess.run(
        [PYTHON, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def spawn_manage(
    args: Sequence[str],
    env: dict[str, str],
    ready: Path | None = None,
    go: Path | None = None,
    python: str | Path = PYTHON,
    cwd: Path = ROOT,
) -> subprocess.Popen[str]:
    """Start ``manage.py ARGS`` (of the project in ``cwd``, with ``python``); with
    ``ready``/``go`` it waits at the barrier first."""
    if ready is None or go is None:
        command = [str(python), "manage.py", *args]
    else:
        command = [PYTHON, "-m", "tests.procs", "manage", "--ready", str(ready), "--go", str(go)]
        command += ["--", *args]
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    """Wait for a child; kill it if it overruns. Return (exit code, stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"child {proc.args} did not finish in {timeout}s:\n{err}") from None
    return proc.returncode, out, err


def release_together(procs: Sequence[Any], ready: Sequence[Path], go: Path) -> None:
    """Wait until every child is at the barrier, then let them all go at once."""

    def all_ready() -> bool:
        for proc in procs:
            if proc.poll() is not None:
                _, err = proc.communicate()
                raise AssertionError(f"child {proc.args} exited before the barrier:\n{err}")
        return all(r.exists() for r in ready)

    wait_until(all_ready, 30, "every child to reach the barrier")
    go.touch()


def _main(argv: list[str]) -> int:
    import django

    django.setup()
    if argv[0] == "manage":
        ready, go = Path(argv[argv.index("--ready") + 1]), Path(argv[argv.index("--go") + 1])
        args = argv[argv.index("--") + 1 :]
        from django.core.management import execute_from_command_line

        ready.touch()
        deadline = time.monotonic() + 60
        while not go.exists():
            if time.monotonic() > deadline:
                return 3
            time.sleep(0.001)
        execute_from_command_line(["manage.py", *args])
        return 0
    if argv[0] == "materialize":
        from fanout.definition import get_definition
        from fanout.dispatch import prepare_run

        name, run_key, params = argv[1], argv[2], json.loads(argv[3])
        run = prepare_run(get_definition(name), params, run_key)
        print(
            json.dumps(
                {
                    "run_id": run.pk,
                    "total": run.total_items,
                    "maxrss_kb": peak_rss_kb(),
                }
            )
        )
        return 0
    raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
