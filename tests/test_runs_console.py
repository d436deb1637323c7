"""fanout_runs: the terminal's runs console lists what runs now and shows one run close up."""

from __future__ import annotations

import fcntl
import json
import os
import struct
import subprocess
import termios
import uuid
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from fanout.console import RunLine, render_lines
from fanout.models import BatchRun, CapacityPool, ItemClaim, ItemStatus, RunStatus
from tests.conftest import prepare, start
from tests.procs import PYTHON, ROOT, child_env
from tests.test_nesting import start_tree, wait_tree
from tests.test_prune import age

pytestmark = pytest.mark.django_db(transaction=True)


def runs_json(*args: str) -> Any:
    out = StringIO()
    call_command("fanout_runs", *args, "--json", stdout=out)
    return json.loads(out.getvalue())


def held_run() -> BatchRun:
    """An open run whose items all wait on a paused pool."""
    CapacityPool.objects.create(name="console-pool", max_concurrency=2, paused=True)
    run = prepare("t_ledger", {"n": 6}, run_key=uuid.uuid4().hex)
    ItemClaim.objects.filter(run=run).update(pool="console-pool")
    BatchRun.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING)
    return run


def paced_run() -> BatchRun:
    """A run of 100 items in a pool of 100 an hour whose burst of 20 is spent: 23 done in its
    first second, the 77 left come at the pool's rate, one every 36 s (46 min in all)."""
    CapacityPool.objects.create(
        name="paced-pool",
        max_concurrency=10,
        rate_count=100,
        rate_period=3600.0,
        burst=20,
        tokens=0.0,
        tokens_at=timezone.now(),
    )
    run = prepare("t_ledger", {"n": 100}, run_key=uuid.uuid4().hex)
    ItemClaim.objects.filter(run=run).update(pool="paced-pool")
    done = ItemClaim.objects.filter(run=run).order_by("key").values_list("pk", flat=True)[:23]
    ItemClaim.objects.filter(pk__in=list(done)).update(status=ItemStatus.SUCCEEDED)
    BatchRun.objects.filter(pk=run.pk).update(
        status=RunStatus.RUNNING, started_at=timezone.now() - timedelta(seconds=1)
    )
    return run


def test_the_eta_of_a_run_paced_by_its_pools_rate_counts_what_the_rate_has_left_to_admit() -> None:
    run = paced_run()

    (line,) = runs_json()
    out = StringIO()
    call_command("fanout_runs", stdout=out)

    assert line["id"] == run.pk and line["done"] == 23
    # 23 items a second so far would say 3 s; the pool admits the other 77 in 46 min.
    assert line["eta_seconds"] >= 76 * 36
    assert "paced by pool paced-pool" in out.getvalue()


def test_the_list_shows_open_and_recent_runs_with_progress_and_what_they_wait_on() -> None:
    held = held_run()
    done = start("t_ledger", {"n": 4}, run_key=uuid.uuid4().hex)
    old = start("t_ledger", {"n": 2}, run_key=uuid.uuid4().hex)
    age([old], 3)

    listed = {r["id"]: r for r in runs_json()}

    assert set(listed) == {held.pk, done.pk}  # finished 3 days ago: not recent
    assert list(listed)[0] == held.pk  # open runs first
    assert listed[held.pk]["done"] == 0 and listed[held.pk]["total"] == 6
    assert listed[held.pk]["waiting"] == {"console-pool: pool paused": 6}
    assert listed[done.pk]["done"] == listed[done.pk]["total"] == 4
    assert listed[done.pk]["status"] == RunStatus.SUCCEEDED
    assert {r["id"] for r in runs_json("--since", "7d")} == {held.pk, done.pk, old.pk}


