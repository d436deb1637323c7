"""manage.py run_fanout: its JSON report, its exit codes, --list, --resume and --retry-failed."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import signal
import struct
import subprocess
import termios
import time
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.core.management.base import OutputWrapper
from django.test import override_settings
from django.utils import timezone

from fanout import report
from fanout.definition import registered
from fanout.models import BatchRun, CapacityPool, RunStatus
from fanout.watch import Progress
from tests import procs
from tests.conftest import executions, keys
from tests.test_runs_console import paced_run

pytestmark = pytest.mark.django_db(transaction=True)

REQUIRED_KEYS = {"run_id", "run_key", "status", "counts", "failed", "join_result"}
ALLOWED_KEYS = REQUIRED_KEYS | {"definition", "error", "notes", "why", "tree"}


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


@pytest.mark.parametrize("text", ["1.50", "1e3", "true", "null", "007", '"quoted"', "[1, 2]"])
def test_a_param_declared_str_keeps_the_exact_text_given(text: str) -> None:
    code, report = run_command("t_strict", "--param", "n=1", "--param", f"label={text}")

    assert code == 0
    assert BatchRun.objects.get(pk=report["run_id"]).params == {"n": 1, "label": text}


def test_undeclared_params_are_still_read_as_json_when_they_parse() -> None:
    code, report = run_command(
        "t_collect", "--param", "n=2", "--param", "sleep=0.0", "--param", "note=1.50x"
    )

    assert code == 0
    params = BatchRun.objects.get(pk=report["run_id"]).params
    assert params == {"n": 2, "sleep": 0.0, "note": "1.50x"}


def test_an_empty_work_list_is_said_plainly_in_the_json_and_the_text_report() -> None:
    code, report = run_command("t_collect", "--param", "n=0")
    text = StringIO()
    call_command("run_fanout", "t_collect", "--param", "n=0", "--run-key", "empty", stdout=text)

    assert code == 0
    assert report["counts"] == dict.fromkeys(report["counts"], 0)
    assert report["notes"] == ["the work list was empty: 0 items"]
    assert "the work list was empty: 0 items" in text.getvalue().splitlines()


def test_running_a_finished_run_again_says_so_and_how_to_start_a_fresh_one() -> None:
    code, first = run_command("t_collect", "--param", "n=2")
    assert (code, first["notes"]) == (0, [])
    text = StringIO()

    code, again = run_command("t_collect", "--param", "n=2")
    call_command("run_fanout", "t_collect", "--param", "n=2", stdout=text)

    run = BatchRun.objects.get()
    assert code == 0 and again["run_id"] == run.pk
    (note,) = again["notes"]
    assert note.startswith(f"run {run.pk} had already finished (succeeded at ")
    assert note.endswith(
        "nothing was run again. To start a fresh run, give it a new run key: "
        "run_fanout t_collect --param n=2 --run-key NEW_KEY"
    )
    assert note in text.getvalue().splitlines()
    assert executions(run.pk) == dict.fromkeys(keys(2), 1)


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
    assert again["notes"][0].startswith(f"run {first['run_id']} had already finished")
    assert {**again, "notes": []} == first
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
        (["t_refuse_empty", "--param", "n=0"], 3, "the work list of 't_refuse_empty' is empty"),
        (["t_refuse_empty", "--param", "n=2"], 0, ""),
        (["comp_parallel", "--param", "n=3", "--param", 'failing=["s00002"]'], 4, "compensated"),
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
        "empty-work-list-refused",
        "work-list-not-empty",
        "compensated",
    ],
)
def test_the_exit_code_says_how_the_command_ended(
    database_url: str, args: list[str], code: int, message: str
) -> None:
    done = procs.manage(["run_fanout", *args], procs.child_env(database_url))

    assert done.returncode == code, done.stderr
    assert message in done.stderr
    if code in (2, 3):
        assert not BatchRun.objects.exists()
    if code != 2:
        # How a run ended is not the command breaking: no "CommandError: ..." for it.
        assert "Error:" not in done.stderr, done.stderr


def test_an_empty_work_list_that_the_definition_refuses_is_reported_and_leaves_no_run() -> None:
    code, report = 0, None
    try:
        call_command("run_fanout", "t_refuse_empty", "--param", "n=0", stdout=StringIO())
    except CommandError as exc:
        code, report = exc.returncode, str(exc)

    assert code == 3
    assert report == (
        "the work list of 't_refuse_empty' is empty, and the definition refuses an empty "
        "work list (allow_empty=False): no run was made; check the params"
    )
    assert not BatchRun.objects.exists()


def test_an_empty_work_list_refused_still_prints_one_json_object() -> None:
    out = StringIO()
    with pytest.raises(CommandError):
        call_command("run_fanout", "t_refuse_empty", "--param", "n=0", "--json", stdout=out)

    report = json.loads(out.getvalue())
    assert report["status"] == "empty" and report["run_id"] is None
    assert "refuses an empty work list" in report["error"]


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


def snapshots(total: int) -> list[report.Progress]:
    """A run's progress from start to end, with a long reason why items wait."""
    run = BatchRun(pk=7, definition="t_collect", status=RunStatus.RUNNING, total_items=total)
    waiting = {"payments: pool full (3/3)": 40, "account-0042: rate limited": 12}
    steps = [
        report.Progress(
            run,
            timezone.now(),
            {"succeeded": d, "failed": 1, "running": 3, "pending": total - d - 4, "cancelled": 0},
            waiting,
        )
        for d in range(0, total - 4, 10)
    ]
    done = BatchRun(pk=7, definition="t_collect", status=RunStatus.SUCCEEDED, total_items=total)
    return [
        *steps,
        report.Progress(
            done,
            timezone.now(),
            {"succeeded": total - 1, "failed": 1, "running": 0, "pending": 0, "cancelled": 0},
        ),
    ]


