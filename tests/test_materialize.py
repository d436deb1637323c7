"""Materialize: a run is created once and its work list becomes one ItemClaim per element."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction
from django.test import override_settings
from django.utils import timezone

from fanout.definition import get_definition
from fanout.errors import FanoutError, MaterializeError
from fanout.materialize import create_run, materialize
from fanout.models import BatchRun, ItemClaim, RunStatus
from tests import procs
from tests.conftest import prepare
from tests.testapp import fanouts
from tests.testapp.models import Widget


def nothing_written() -> bool:
    return not BatchRun.objects.exists() and not ItemClaim.objects.exists()


@pytest.mark.django_db
def test_starting_the_same_run_key_twice_returns_the_same_run() -> None:
    definition = get_definition("t_ledger")

    first, created = create_run(definition, {"n": 3}, "same-key")
    again, created_again = create_run(definition, {"n": 3}, "same-key")

    assert (created, created_again) == (True, False)
    assert again.pk == first.pk
    assert BatchRun.objects.filter(run_key="same-key").count() == 1


@pytest.mark.django_db
def test_the_database_refuses_a_second_run_with_the_same_run_key() -> None:
    fields = dict(definition="t_ledger", max_parallel=1, failure_policy="collect", join_mode="all")
    BatchRun.objects.create(run_key="dup", **fields)

    with pytest.raises(IntegrityError), transaction.atomic():
        BatchRun.objects.create(run_key="dup", **fields)


@pytest.mark.django_db
def test_the_database_refuses_a_second_item_with_the_same_key_in_a_run() -> None:
    run = prepare("t_ledger", {"n": 2})
    other = prepare("t_ledger", {"n": 2}, run_key="other")
    columns = (
        "run_id, key, index, pool, status, owner, attempt, crashes, next_attempt_at, "
        "error, error_class"
    )
    insert = (
        f"INSERT INTO fanout_itemclaim ({columns}) "
        "VALUES (%s, %s, %s, '', 'pending', '', 1, 0, now(), '', '')"
    )

    with connection.cursor() as cursor:
        # The same key in another run is a different item.
        with transaction.atomic():
            cursor.execute(insert, [other.pk, "k09999", 99])
        with pytest.raises(IntegrityError, match="fanout_item_unique_run_key"):
            with transaction.atomic():
                cursor.execute(insert, [run.pk, "k00001", 99])

    assert ItemClaim.objects.filter(run=run).count() == 2


@pytest.mark.django_db
def test_a_queryset_work_list_is_paged_with_iterator_in_its_own_order() -> None:
    count = 5000
    Widget.objects.bulk_create(
        Widget(batch="b1", name=f"w{i}", rank=(i * 7919) % 1000) for i in range(count)
    )
    Widget.objects.bulk_create(Widget(batch="other", name="x", rank=0) for _ in range(10))
    expected = list(
        Widget.objects.filter(batch="b1").order_by("-rank", "pk").values_list("pk", "name", "rank")
    )
    fanouts.last_querysets.clear()

    run = prepare("t_widgets", {"batch": "b1"})

    rows = list(run.items.order_by("index").values_list("index", "key", "payload"))
    assert run.status == RunStatus.RUNNING
    assert run.total_items == count
    assert [r[0] for r in rows] == list(range(count))
    assert [r[1] for r in rows] == [f"widget-{pk}" for pk, _, _ in expected]
    assert [r[2] for r in rows] == [{"name": name, "rank": rank} for _, name, rank in expected]
    # iterator() streams rows; iterating the queryset itself would have cached all of them.
    assert len(fanouts.last_querysets) == 1
    assert fanouts.last_querysets[0]._result_cache is None


@pytest.mark.django_db
def test_a_plain_list_work_list_becomes_items_in_order() -> None:
    run = prepare("t_list", {"items": ["c", "a", "b"]})

    rows = list(run.items.order_by("index").values_list("index", "key", "payload"))
    assert rows == [(0, "c", {"v": "c"}), (1, "a", {"v": "a"}), (2, "b", {"v": "b"})]


@pytest.mark.django_db
@override_settings(FANOUT_MATERIALIZE_CHUNK=100)
def test_a_generator_work_list_is_written_across_chunks() -> None:
    run = prepare("t_generated", {"n": 250})

    rows = list(run.items.order_by("index").values_list("index", "key", "payload"))
    assert run.total_items == 250
    assert run.materialized_upto == 250
    assert rows == [(i, f"g{i:06d}", {"i": i}) for i in range(250)]


@pytest.mark.django_db
def test_a_run_key_of_another_definition_is_refused() -> None:
    prepare("t_list", {"items": ["a"]}, run_key="taken")

    with pytest.raises(FanoutError, match="run key 'taken' belongs to a run of 't_list'"):
        prepare("t_generated", {"n": 1}, run_key="taken")

    assert ItemClaim.objects.count() == 1


@pytest.mark.django_db
def test_preparing_a_run_again_adds_no_items() -> None:
    run = prepare("t_generated", {"n": 30})
    again = prepare("t_generated", {"n": 30})

    assert again.pk == run.pk
    assert ItemClaim.objects.count() == 30


@pytest.mark.django_db
@override_settings(FANOUT_MATERIALIZE_CHUNK=100)
def test_a_materializer_that_died_is_resumed_where_it_stopped() -> None:
    definition = get_definition("t_generated")
    run, _ = create_run(definition, {"n": 250}, None)
    # What a materializer that died after its first chunk leaves behind: 100 items, a lapsed lease.
    ItemClaim.objects.bulk_create(
        ItemClaim(run=run, key=f"g{i:06d}", index=i, payload={"i": i}) for i in range(100)
    )
    BatchRun.objects.filter(pk=run.pk).update(
        materialized_upto=100,
        materialize_token=uuid.uuid4(),
        materialize_lease_expires_at=timezone.now() - timedelta(seconds=1),
    )

    run = materialize(run, definition)

    assert run.status == RunStatus.RUNNING
    assert run.total_items == 250
    rows = list(run.items.order_by("index").values_list("index", "key"))
    assert rows == [(i, f"g{i:06d}") for i in range(250)]


@pytest.mark.django_db
def test_duplicate_keys_in_one_list_fail_naming_the_key_and_leave_nothing() -> None:
    with pytest.raises(MaterializeError) as caught:
        prepare("t_list", {"items": ["a", "b", "c", "b", "d"]})

    assert "duplicate key 'b' at items 1 and 3" in str(caught.value)
    assert nothing_written()


@pytest.mark.django_db
@override_settings(FANOUT_MATERIALIZE_CHUNK=100)
def test_a_duplicate_key_in_a_later_chunk_is_caught_and_leaves_nothing() -> None:
    # Element 150 repeats the key of element 5, committed with the first chunk.
    with pytest.raises(MaterializeError) as caught:
        prepare("t_generated", {"n": 250, "keys": {"150": "g000005"}})

    assert "duplicate key 'g000005' at items 5 and 150" in str(caught.value)
    assert nothing_written()


@pytest.mark.django_db
@override_settings(FANOUT_MATERIALIZE_CHUNK=100)
def test_a_payload_that_is_not_json_fails_clearly_and_leaves_nothing() -> None:
    with pytest.raises(MaterializeError) as caught:
        prepare("t_generated", {"n": 250, "bad_payload": [170]})

    message = str(caught.value)
    assert "the payload of item 170 is not JSON" in message
    assert "datetime" in message
    assert nothing_written()


@pytest.mark.django_db
@override_settings(FANOUT_MATERIALIZE_CHUNK=100)
def test_a_work_list_that_raises_midway_fails_clearly_and_leaves_nothing() -> None:
    with pytest.raises(MaterializeError) as caught:
        prepare("t_generated", {"n": 400, "fail_at": 250})

    assert "the work list failed: RuntimeError: the source broke at element 250" in str(
        caught.value
    )
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert nothing_written()


@pytest.mark.django_db(transaction=True)
def test_materializing_200000_generated_items_keeps_memory_flat(database_url: str) -> None:
    count = 200_000
    done = procs.subprocess.run(
        [
            procs.PYTHON,
            "-m",
            "tests.procs",
            "materialize",
            "t_generated",
            "big",
            json.dumps({"n": count}),
        ],
        cwd=procs.ROOT,
        env=procs.child_env(database_url),
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["total"] == count
    assert ItemClaim.objects.filter(run_id=report["run_id"]).count() == count
    # A Django process starts at ~65 MB and streaming peaks near 80 MB; holding the work list
    # would take it past 150 MB (the bare elements) or 210 MB (as unsaved ItemClaims).
    assert report["maxrss_kb"] < 120 * 1024, report


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("chunk", [10, 1000])
def test_a_run_cancelled_while_its_items_are_written_stays_cancelled(chunk: int) -> None:
    from fanout.models import BatchRun, ItemClaim, ItemStatus, RunStatus

    with override_settings(FANOUT_MATERIALIZE_CHUNK=chunk):
        run = get_definition("slots_cancelled_mid_write").start(
            {"n": 50, "cancel_at": 30}, run_key=f"mid-write-{chunk}"
        )

    run = BatchRun.objects.get(pk=run.pk)
    assert (run.status, run.error) == (
        RunStatus.CANCELLED,
        "cancelled while its items were written",
    )
    statuses = list(ItemClaim.objects.filter(run=run).values_list("status", flat=True))
    assert statuses == [ItemStatus.CANCELLED] * 50
