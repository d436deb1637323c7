"""Lease renewal: a background thread keeps a live owner's claims from expiring."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator

from django.db import close_old_connections, connection, transaction

from .clock import db_now_plus
from .models import ItemClaim

logger = logging.getLogger("fanout")


@contextlib.contextmanager
def keep_alive(renew: Callable[[], None], interval: float) -> Iterator[None]:
    """Call ``renew`` every ``interval`` seconds in a thread while the block runs."""
    stop = threading.Event()

    def loop() -> None:
        try:
            while not stop.wait(interval):
                try:
                    renew()
                except Exception:  # a missed renewal is retried; the lease is longer than this
                    logger.exception("lease renewal failed")
                    close_old_connections()
        finally:
            connection.close()

    thread = threading.Thread(target=loop, name="fanout-keep-alive", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class LeaseKeeper:
    """Renews the leases of every item this process holds, one UPDATE per round.

    Leases are per item. An item whose handler has run past the definition's timeout is no
    longer renewed: its lease runs out and another worker reclaims it, as if this one had
    died, while the items claimed with it keep theirs. An item whose handler has finished is
    renewed until its outcome is recorded, so finished work is never reclaimed. A renewal
    extends only a lease that is still live, by the database's clock: a renewer that stalled
    past its lease cannot bring back a slot that was already given away.
    """

    def __init__(self, lease_seconds: float) -> None:
        self.lease_seconds = lease_seconds
        self.interval = max(0.05, lease_seconds / 3)
        # pk -> (claim token, time.monotonic() deadline of its handler; inf: none or finished)
        self._held: dict[int, tuple[uuid.UUID, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, token: uuid.UUID, pks: Iterable[int]) -> None:
        """Renew these items (claimed under ``token``) until they are dropped."""
        with self._lock:
            for pk in pks:
                self._held[pk] = (token, float("inf"))

    def started(self, pk: int, timeout: float | None) -> None:
        """The item's handler starts now: renew it for at most ``timeout`` seconds."""
        with self._lock:
            if pk in self._held and timeout:
                self._held[pk] = (self._held[pk][0], time.monotonic() + timeout)

    def finished(self, pk: int) -> None:
        """The handler returned: keep the lease until the outcome is recorded."""
        with self._lock:
            if pk in self._held:
                self._held[pk] = (self._held[pk][0], float("inf"))

    def drop(self, pks: Iterable[int]) -> None:
        with self._lock:
            for pk in pks:
                self._held.pop(pk, None)

    def held(self) -> dict[int, uuid.UUID]:
        """Every item held: pk -> claim token."""
        with self._lock:
            return {pk: token for pk, (token, _) in self._held.items()}

    def renew_now(self) -> int:
        now = time.monotonic()
        with self._lock:
            live = {pk: token for pk, (token, deadline) in self._held.items() if deadline > now}
        if not live:
            return 0
        # Rows another transaction holds are skipped, renewed next round (a lease outlives two
        # missed rounds): mostly their own outcome being written, possibly several of this
        # process's items in one statement (a grouped hand-over, a batch's record) in an order
        # of their own. A renewal that waited for them would hold the rows it had already
        # renewed, and the two would deadlock.
        with transaction.atomic():
            free = list(
                ItemClaim.objects.filter(pk__in=list(live), claim_token__in=set(live.values()))
                .leased()
                .select_for_update(skip_locked=True)
                .values_list("pk", flat=True)
            )
            if not free:
                return 0
            return ItemClaim.objects.filter(pk__in=free).update(
                lease_expires_at=db_now_plus(self.lease_seconds)
            )

    def start(self) -> LeaseKeeper:
        self._thread = threading.Thread(target=self._loop, name="fanout-lease-keeper", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                try:
                    self.renew_now()
                except Exception:  # retried next round; the lease outlives two missed rounds
                    logger.exception("lease renewal failed")
                    close_old_connections()
        finally:
            connection.close()

    def __enter__(self) -> LeaseKeeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Keepers:
    """One started LeaseKeeper per lease length: a worker that serves runs of several
    definitions renews each item by its own definition's lease."""

    def __init__(self) -> None:
        self._by_lease: dict[float, LeaseKeeper] = {}
        self._lock = threading.Lock()
        self._stopped = False

    def for_lease(self, lease_seconds: float) -> LeaseKeeper:
        with self._lock:
            keeper = self._by_lease.get(lease_seconds)
            if keeper is None:
                keeper = self._by_lease[lease_seconds] = LeaseKeeper(lease_seconds)
                if not self._stopped:
                    keeper.start()
            return keeper

    def held(self) -> dict[int, uuid.UUID]:
        """Every item held by any keeper: pk -> claim token."""
        with self._lock:
            keepers = list(self._by_lease.values())
        return {pk: token for keeper in keepers for pk, token in keeper.held().items()}

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            keepers = list(self._by_lease.values())
        for keeper in keepers:
            keeper.stop()