def screen(output: str, width: int) -> list[str]:
    """The lines a terminal ``width`` columns wide shows after ``output`` (the escape codes
    rich uses: carriage return, cursor up, erase line, colours); a wider line fails."""
    lines, row, col = [""], 0, 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]+", output):
        if token == "\n":
            row, col = row + 1, 0
            lines += [""] * (row + 1 - len(lines))
        elif token == "\r":
            col = 0
        elif token.startswith("\x1b[") and token.endswith("A"):
            row -= int(token[2:-1] or 1)
        elif token == "\x1b[2K":
            lines[row] = ""
        elif not token.startswith("\x1b"):
            lines[row] = lines[row][:col] + token + lines[row][col + len(token) :]
            col += len(token)
            assert len(lines[row]) <= width, f"{len(lines[row])} columns: {lines[row]!r}"
    return [line.rstrip() for line in lines if line.strip()]


def test_progress_on_a_terminal_fits_its_width_and_is_redrawn_in_place_reason_whole() -> None:
    out = StringIO()
    progress = Progress(OutputWrapper(out), isatty=True, width=80)
    *steps, last = snapshots(100)

    for snap in steps:
        progress.show(snap)
    shown = screen(out.getvalue(), 80)  # no line wider than 80 columns

    # Only the latest frame is on the screen; what holds the run up comes before the counts,
    # whole, on as many lines as it takes.
    assert shown[0].startswith("run 7 running: 91/100 (91%) ")
    text = " ".join(shown)
    assert "…" not in text
    assert text.endswith(
        "waiting: 40 payments: pool full (3/3), 12 account-0042: rate limited | "
        "succeeded 90 failed 1 running 3 pending 6"
    )
    progress.show(last, final=True)

    # The last frame replaced the others, whose longer reason left no line behind.
    final = screen(out.getvalue(), 80)
    assert final[0].startswith("run 7 succeeded: 100/100 (100%) ")
    assert " ".join(final).endswith(" succeeded 99 failed 1")
    assert "waiting" not in " ".join(final)


