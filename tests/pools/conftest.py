"""Fixtures of the capacity-pool tests: worker processes on this session's database, and
inline workers in this process; every one is stopped when its test ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fanout.definition import get_definition
from fanout.dispatch import InlineExecutor, dispatch, prepare_run

from .workers import Workers


@pytest.fixture
def child_database_url(database_url: str) -> str:
    """A DATABASE_URL that points a worker process at this session's test database."""
    return database_url


@pytest.fixture
def workers(child_database_url: str, tmp_path: Path) -> Iterator[Workers]:
    """Start worker processes on this session's database; every one is killed at the end."""
    started = Workers(child_database_url, tmp_path)
    try:
        yield started
    finally:
        started.kill_all()


@pytest.fixture
def inline() -> Iterator[Callable[..., InlineExecutor]]:
    """Start a run's inline workers in this process; they are stopped at the end."""
    handles: list[InlineExecutor] = []

    def start(name: str, params: dict[str, Any], run_key: str, workers: int) -> InlineExecutor:
        definition = get_definition(name)
        run = prepare_run(definition, params, run_key)
        handle = dispatch(run, definition, "inline", workers)
        assert handle is not None
        handles.append(handle)
        return handle

    yield start
    for handle in handles:
        handle.stop.set()
        handle.join(timeout=30)
