"""manage.py fanout_pools: list capacity pools with their usage, or sync them from settings."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

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
        now = timezone.now()
        pools = list(CapacityPool.objects.all())
        states = pool_states([p.name for p in pools], now)
        in_flight = {p: ItemClaim.objects.in_flight(now).filter(pool=p).count() for p in states}
        waiting = {
            p: ItemClaim.objects.filter(pool=p, status=ItemStatus.PENDING).count() for p in states
        }
        for pool in pools:
            self.stdout.write(
                f"{pool.name}: in flight {in_flight[pool.name]}/{pool.max_concurrency}, "
                f"rate {pool.describe_rate()}, pending {waiting[pool.name]}"
                + (", paused" if pool.paused else "")
                + (f" — {states[pool.name]}" if states[pool.name] else "")
            )
