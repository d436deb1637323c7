"""What the runs', items' and pools' admins share: the page-at-once changelist, custom
permissions, times to the second, links to filtered item lists, and waking a run's workers."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from datetime import datetime
from types import MappingProxyType
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.db.models import Count
from django.http import HttpRequest
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.dateformat import format as date_format
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.safestring import mark_safe
from redis.exceptions import RedisError
from rq import Worker

from ..definition import FanOut, get_definition
from ..dispatch import dispatch, move_to_rq, rq_unavailable
from ..errors import FanoutError
from ..models import BatchRun, ItemClaim, ItemStatus, RunStatus
from ..rq import get_queue
from ..text import last_line

# Django 6.1 offers actions on an object's page too; before it, only on the list.
LOCATIONS = getattr(admin, "ActionLocation", None)


def action(**options: Any) -> Any:
    """``@admin.action``, offered both on the list and on an object's page where Django can."""
    if LOCATIONS is not None:
        options["location"] = [LOCATIONS.CHANGE_LIST, LOCATIONS.CHANGE_FORM]
    return admin.action(**options)


def page_actions(model_admin: admin.ModelAdmin, request: HttpRequest) -> dict[str, Any]:
    """The actions an object's page may offer its viewer."""
    if LOCATIONS is None:
        return model_admin.get_actions(request)
    return model_admin.get_actions(request, action_location=LOCATIONS.CHANGE_FORM)


def page_action_form(changelist_url: str) -> tuple[str, str]:
    """Where an object's page posts an action, and the field that names it: the page itself
    on Django 6.1+, else the list's action endpoint (which then shows the list)."""
    if LOCATIONS is None:
        return changelist_url, "action"
    return "", f"{LOCATIONS.CHANGE_FORM.value}-action"


# Set by the page that asked an operator to confirm an action whose items nobody would run.
CONFIRMED = "fanout_confirmed"
CANCELLABLE_RUNS = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.JOINING)
TIME_FORMAT = "Y-m-d H:i:s"
EMPTY = "-"  # an empty field, as Django's admin marks one (empty_value_display)


def items_url(**params: Any) -> str:
    """The item list filtered by ``params`` (run, status, pool, error_class)."""
    return f"{reverse('admin:fanout_itemclaim_changelist')}?{urlencode(params)}"


def json_block(value: Any) -> str:
    if value is None:
        return EMPTY
    return format_html('<pre class="fanout-json">{}</pre>', json.dumps(value, indent=2))


def clipped(text: str, css: str = "") -> str:
    """Text cut to its column's width by the stylesheet, whole in its tooltip; "" for none."""
    if not text:
        return ""
    return format_html('<span class="fanout-clip {}" title="{}">{}</span>', css, text, text)


# A traceback's last line names its exception with the module path: "pkg.mod.Error: message".
_DOTTED = re.compile(r"^(?:[A-Za-z_][\w]*\.)+(?=[A-Za-z_]\w*(?::|$))")


def short_error(error: str | None) -> str:
    """What an error says, short: its last line, the exception's class without its module."""
    return _DOTTED.sub("", last_line(error))


def wrapped(text: str, css: str = "") -> str:
    """Text that wraps to its column's width instead of being cut, whole in its tooltip."""
    if not text:
        return ""
    return format_html('<span class="fanout-wrap {}" title="{}">{}</span>', css, text, text)


def worker_name(owner: str, short: bool = False) -> str:
    """A lease holder (host:pid:thread), wrapping only between its parts. ``short`` (a list's
    narrow column): one line of the host's first label, the process and the thread (its last
    part: an inline worker is "MainThread:inline-2"), the whole name in the tooltip; a fully
    qualified host broke mid-word over five lines, and host, process and threads over four."""
    host, *rest = owner.split(":")
    if short and len(rest) > 1:
        label = host if host.replace(".", "").isdigit() else host.split(".")[0]
        return format_html(
            '<span class="fanout-worker" title="{}"><span class="fanout-host">{} · {}</span>'
            ' · <span class="fanout-thread">{}</span></span>',
            owner,
            label,
            rest[0],
            rest[-1],
        )
    parts = format_html_join(mark_safe(":<wbr>"), "{}", ((p,) for p in owner.split(":")))
    return format_html('<span class="fanout-wrap fanout-worker" title="{}">{}</span>', owner, parts)


def gauge(value: int, limit: int, label: str, title: str = "") -> str:
    """A meter of ``value`` against ``limit`` that turns to a warning one short of full."""
    return render_to_string(
        "fanout/admin/gauge.html",
        {"value": value, "limit": limit, "high": max(1, limit - 1), "label": label, "title": title},
    )


def timestamp(value: datetime | None, time_only: bool = False) -> str:
    """A local time to the second, its zone in the tooltip; a narrow column breaks it only
    between the date and the time."""
    if value is None:
        return ""
    local = timezone.localtime(value)
    when = date_format(local, "H:i:s")
    if not time_only:
        when = format_html(
            '<span class="fanout-date">{}</span> {}', date_format(local, "Y-m-d"), when
        )
    return format_html(
        '<time datetime="{}" title="{}">{}</time>',
        value.isoformat(),
        date_format(local, f"{TIME_FORMAT} T"),
        when,
    )