def test_progress_elsewhere_is_one_plain_line_per_interval_never_cut() -> None:
    out = StringIO()
    progress = Progress(OutputWrapper(out), isatty=False, every=3600)
    *steps, last = snapshots(100)

    for snap in steps:
        progress.show(snap)
    progress.show(last, final=True)

    lines = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue()
    assert len(lines) == 2
    assert lines[0].startswith("run 7 running: 1/100 (1%) ")
    assert lines[0].endswith(
        " waiting: 40 payments: pool full (3/3), 12 account-0042: rate limited | "
        "failed 1 running 3 pending 96"
    )
    assert lines[1].startswith("run 7 succeeded: 100/100 (100%) ")


def on_a_terminal(args: list[str], env: dict[str, str], columns: int, until: str) -> str:
    """Run ``manage.py ARGS`` on a pseudo-terminal ``columns`` wide; Ctrl-C it once its output
    holds ``until``; return everything it wrote there."""
    return ctrl_c_on_a_terminal(args, env, columns, until)[0]


def ctrl_c_on_a_terminal(
    args: list[str], env: dict[str, str], columns: int, until: str
) -> tuple[str, int, str]:
    """``on_a_terminal``, with the command's exit code and what it wrote on stderr."""
    main, child = os.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(
        [procs.PYTHON, "manage.py", *args],
        cwd=procs.ROOT,
        env={**env, "COLUMNS": "", "LINES": ""},
        stdin=child,
        stdout=child,
        stderr=subprocess.PIPE,
    )
    os.close(child)
    text, interrupted = b"", False
    deadline = time.monotonic() + 120  # a safety net for a broken run, not a measure
    try:
        while time.monotonic() < deadline:
            if not interrupted and until.encode() in text:
                proc.send_signal(signal.SIGINT)
                interrupted = True
            ready, _, _ = select.select([main], [], [], 0.5)
            if not ready:
                continue
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal's last writer left
                break
            if not chunk:
                break
            text += chunk
        _, errors = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main)
    assert interrupted, f"the output never held {until!r}:\n{text.decode()}"
    return text.decode(), proc.returncode, errors.decode()


def test_on_a_terminal_of_120_columns_the_rate_limit_that_binds_comes_first_and_whole(
    database_url: str,
) -> None:
    # One item an hour while four workers are free: the pool's rate is what holds the run.
    pool = "payments-provider-eu-west-1-shared-by-every-account-of-the-region"
    CapacityPool.objects.create(
        name=pool, max_concurrency=4, rate_count=1, rate_period=3600.0, burst=1
    )

    output = on_a_terminal(
        ["run_fanout", "pools_named", "--run-key", "bound"]
        + ["--param", "n=40", "--param", f"pool={pool}"],
        procs.child_env(database_url),
        columns=120,
        until="1/40",
    )

    lines = screen(output, 120)  # no line wider than the terminal
    # The last frame of progress stays on the screen, above the report's first line.
    report = next(i for i, line in enumerate(lines) if re.match(r"run \d+ \(pools_named", line))
    (start,) = [i for i, line in enumerate(lines[:report]) if re.match(r"run \d+ running", line)]
    frame = lines[start:report]
    reason = f"waiting: 39 {pool}: rate limited".replace(" ", "")
    text = "".join(frame).replace(" ", "")
    assert "…" not in text, frame
    assert reason in text, frame
    assert text.index(reason) < text.index("succeeded1"), frame


