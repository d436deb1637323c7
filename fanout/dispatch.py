"""Dispatch: wake a bounded number of workers for a run, in this process or on RQ."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from django.db import connection
from redis.exceptions import RedisError

from . import launch
from .definition import EXECUTORS, FanOut, Spawn, get_definition
from .errors import FanoutError
from .lease import LeaseKeeper
from .materialize import WritingInterrupted, create_run, materialize
from .models import BatchRun, RunStatus
from .nest import child_run_key, open_children
from .queues import enqueue_drains, get_queue
from .supervise import Supervisor
from .transitions import ClaimedItem
from .worker import Drain, owner_name

logger = logging.getLogger("fanout")

MAX_INLINE_WORKERS = 64


class InlineExecutor:
    """N worker threads in this process, sharing one lease keeper."""

    def __init__(self, run: BatchRun, definition: FanOut, workers: int | None = None) -> None:
        count = workers or min(run.max_parallel, 16)
        if count < 1 or count > MAX_INLINE_WORKERS:
            raise FanoutError(f"workers must be between 1 and {MAX_INLINE_WORKERS}, got {count}")
        self.run = run
        self.definition = definition
        self.keeper = LeaseKeeper(definition.lease_seconds)
        self.stop = threading.Event()
        self.drains = [
            Drain(
                run.pk,
                definition,
                self.keeper,
                run.params,
                stop=self.stop,
                owner=owner_name(f"inline-{i + 1}"),
            )
            for i in range(count)
        ]
        self.threads = [
            threading.Thread(target=self._thread_main, args=(d,), name=f"fanout-{run.pk}-{i + 1}")
            for i, d in enumerate(self.drains)
        ]
        self.outcomes: list[str] = []
        # While it runs, this process also takes up runs nobody carries (fanout.supervise);
        # one supervisor is enough: a child run's executor (Item.spawn) has none of its own.
        self.supervisor = (
            Supervisor(f"fanout-supervisor-{run.pk}") if run.parent_item_id is None else None
        )
        self._running = len(self.threads)
        self._count_lock = threading.Lock()
        self._leaving = 0  # threads that found their (child) run ended; under _children_lock

    def _thread_main(self, drain: Drain) -> None:
        try:
            while True:
                try:
                    self.outcomes.append(drain())
                except Exception:
                    logger.exception("run %s: worker thread failed", self.run.pk)
                    self.outcomes.append("crashed")
                    self._reopened(leaving=True)  # a crash is not retried in a loop
                    break
                if not self._reopened():
                    break
        finally:
            connection.close()
            with self._count_lock:
                self._running -= 1
                last = self._running == 0
            if last:
                # Nobody may ever join() a child run's executor: the last thread tidies up.
                self._stop_helpers()

    def _reopened(self, leaving: bool = False) -> bool:
        """Whether a child run's thread, whose run had ended, must carry on: it was reopened
        (retry-failed) meanwhile. Decided under the lock a resume takes to see whether this
        executor still carries the run, so that one of them always does."""
        if self.run.parent_item_id is None:
            return False
        with _children_lock:
            if not leaving and not self.stop.is_set():
                status = BatchRun.objects.filter(pk=self.run.pk).values_list("status", flat=True)
                if status.first() in (RunStatus.RUNNING, RunStatus.COMPENSATING):
                    return True
            self._leaving += 1
            if self._leaving == len(self.threads) and _children.get(self.run.pk) is self:
                del _children[self.run.pk]  # a resume from now on starts a new executor
            return False

    def _stop_helpers(self) -> None:
        self.keeper.stop()
        if self.supervisor is not None:
            self.supervisor.stop()

    def start(self) -> InlineExecutor:
        self.keeper.start()
        if self.supervisor is not None:
            self.supervisor.start()
        for t in self.threads:
            t.start()
        return self

    @property
    def carrying(self) -> bool:
        """Some thread still drains the run (callers hold _children_lock)."""
        return self._leaving < len(self.threads) and self.alive

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self.threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not self.alive:
            self._stop_helpers()

    def shutdown(self) -> None:
        """Stop claiming, let running items finish, release claimed ones not yet started."""
        self.stop.set()
        self.join()


def dispatch(
    run: BatchRun, definition: FanOut, executor: str = "inline", workers: int | None = None
) -> InlineExecutor | None:
    """Start workers for ``run``: threads here, or drain jobs on RQ. Idempotent."""
    if executor not in EXECUTORS:
        raise FanoutError(f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    if run.status not in (RunStatus.RUNNING, RunStatus.COMPENSATING):
        return None
    if executor == "rq":
        enqueue_drains(run, definition, workers)
        return None
    if run.parent_item_id is not None:
        with _children_lock:
            handle = _children.get(run.pk)
            if handle is None or not handle.carrying:
                handle = _children[run.pk] = InlineExecutor(run, definition, workers).start()
    else:
        handle = InlineExecutor(run, definition, workers).start()
    _carry_children(run)
    return handle


# Inline executors of child runs this process started, so that a resume starts each once.
_children: dict[int, InlineExecutor] = {}
_children_lock = threading.Lock()


def _carry_children(run: BatchRun) -> None:
    """Inline: run the run's unfinished child runs here too (a resume, a retry-failed)."""
    for child in open_children([run.pk]):
        if child.status != RunStatus.RUNNING:
            continue
        with _children_lock:
            handle = _children.get(child.pk)
            if handle is None or not handle.carrying:
                definition = get_definition(child.definition)
                _children[child.pk] = InlineExecutor(child, definition).start()
        # Its own children too, whether or not its executor was already running: a reopened
        # grandchild needs one even when its parent run's threads carried on.
        _carry_children(child)


