"""Lease renewal: a background thread keeps a live owner's claims from expiring."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

from django.db import close_old_connections, connection
from django.utils import timezone

from .models import ItemClaim, ItemStatus

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
    """Renews the leases of every claim this process holds, one UPDATE per round.

    A claim whose handler has run past the definition's timeout is no longer renewed: its
    lease then runs out and another worker reclaims it, as if this one had died.
    """

    def __init__(self, lease_seconds: float) -> None:
        self.lease_seconds = lease_seconds
        self.interval = max(0.05, lease_seconds / 3)
        self._held: dict[uuid.UUID, float] = {}  # token -> monotonic deadline (inf: none)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, token: uuid.UUID, timeout: float | None) -> None:
        with self._lock:
            self._held[token] = time.monotonic() + timeout if timeout else float("inf")

    def drop(self, token: uuid.UUID) -> None:
        with self._lock:
            self._held.pop(token, None)

    def held(self) -> list[uuid.UUID]:
        with self._lock:
            return list(self._held)

    def renew_now(self) -> int:
        now = time.monotonic()
        with self._lock:
            tokens = [t for t, deadline in self._held.items() if deadline > now]
        if not tokens:
            return 0
        expires = timezone.now() + timedelta(seconds=self.lease_seconds)
        return ItemClaim.objects.filter(claim_token__in=tokens, status=ItemStatus.RUNNING).update(
            lease_expires_at=expires
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
