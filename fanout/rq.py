"""The RQ executor: drain jobs that carry only a run id, in a bounded number of slots per run.

PostgreSQL stays the source of truth; RQ only carries wake-ups. A drain job's threads serve
every open run of its queue, the run that woke them first (fanout.worker.Roam): the item, not
the run, is the unit of scheduling, so a process never idles while a run of its queue has an
admissible item, and the job leaves when none has. Each run has ``slots`` drain slots
(fanout.queues enqueues the jobs and frees dead slots); a live job keeps its slot's key fresh.
A duplicated wake-up is harmless: every item is still claimed in the database, under
max_parallel and the pools' limits.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from django.db import close_old_connections, connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from rq import SimpleWorker, get_current_job
from rq.serializers import JSONSerializer

from .actions import release
from .conf import conf, host_name
from .definition import FanOut, get_definition, unknown_here
from .discover import import_errors
from .errors import DefinitionNotFound, FanoutError
from .lease import Keepers
from .models import BatchRun
from .queues import ALIVE_TTL, drain_threads, enqueue_slot, get_queue, slot_key
from .stall import clear_stall, note_stall
from .supervise import Supervisor
from .worker import SERVING, Roam, joiner, owner_name, serve_first

logger = logging.getLogger("fanout")

# A drain thread with nothing claimable and nothing due this soon returns, freeing its worker
# (a parent run whose items wait on child runs must not hold the workers the children need).
IDLE_EXIT_SECONDS = 2.0

# Set while a FanoutWorker runs in this process: it supervises, so idle drains may leave.
_supervising = threading.Event()
# Set when the RQ worker running us was asked to stop (see FanoutWorker.request_stop).
_stop_requested = threading.Event()
# The stop events of the drains running in this process: a stop request sets them at once, so
# that no drain claims another item while the main thread has yet to poll.
_running: set[threading.Event] = set()


def _request_stop() -> None:
    _stop_requested.set()
    for stop in list(_running):
        stop.set()


def _worker_stopping(job: Any, checked: list[float]) -> bool:
    """True once our RQ worker was asked to stop (a forked work horse reads it from Redis)."""
    if _stop_requested.is_set():
        return True
    now = time.monotonic()
    if job is None or not job.worker_name or now - checked[0] < 1.0:
        return False
    checked[0] = now
    try:
        return bool(
            job.connection.hexists(f"rq:worker:{job.worker_name}", "shutdown_requested_date")
        )
    except RedisError:
        return False


def drain_job(run_id: int, slot: int) -> str:
    """RQ job: drain one run until it is finished, a time budget is spent or the worker stops."""
    job = get_current_job()
    key = slot_key(run_id, slot)
    # Beat at once: until then the slot key carries QUEUED_TTL, so a worker killed before its
    # first beat would hold the slot for minutes (reap_slots also cuts such a key short).
    _heartbeat(job, key, force=True)
    close_old_connections()
    try:
        return _drain(job, key, run_id, slot)
    finally:
        connection.close()
        if job is not None:
            try:
                # Free the slot unless a newer job already holds it.
                if job.connection.get(key) in (job.id, job.id.encode()):
                    job.connection.delete(key)
            except RedisError:
                pass


def _drain(job: Any, key: str, run_id: int, slot: int) -> str:
    run = BatchRun.objects.filter(pk=run_id).first()
    if run is None or run.status not in SERVING:
        return f"run {run_id} is {run.status if run else 'gone'}: nothing to do"
    definition = _definition_here(run)
    if definition is None:
        return f"fan-out {run.definition!r} is unknown on host {host_name()}"
    clear_stall(run_id)
    crew = _crew(run, definition, slot)
    _stop_on_sigterm()
    alive_ttl = _first_beat(job, key, definition)
    if not _serve(job, key, alive_ttl, crew, run_id):
        return "stopped: items released"
    if "time budget spent" in crew.outcomes and not crew.stop.is_set():
        _come_back(job, key, definition, run_id, slot)
    return "; ".join(sorted(set(crew.outcomes))) or "crashed"


@dataclass
class _Crew:
    """A drain job's threads and what they share: lease keepers, a stop, their outcomes."""

    roams: list[Roam]
    keepers: Keepers
    stop: threading.Event
    threads: list[threading.Thread]
    outcomes: list[str]


def _crew(run: BatchRun, definition: FanOut, slot: int) -> _Crew:
    keepers = Keepers()
    stop = threading.Event()
    roams = _roams(run, definition, slot, keepers, stop)
    outcomes: list[str] = []
    threads = _threads(roams, outcomes, f"fanout-drain-{run.pk}-{slot}")
    return _Crew(roams, keepers, stop, threads, outcomes)