def prepare_run(
    definition: FanOut,
    params: Mapping[str, Any] | None = None,
    run_key: str | None = None,
    *,
    executor: str = "inline",
    max_parallel: int | None = None,
    max_spend: Mapping[str, float] | float | None = None,
) -> BatchRun:
    """Create or find the run and make sure its items are written."""
    if executor not in EXECUTORS:
        raise FanoutError(f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    if executor == "rq":
        get_queue(definition)  # a queue the settings do not name: refused before any run is made
    run, _ = create_run(
        definition, dict(params or {}), run_key, max_parallel, executor, max_spend=max_spend
    )
    return materialize(run, definition)


def start_run(
    definition: FanOut,
    params: Mapping[str, Any] | None,
    run_key: str | None,
    *,
    executor: str = "inline",
    workers: int | None = None,
    max_parallel: int | None = None,
    wait: bool = True,
    max_spend: Mapping[str, float] | float | None = None,
) -> BatchRun:
    run = prepare_run(
        definition,
        params,
        run_key,
        executor=executor,
        max_parallel=max_parallel,
        max_spend=max_spend,
    )
    handle = dispatch(run, definition, executor, workers)
    if handle is not None and wait:
        handle.join()
        run.refresh_from_db()
    return run


def start_child(parent_run_id: int, item: ClaimedItem, spawn: Spawn) -> BatchRun:
    """Create (or find) the item's child run, write its items and dispatch it."""
    parent = BatchRun.objects.get(pk=parent_run_id)
    definition = get_definition(spawn.definition)
    run_key = child_run_key(parent_run_id, item.key)
    # A child whose work list failed (it never started) gives way to a new one: the item runs
    # again (a retry), and a fixed definition starts clean.
    BatchRun.objects.filter(
        run_key=run_key, status=RunStatus.FAILED, started_at__isnull=True
    ).delete()
    child, _ = create_run(
        definition, spawn.params, run_key, executor=parent.executor, parent_item_id=item.pk
    )
    try:
        child = materialize(child, definition)
    except WritingInterrupted as exc:
        # The database went away mid-write, not the definition: the item waits for its child
        # all the same, whose writing a worker's supervisor finishes (and dispatches).
        logger.warning("run %s: child run kept for the next writer: %s", parent_run_id, exc)
        return child
    dispatch(child, definition, parent.executor)
    return child


def resume(
    run_id: int, executor: str | None = None, workers: int | None = None
) -> tuple[BatchRun, InlineExecutor | None]:
    """Pick a run up again after its workers or parent died: finish writing items, dispatch."""
    try:
        run = BatchRun.objects.get(pk=run_id)
    except BatchRun.DoesNotExist:
        raise FanoutError(f"there is no run {run_id}") from None
    definition = get_definition(run.definition)
    run = materialize(run, definition)
    return run, dispatch(run, definition, executor or run.executor, workers)


def rq_unavailable(definition: FanOut) -> str:
    """Why RQ cannot take ``definition``'s drain jobs from this process; "" when it can."""
    try:
        queue = get_queue(definition)
        # An operator's request must not hang on a Redis host that does not answer.
        queue.connection.connection_pool.connection_kwargs.setdefault("socket_connect_timeout", 2)
        queue.connection.ping()
    except FanoutError as exc:
        return str(exc)
    except RedisError as exc:
        return f"Redis for queue {definition.queue!r} is not reachable ({exc})"
    except Exception as exc:  # a malformed RQ_QUEUES entry
        return f"RQ queue {definition.queue!r} is misconfigured ({exc})"
    return ""


def move_to_rq(run: BatchRun, definition: FanOut) -> int:
    """Carry an inline run, and its open child runs, on RQ workers from now on.

    An inline run's workers are threads of the process that started it: once that process has
    ended, nothing runs items put back to pending (a retry from the admin) until someone
    resumes it in a shell. On RQ, drain jobs (enqueued after commit, carrying only the run's
    id) run them, and the workers' supervisors keep the run moving. Threads of a process still
    carrying the run are harmless beside them: every item is claimed in the database.
    Returns the number of runs moved.
    """
    runs = frontier = [run.pk]
    while frontier:
        frontier = [child.pk for child in open_children(frontier)]
        runs = runs + frontier
    moved = BatchRun.objects.filter(pk__in=runs, executor="inline").update(executor="rq")
    run.executor = "rq"
    dispatch(run, definition, "rq")
    return moved


# The layers below dispatch start and dispatch runs through fanout.launch (connected at ready).
LAUNCHER = launch.Launcher(start_run=start_run, start_child=start_child, dispatch=dispatch)
