"""Launch: starting and dispatching runs, asked for from below fanout.dispatch and done by it.

A definition's ``start`` (fanout.definition), a call whose handler spawned a child run
(fanout.call) and a supervisor that finished writing an inline child run (fanout.supervise)
sit in layers below fanout.dispatch, which imports the executors and so most of fanout.
Dispatch is connected here when the app is ready (``FanoutConfig.ready``): every import goes
downward, and these three calls go up through this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured

if TYPE_CHECKING:
    from .definition import FanOut, Spawn
    from .models import BatchRun
    from .transitions import ClaimedItem


@dataclass(frozen=True)
class Launcher:
    """What fanout.dispatch does for the layers below it."""

    start_run: Callable[..., BatchRun]
    start_child: Callable[[int, ClaimedItem, Spawn], BatchRun]
    dispatch: Callable[..., Any]


_launcher: Launcher | None = None


def connect(launcher: Launcher) -> None:
    """Name what starts and dispatches runs (FanoutConfig.ready connects fanout.dispatch)."""
    global _launcher
    _launcher = launcher


def _connected() -> Launcher:
    if _launcher is None:
        raise ImproperlyConfigured(
            "fanout is not ready: add 'fanout' to INSTALLED_APPS and call django.setup() "
            "before starting a run"
        )
    return _launcher


def start_run(definition: FanOut, params: Any, run_key: str | None, **options: Any) -> BatchRun:
    """Create (or find) the run, write its items and dispatch it (FanOut.start)."""
    return _connected().start_run(definition, params, run_key, **options)


def start_child(parent_run_id: int, item: ClaimedItem, spawn: Spawn) -> BatchRun:
    """Create (or find) the item's child run, write its items and dispatch it."""
    return _connected().start_child(parent_run_id, item, spawn)


def dispatch(run: BatchRun, definition: FanOut, executor: str = "inline") -> Any:
    """Start workers for ``run``: threads here, or drain jobs on RQ."""
    return _connected().dispatch(run, definition, executor)