def test_one_run_close_up_shows_its_tree_its_pools_and_its_latest_failures() -> None:
    root = start_tree(orgs=2, repos=2, files=2)
    runs = wait_tree(root)
    failing = start("t_collect", {"n": 3, "permanent": ["k00001"]}, run_key=uuid.uuid4().hex)

    tree = runs_json(str(root.pk))
    close = runs_json(str(failing.pk))
    out = StringIO()
    call_command("fanout_runs", str(failing.pk), stdout=out)

    assert tree["run"]["id"] == root.pk
    assert {r["id"] for r in tree["tree"]} == {r.pk for r in runs[1:]}
    assert max(r["depth"] for r in tree["tree"]) == 2
    (failure,) = close["failures"]
    assert failure["key"] == "k00001" and failure["error_class"].endswith("PermanentError")
    assert failure["error"].endswith("PermanentError: k00001 is broken for good")
    assert "PermanentError: k00001 is broken for good" in out.getvalue()


def test_a_failure_close_up_names_its_error_class_once() -> None:
    failing = start("t_collect", {"n": 2, "permanent": ["k00001"]}, run_key=uuid.uuid4().hex)

    out = StringIO()
    call_command("fanout_runs", str(failing.pk), stdout=out)

    (line,) = [text for text in out.getvalue().splitlines() if "k00001" in text]
    assert line.count("PermanentError") == 1, line
    assert "(attempt 1): PermanentError: " in line, line


def test_on_a_terminal_every_line_fits_its_width_and_a_long_reason_wraps_whole() -> None:
    reason = "stalled: nothing running, no item claimed for 5m 02s; " + "x" * 150
    line = RunLine(
        7,
        "charge_invoices",
        "k",
        "running",
        10,
        2000,
        0.5,
        3.2,
        600.0,
        reason,
        {"billing: rate limited": 1990},
        True,
    )

    lines = render_lines([line], width=80)

    assert all(len(text) <= 80 for text in lines), lines
    joined = "".join(text.strip().removeprefix("└ ") for text in lines[2:])
    assert reason.replace(" ", "") in joined.replace(" ", "")
    assert "1,990 waiting: billing: rate limited" in " ".join(lines)


def test_on_a_real_terminal_of_80_columns_no_line_is_longer(database_url: str) -> None:
    held = held_run()
    BatchRun.objects.filter(pk=held.pk).update(definition="a_definition_" + "n" * 80)
    main, child = os.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.run(
        [PYTHON, "manage.py", "fanout_runs"],
        cwd=ROOT,
        env={**child_env(database_url), "COLUMNS": "", "LINES": ""},
        stdin=child,
        stdout=child,
        stderr=subprocess.PIPE,
        timeout=60,
    )
    os.close(child)
    text = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:
            break
        if not chunk:
            break
        text += chunk
    os.close(main)

    assert proc.returncode == 0, proc.stderr
    lines = text.decode().splitlines()
    assert any(str(held.pk) in line for line in lines), lines
    assert all(len(line) <= 80 for line in lines), lines


def test_watch_redraws_until_its_count_as_plain_lines_off_a_terminal() -> None:
    held_run()
    out = StringIO()

    call_command("fanout_runs", "--watch", "--count", "3", "--interval", "0.05", stdout=out)

    blocks = [line for line in out.getvalue().splitlines() if line.startswith("-- ")]
    assert len(blocks) == 3
    assert "\x1b" not in out.getvalue()


def test_an_unknown_run_is_a_clear_error() -> None:
    with pytest.raises(CommandError, match="no run 987654"):
        call_command("fanout_runs", "987654")


@pytest.mark.parametrize(
    "args",
    [
        ["fanout_prune", "--older-than", "1x"],
        ["fanout_prune", "--older-than", "3d", "--status", "bogus"],
        ["fanout_runs", "--since", "1x"],
        ["fanout_runs", "--watch", "--interval", "0"],
    ],
)
def test_a_bad_option_from_the_shell_is_one_clear_line_and_exit_2(
    database_url: str, args: list[str]
) -> None:
    proc = subprocess.run(
        [PYTHON, "manage.py", *args],
        cwd=ROOT,
        env=child_env(database_url),
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"error: argument {args[-2]}" in proc.stderr
