"""An operator in a real browser at 1400 px (and 1366): every page fits the screen, and the
failures of a run are found and retried in two clicks.

Drives the machine's Chromium (/usr/bin/chromium, installed with apt-get when missing) with
Playwright against pytest-django's live server. Screenshots are saved in test-artifacts/:
console-*.png for the pages as a stranger first sees them (console-1366-*.png at 1366 px),
and runs.png, run-page.png and failed-items.png along the retry. The pages a newcomer reads
first are shot at 1280, 1400 and 1920 px and at a phone's 390 px into docs/screenshots/, which
the docs show: those are committed, so they come from this test and nowhere else.
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
from django.utils import timezone

from fanout.models import BatchRun, CapacityPool, ItemClaim, ItemStatus, RunStatus

from .helpers import make_run, statuses

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
WIDTHS = (1280, 1400, 1920, 390)  # two laptops, a desktop, a phone
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
WIDTH = 1400  # the screenshots' width; the layout is also checked at 1366
THREE_LINES = 70  # px: a list row whose error or worker wraps to three lines
LONG_ERROR = (
    "botocore.exceptions.ClientError: An error occurred (SlowDown) when calling the PutObject "
    "operation (reached max retries: 4): Please reduce your request rate. The bucket "
    "thumbnails-eu-west-1-production received more requests than it can serve for the prefix "
    "2026/11/29/originals/ in the last second."
)


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


def log_in(page: Any, url: str, next_path: str) -> None:
    page.goto(f"{url}/admin/login/?next={next_path}")
    page.fill("#id_username", "operator")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")


def layout(page: Any, cells: str) -> dict[str, float]:
    """Where the page's content ends, how far ``cells`` reach right, and its tallest row."""
    return page.evaluate(
        """(cells) => {
            const found = [...document.querySelectorAll(cells)];
            // A list scrolls sideways inside its own box: what is past its edge is unseen too.
            const results = document.querySelector("#changelist .results");
            const rows = [...document.querySelectorAll("#result_list tbody tr")];
            return {
                page: document.documentElement.scrollWidth,
                cells: found.length,
                right: Math.max(0, ...found.map(c => c.getBoundingClientRect().right)),
                edge: results ? results.getBoundingClientRect().right : innerWidth,
                scrolls: results ? results.scrollWidth > results.clientWidth : false,
                row: Math.max(0, ...rows.map(r => r.getBoundingClientRect().height)),
                // Clipped text must stay inside its own cell, not paint over the next one.
                spills: [...document.querySelectorAll("#result_list .fanout-clip")].filter(
                    c => c.getBoundingClientRect().right > c.closest("td, th")
                        .getBoundingClientRect().right + 1
                ).length,
            };
        }""",
        cells,
    )


def assert_fits(page: Any, cells: str, row_height: float | None = None) -> None:
    """Nothing scrolls sideways, ``cells`` end within the screen, list rows are not too tall."""
    seen = layout(page, cells)
    width = page.viewport_size["width"]
    assert seen["cells"], f"no {cells} on {page.url}"
    assert seen["page"] <= width, f"{page.url} scrolls sideways: {seen}"
    assert not seen["scrolls"], f"the list on {page.url} scrolls sideways: {seen}"
    assert seen["right"] <= min(width, seen["edge"]), f"{cells} on {page.url} end unseen: {seen}"
    assert not seen["spills"], f"text on {page.url} spills into the next column: {seen}"
    if row_height is not None:
        assert seen["row"] <= row_height, f"rows of {page.url} are too tall: {seen}"