def time_field(name: str, description: str) -> Callable[[Any, Any], str]:
    """A read-only field or list column showing the datetime ``name`` to the second (the admin's
    own shows the project's DATETIME_FORMAT, minutes by default)."""

    @admin.display(description=description, ordering=name)
    def show(model_admin: Any, obj: Any) -> str:
        return timestamp(getattr(obj, name)) or model_admin.get_empty_value_display()

    return show


@admin.display(description="counter audit")
def counter_drift_display(model_admin: Any, obj: Any) -> str:
    """What the supervisor's audit found on a run's or pool's in_flight counter."""
    if not obj.counter_drift:
        return "no drift found"
    return format_html(
        '<span class="fanout-drift">in_flight differed from the rows and was corrected {}, '
        "last at {}: a bug worth reporting (see the warnings logged)</span>",
        "once" if obj.counter_drift == 1 else f"{obj.counter_drift:,} times",
        timestamp(obj.drift_noted_at),
    )


# The facts of the list page being drawn, {pk: what its admin's read_page found}. One
# ModelAdmin serves every request thread, so they are set in the request's own context, for
# the time it takes to draw the rows, never on the admin (nor patched onto the rows).
_page: ContextVar[Mapping[Any, Any]] = ContextVar("fanout_page", default=MappingProxyType({}))


def page_facts(obj: Any) -> Any:
    """What the list page being drawn read for ``obj`` (its admin's read_page), or None."""
    return _page.get().get(obj.pk)


class PageChangeList(ChangeList):
    """A changelist whose admin reads what its columns show for the whole page at once: its
    ``facts``, {pk: what read_page found}."""

    facts: Mapping[Any, Any]

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        # Evaluates the page (the template then iterates the cached rows).
        rows = list(self.result_list)
        self.facts = self.model_admin.read_page(request, rows)  # type: ignore[attr-defined]


class FanoutAdmin(admin.ModelAdmin):
    """A fanout model's admin: its stylesheet, a page read at once, its custom permissions."""

    class Media:
        css = {"all": ("fanout/admin.css",)}

    @staticmethod
    def has_fanout_permission(request: HttpRequest, codename: str) -> bool:
        """Whether the user holds one of the custom permissions of fanout's models' Meta."""
        return request.user.has_perm(f"fanout.{codename}")

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return PageChangeList

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        response = super().changelist_view(request, extra_context)
        if not isinstance(response, TemplateResponse):
            return response  # a redirect after an action or a save
        cl = (response.context_data or {}).get("cl")
        if not isinstance(cl, PageChangeList):
            return response  # an action's own page
        # The columns read the page's facts while the rows are drawn: draw them here, with the
        # facts set, rather than after the view has returned.
        token = _page.set(cl.facts)
        try:
            response.render()
        finally:
            _page.reset(token)
        return response

    def read_page(self, request: HttpRequest, rows: list[Any]) -> Mapping[Any, Any]:
        """What the page's columns show, read for all its rows at once: {pk: facts}."""
        return {}


def _runs(pks: list[int]) -> str:
    return f"run {pks[0]}" if len(pks) == 1 else f"runs {', '.join(map(str, sorted(pks)))}"


def _queue_has_workers(definition: FanOut) -> bool:
    """Whether some RQ worker listens on ``definition``'s queue now."""
    queue = get_queue(definition)
    try:
        return Worker.count(connection=queue.connection, queue=queue) > 0
    except RedisError:
        return True  # unknown: say nothing rather than something wrong


def stranded_runs(runs: list[BatchRun]) -> list[tuple[BatchRun, str]]:
    """The inline runs among ``runs`` that RQ cannot take over from here, each with why: items
    put back to pending there wait until someone resumes the run in a shell."""
    stranded = []
    for run in runs:
        if run.executor != "inline":
            continue
        try:
            why = rq_unavailable(get_definition(run.definition))
        except FanoutError as exc:
            why = str(exc)
        if why:
            stranded.append((run, why))
    return stranded


def resume_command(pks: list[int]) -> str:
    return f"`manage.py run_fanout --resume {pks[0] if len(pks) == 1 else 'ID'}`"


def confirm_stranded(
    model_admin: admin.ModelAdmin, request: HttpRequest, runs: list[BatchRun], what: str
) -> TemplateResponse | None:
    """A page that says, before anything changes, that ``what`` leaves these runs' items
    pending with nobody to run them; None once confirmed, or when nothing would be stranded."""
    stranded = stranded_runs(runs)
    if not stranded or request.POST.get(CONFIRMED):
        return None
    opts = model_admin.model._meta
    repost = [
        (name, value)
        for name in request.POST
        if name != "csrfmiddlewaretoken"
        for value in request.POST.getlist(name)
    ]
    context = {
        **model_admin.admin_site.each_context(request),
        "title": f"{what}?",
        "subtitle": None,
        "opts": opts,
        "what": what,
        "stranded": [
            {"run": run, "why": why, "command": resume_command([run.pk])} for run, why in stranded
        ],
        "repost": repost,
        "confirmed_field": CONFIRMED,
        "back_url": _local(request.POST.get("_return_to", "")) or request.get_full_path(),
    }
    return TemplateResponse(request, "fanout/admin/confirm_stranded.html", context)