def _first_beat(job: Any, key: str, definition: FanOut) -> int:
    """Beat with the job's own time to live, and return it."""
    # A lost job's slot must free itself before its items' leases run out, so that idle
    # workers are sent to reclaim them.
    alive_ttl = max(1, min(ALIVE_TTL, int(definition.lease_seconds)))
    # The job's first beat (in drain_job) gave the key ALIVE_TTL, and holds off the loop's
    # beat below for a while: cut it to alive_ttl now, before any item is claimed, or a worker
    # that dies in its first moments holds the slot for ALIVE_TTL, past its items' leases.
    _heartbeat(job, key, alive_ttl, force=True)
    return alive_ttl


def _serve(job: Any, key: str, alive_ttl: int, crew: _Crew, run_id: int) -> bool:
    """Run the crew's threads, beating, until they return (True), or until the worker stops
    and the grace period runs out (False: finished items recorded, the rest released)."""
    _running.add(crew.stop)
    try:
        for thread in crew.threads:
            thread.start()
        if not _watch(job, key, alive_ttl, crew.threads, crew.stop):
            recorded, released = _give_back(crew.roams, crew.keepers)
            logger.warning(
                "run %s: worker stopping; recorded %d finished items, released %d unfinished",
                run_id,
                recorded,
                released,
            )
            return False
        _settle_joins(job, key, alive_ttl)
    except BaseException:
        # The worker is being shut down hard: give back what we hold before leaving. Items
        # whose handlers finished are recorded (by their threads within moments, or here);
        # the rest are released (no attempt used), and a late record of them is refused by
        # the fence.
        crew.stop.set()
        for thread in crew.threads:
            thread.join(1.0)
        _give_back(crew.roams, crew.keepers)
        raise
    finally:
        _running.discard(crew.stop)
        crew.keepers.stop()
    return True


def _settle_joins(job: Any, key: str, alive_ttl: int) -> None:
    """Wait, beating, for the joins the threads left to this process's joiner: a forked work
    horse ends with its job. A stopping worker waits no longer than its grace period; a join
    it leaves is taken up by a supervisor, as the join of a worker that died."""
    checked = [0.0]
    stopping_since: float | None = None
    while not joiner.settle(0.1):
        _heartbeat(job, key, alive_ttl)
        if stopping_since is None and _worker_stopping(job, checked):
            stopping_since = time.monotonic()
        if stopping_since is not None and (
            time.monotonic() - stopping_since > conf.STOP_GRACE_SECONDS
        ):
            return


def _definition_here(run: BatchRun) -> FanOut | None:
    """The run's definition in this process, or None after saying on the run why not."""
    try:
        return get_definition(run.definition)  # only registered definitions ever run
    except DefinitionNotFound:
        reason = unknown_here(run.definition, host_name())
        for module, error in import_errors().items():
            reason += f"; {module} failed to import there: {error}"
        note_stall(run.pk, reason)
        return None


def _roams(
    run: BatchRun, definition: FanOut, slot: int, keepers: Keepers, stop: threading.Event
) -> list[Roam]:
    """The job's threads: each serves every open run of the run's queue, this one first.

    The run's own share (drain_threads) stays while it is open where nobody supervises (RQ's
    own workers: no supervisor would bring a drain back); the other threads, and every thread
    of a FanoutWorker, leave after IDLE_EXIT_SECONDS with nothing to do anywhere. A batched
    run's job keeps its one thread (see drain_threads).
    """
    own = drain_threads(run, definition)
    count = own if definition.batch_size > 1 else max(own, int(conf.WORKER_THREADS))
    deadline = time.monotonic() + conf.DRAIN_SECONDS
    supervised = _supervising.is_set()
    serve_first(run.pk)  # the run whose job woke us
    return [
        Roam(
            definition.queue,
            keepers,
            owner=owner_name(f"rq-{slot}-{i + 1}"),
            stop=stop,
            deadline=deadline,
            home=None if supervised or i >= own else run.pk,
            idle_exit=IDLE_EXIT_SECONDS,
        )
        for i in range(count)
    ]


def _threads(roams: list[Roam], outcomes: list[str], name: str) -> list[threading.Thread]:
    def target(roam: Roam) -> None:
        try:
            outcomes.append(roam())
        except Exception:
            logger.exception("queue %s: drain failed", roam.queue)
            outcomes.append("crashed")

    return [
        threading.Thread(target=target, args=(r,), name=f"{name}-{i + 1}", daemon=True)
        for i, r in enumerate(roams)
    ]


