"""Handler results the database could not store fail their item when they are made, everywhere."""

from __future__ import annotations

import pytest

from fanout.models import ItemStatus, RunStatus
from tests.conftest import executions, items, keys, start

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    ("kind", "named"),
    [("nan", "NaN"), ("nul", "NUL character (\\u0000)"), ("surrogate", "lone surrogate")],
)
def test_a_result_the_database_cannot_store_fails_its_item_once_and_the_run_does_not_stall(
    kind: str, named: str
) -> None:
    # PostgreSQL's jsonb refuses NaN, "\u0000" and a lone surrogate when the outcome is
    # recorded: a permanent database error there stopped the drain and, once the lease ran out,
    # ran the item again.
    # MariaDB/MySQL may hold what PostgreSQL refuses: the rule is the same on every database.
    run = start("t_collect", {"n": 4, "unstorable": {"k00001": kind}}, workers=1)

    rows = items(run.pk)
    bad = rows["k00001"]
    assert (bad.status, bad.error_class, bad.result) == (
        ItemStatus.FAILED,
        "ResultNotStorable",
        None,
    )
    assert named in bad.error
    assert executions(run.pk) == dict.fromkeys(keys(4), 1)
    for key in ("k00000", "k00002", "k00003"):
        assert rows[key].status == ItemStatus.SUCCEEDED, key
    run.refresh_from_db()
    assert run.stalled == ""
    assert (run.status, run.in_flight) == (RunStatus.FAILED, 0)


def test_a_backslash_before_u0000_in_a_result_is_text_that_is_stored() -> None:
    run = start("t_no_join", {"n": 2, "unstorable": {"k00001": "nul_lookalike"}}, workers=1)

    row = items(run.pk)["k00001"]
    assert (row.status, row.result) == (ItemStatus.SUCCEEDED, {"s": "a\\u0000b"})
    run.refresh_from_db()
    assert (run.status, run.stalled) == (RunStatus.SUCCEEDED, "")


def test_a_handler_error_holding_a_nul_or_a_lone_surrogate_fails_its_item_once_with_it_escaped(  # noqa: E501
) -> None:
    # PostgreSQL's text holds neither a NUL character nor a lone surrogate: an error message
    # carrying one failed at record time, as an unstorable result did.
    run = start("t_collect", {"n": 3, "unstorable_error": ["k00001"]}, workers=1)

    rows = items(run.pk)
    bad = rows["k00001"]
    assert (bad.status, bad.error_class) == (ItemStatus.FAILED, "PermanentError")
    assert "k00001 read a\\x00b and c\\udc80d" in bad.error
    assert executions(run.pk) == dict.fromkeys(keys(3), 1)
    assert {rows[k].status for k in ("k00000", "k00002")} == {ItemStatus.SUCCEEDED}
    run.refresh_from_db()
    assert (run.status, run.stalled, run.in_flight) == (RunStatus.FAILED, "", 0)
