"""The admin tests' definition, runs built row by row, and shortcuts for posting actions."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.db.models import F
from django.test import Client
from django.utils import timezone

from fanout import FanOut, Item
from fanout.models import BatchRun, CapacityPool, ItemClaim, ItemStatus, RunStatus

DEFINITION = "admin-console"


def _handle(item: Item) -> dict[str, Any]:
    return {"key": item.key}


def _join(outcomes: Iterable[Any]) -> dict[str, int]:
    outcomes = list(outcomes)
    return {"succeeded": sum(o.succeeded for o in outcomes), "total": len(outcomes)}


# Constructing it registers it in this process (the admin looks up max_attempts and dispatch).
console = FanOut(
    DEFINITION,
    over=lambda params: range(int(params.get("n", 10))),
    do=_handle,
    key=lambda i: f"item-{i:06d}",
    max_attempts=3,
    join=_join,
)

# The custom permissions (fanout/models.py Meta.permissions), by admin action.
PERMISSIONS = {
    "retry_run": (BatchRun, "Can retry the failed items of a run"),
    "cancel_run": (BatchRun, "Can cancel a run"),
    "dispatch_run": (BatchRun, "Can re-dispatch a run's workers"),
    "retry_item": (ItemClaim, "Can retry failed items"),
    "cancel_item": (ItemClaim, "Can cancel pending items"),
    "force_release_item": (ItemClaim, "Can take an item's lease away from its holder"),
    "pause_pool": (CapacityPool, "Can pause and resume a pool"),
}
VIEW = ("view_batchrun", "view_itemclaim", "view_capacitypool")


def permission(codename: str) -> Permission:
    if codename in PERMISSIONS:
        model, name = PERMISSIONS[codename]
        perm, _ = Permission.objects.get_or_create(
            codename=codename,
            content_type=ContentType.objects.get_for_model(model),
            defaults={"name": name},
        )
        return perm
    return Permission.objects.get(content_type__app_label="fanout", codename=codename)


def make_run(
    counts: dict[str, int] | None = None,
    *,
    status: str = RunStatus.RUNNING,
    executor: str = "inline",
    pool: str = "",
    run_key: str | None = None,
    pk: int | None = None,
    error_classes: tuple[str, ...] = ("ValueError", "TimeoutError"),
    waiting: int = 0,
    lease_seconds: float = 600,
    **fields: Any,
) -> BatchRun:
    """A run with items in the given statuses, written with bulk_create in index order.

    ``waiting`` of the pending items have a retry that is not yet due.
    """
    counts = counts or {}
    now = timezone.now()
    total = sum(counts.values())
    run = BatchRun.objects.create(
        pk=pk,
        definition=DEFINITION,
        run_key=run_key or f"{DEFINITION}:{uuid.uuid4().hex[:12]}",
        params={"n": total},
        status=status,
        max_parallel=fields.pop("max_parallel", 4),
        failure_policy="collect",
        join_mode="all",
        executor=executor,
        total_items=total,
        materialized_upto=total,
        created_at=fields.pop("created_at", now - timedelta(minutes=5)),
        started_at=now - timedelta(minutes=5),
        finished_at=now if status in (RunStatus.SUCCEEDED, RunStatus.FAILED) else None,
        **fields,
    )
    rows = []
    index = 0
    token = uuid.uuid4()
    for item_status, n in counts.items():
        for i in range(n):
            row = ItemClaim(
                run=run,
                key=f"item-{index:06d}",
                index=index,
                payload={"i": index},
                pool=pool,
                status=item_status,
                # Written when the run started, and due since then.
                next_attempt_at=now - timedelta(minutes=5),
            )
            if item_status in (ItemStatus.SUCCEEDED, ItemStatus.FAILED, ItemStatus.CANCELLED):
                row.started_at = now - timedelta(seconds=30)
                row.finished_at = now - timedelta(seconds=20) + timedelta(microseconds=index)
                row.claimed_at = row.started_at
                row.owner = "host:1:worker-1"
            if item_status == ItemStatus.SUCCEEDED:
                row.result = {"ok": index}
            elif item_status == ItemStatus.FAILED:
                cls = error_classes[i % len(error_classes)]
                row.error_class = cls
                row.error = f"Traceback (most recent call last):\n  ...\n{cls}: item {index} broke"
                row.attempt = 3
            elif item_status == ItemStatus.CANCELLED:
                row.error_class = "Cancelled"
                row.error = "cancelled by an operator"
            elif item_status == ItemStatus.RUNNING:
                row.owner = "host:1:worker-2"
                row.claim_token = token
                row.claimed_at = now
                row.started_at = now
                row.lease_expires_at = now + timedelta(seconds=lease_seconds)
            elif item_status == ItemStatus.PENDING and i < waiting:
                row.next_attempt_at = now + timedelta(minutes=2)
                row.attempt = 2
            rows.append(row)
            index += 1
    ItemClaim.objects.bulk_create(rows, batch_size=5000)
    # The counters are the rows (as every transition keeps them): running items hold slots.
    running = sum(n for s, n in counts.items() if s in (ItemStatus.RUNNING, ItemStatus.WAITING))
    BatchRun.objects.filter(pk=run.pk).update(in_flight=running)
    if pool:
        CapacityPool.objects.filter(name=pool).update(
            in_flight=F("in_flight") + counts.get(ItemStatus.RUNNING, 0)
        )
    run.refresh_from_db()
    return run


def action(
    client: Client, url: str, name: str, *pks: int, across: bool = False, confirm: bool = False
) -> Any:
    """Run a changelist action on the rows ``pks`` (or, ``across``, on every row of ``url``);
    ``confirm``: as its confirmation page posts it again."""
    data: dict[str, Any] = {"action": name, "index": 0, "_selected_action": [str(p) for p in pks]}
    if across:
        data["select_across"] = "1"
    if confirm:
        data["post"] = "yes"
    return client.post(url, data)


def page_action(client: Client, url: str, name: str, pk: int) -> Any:
    """Press an action's button on an object's own page, as its form posts it."""
    page = client.get(url)
    target = page.context.get("action_url", "")
    field = page.context.get("action_field", "CHANGE_FORM-action")
    data = {field: name, "_selected_action": str(pk)}
    if target:  # before Django 6.1: the list's action endpoint, then back to the page
        data.update(index="0", _return_to=url)
    return client.post(target or url, data)


def messages_of(response: Any) -> list[str]:
    """The messages this request added for the user."""
    return [str(m) for m in response.wsgi_request._messages._queued_messages]


def statuses(run: BatchRun) -> dict[str, int]:
    out: dict[str, int] = {}
    for status in ItemClaim.objects.filter(run=run).values_list("status", flat=True):
        out[status] = out.get(status, 0) + 1
    return out
