"""An operator in a real browser: find the failures of a run and retry them in two clicks.

Drives the machine's Chromium (/usr/bin/chromium, installed with apt-get when missing) with
Playwright against pytest-django's live server. Screenshots of the run list, the run page and
its failed items are saved in test-artifacts/ (run-page.png, runs.png, failed-items.png).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connections

from fanout.models import CapacityPool, ItemClaim, ItemStatus, RunStatus

from .helpers import make_run

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PASSWORD = "a long operator password"


def ensure_chromium() -> None:
    """Install the distribution's Chromium when it is missing (never a downloaded browser)."""
    if CHROMIUM.exists():
        return
    if shutil.which("apt-get") is None:
        pytest.skip("no /usr/bin/chromium and no apt-get to install it")
    install = ["apt-get", "install", "-y", "chromium"]
    env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    if subprocess.run(install, env=env, check=False).returncode != 0:
        # The package lists may be missing in a fresh container.
        subprocess.run(["apt-get", "update"], env=env, check=True)
        subprocess.run(install, env=env, check=True)
    assert CHROMIUM.exists(), "apt-get installed chromium, but not as /usr/bin/chromium"


def in_a_thread(write: Callable[[], None]) -> None:
    """Write to the database from a plain thread, as a worker would, while Playwright's event
    loop runs in this one."""

    def target() -> None:
        try:
            write()
        finally:
            connections.close_all()

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()


@contextlib.contextmanager
def chromium_page() -> Iterator[Any]:
    """A Chromium page; the test touches the database only outside this block, where Django's
    connections are the ones pytest-django closes (Playwright runs its own event loop)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(15_000)
            yield page
        finally:
            browser.close()


@pytest.mark.django_db(transaction=True)
def test_an_operator_finds_a_runs_failures_and_retries_them_in_the_browser(
    live_server, django_user_model
):
    from playwright.sync_api import expect

    ensure_chromium()
    django_user_model.objects.create_superuser("operator", "op@example.com", PASSWORD)
    CapacityPool.objects.create(name="thumbnailer-api", max_concurrency=8, rate_count=20)
    run = make_run(
        {"succeeded": 132, "failed": 14, "running": 6, "pending": 48},
        pool="thumbnailer-api",
        run_key="thumbnails:2026-11-29",
        waiting=12,
        error_classes=("TimeoutError", "TimeoutError", "ValueError"),
    )
    failed_keys = set(
        ItemClaim.objects.filter(run=run, status=ItemStatus.FAILED).values_list("key", flat=True)
    )
    with chromium_page() as page:
        # Log in.
        page.goto(f"{live_server.url}/admin/login/?next=/admin/fanout/batchrun/")
        page.fill("#id_username", "operator")
        page.fill("#id_password", PASSWORD)
        page.click("input[type=submit]")
        expect(page.locator("#result_list")).to_contain_text("thumbnails:2026-11-29")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "runs.png"), full_page=True)

        # Open the run: its progress bar, its failures by error class.
        page.get_by_role("link", name="thumbnails:2026-11-29").click()
        bar = page.locator(".fanout-summary svg.fanout-bar")
        expect(bar).to_be_visible()
        expect(bar.locator("rect.fanout-seg-failed")).to_have_count(1)
        expect(bar.locator("rect.fanout-seg-waiting")).to_have_count(1)
        expect(page.locator(".fanout-failures")).to_contain_text("TimeoutError")
        expect(page.locator('[data-count="failed"]')).to_have_text("14")
        page.screenshot(path=str(ARTIFACTS / "run-page.png"), full_page=True)

        # Its items, filtered by status in the sidebar.
        page.get_by_role("link", name="All items").click()
        page.locator("#changelist-filter").get_by_role("link", name="Failed").click()
        expect(page).to_have_url(re.compile(r"status=failed"))
        rows = page.locator("#result_list tbody tr")
        expect(rows).to_have_count(14)
        expect(rows.first).to_contain_text("Failed")
        page.screenshot(path=str(ARTIFACTS / "failed-items.png"), full_page=True)

        # Back on the run's page, one button retries exactly the failed items.
        page.go_back()
        page.go_back()
        page.get_by_role("button", name="Retry 14 failed items").click()
        expect(page.locator(".messagelist")).to_contain_text(
            "14 failed items of 1 run back to pending"
        )
        expect(page.locator('[data-count="failed"]')).to_have_text("0")

        # The page follows the run by itself while it is active: a worker finishes items...
        def finish_five() -> None:
            last = ItemClaim.objects.filter(run=run, status=ItemStatus.PENDING).order_by("-index")
            ItemClaim.objects.filter(pk__in=list(last.values_list("pk", flat=True)[:5])).update(
                status=ItemStatus.SUCCEEDED
            )

        in_a_thread(finish_five)
        expect(page.locator('[data-count="succeeded"]')).to_have_text("137")

        # The items are pending again, waiting for workers.
        page.goto(f"{live_server.url}/admin/fanout/itemclaim/?run={run.pk}&status=failed")
        expect(page.locator("#result_list tbody tr")).to_have_count(0)
        page.locator("#changelist-filter").get_by_role("link", name="Pending", exact=True).click()
        shown = page.locator("#result_list tbody tr")
        expect(shown).to_have_count(48 + 14 - 5)
        for key in sorted(failed_keys)[:3]:
            expect(shown.filter(has_text=key)).to_contain_text("Pending")

    assert (
        ItemClaim.objects.filter(run=run, key__in=failed_keys, status=ItemStatus.PENDING).count()
        == 14
    )
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING
