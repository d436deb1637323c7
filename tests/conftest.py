"""Fixtures shared by the core tests: the test database's URL for children, runs, the ledger."""

from __future__ import annotations

import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from fanout.definition import get_definition
from fanout.models import BatchRun, ItemClaim
from tests.testapp.models import Execution


@pytest.fixture
def database_url(django_db_setup: Any, django_db_blocker: Any) -> str:
    """A DATABASE_URL that points a child process at this test run's database (PostgreSQL or
    MariaDB/MySQL; the SQLite tests start their children on files of their own)."""
    from django.db import connection

    from tests.procs import database_url_of

    url = database_url_of(connection.settings_dict)
    if url is None:
        pytest.skip("child processes need PostgreSQL or MariaDB/MySQL")
    return url


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    """Children a test starts; those still alive at the end are killed before the flush."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.communicate()


def prepare(
    name: str, params: dict[str, Any] | None = None, run_key: str | None = None
) -> BatchRun:
    """Create a run of ``name`` and write its items, without running any of them."""
    from fanout.dispatch import prepare_run

    return prepare_run(get_definition(name), params or {}, run_key)


def start(name: str, params: dict[str, Any] | None = None, **kwargs: Any) -> BatchRun:
    """Run ``name`` to the end on the inline executor, in this process."""
    return get_definition(name).start(params or {}, **kwargs)


def executions(run_id: int) -> Counter[str]:
    """How many times the handler was called for each key of the run."""
    return Counter(Execution.objects.filter(run_id=run_id).values_list("key", flat=True))


def items(run_id: int) -> dict[str, ItemClaim]:
    return {i.key: i for i in ItemClaim.objects.filter(run_id=run_id)}


def keys(n: int) -> list[str]:
    return [f"k{i:05d}" for i in range(n)]
