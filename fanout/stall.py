"""Stalls: why no worker could run a run, said on the run until one does."""

from __future__ import annotations

import logging

from .models import BatchRun

logger = logging.getLogger("fanout")

# A stalled run's re-dispatch is held back this long, doubled per re-dispatch, at most the cap.
STALL_BACKOFF = 2.0
STALL_BACKOFF_MAX = 60.0


def note_stall(run_id: int, reason: str) -> None:
    """Say on the run why no worker could run it; cleared once one does. Logged once per
    stall (by whoever writes it first), not on every re-dispatch that meets it again."""
    reason = reason[:4000]
    if BatchRun.objects.filter(pk=run_id, stalled="").update(stalled=reason):
        logger.error(
            "run %s stalls: %s; re-dispatched with backoff (%g s, doubling up to %g s) until "
            "a worker runs it",
            run_id,
            reason,
            STALL_BACKOFF,
            STALL_BACKOFF_MAX,
        )
        return
    BatchRun.objects.filter(pk=run_id).exclude(stalled=reason).update(stalled=reason)


def clear_stall(run_id: int) -> None:
    BatchRun.objects.filter(pk=run_id).exclude(stalled="").update(stalled="")
