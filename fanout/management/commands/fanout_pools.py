"""manage.py fanout_pools: list capacity pools with their usage, or sync them from settings."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Count

from fanout.clock import db_now
from fanout.errors import FanoutError
from fanout.models import CapacityPool, ItemClaim, ItemStatus
from fanout.pools import sync_pools
from fanout.report import pool_states


class Command(BaseCommand):
    help = "List capacity pools and what they admit now; --sync applies FANOUT_POOLS to the rows."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--sync",
            action="store_true",
            help="Create the pools FANOUT_POOLS names and reset existing ones to its limits "
            "(edits made in the admin are overwritten). Default: only list.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["sync"]:
            try:
                created, updated = sync_pools(overwrite=True)
            except FanoutError as exc:
                raise CommandError(str(exc), returncode=2) from None
            self.stdout.write(
                f"pools created: {', '.join(created) or 'none'}; "
                f"updated from FANOUT_POOLS: {', '.join(updated) or 'none'}"
            )
        now = db_now()  # the clock budgets' periods and leases end by
        pools = list(CapacityPool.objects.all())
        states = pool_states([p.name for p in pools], now)
        pending = dict(
            ItemClaim.objects.filter(status=ItemStatus.PENDING, pool__in=list(states))
            .values("pool")
            .annotate(n=Count("pk"))
            .order_by()
            .values_list("pool", "n")
        )
        for pool in pools:
            state = states[pool.name]
            self.stdout.write(
                f"{pool.name}: in flight {state.in_flight}/{pool.max_concurrency}, "
                f"rate {pool.describe_rate()}, pending {pending.get(pool.name, 0)}"
                + (", paused" if pool.paused else "")
                + (f" — {state.reason}" if state.reason else "")
            )
