"""The execution ledger every test handler writes, so duplicates are counted, not guessed."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

from fanout import Item

from .models import Execution


@contextlib.contextmanager
def executing(item: Item, worker: str | None = None) -> Iterator[bool]:
    """Record a handler call for ``item`` while the block runs; yield whether it is the first.

    The row is written when the handler starts (so a worker killed mid-item leaves it behind)
    and its end time when the handler returns or raises.
    """
    first = not Execution.objects.filter(run_id=item.run_id, key=item.key).exists()
    row = Execution.objects.create(
        run_id=item.run_id,
        key=item.key,
        attempt=item.attempt,
        pool=item.pool,
        worker=worker or f"{os.getpid()}:{threading.current_thread().name}",
        started=time.time(),
    )
    try:
        yield first
    finally:
        Execution.objects.filter(pk=row.pk).update(ended=time.time())
