"""manage.py run_fanout: its JSON report, its exit codes, --list, --resume and --retry-failed."""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from fanout.definition import registered
from fanout.models import BatchRun, RunStatus
from tests import procs
from tests.conftest import executions, keys

pytestmark = pytest.mark.django_db(transaction=True)

REQUIRED_KEYS = {"run_id", "run_key", "status", "counts", "failed", "join_result"}
ALLOWED_KEYS = REQUIRED_KEYS | {"definition", "error"}


def run_command(*args: str) -> tuple[int, dict[str, Any]]:
    """call_command with --json; return (exit code, report)."""
    out = StringIO()
    try:
        call_command("run_fanout", *args, "--json", stdout=out, stderr=StringIO())
        code = 0
    except CommandError as exc:
        code = exc.returncode
    return code, json.loads(out.getvalue().strip().splitlines()[-1])


def test_the_json_report_of_a_succeeded_run_has_exactly_the_documented_keys() -> None:
    code, report = run_command("t_collect", "--param", "n=3", "--workers", "2")

    assert code == 0
    assert REQUIRED_KEYS <= set(report) <= ALLOWED_KEYS
    run = BatchRun.objects.get()
    assert report["run_id"] == run.pk
    assert report["run_key"] == run.run_key == 't_collect:{"n":3}'
    assert report["status"] == "succeeded"
    assert report["counts"] == {
        "pending": 0,
        "running": 0,
        "succeeded": 3,
        "failed": 0,
        "cancelled": 0,
    }
    assert report["failed"] == []
    assert report["join_result"] == {"count": 3, "succeeded": 3, "sum": 3}


def test_the_json_report_of_a_failed_run_lists_each_failed_item_with_its_error() -> None:
    code, report = run_command(
        "t_collect",
        "--param",
        "n=4",
        "--param",
        'permanent=["k00001", "k00003"]',
        "--run-key",
        "two-fail",
    )

    assert code == 1
    assert REQUIRED_KEYS <= set(report) <= ALLOWED_KEYS
    assert report["status"] == "failed"
    assert report["run_key"] == "two-fail"
    assert report["failed"] == [
        {"key": "k00001", "error": "fanout.errors.PermanentError: k00001 is broken for good"},
        {"key": "k00003", "error": "fanout.errors.PermanentError: k00003 is broken for good"},
    ]
    assert report["counts"]["succeeded"] == 2
    assert report["join_result"] == {"count": 4, "succeeded": 2, "sum": 2}


def test_declared_params_given_on_the_command_line_are_converted() -> None:
    code, report = run_command("t_strict", "--param", "n=2", "--param", "label=hello")

    assert code == 0
    assert BatchRun.objects.get(pk=report["run_id"]).params == {"n": 2, "label": "hello"}


def test_list_shows_every_registered_definition() -> None:
    out = StringIO()

    call_command("run_fanout", "--list", stdout=out)

    lines = out.getvalue().splitlines()
    assert [line.split(":")[0] for line in lines] == list(registered())
    assert (
        "t_fail_fast: pool -, max_parallel 2, max_attempts 3, failure_policy fail_fast, "
        "join_mode all (tests.testapp.fanouts)"
    ) in lines


def test_resuming_a_finished_run_reports_it_without_running_anything() -> None:
    code, first = run_command("t_collect", "--param", "n=2")
    assert code == 0

    code, again = run_command("--resume", str(first["run_id"]))

    assert code == 0
    assert again == first
    assert executions(first["run_id"]) == dict.fromkeys(keys(2), 1)


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["t_collect", "--param", "n=2"], 0, ""),
        (["t_collect", "--param", "n=2", "--param", 'permanent=["k00000"]'], 1, "failed"),
        (["no_such_fanout"], 2, "unknown fan-out 'no_such_fanout'"),
        (["t_collect", "--param", "n"], 2, "'n' is not of the form key=value"),
        (["t_collect", "--max-parallel", "0"], 2, "must be >= 1, got 0"),
        (["t_collect", "--workers", "0"], 2, "must be >= 1, got 0"),
        (["t_strict", "--param", "n=1", "--param", "colour=red"], 2, "has no param 'colour'"),
        (["t_strict"], 2, "needs param 'n'"),
        (["--resume", "999999"], 2, "there is no run 999999"),
    ],
    ids=[
        "succeeded",
        "failed-run",
        "unknown-definition",
        "param-without-equals",
        "max-parallel-0",
        "workers-0",
        "unknown-param",
        "missing-param",
        "resume-unknown-run",
    ],
)
def test_the_exit_code_says_how_the_command_ended(
    database_url: str, args: list[str], code: int, message: str
) -> None:
    done = procs.manage(["run_fanout", *args], procs.child_env(database_url))

    assert done.returncode == code, done.stderr
    assert message in done.stderr
    if code == 2:
        assert not BatchRun.objects.exists()


def test_retry_failed_from_the_command_line_reruns_only_the_failed_items(
    database_url: str,
) -> None:
    env = procs.child_env(database_url)
    first = procs.manage(
        ["run_fanout", "t_collect", "--param", "n=4", "--param", 'permanent_once=["k00001"]']
        + ["--json"],
        env,
    )
    assert first.returncode == 1, first.stderr
    report = json.loads(first.stdout.strip().splitlines()[-1])
    assert [f["key"] for f in report["failed"]] == ["k00001"]

    again = procs.manage(["run_fanout", "--retry-failed", str(report["run_id"]), "--json"], env)

    assert again.returncode == 0, again.stderr
    assert "1 failed items back to pending" in again.stderr
    retried = json.loads(again.stdout.strip().splitlines()[-1])
    assert (retried["run_id"], retried["status"], retried["failed"]) == (
        report["run_id"],
        "succeeded",
        [],
    )
    assert retried["join_result"] == {"count": 4, "succeeded": 4, "sum": 6}
    assert executions(report["run_id"]) == {**dict.fromkeys(keys(4), 1), "k00001": 2}
    run = BatchRun.objects.get(pk=report["run_id"])
    assert (run.status, run.join_runs) == (RunStatus.SUCCEEDED, 2)
