"""System checks: a project that cannot run fanout's workers or admin is told so by `check`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.core.checks import Error, Warning, run_checks
from django.db import connection
from django.test import Client, override_settings
from django.urls import reverse

from fanout import FanOut, Group, Step
from fanout.checks import check_admin_needs, check_pools
from fanout.definition import _registry
from fanout.models import CapacityPool
from fanout.pools import settings_drift
from fanout.rq import FanoutWorker

WITHOUT_FILTERS = [app for app in settings.INSTALLED_APPS if app != "django_filters"]
FANOUT_QUEUE = {"fanout": {"URL": "redis://127.0.0.1:1/0"}}  # never reached by these checks


class PickleWorker(FanoutWorker):
    """A subclass of FanoutWorker is as good as FanoutWorker."""


def fanout_messages() -> list[Any]:
    return [m for m in run_checks(include_deployment_checks=False) if m.id.startswith("fanout.")]


def ids(messages: list[Any]) -> list[str]:
    return sorted(m.id for m in messages if m.id not in {"fanout.W002", "fanout.W003"})


@override_settings(INSTALLED_APPS=WITHOUT_FILTERS)
def test_the_admin_without_django_filters_is_an_error_that_names_the_missing_template() -> None:
    (problem,) = [m for m in fanout_messages() if m.id == "fanout.E004"]

    assert isinstance(problem, Error)
    assert "django_filters/widgets/multiwidget.html" in problem.msg
    assert problem.hint == 'add "django_filters" to INSTALLED_APPS'


@override_settings(INSTALLED_APPS=[a for a in WITHOUT_FILTERS if a != "django.contrib.admin"])
def test_django_filters_is_not_required_when_the_admin_is_not_installed() -> None:
    assert check_admin_needs() == []


def test_the_example_projects_settings_pass_every_fanout_check() -> None:
    assert ids(fanout_messages()) == []


@override_settings()
def test_a_project_without_rq_queues_is_warned_that_the_rq_executor_cannot_dispatch() -> None:
    del settings.RQ_QUEUES

    (problem,) = [m for m in fanout_messages() if m.id == "fanout.W001"]

    assert isinstance(problem, Warning)
    assert problem.msg.startswith("RQ_QUEUES is not set: run_fanout --executor rq")
    assert '"fanout": {"URL":' in problem.hint
    assert ids(fanout_messages()) == ["fanout.W001"]


@override_settings(RQ_QUEUES={"default": {"URL": "redis://127.0.0.1:1/0"}})
def test_rq_queues_without_the_fanout_queue_is_warned() -> None:
    assert ids(fanout_messages()) == ["fanout.W001"]


def test_rq_queues_without_django_rq_installed_is_warned_that_there_is_no_rqworker_command(
    settings: Any,
) -> None:
    settings.INSTALLED_APPS = [app for app in settings.INSTALLED_APPS if app != "django_rq"]

    (problem,) = [m for m in fanout_messages() if m.id == "fanout.W008"]

    assert isinstance(problem, Warning)
    assert "'django_rq' is not in INSTALLED_APPS" in problem.msg
    assert "manage.py rqworker" in problem.msg
    assert '"django_rq"' in problem.hint


@override_settings(RQ_QUEUES=FANOUT_QUEUE, RQ={})
def test_workers_that_would_read_jobs_with_pickle_are_warned_with_the_setting_to_fix_it() -> None:
    (problem,) = [m for m in fanout_messages() if m.id == "fanout.W005"]

    assert isinstance(problem, Warning)
    assert "rq.Worker" in problem.msg and "DeserializationError" in problem.msg
    assert 'RQ = {"WORKER_CLASS": "fanout.rq.FanoutWorker"}' in problem.hint


@override_settings(RQ_QUEUES=FANOUT_QUEUE, RQ={"WORKER_CLASS": "rq.worker.SimpleWorker"})
def test_a_worker_class_that_is_not_a_fanout_worker_is_warned() -> None:
    assert ids(fanout_messages()) == ["fanout.W005"]


@override_settings(RQ_QUEUES=FANOUT_QUEUE, RQ={"WORKER_CLASS": "no.such.Worker"})
def test_a_worker_class_that_cannot_be_imported_is_warned() -> None:
    (problem,) = [m for m in fanout_messages() if m.id == "fanout.W005"]

    assert "cannot be imported" in problem.msg


@override_settings(
    RQ_QUEUES=FANOUT_QUEUE, RQ={"WORKER_CLASS": f"{__name__}.{PickleWorker.__qualname__}"}
)
def test_a_subclass_of_the_fanout_worker_passes() -> None:
    assert ids(fanout_messages()) == []


def test_a_stricter_isolation_level_than_read_committed_is_an_error() -> None:
    from django.core.checks import run_checks
    from django.db import connections

    options = connections["default"].settings_dict.setdefault("OPTIONS", {})
    saved = dict(options)
    try:
        options["isolation_level"] = "repeatable read"
        errors = [e for e in run_checks(include_deployment_checks=False, databases=["default"])]
        assert "fanout.E005" in {e.id for e in errors}
        options["isolation_level"] = "read committed"
        errors = run_checks(databases=["default"])
        assert "fanout.E005" not in {e.id for e in errors}
    finally:
        options.clear()
        options.update(saved)


@pytest.fixture
def defines_pools() -> Iterator[Callable[..., None]]:
    """Register definitions for one test only: a name no other test's registry expects."""
    names: list[str] = []

    def define(name: str, **options: Any) -> None:
        if "steps" in options:
            Group(name, **options)
        else:
            FanOut(name, over=lambda params: [], do=lambda item: None, **options)
        names.append(name)

    yield define
    for name in names:
        _registry.pop(name, None)