def console_runs() -> dict[str, BatchRun]:
    """A busy console: a run with failures, waiting and running items, one that stalled with
    nothing running, one that finished, and one whose pool is paused."""
    CapacityPool.objects.create(name="thumbnailer-api", max_concurrency=8, rate_count=20)
    CapacityPool.objects.create(name="ocr-provider", max_concurrency=2, paused=True)
    busy = make_run(
        {"succeeded": 132, "failed": 14, "running": 6, "pending": 48},
        pool="thumbnailer-api",
        run_key="thumbnails:2026-11-29:eu-west-1:originals-and-previews",
        waiting=12,
        error_classes=("ClientError", "ClientError", "ValueError"),
    )
    BatchRun.objects.filter(pk=busy.pk).update(max_parallel=6)
    failed = ItemClaim.objects.filter(run=busy, status=ItemStatus.FAILED, error_class="ClientError")
    failed.update(error=f"Traceback (most recent call last):\n  ...\n{LONG_ERROR}")
    key = ItemClaim.objects.filter(run=busy, status=ItemStatus.FAILED).order_by("index").first()
    ItemClaim.objects.filter(pk=key.pk).update(
        key="s3://thumbnails-eu-west-1-production/2026/11/29/originals/IMG_20261129_101501.jpg"
    )
    stalled = make_run({"succeeded": 40, "pending": 1050}, executor="rq", run_key="ocr:backfill")
    done = make_run({"succeeded": 500}, status=RunStatus.SUCCEEDED, run_key="reindex:2026-11-28")
    BatchRun.objects.filter(pk=done.pk).update(finished_at=timezone.now())
    held = make_run({"succeeded": 3, "pending": 9}, pool="ocr-provider", run_key="ocr:invoices")
    return {"busy": busy, "stalled": stalled, "done": done, "held": held}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("width", [WIDTH, 1366])