def confirm_cancel(
    model_admin: admin.ModelAdmin,
    request: HttpRequest,
    runs: list[BatchRun],
    what: str,
    undo: bool = False,
) -> TemplateResponse | None:
    """Like Django's delete confirmation: before a cancel, a page that lists the runs, what
    becomes of their items, and asks again; None once confirmed (``post=yes``) or when no run
    can be cancelled. Reached through the action alone: its permission is checked first."""
    if not runs or request.POST.get("post") == "yes":
        return None
    rows = (
        ItemClaim.objects.filter(run__in=runs)
        .values("run_id", "status")
        .annotate(n=Count("pk"))
        .order_by()
        .values_list("run_id", "status", "n")
    )
    counts: dict[int, dict[str, int]] = {}
    for run_id, status, n in rows:
        counts.setdefault(run_id, {})[status] = n
    opts = model_admin.model._meta
    context = {
        **model_admin.admin_site.each_context(request),
        "title": f"{what}: are you sure?",
        "subtitle": None,
        "opts": opts,
        "what": what,
        "undo": undo,
        "runs": [
            {
                "run": run,
                "pending": counts.get(run.pk, {}).get(ItemStatus.PENDING, 0),
                "running": sum(
                    counts.get(run.pk, {}).get(s, 0)
                    for s in (ItemStatus.RUNNING, ItemStatus.WAITING)
                ),
                "succeeded": counts.get(run.pk, {}).get(ItemStatus.SUCCEEDED, 0),
            }
            for run in runs
        ],
        "repost": [
            (name, value)
            for name in request.POST
            if name not in ("csrfmiddlewaretoken", "post")
            for value in request.POST.getlist(name)
        ],
        "back_url": _local(request.POST.get("_return_to", "")) or request.get_full_path(),
    }
    return TemplateResponse(request, "fanout/admin/confirm_cancel.html", context)


def _local(url: str) -> str:
    return url if url.startswith("/") and not url.startswith("//") else ""


def redispatch(model_admin: admin.ModelAdmin, request: HttpRequest, runs: list[BatchRun]) -> None:
    """Wake workers for the running ones among ``runs``, and tell the operator what happened.

    An inline run is handed to RQ where RQ can take it: its inline workers were threads of the
    process that started it, and the web server must not run items itself.
    """
    inline: list[tuple[int, str]] = []
    woken: list[int] = []
    moved: list[tuple[int, FanOut]] = []
    for run in runs:
        if run.status != RunStatus.RUNNING:
            continue
        try:
            _wake(run, inline, woken, moved)
        except (ImportError, FanoutError) as exc:
            model_admin.message_user(
                request, f"run {run.pk} could not be dispatched: {exc}", messages.ERROR
            )
    if woken:
        model_admin.message_user(request, f"Workers woken for {_runs(woken)}.", messages.INFO)
    for pk, definition in moved:
        _say_moved(model_admin, request, pk, definition)
    if inline:
        _say_inline(model_admin, request, inline)


def _wake(
    run: BatchRun,
    inline: list[tuple[int, str]],
    woken: list[int],
    moved: list[tuple[int, FanOut]],
) -> None:
    """Dispatch one running run, noting it as woken, moved to RQ, or left inline (and why)."""
    definition = get_definition(run.definition)
    if run.executor != "inline":
        dispatch(run, definition, run.executor)
        woken.append(run.pk)
        return
    why = rq_unavailable(definition)
    if why:
        inline.append((run.pk, why))
        return
    move_to_rq(run, definition)
    moved.append((run.pk, definition))


def _say_moved(
    model_admin: admin.ModelAdmin, request: HttpRequest, pk: int, definition: FanOut
) -> None:
    model_admin.message_user(
        request,
        f"run {pk} was carried by inline workers: its items now run on RQ workers "
        f"(queue {definition.queue!r}).",
        messages.INFO,
    )
    if not _queue_has_workers(definition):
        model_admin.message_user(
            request,
            f"No RQ worker listens on queue {definition.queue!r} now: start "
            f"`manage.py rqworker {definition.queue}` to run run {pk}.",
            messages.WARNING,
        )


def _say_inline(
    model_admin: admin.ModelAdmin, request: HttpRequest, inline: list[tuple[int, str]]
) -> None:
    pks = [pk for pk, _ in inline]
    reasons = "; ".join(sorted({why for _, why in inline}))
    model_admin.message_user(
        request,
        f"{_runs(pks)} {'uses' if len(pks) == 1 else 'use'} the inline executor: "
        f"start {'its' if len(pks) == 1 else 'their'} workers with {resume_command(pks)} "
        f"(RQ cannot take over here: {reasons})",
        messages.WARNING,
    )
