"""Worker processes for the spend tests, on this session's database; killed when a test ends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pools.workers import Workers


@pytest.fixture
def workers(database_url: str, tmp_path: Path) -> Iterator[Workers]:
    started = Workers(database_url, tmp_path)
    try:
        yield started
    finally:
        started.kill_all()
