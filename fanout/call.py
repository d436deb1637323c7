"""Call: call the handler for one claimed item and turn what happened into an outcome."""

from __future__ import annotations

import json
import random
import re
import time
import traceback
from datetime import timedelta
from typing import Any

from django.utils import timezone

from . import launch
from .conf import conf
from .cost import from_answer
from .definition import FanOut, Item, Spawn
from .errors import FanoutError, PermanentError, Throttled
from .transitions import (
    FAILED,
    RETRY,
    SPAWNED,
    SUCCEEDED,
    THROTTLED,
    ClaimedItem,
    ExecutionOutcome,
)


def backoff(definition: FanOut, attempt: int) -> float:
    """Seconds before attempt ``attempt + 1``: exponential, capped, with full jitter above half."""
    base = min(conf.RETRY_BACKOFF_MAX, definition.retry_backoff * (2 ** (attempt - 1)))
    return base / 2 + random.uniform(0, base / 2)


# "\u0000" in JSON text: an escape of its own, not an escaped backslash followed by "u0000".
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def unstorable(value: Any, text: str) -> str:
    """Why the database cannot store ``value`` (dumped as ``text``) as JSON; "" if it can.

    PostgreSQL's jsonb refuses NaN and Infinity, which JSON has no value for, "\\u0000", which
    its text cannot hold, and a surrogate escape that is not half of a pair; the rule is the
    same on every database, so an outcome never depends on where it is recorded.
    """
    if ("NaN" in text or "Infinity" in text) and not _dumps_strict(value):
        return "a float NaN or Infinity (JSON has no such number)"
    if "\\u0000" in text and _NUL_ESCAPE.search(text):
        return "a string holding a NUL character (\\u0000)"
    if "\\ud" in text and not _utf8(value):
        return "a string holding a lone surrogate (\\ud800-\\udfff), which no UTF-8 text can"
    return ""


def _dumps_strict(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True


def _utf8(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def storable_text(text: str) -> str:
    """``text`` with what no database text column holds escaped: NUL and lone surrogates."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode()
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode()
    return text


def _describe(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc, limit=-6))
    return storable_text(text[-4000:])


def _spawned(
    outcome: ExecutionOutcome, run_id: int, claimed: ClaimedItem, spawn: Spawn, began: float
) -> ExecutionOutcome:
    """The handler handed its item to a child run: start it (or find it) and wait for it."""
    try:
        child = launch.start_child(run_id, claimed, spawn)
    except FanoutError as exc:
        outcome.kind, outcome.error_class, outcome.error = FAILED, "SpawnFailed", str(exc)
    else:
        outcome.kind, outcome.result = SPAWNED, {"child_run": child.pk}
    return _timed(outcome, claimed, began)  # a failed spawn's end is written


COMPENSATION = "compensation"


def _call(definition: FanOut, item: Item, outcome: ExecutionOutcome) -> Any:
    """Call the handler; what it reported it cost stays on the outcome whatever it raised."""
    try:
        return definition.do(item)
    finally:
        if item.reported:
            outcome.cost, outcome.accounted = dict(item.reported), True


def execute(
    definition: FanOut,
    run_id: int,
    params: dict[str, Any],
    claimed: ClaimedItem,
    undoing: tuple[Any] | None = None,
) -> ExecutionOutcome:
    """Run the handler once; never raise for what the handler does.

    With ``undoing`` (the item's result, in a tuple), run its compensation instead: the same
    outcomes (Throttled, PermanentError, a retry with backoff), its value is not kept."""
    item = _item(run_id, params, claimed, undoing)
    outcome = ExecutionOutcome(pk=claimed.pk, key=claimed.key, kind=SUCCEEDED, pool=claimed.pool)
    outcome.accounted = definition.accounted and undoing is None  # a refund spends nothing
    began = time.monotonic()
    try:
        if undoing is not None:
            assert definition.compensate is not None
            definition.compensate(item, undoing[0])
            return _timed(outcome, claimed, began)
        value = _call(definition, item, outcome)
    except Exception as exc:
        _raised(outcome, exc, definition, claimed, undoing is not None)
    else:
        if isinstance(value, Spawn):
            return _spawned(outcome, run_id, claimed, value, began)
        _returned(outcome, value)
        if definition.cost_from is not None and outcome.cost is None:
            _cost_from_answer(outcome, definition)
    return _timed(outcome, claimed, began)


def _item(
    run_id: int, params: dict[str, Any], claimed: ClaimedItem, undoing: tuple[Any] | None
) -> Item:
    """What the handler (or the compensation) gets."""
    return Item(
        key=claimed.key,
        index=claimed.index,
        payload=claimed.payload,
        attempt=claimed.attempt,
        run_id=run_id,
        pool=claimed.pool,
        params=params,
        phase="forward" if undoing is None else COMPENSATION,
    )


def _raised(
    outcome: ExecutionOutcome,
    exc: Exception,
    definition: FanOut,
    claimed: ClaimedItem,
    undoing: bool,
) -> None:
    """The call raised: throttled, failed for good, or retried while attempts are left."""
    if isinstance(exc, Throttled):
        outcome.kind, outcome.retry_after = THROTTLED, exc.retry_after
        outcome.error_class, outcome.error = "Throttled", storable_text(str(exc))
        return
    outcome.error_class, outcome.error = type(exc).__name__, _describe(exc)
    if isinstance(exc, PermanentError):
        outcome.kind = FAILED
        return
    attempts = definition.max_attempts if undoing else definition.attempts_for(claimed.key)
    if claimed.attempt < attempts:
        outcome.kind = RETRY
        outcome.retry_after = backoff(definition, claimed.attempt)
    else:
        outcome.kind = FAILED


def _returned(outcome: ExecutionOutcome, value: Any) -> None:
    """The handler returned ``value``: kept as its result if it is JSON the database stores."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError) as exc:
        outcome.kind, outcome.error_class = FAILED, "ResultNotJSON"
        outcome.error = f"the handler returned a value that is not JSON-serializable: {exc}"
        return
    # Refused here rather than by the database when it is recorded: a permanent database
    # error there stops the drain, and the item runs again once its lease ends.
    problem = unstorable(value, text)
    if problem:
        outcome.kind, outcome.error_class = FAILED, "ResultNotStorable"
        outcome.error = f"the handler's result cannot be stored: it holds {problem}"
    else:
        # Read back now so what is stored is exactly what the join will read back.
        outcome.result = json.loads(text)


def _cost_from_answer(outcome: ExecutionOutcome, definition: FanOut) -> None:
    """A call whose handler reported nothing cost what its answer says (``cost_from=``)."""
    if outcome.kind != SUCCEEDED:
        return
    assert definition.cost_from is not None
    try:
        cost = from_answer(definition.name, definition.cost_from, outcome.result)
    except FanoutError as exc:
        outcome.kind, outcome.error_class, outcome.error = FAILED, "CostNotReadable", str(exc)
        outcome.result, outcome.cost_unread = None, True
        return
    if cost is not None:
        outcome.cost, outcome.accounted = cost, True


def _timed(outcome: ExecutionOutcome, claimed: ClaimedItem, began: float) -> ExecutionOutcome:
    # Durations by this host's monotonic clock, placed on the database's: no wall clock here.
    outcome.elapsed = time.monotonic() - began
    started = claimed.started_at
    outcome.finished_at = (
        started + timedelta(seconds=outcome.elapsed) if started is not None else timezone.now()
    )
    return outcome