@pytest.mark.django_db
@override_settings(FANOUT_POOLS={"known": {"max_concurrency": 2}})
def test_a_pool_that_definitions_name_but_that_exists_nowhere_is_warned_before_any_run(
    defines_pools: Callable[..., None],
) -> None:
    CapacityPool.objects.create(name="made_in_the_admin", max_concurrency=1)
    defines_pools("check_ghost", pool="ghost_pool")
    defines_pools("check_known", pool="known")
    defines_pools("check_admin_made", pool="made_in_the_admin")
    defines_pools("check_group", steps={"mail": Step(lambda item: None, pool="ghost_smtp")})

    problems = [m for m in check_pools() if m.id == "fanout.W006" and "'check_" in m.msg]

    assert sorted(m.msg for m in problems) == [
        "fan-out 'check_ghost' names pool 'ghost_pool', which exists nowhere: "
        "neither in FANOUT_POOLS nor as a pool row; its runs fail at start",
        "fan-out 'check_group' names pool 'ghost_smtp', which exists nowhere: "
        "neither in FANOUT_POOLS nor as a pool row; its runs fail at start",
    ]
    assert all(isinstance(m, Warning) for m in problems)
    assert problems[0].hint.startswith("add it to FANOUT_POOLS")


@pytest.mark.django_db(transaction=True)  # MariaDB/MySQL cannot roll DDL back
@override_settings(FANOUT_POOLS={"known": {"max_concurrency": 2}})
def test_the_pool_check_before_migrate_treats_a_missing_table_as_no_pool_rows(
    defines_pools: Callable[..., None],
) -> None:
    defines_pools("check_before_migrate", pool="ghost_pool")
    defines_pools("check_known_before_migrate", pool="known")
    with connection.schema_editor() as editor:
        editor.delete_model(CapacityPool)
    try:
        problems = [m.msg for m in check_pools() if m.id == "fanout.W006" and "'check_" in m.msg]
    finally:
        with connection.schema_editor() as editor:
            editor.create_model(CapacityPool)

    assert [p.split(",")[0] for p in problems] == [
        "fan-out 'check_before_migrate' names pool 'ghost_pool'"
    ]


@pytest.mark.django_db
@override_settings(
    FANOUT_POOLS={"payments": {"max_concurrency": 5, "rate": "50/s"}, "same": {"rate": "9/m"}}
)
def test_pool_rows_that_differ_from_fanout_pools_are_warned_and_the_row_is_said_to_win() -> None:
    payments = CapacityPool.objects.create(
        name="payments", max_concurrency=10, rate_count=100, rate_period=60.0
    )
    CapacityPool.objects.create(name="same", max_concurrency=10, rate_count=9, rate_period=60.0)

    (problem,) = [m for m in check_pools() if m.id == "fanout.W007"]

    assert isinstance(problem, Warning)
    assert (
        problem.msg
        == settings_drift(payments)
        == (
            "pool 'payments' differs from FANOUT_POOLS: max_concurrency 10 (FANOUT_POOLS: 5), "
            "rate 100/60s (burst 100) (FANOUT_POOLS: 50/1s (burst 50)); the pool's row wins"
        )
    )
    assert problem.hint == (
        "run manage.py fanout_pools --sync to apply FANOUT_POOLS to the row, or change "
        "FANOUT_POOLS to match the row"
    )
    assert settings_drift(CapacityPool.objects.get(name="same")) == ""


@pytest.mark.django_db
@override_settings(FANOUT_POOLS={"payments": {"max_concurrency": 5}})
def test_the_pools_admin_page_says_when_its_row_differs_from_fanout_pools(
    admin_client: Client,
) -> None:
    pool = CapacityPool.objects.create(name="payments", max_concurrency=10)
    page = reverse("admin:fanout_capacitypool_change", args=[pool.pk])

    shown = [str(m) for m in admin_client.get(page).context["messages"]]

    assert shown == [
        "pool 'payments' differs from FANOUT_POOLS: max_concurrency 10 (FANOUT_POOLS: 5); the "
        "pool's row wins: manage.py fanout_pools --sync applies FANOUT_POOLS"
    ]
    CapacityPool.objects.filter(pk=pool.pk).update(max_concurrency=5)
    assert list(admin_client.get(page).context["messages"]) == []
