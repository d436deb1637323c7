"""SQLite: no row locks, so a transaction that will write takes the write lock first."""

from __future__ import annotations

from typing import Any

from django.db.models import F, QuerySet

from .base import Backend


class SQLite(Backend):
    vendor = "sqlite"

    def take_write_lock(self, rows: QuerySet[Any]) -> None:
        # A write first takes the database's write lock for the whole transaction, which
        # serialises writers as FOR UPDATE would, and never upgrades a read lock (a deadlock).
        pk = rows.model._meta.pk.attname
        rows.filter(pk__in=rows.values("pk")[:1]).update(**{pk: F(pk)})
