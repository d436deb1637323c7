"""The chaos harness, shortened: every scenario with few items, against real services.

It runs ``python -m chaos --quick`` in a child process with a database of its own (dropped at
the end) and a Redis server of its own, so that it can stop and flush Redis without touching
anybody else's. The PostgreSQL fault terminates this database's sessions and refuses new ones
for a few seconds instead of restarting the server, which other test sessions share.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _chaos_database_url() -> str:
    url = os.environ.get("DATABASE_URL", "postgres://root@127.0.0.1:5432/test")
    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql"):
        pytest.skip("the chaos harness runs on PostgreSQL")
    return urlunsplit(parts._replace(path=f"/fanout_chaos_{os.getpid()}"))


def test_every_chaos_scenario_passes_with_few_items(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("the chaos harness starts a redis-server of its own")
    report = tmp_path / "chaos.json"
    command = [sys.executable, "-m", "chaos", "--quick", "--pg-fault", "terminate"]
    command += ["--database-url", _chaos_database_url(), "--drop-database", "--json", str(report)]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ)
    )
    assert report.exists(), f"the harness wrote no report:\n{done.stdout}\n{done.stderr[-3000:]}"
    figures = json.loads(report.read_text())
    failed = {s["name"]: s["failures"] for s in figures["scenarios"] if not s["passed"]}
    assert not failed, done.stdout
    count = len(figures["scenarios"])
    assert count == 15, done.stdout
    assert done.stdout.strip().splitlines()[-1] == f"{count} passed, 0 failed"
    assert done.returncode == 0