def _stop_on_sigterm() -> None:
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):
        # A forked work horse: a SIGTERM meant for the worker's group stops us gracefully.
        signal.signal(signal.SIGTERM, lambda signum, frame: _request_stop())


def _watch(
    job: Any, key: str, alive_ttl: int, threads: list[threading.Thread], stop: threading.Event
) -> bool:
    """Beat while the threads run; once the worker stops, stop them and wait out the grace
    period. True when every thread returned, False when the grace period ran out first."""
    checked = [0.0]
    stopping_since: float | None = None
    while alive := [t for t in threads if t.is_alive()]:
        alive[0].join(0.1)
        _heartbeat(job, key, alive_ttl)
        if stopping_since is None and _worker_stopping(job, checked):
            stop.set()  # claim nothing more; items not started are released
            stopping_since = time.monotonic()
        if (
            stopping_since is not None
            and time.monotonic() - stopping_since > conf.STOP_GRACE_SECONDS
        ):
            return False
    return True


def _give_back(roams: list[Roam], keepers: Keepers) -> tuple[int, int]:
    """Record the items whose handlers returned, then release what never finished.

    A finished item waiting to be recorded with its batch must not be released: it would
    run again on another worker.
    """
    recorded = 0
    for roam in roams:
        drain = roam.current
        if drain is None:
            continue
        try:
            recorded += drain.record_finished()
        except Exception:  # the database is away: their leases expire and they run again
            logger.exception("run %s: could not record finished items", drain.run_id)
    return recorded, release(keepers.held())


def _come_back(job: Any, key: str, definition: FanOut, run_id: int, slot: int) -> None:
    """Yield the RQ worker to other queued jobs, and come back behind them."""
    try:
        job.connection.delete(key)
        enqueue_slot(get_queue(definition), run_id, slot)
    except (RedisError, FanoutError) as exc:
        logger.warning("run %s: could not re-enqueue slot %s: %s", run_id, slot, exc)


_last_beat: dict[str, float] = {}


def _heartbeat(job: Any, key: str, ttl: int = ALIVE_TTL, force: bool = False) -> None:
    """Keep this job's slot key alive; a crashed job's slot frees itself within ``ttl``."""
    now = time.monotonic()
    if job is None or (not force and now - _last_beat.get(key, 0.0) < ttl / 4):
        return
    _last_beat[key] = now
    try:
        conn = job.connection
        if not conn.set(key, job.id, nx=True, ex=ttl):
            if conn.get(key) in (job.id, job.id.encode()):
                conn.expire(key, ttl)
    except RedisError:
        pass  # Redis is down: the rows still are the queue


class FanoutWorker(SimpleWorker):
    """RQ worker for fan-out drain jobs: no fork per job, JSON jobs, graceful SIGTERM.

    A drain job runs many items, so forking per job buys no isolation worth its cost, and in
    the worker's own process a SIGTERM reaches the drain at once: it stops claiming, lets its
    items finish within FANOUT_STOP_GRACE_SECONDS or releases them, and the worker exits.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["serializer"] = JSONSerializer
        super().__init__(*args, **kwargs)

    def work(self, *args: Any, **kwargs: Any) -> bool:
        # Every worker also supervises: it takes up runs that lost their drain jobs or their
        # joiner, so no run depends on a waiting parent (see fanout.supervise).
        supervisor = Supervisor(f"fanout-supervisor-{self.name}").start()
        _supervising.set()
        try:
            return super().work(*args, **kwargs)
        finally:
            _supervising.clear()
            supervisor.stop()

    def request_stop(self, signum: Any, frame: Any) -> None:
        _request_stop()
        super().request_stop(signum, frame)

    def execute_job(self, job: Any, queue: Any) -> Any:
        close_old_connections()
        try:
            return super().execute_job(job, queue)
        except RedisConnectionError as exc:
            # The drain ran; only RQ's record of it went down with Redis. The rows are the
            # queue: wait for Redis and carry on, as RQ itself does while dequeuing.
            logger.warning("Redis unreachable after job %s (%s); waiting for it", job.id, exc)
            self._wait_for_redis()
            return None
        finally:
            close_old_connections()

    def _wait_for_redis(self) -> None:
        pause = 0.5
        while not self._stop_requested:
            try:
                self.connection.ping()
            except RedisConnectionError:
                time.sleep(pause)
                pause = min(pause * 2, 10.0)
                continue
            if not self.connection.exists(self.key):
                self.register_birth()  # Redis came back empty: be listed again
            return
