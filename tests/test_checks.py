"""System checks: a project that cannot run fanout's workers or admin is told so by `check`."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, Warning, run_checks
from django.test import override_settings

from fanout.checks import check_admin_needs
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
