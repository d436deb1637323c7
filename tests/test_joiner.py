"""A process's joiner joins every run whose last item its threads recorded."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from fanout.claim import claim
from fanout.definition import FanOut, get_definition
from fanout.models import RunStatus
from fanout.record import SUCCEEDED, ExecutionOutcome, record
from fanout.worker import Joiner
from tests.conftest import prepare

pytestmark = pytest.mark.django_db(transaction=True)


class LookingJoiner(Joiner):
    """Holds its first join thread once that thread has looked at the run, until told."""

    def __init__(self) -> None:
        super().__init__()
        self.looked = threading.Event()
        self.go = threading.Event()

    def _join(self, run_id: int, definition: FanOut) -> None:
        super()._join(run_id, definition)
        if not self.looked.is_set():
            self.looked.set()
            assert self.go.wait(30)


def test_a_run_whose_last_item_ends_while_its_join_thread_looks_is_joined() -> None:
    definition = get_definition("t_collect")
    run = prepare("t_collect", {"n": 1})
    taken = claim(run.pk, "owner", 1, 30, 3, None)
    assert taken.token is not None
    (item,) = taken.items
    joiner = LookingJoiner()
    # Another item of the run ended: the join thread finds this one still running.
    joiner.add(run.pk, definition)
    assert joiner.looked.wait(30)
    # The last item ends, and the thread that recorded it asks the joiner as that one did.
    outcome: Any = ExecutionOutcome(item.pk, item.key, SUCCEEDED, result={"i": 0})
    record(run.pk, taken.token, [outcome], definition.failure_policy, definition)
    joiner.add(run.pk, definition)
    joiner.go.set()
    assert joiner.settle(30)

    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert run.join_result["count"] == 1