def test_every_console_page_fits_a_laptop_screen_with_errors_and_reasons_in_view(
    live_server, django_user_model, width
):
    from playwright.sync_api import expect

    ensure_chromium()
    django_user_model.objects.create_superuser("operator", "op@example.com", PASSWORD)
    runs = console_runs()
    busy, stalled = runs["busy"], runs["stalled"]
    failed_item = ItemClaim.objects.filter(run=busy, status=ItemStatus.FAILED).order_by("index")[0]
    waiting_item = ItemClaim.objects.filter(run=stalled, status=ItemStatus.PENDING)[0]
    ARTIFACTS.mkdir(exist_ok=True)
    admin = f"{live_server.url}/admin/fanout"

    with chromium_page(width) as page:

        def shoot(name: str, full_page: bool = True) -> None:
            name = name if width == WIDTH else f"{width}-{name}"
            page.screenshot(path=str(ARTIFACTS / f"console-{name}.png"), full_page=full_page)

        log_in(page, live_server.url, "/admin/fanout/batchrun/")

        # The run list: ids, times to the second, and why the stalled run does not move.
        table = page.locator("#result_list")
        expect(table).to_contain_text(f"#{busy.pk}")
        expect(table.locator("th.column-run_id")).to_have_count(1)
        expect(table).to_contain_text(re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"))
        row = table.locator("tr", has=page.get_by_role("link", name=f"#{stalled.pk}", exact=True))
        expect(row.locator(".fanout-stalled")).to_contain_text("stalled: nothing running")
        expect(row.locator(".fanout-badge")).to_have_text("Stalled")
        busy_row = table.locator("tr", has=page.get_by_role("link", name=f"#{busy.pk}", exact=True))
        expect(busy_row.locator(".fanout-badge")).to_have_text("Running")
        shoot("runs")
        # A stalled run's reason is shown whole (what to do comes last), up to seven short lines
        # under its bar at 1366 px; the other rows stay three or four lines tall.
        assert_fits(page, "#result_list td, #result_list th", row_height=150)
        assert busy_row.bounding_box()["height"] <= 100

        # The busy run's page: failures by class with their error clipped, what waits and why.
        page.goto(f"{admin}/batchrun/{busy.pk}/change/")
        expect(page.locator(".fanout-waiting-reasons")).to_contain_text("retry not yet due (12)")
        summary = page.locator(".fanout-failures summary").first
        expect(summary).to_contain_text("SlowDown")
        shoot("run-page")
        assert_fits(page, ".fanout-failures td, .fanout-summary")
        summary.click()
        expect(page.locator(".fanout-failures pre.fanout-traceback").first).to_be_visible()
        assert_fits(page, ".fanout-failures td")

        # The stalled run's page says so, and how to get it going.
        page.goto(f"{admin}/batchrun/{stalled.pk}/change/")
        why = page.locator('[data-field="why"]')
        expect(why).to_contain_text("no live worker takes its drain jobs")
        expect(why).to_contain_text("rqworker fanout")
        shoot("stalled-run")

        # Its failed items: the last error and the duration in view, one line a row.
        page.goto(f"{admin}/itemclaim/?run={busy.pk}&status=failed")
        expect(page.locator("#result_list tbody tr")).to_have_count(14)
        shoot("failed-items")
        # An error wraps to three lines at most: its class and message are read, not hovered.
        assert_fits(page, "#result_list td.field-last_error", row_height=THREE_LINES)
        assert_fits(page, "#result_list td.field-duration_display", row_height=THREE_LINES)
        error = page.locator("#result_list td.field-last_error .fanout-wrap").first
        expect(error).to_have_attribute("title", LONG_ERROR.removeprefix("botocore.exceptions."))
        expect(error).to_contain_text("ClientError: An error occurred (SlowDown)")

        # All its items, every column: still no sideways scrolling.
        page.goto(f"{admin}/itemclaim/?run={busy.pk}&o=-3")
        shoot("all-items", full_page=False)
        assert_fits(page, "#result_list td.field-last_error", row_height=THREE_LINES)
        assert_fits(page, "#result_list td.field-duration_display", row_height=THREE_LINES)

        # Its pending items, each with why it waits.
        page.goto(f"{admin}/itemclaim/?run={busy.pk}&status=pending")
        expect(page.locator("#result_list")).to_contain_text("retry due in")
        shoot("pending-items")
        assert_fits(page, "#result_list td.field-why_it_waits", row_height=45)
        page.goto(f"{admin}/itemclaim/?run={runs['held'].pk}&status=held")
        expect(page.locator("#result_list")).to_contain_text("ocr-provider: pool paused")
        shoot("waiting-items")

        # A failed item's page: its whole traceback, times to the second.
        page.goto(f"{admin}/itemclaim/{failed_item.pk}/change/")
        expect(page.locator("pre.fanout-traceback")).to_contain_text("SlowDown")
        expect(page.locator("#content")).to_contain_text(
            re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
        )
        shoot("item-page")
        assert_fits(page, "pre.fanout-traceback, fieldset")

        # A pending item of the stalled run says why it waits on its own page too.
        page.goto(f"{admin}/itemclaim/{waiting_item.pk}/change/")
        expect(page.locator(".field-why_it_waits_now")).to_contain_text("stalled: nothing running")
        shoot("waiting-item-page")

        # The pools: one full of this run's leases, one paused.
        page.goto(f"{admin}/capacitypool/")
        expect(page.locator("#result_list")).to_contain_text("pool paused")
        shoot("pools")
        assert_fits(page, "#result_list td", row_height=45)


@contextlib.contextmanager
def chromium_page(width: int = WIDTH, height: int = 1000) -> Iterator[Any]:
    """A Chromium page; the test touches the database only outside this block, where Django's
    connections are the ones pytest-django closes (Playwright runs its own event loop)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
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
    run = console_runs()["busy"]
    failed_keys = set(
        ItemClaim.objects.filter(run=run, status=ItemStatus.FAILED).values_list("key", flat=True)
    )
    with chromium_page() as page:
        log_in(page, live_server.url, "/admin/fanout/batchrun/")
        expect(page.locator("#result_list")).to_contain_text("thumbnails:2026-11-29")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "runs.png"), full_page=True)

        # Open the run: its progress bar, its failures by error class.
        page.get_by_role("link", name="thumbnails:2026-11-29").click()
        bar = page.locator(".fanout-summary svg.fanout-bar")
        expect(bar).to_be_visible()
        expect(bar.locator("rect.fanout-seg-failed")).to_have_count(1)
        expect(bar.locator("rect.fanout-seg-waiting")).to_have_count(1)
        expect(page.locator(".fanout-failures")).to_contain_text("ClientError")
        expect(page.locator('[data-count="failed"]')).to_have_text("14")
        page.screenshot(path=str(ARTIFACTS / "run-page.png"), full_page=True)

        # Its items, filtered by status in the sidebar.
        page.get_by_role("link", name="All items").click()
        page.locator("#changelist-filter").get_by_role("link", name="Failed", exact=True).click()
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


def composed_runs() -> dict[str, BatchRun]:
    """Real runs, run inline: a tree three levels deep, a run that failed and compensated what
    it had done, and a group whose email step succeeded on its third attempt."""
    import uuid

    from fanout.definition import get_definition

    def start(name: str, **params: Any) -> BatchRun:
        return get_definition(name).start(params, run_key=f"{name}:{uuid.uuid4().hex[:6]}")

    return {
        "tree": start("nest_orgs", orgs=2, repos=2, files=2),
        "compensated": start("comp_reverse", n=8, failing=["s00005"]),
        "group": start("group_onboard", customer=7, email_flaky=2, n=1),
    }


@pytest.mark.django_db(transaction=True)
def test_trees_compensations_and_attempt_histories_read_plainly_at_1400_px(
    live_server, django_user_model
):
    from playwright.sync_api import expect

    ensure_chromium()
    django_user_model.objects.create_superuser("operator", "op@example.com", PASSWORD)
    runs = composed_runs()
    tree, compensated, group = runs["tree"], runs["compensated"], runs["group"]
    assert tree.status == RunStatus.SUCCEEDED, tree.error
    assert compensated.status == RunStatus.COMPENSATED, compensated.error
    org = ItemClaim.objects.get(run=tree, key="o0")
    child = BatchRun.objects.get(parent_item=org)
    email = ItemClaim.objects.get(run=group, key="email")
    undone = ItemClaim.objects.filter(run=compensated, status=ItemStatus.COMPENSATED).count()
    assert undone >= 1
    # Its items cancelled before they ran (how many depends on the workers' pace).
    cancelled = statuses(compensated).get("cancelled", 0)
    ARTIFACTS.mkdir(exist_ok=True)
    admin = f"{live_server.url}/admin/fanout"

    with chromium_page() as page:

        def shoot(name: str) -> None:
            page.screenshot(path=str(ARTIFACTS / f"composed-{name}.png"), full_page=True)

        log_in(page, live_server.url, "/admin/fanout/batchrun/")

        # The root of the tree sums its runs (itself, 2 children, 4 grandchildren) and items.
        counts = page.locator(".fieldBox.field-tree_counts")
        page.goto(f"{admin}/batchrun/{tree.pk}/change/")
        expect(counts).to_contain_text("7 runs: 14 succeeded")
        shoot("tree-root")
        assert_fits(page, ".fanout-summary, fieldset")

        # An item of the root links to the run it handed its work to, and that run links back.
        page.goto(f"{admin}/itemclaim/{org.pk}/change/")
        link = page.locator(".field-child_run_link a")
        expect(link).to_have_text(f"#{child.pk} nest_repos")
        shoot("tree-item")
        link.click()
        expect(page.locator(".fieldBox.field-parent_link")).to_contain_text(f"o0 of run #{tree.pk}")
        expect(counts).to_contain_text("3 runs: 6 succeeded")
        shoot("tree-child")

        # The compensated run: its status, and every item that had succeeded, undone.
        page.goto(f"{admin}/batchrun/{compensated.pk}/change/")
        expect(page.locator("#content")).to_contain_text("Compensated")
        # Its items cancelled before they ran are counted apart from the ones done.
        apart = f", {cancelled} cancelled" if cancelled else ""
        expect(page.locator(".fanout-summary")).to_contain_text(
            f"{8 - cancelled} of 8 items done{apart}"
        )
        shoot("compensated-run")
        assert_fits(page, ".fanout-summary, fieldset")
        page.goto(f"{admin}/itemclaim/?run={compensated.pk}&status=compensated")
        expect(page.locator("#result_list tbody tr")).to_have_count(undone)
        expect(page.locator("#result_list tbody tr").first).to_contain_text("Compensated")
        shoot("compensated-items")
        assert_fits(page, "#result_list td", row_height=THREE_LINES)

        # The email step's page keeps both failed attempts: when, where, how long and why.
        page.goto(f"{admin}/itemclaim/{email.pk}/change/")
        history = page.locator("table.fanout-attempts tbody tr")
        expect(history).to_have_count(2)
        expect(history.first).to_contain_text("RuntimeError")
        expect(history.first).to_contain_text("smtp hiccup on attempt 1")
        shoot("attempt-history")
        assert_fits(page, "table.fanout-attempts td, fieldset")


PERMANENT = "fanout.errors.PermanentError"
CARD_DECLINED = "card declined by the issuer (insufficient funds)"
WORKER = "worker-7.eu-west-1.internal:48211:fanout-drain-3"


def glance_runs() -> dict[str, Any]:
    """Two runs of one definition told apart by their params, one failed under collect, and
    the pool they share."""
    pool = CapacityPool.objects.create(name="payments-api", max_concurrency=8, rate_count=50)
    failed = make_run(
        {"succeeded": 17, "failed": 3},
        status=RunStatus.FAILED,
        pool=pool.name,
        run_key='admin-console:{"month":"2026-11","region":"eu-west-1"}',
    )
    ItemClaim.objects.filter(run=failed, status=ItemStatus.FAILED).update(
        error=f"Traceback (most recent call last):\n  ...\n{PERMANENT}: {CARD_DECLINED}",
        error_class="PermanentError",
        owner=WORKER,
    )
    running = make_run(
        {"succeeded": 5, "running": 2, "pending": 13},
        pool=pool.name,
        run_key='admin-console:{"month":"2026-10","region":"eu-west-1"}',
    )
    return {"pool": pool, "failed": failed, "running": running}


def seen_whole(locator: Any) -> dict[str, Any]:
    """Scroll the page (never a list sideways) to the element; say whether all of it is on the
    screen and none of its text is cut, by itself or by a box around it."""
    return locator.evaluate(
        """(el) => {
            window.scrollBy(0, el.getBoundingClientRect().top - innerHeight / 3);
            const r = el.getBoundingClientRect();
            const cutBy = [];
            for (let box = el.parentElement; box; box = box.parentElement) {
                const style = getComputedStyle(box);
                if (style.overflowX === "visible" && style.overflowY === "visible") continue;
                const b = box.getBoundingClientRect();
                if (r.left < b.left - 1 || r.right > b.right + 1 ||
                    r.top < b.top - 1 || r.bottom > b.bottom + 1) {
                    cutBy.push(box.tagName + "." + box.className);
                }
            }
            return {
                text: el.innerText,
                left: r.left, right: r.right, top: r.top, bottom: r.bottom,
                width: innerWidth, height: innerHeight,
                onScreen: r.width > 0 && r.left >= 0 && r.right <= innerWidth + 1 &&
                    r.top >= 0 && r.bottom <= innerHeight + 1,
                cutItself: el.scrollWidth > el.clientWidth + 1 ||
                    el.scrollHeight > el.clientHeight + 1,
                cutBy: cutBy,
            };
        }"""
    )


def assert_seen_whole(locator: Any, text: str) -> None:
    from playwright.sync_api import expect

    expect(locator).to_contain_text(text)
    seen = seen_whole(locator)
    assert seen["onScreen"] and not seen["cutItself"] and not seen["cutBy"], (text, seen)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("width", WIDTHS)
def test_a_runs_params_its_errors_and_why_it_failed_are_read_without_hovering_at_any_width(
    live_server, django_user_model, width
):
    from playwright.sync_api import expect

    ensure_chromium()
    expect.set_options(timeout=15_000)  # a loaded machine renders slowly; nothing here polls
    django_user_model.objects.create_superuser("operator", "op@example.com", PASSWORD)
    runs = glance_runs()
    failed, pool = runs["failed"], runs["pool"]
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    admin = f"{live_server.url}/admin/fanout"

    with chromium_page(width, height=760) as page:

        def shoot(name: str) -> None:
            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(SCREENSHOTS / f"{name}-{width}.png"))

        log_in(page, live_server.url, "/admin/fanout/batchrun/")

        # The runs list tells the two runs apart by their params, whole.
        expect(page.locator("#result_list")).to_be_visible()
        shoot("runs")
        keys = page.locator("#result_list td.field-run_name .fanout-wrap")
        assert_seen_whole(
            keys.filter(has_text="2026-11"), '{"month":"2026-11","region":"eu-west-1"}'
        )
        assert_seen_whole(
            keys.filter(has_text="2026-10"), '{"month":"2026-10","region":"eu-west-1"}'
        )
        # ...and how far each has come, on the screen at a phone's width too.
        counts = page.locator("#result_list td.field-progress_bar .fanout-counts")
        assert_seen_whole(counts.first, "/")
        # ...and why the running run waits, the limit that binds first, to its last word.
        why = page.locator("#result_list td.field-progress_bar .fanout-why")
        assert_seen_whole(why.filter(has_text="allowed"), "(--workers sets how many)")

        # The failed items: each error's class and message, and the worker that ran it.
        page.goto(f"{admin}/itemclaim/?run={failed.pk}&status=failed")
        expect(page.locator("#result_list tbody tr")).to_have_count(3)
        shoot("failed-items")
        error = page.locator("#result_list td.field-last_error .fanout-wrap").first
        assert_seen_whole(error, f"PermanentError: {CARD_DECLINED}")
        assert "fanout.errors" not in error.inner_text()
        # The worker: its host's first label, process and thread, each whole (the thread on a
        # second line at most); the fully qualified name in the tooltip.
        worker = page.locator("#result_list td.field-lease .fanout-worker").first
        assert_seen_whole(worker.locator(".fanout-host"), "worker-7 · 48211")
        assert_seen_whole(worker.locator(".fanout-thread"), "fanout-drain-3")
        assert worker.get_attribute("title") == WORKER
        assert worker.bounding_box()["height"] < 3 * 18, worker.bounding_box()

        # The run's page says why it failed, and offers nothing to edit or save.
        page.goto(f"{admin}/batchrun/{failed.pk}/change/")
        shoot("failed-run")
        assert_seen_whole(
            page.locator('[data-field="failed_why"]'),
            f"3 of 20 items failed: PermanentError: {CARD_DECLINED} (first)",
        )
        expect(page.locator('input[name="max_parallel"]')).to_have_count(0)
        expect(page.locator('input[name="_save"]')).to_have_count(0)

        # The pool's page: the burst it applies, its pause switch, the runs that use it.
        page.goto(f"{admin}/capacitypool/{pool.pk}/change/")
        shoot("pool")
        assert_seen_whole(page.locator(".field-burst_now .readonly"), "50 (the rate count)")
        assert_seen_whole(page.get_by_role("button", name="Pause pool"), "Pause pool")
        table = page.locator(".fanout-pool-runs")
        running = runs["running"]
        assert_seen_whole(table.get_by_role("link", name=f"#{running.pk} admin-console"), "#")
        expect(table.locator("tbody tr")).to_have_count(1)  # the failed run has nothing left


def charted_run() -> dict[str, Any]:
    """A finished run of 600 items over ten minutes with its failures, retries, waits sampled
    every ten seconds and three child runs, and the pool it used."""
    from datetime import timedelta

    from fanout.models import RunSample
    from tests.test_charts import finished_items, new_run

    pool = CapacityPool.objects.create(name="render-farm", max_concurrency=32, rate_count=5)
    run = new_run(
        RunStatus.SUCCEEDED,
        minutes=10,
        definition="renders",
        run_key="renders:2026-11-29:catalogue",
    )
    items = finished_items(run, 600, pool=pool.name)
    assert run.started_at is not None
    RunSample.objects.bulk_create(
        RunSample(
            run=run,
            at=run.started_at + timedelta(seconds=s),
            running=min(32, s // 10 + 4),
            ready=max(0, 30 - s // 20),
            pool_full=(s * 7) % 40 if s < 400 else 0,
            rate_limited=(s * 3) % 25 if 200 < s < 500 else 0,
            retry_due=s % 9,
        )
        for s in range(0, 600, 10)
    )
    for i, item in enumerate(items[:3]):
        BatchRun.objects.create(
            definition="renders.pages",
            run_key=f"renders:child:{i}",
            status=RunStatus.SUCCEEDED if i != 1 else RunStatus.FAILED,
            max_parallel=4,
            failure_policy="collect",
            join_mode="all",
            parent_item=item,
            created_at=run.started_at + timedelta(seconds=40 * i),
            started_at=run.started_at + timedelta(seconds=40 * i),
            finished_at=run.started_at + timedelta(seconds=40 * i + 150 + 60 * i),
        )
    return {"run": run, "pool": pool}


def charts_fit(page: Any) -> list[str]:
    """The parts of the charts that reach past the right edge of the screen."""
    return page.evaluate(
        """() => [...document.querySelectorAll('.fanout-charts *')]
            .filter(e => e.getBoundingClientRect().right > innerWidth + 1)
            .map(e => e.tagName + '.' + e.getAttribute('class'))"""
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("width", (1400, 390))
def test_a_runs_charts_and_a_pools_last_hour_are_drawn_whole_at_a_laptops_and_a_phones_width(
    live_server, django_user_model, width
):
    from playwright.sync_api import expect

    ensure_chromium()
    expect.set_options(timeout=15_000)
    django_user_model.objects.create_superuser("operator", "op@example.com", PASSWORD)
    made = charted_run()
    run, pool = made["run"], made["pool"]
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    admin = f"{live_server.url}/admin/fanout"

    with chromium_page(width, height=900) as page:
        log_in(page, live_server.url, f"/admin/fanout/batchrun/{run.pk}/change/")
        charts = page.locator(".fanout-charts")
        expect(charts.locator("svg.fanout-chart")).to_have_count(5)
        for name in ("throughput", "durations", "attempts", "waits", "children"):
            chart = charts.locator(f'[data-chart="{name}"] svg.fanout-chart')
            expect(chart.locator("rect").first).to_be_attached()
            box = chart.bounding_box()
            assert box and box["width"] >= min(width - 80, 400), (name, box)
            assert box["x"] >= 0 and box["x"] + box["width"] <= width, (name, box)
        # Server-side SVG: the charts need no script, and none is loaded for them.
        assert not page.locator(".fanout-charts script").count()
        expect(charts.locator('[data-chart="durations"] [data-field="note"]')).to_contain_text(
            "p99"
        )
        assert charts_fit(page) == [], "chart parts past the screen's edge"
        # The panels above the charts fit too (the Pools table with its gauges included):
        # the run page does not scroll sideways.
        expect(page.locator(".fanout-pools td")).to_have_count(4)
        assert_fits(page, ".fanout-panels td")
        charts.screenshot(path=str(SCREENSHOTS / f"run-charts-{width}.png"))

        page.goto(f"{admin}/capacitypool/{pool.pk}/change/")
        pool_charts = page.locator(".fanout-charts")
        expect(pool_charts.locator("svg.fanout-chart")).to_have_count(2)
        expect(pool_charts.locator("line.fanout-chart-limit")).to_have_count(2)
        assert charts_fit(page) == [], "chart parts past the screen's edge"
        assert_fits(page, ".fanout-chart-panel")
        pool_charts.screenshot(path=str(SCREENSHOTS / f"pool-charts-{width}.png"))


def spending_runs() -> dict[str, Any]:
    """Runs and pools with budgets: one nearly spent, one full, a token budget, a pool's."""
    from fanout.models import SpendAccount

    sweep = make_run(
        {"succeeded": 180, "running": 6, "pending": 30},
        pool="openai",
        run_key="llm-sweep:2026-11-29:gpt-x-prompts",
    )
    full = make_run({"succeeded": 40, "pending": 12}, run_key="embeddings:docs-2026-11")
    CapacityPool.objects.create(name="openai", max_concurrency=8, rate_count=500, rate_period=60)
    CapacityPool.objects.create(name="anthropic", max_concurrency=4, rate_count=50)
    SpendAccount.objects.create(run=sweep, unit="usd", budget=50, spent=49.8, reserved=0.6)
    SpendAccount.objects.create(run=full, unit="usd", budget=20, spent=20)
    SpendAccount.objects.create(
        pool="openai", unit="tokens", budget=900_000, spent=612_400, reserved=24_000, period=86400
    )
    SpendAccount.objects.create(pool="anthropic", unit="usd", budget=200, spent=35.5)
    return {"sweep": sweep, "pool": CapacityPool.objects.get(name="openai")}


@pytest.mark.django_db(transaction=True)
def test_the_budgets_page_draws_every_budget_bar_within_a_laptops_screen(
    live_server, django_user_model
):
    from playwright.sync_api import expect

    ensure_chromium()
    expect.set_options(timeout=15_000)
    django_user_model.objects.create_superuser("operator", "op@example.com", PASSWORD)
    made = spending_runs()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    with chromium_page(WIDTH, height=600) as page:
        log_in(page, live_server.url, "/admin/fanout/spendaccount/")
        expect(page.locator("#result_list .fanout-budget meter")).to_have_count(4)
        expect(page.locator("#result_list")).to_contain_text("$50.40 of $50.00")
        assert_fits(page, "#result_list td")
        page.screenshot(path=str(SCREENSHOTS / f"budgets-{WIDTH}.png"), full_page=True)

        # The same bar on the pool's page, beside its concurrency and rate.
        page.goto(f"{live_server.url}/admin/fanout/capacitypool/{made['pool'].pk}/change/")
        expect(page.locator(".fanout-headline .fanout-budget")).to_contain_text(
            "636,400 tokens of 900,000 tokens"
        )
