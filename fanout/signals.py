"""Signals fanout sends, each after the change it announces has committed.

- ``run_started(run)``: a run's items are written and it is running.
- ``item_finished(run_id, key, status, result, error)``: an item's outcome was recorded as
  succeeded or failed (a retry is not a finish).
- ``run_finished(run)``: a run ended: succeeded, failed (after its join) or cancelled.
- ``pool_throttled(pool, retry_after)``: a handler raised ``Throttled``; the pool admits nothing
  for ``retry_after`` seconds.

Receivers run in the worker that made the change, after its commit: keep them short, and do
not let them raise (an exception is logged and the worker goes on).
"""

from __future__ import annotations

import logging
from typing import Any

from django.dispatch import Signal

logger = logging.getLogger("fanout")

run_started = Signal()
item_finished = Signal()
run_finished = Signal()
pool_throttled = Signal()


def send(signal: Signal, sender: Any, **kwargs: Any) -> None:
    """Send ``signal`` if anyone listens; a receiver's error is logged, never raised."""
    if not signal.has_listeners(sender):
        return
    for receiver, result in signal.send_robust(sender, **kwargs):
        if isinstance(result, Exception):
            logger.error("fanout signal receiver %r raised %r", receiver, result)