def test_the_eta_of_a_run_paced_by_its_pools_rate_counts_what_the_pool_has_left_to_admit(
    database_url: str,
) -> None:
    # One admission an hour, burst 1: after the first item, the other 39 take 39 hours
    # whatever the first one's speed said.
    CapacityPool.objects.create(
        name="hourly", max_concurrency=4, rate_count=1, rate_period=3600.0, burst=1
    )

    output, code, errors = ctrl_c_on_a_terminal(
        ["run_fanout", "pools_named", "--run-key", "paced"]
        + ["--param", "n=40", "--param", "pool=hourly"],
        procs.child_env(database_url),
        columns=120,
        until="1/40",
    )

    lines = screen(output, 120)
    report = next(i for i, line in enumerate(lines) if re.match(r"run \d+ \(pools_named", line))
    frame = " ".join(lines[:report])
    assert re.search(r"1/40 \(2%\).* eta 1d 1[45]h \(paced by pool hourly\) ", frame), frame
    # Ctrl-C is how the command ended, not an error of it: one plain line, exit 1.
    run = BatchRun.objects.get()
    assert code == 1, errors
    assert f"interrupted: run {run.pk} is running; pick it up with run_fanout --resume" in errors
    assert "Error" not in errors, errors


def test_the_progress_line_says_the_eta_the_pools_rate_allows_and_that_it_paces_the_run() -> None:
    run = paced_run()
    out = StringIO()
    progress = Progress(OutputWrapper(out), isatty=False)

    progress.show(report.snapshot(run), final=True)

    line = out.getvalue()
    assert "23/100 (23%)" in line
    assert re.search(r" eta 4[56]m \d\ds \(paced by pool paced-pool\) ", line), line


@override_settings(FANOUT_POOLS={"slots-pool": {"max_concurrency": 5, "rate": "50/s"}})
def test_the_start_line_says_when_a_pools_row_differs_from_fanout_pools() -> None:
    CapacityPool.objects.create(
        name="slots-pool", max_concurrency=10, rate_count=100, rate_period=60.0
    )
    err = StringIO()

    call_command("run_fanout", "slots_pool", "--param", "n=2", stdout=StringIO(), stderr=err)

    assert err.getvalue().splitlines()[0] == (
        "pool 'slots-pool' differs from FANOUT_POOLS: max_concurrency 10 (FANOUT_POOLS: 5), "
        "rate 100/60s (burst 100) (FANOUT_POOLS: 50/1s (burst 50)); the pool's row wins: "
        "this run uses the row's limits (manage.py fanout_pools --sync applies FANOUT_POOLS)"
    )
    CapacityPool.objects.filter(name="slots-pool").update(
        max_concurrency=5, rate_count=50, rate_period=1.0
    )
    err = StringIO()
    call_command(
        "run_fanout",
        "slots_pool",
        "--param",
        "n=2",
        "--run-key",
        "synced",
        stderr=err,
        stdout=StringIO(),
    )
    assert "FANOUT_POOLS" not in err.getvalue()


@override_settings(FANOUT_POOLS={"slots-pool": {"max_concurrency": 5}})
def test_run_fanout_says_a_pools_drift_once_though_it_runs_the_system_checks() -> None:
    CapacityPool.objects.create(name="slots-pool", max_concurrency=10)
    err = StringIO()

    # As from a shell: the system checks run first, and fanout.W007 is one of them.
    call_command(
        "run_fanout",
        "slots_pool",
        "--param",
        "n=2",
        skip_checks=False,
        stdout=StringIO(),
        stderr=err,
    )

    assert err.getvalue().count("differs from FANOUT_POOLS") == 1, err.getvalue()
    assert "this run uses the row's limits" in err.getvalue()
    # manage.py check still says it.
    checked = StringIO()
    call_command("check", stdout=checked, stderr=checked)
    assert "fanout.W007" in checked.getvalue()


def test_an_rq_run_without_rq_queues_is_refused_in_one_line_and_makes_no_run(
    settings: Any,
) -> None:
    del settings.RQ_QUEUES
    with pytest.raises(CommandError) as refused:
        call_command(
            "run_fanout",
            "t_collect",
            "--param",
            "n=3",
            "--executor",
            "rq",
            stdout=StringIO(),
            stderr=StringIO(),
        )
    # Not django-rq's traceback ("You have to define RQ_QUEUES"), and no run left open that
    # nothing will ever drain.
    assert refused.value.returncode == 2
    assert "RQ_QUEUES" in str(refused.value) and "fanout" in str(refused.value)
    assert not BatchRun.objects.exists()
