"""The RQ executor: drain jobs that carry only a run id, in a bounded number of slots per run.

PostgreSQL stays the source of truth; RQ only carries wake-ups. Each run has ``slots`` drain
slots; a slot is taken with an atomic ``SET NX`` on a Redis key that a live drain job keeps
fresh, so two parents dispatching at once enqueue one job per slot, and a slot whose job was
lost (Redis flushed, worker killed) frees itself when the key expires and is filled again by
the next dispatch. A duplicated wake-up is harmless: every item is still claimed in the
database, under max_parallel and the pools' limits.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from typing import Any

from django.db import close_old_connections, connection, transaction
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from rq import SimpleWorker, get_current_job
from rq.serializers import JSONSerializer

from .conf import conf, host_name
from .definition import FanOut, get_definition
from .errors import DefinitionNotFound, FanoutError
from .lease import LeaseKeeper
from .models import BatchRun, RunStatus
from .recover import release
from .supervise import Supervisor, clear_stall, note_stall
from .worker import Drain, owner_name

logger = logging.getLogger("fanout")

MAX_SLOTS = 64
ALIVE_TTL = 10  # seconds a running drain job's slot key lives without renewal
# A drain thread with nothing claimable and nothing due this soon returns, freeing its worker
# (a parent run whose items wait on child runs must not hold the workers the children need).
IDLE_EXIT_SECONDS = 2.0
QUEUED_TTL = 600  # seconds a slot stays taken by a job that waits in the queue

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


def slot_key(run_id: int, slot: int) -> str:
    return f"fanout:drain:{run_id}:{slot}"


def drain_threads(run: BatchRun, definition: FanOut) -> int:
    """Items one drain job runs at once: FANOUT_WORKER_THREADS, no more than the run can use.

    A batched definition (batch_size > 1) is one for cheap handlers, whose batches a thread
    runs one after another: more threads would only take turns on the interpreter's lock, so
    its drain jobs run one thread each and the run gets more drain jobs instead.
    """
    if definition.batch_size > 1:
        return 1
    return max(1, min(int(conf.WORKER_THREADS), run.max_parallel))


def default_slots(run: BatchRun, definition: FanOut) -> int:
    """Drain jobs for a run: enough threads for max_parallel, and two where the run can use
    more than one thread, so that two worker processes share a run from its start."""
    per_thread = max(1, definition.batch_size)
    threads = drain_threads(run, definition)
    needed = -(-run.max_parallel // (per_thread * threads))
    usable = -(-run.max_parallel // per_thread)
    return max(1, min(MAX_SLOTS, 16, max(needed, min(2, usable))))


def get_queue(definition: FanOut) -> Any:
    import django_rq

    try:
        return django_rq.get_queue(definition.queue, serializer=JSONSerializer)
    except KeyError:
        raise FanoutError(
            f"RQ_QUEUES has no queue {definition.queue!r} for fan-out {definition.name!r}: "
            f'add "{definition.queue}": {{"URL": REDIS_URL}} to RQ_QUEUES'
        ) from None


def enqueue_drains(run: BatchRun, definition: FanOut, slots: int | None = None) -> int:
    """Fill the run's empty drain slots with jobs, after the current transaction commits."""
    if slots is not None and not 1 <= slots <= MAX_SLOTS:
        raise FanoutError(f"workers must be between 1 and {MAX_SLOTS}, got {slots}")
    queue = get_queue(definition)
    count = slots or default_slots(run, definition)
    enqueued = 0
    try:
        for slot in range(count):
            enqueued += _enqueue_slot(queue, run.pk, slot)
    except RedisError as exc:
        raise FanoutError(
            f"Redis is not reachable for queue {definition.queue!r} ({exc}); "
            f"run {run.pk} is saved: "
            f"start Redis and resume it with run_fanout --resume {run.pk}, or use --executor inline"
        ) from None
    return enqueued


def _enqueue_slot(queue: Any, run_id: int, slot: int) -> int:
    taken: list[str] = []

    def enqueue() -> None:
        job_id = f"fanout-drain-{run_id}-{slot}-{uuid.uuid4().hex[:12]}"
        if not queue.connection.set(slot_key(run_id, slot), job_id, nx=True, ex=QUEUED_TTL):
            return  # a job holds this slot, queued or running
        queue.enqueue_call(
            "fanout.rq.drain_job",
            args=(run_id, slot),
            job_id=job_id,
            # No job timeout: an item may run for hours, and a timeout raised inside the job
            # would cut it off. A drain claims nothing after FANOUT_DRAIN_SECONDS, and its
            # items are bounded by the definition's timeout= (past it they are reclaimed).
            timeout=-1,
            result_ttl=300,
            failure_ttl=86400,
            description=f"fanout: drain run {run_id} (slot {slot})",
        )
        taken.append(job_id)

    # Take the slot and enqueue only once the rows the job will look for are committed: a
    # dispatch that is rolled back must not hold the slot for QUEUED_TTL with no job behind it.
    transaction.on_commit(enqueue)
    return len(taken)  # inside a transaction, 0 until it commits


_DEAD_STATUSES = {b"failed", b"stopped", b"canceled", b"finished"}
# What RQ's own maintenance writes when it fails a job that a dead or stopping worker left
# behind (never started, or started and abandoned): nothing is misconfigured, the slot is
# simply filled again.
RQ_CLEANUP = ("Job was stuck in intermediate queue", "AbandonedJobError")


def cleaned_up_by_rq(detail: str) -> bool:
    return any(marker in detail for marker in RQ_CLEANUP)


def reap_slots(run: BatchRun, definition: FanOut) -> list[str]:
    """Free the run's slots whose job failed, ended or vanished; say why each failed job did.

    A slot normally frees itself when its job ends, or within ALIVE_TTL when its worker dies;
    a job that never ran our code (a worker that cannot deserialize it, say) would hold its
    slot for QUEUED_TTL and leave nobody the wiser.
    """
    conn = get_queue(definition).connection
    reasons = []
    for key in conn.scan_iter(match=f"fanout:drain:{run.pk}:*", count=1000):
        job_id = conn.get(key)
        if job_id is None:
            continue
        job_key = b"rq:job:" + (job_id if isinstance(job_id, bytes) else job_id.encode())
        status = conn.hget(job_key, "status")
        if status == b"started" and conn.ttl(key) > ALIVE_TTL:
            # Started but never beat (its worker may have died between dequeue and the first
            # beat): a live job's beat keeps the key from now on; a dead one's frees it soon.
            conn.expire(key, ALIVE_TTL)
        if status is not None and status not in _DEAD_STATUSES:
            continue  # queued or running
        if conn.get(key) == job_id:
            conn.delete(key)
        if status in (b"failed", b"stopped"):
            job_id = job_id.decode() if isinstance(job_id, bytes) else job_id
            worker, detail = _job_failure(conn, job_id)
            if cleaned_up_by_rq(detail):
                logger.info("run %s: RQ failed drain job %s (%s)", run.pk, job_id, detail)
                continue
            reasons.append(
                f"no worker could run {definition.name!r}: drain job {job_id} failed on worker "
                f"{worker}: {detail} (workers must use fanout.rq.FanoutWorker or RQ's JSON "
                "serializer)"
            )
    return reasons


def _job_failure(conn: Any, job_id: str) -> tuple[str, str]:
    """The worker that failed the job, and the last line of its error."""
    from rq.job import Job

    worker = conn.hget(f"rq:job:{job_id}", "worker_name") or b"?"
    worker = worker.decode() if isinstance(worker, bytes) else worker
    detail = "no error recorded"
    try:
        result = Job.fetch(job_id, connection=conn, serializer=JSONSerializer).latest_result()
        if result is not None and result.exc_string:
            detail = result.exc_string.strip().splitlines()[-1]
    except Exception as exc:  # the job's record is unreadable: say that instead
        detail = f"its record could not be read ({type(exc).__name__})"
    return worker, detail


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
    if run is None or run.status not in (RunStatus.RUNNING, RunStatus.COMPENSATING):
        return f"run {run_id} is {run.status if run else 'gone'}: nothing to do"
    try:
        definition = get_definition(run.definition)  # only registered definitions ever run
    except DefinitionNotFound as exc:
        from .apps import import_errors

        reason = f"no worker could run {run.definition!r}: unknown fan-out on host "
        reason += f"{host_name()} (workers started before it was deployed?)"
        for module, error in import_errors().items():
            reason += f"; {module} failed to import there: {error}"
        note_stall(run_id, reason)
        return str(exc)
    clear_stall(run_id)
    keeper = LeaseKeeper(definition.lease_seconds)
    stop = threading.Event()
    deadline = time.monotonic() + conf.DRAIN_SECONDS
    drains = [
        Drain(
            run.pk,
            definition,
            keeper,
            run.params,
            owner=owner_name(f"rq-{slot}-{i + 1}"),
            stop=stop,
            deadline=deadline,
            # Only where this process supervises (FanoutWorker) may an idle drain leave: the
            # supervisor brings one back when work appears. RQ's own workers keep theirs.
            idle_exit=IDLE_EXIT_SECONDS if _supervising.is_set() else None,
        )
        for i in range(drain_threads(run, definition))
    ]
    outcomes: list[str] = []

    def target(drain: Drain) -> None:
        try:
            outcomes.append(drain())
        except Exception:
            logger.exception("run %s: drain failed", run_id)
            outcomes.append("crashed")

    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):
        # A forked work horse: a SIGTERM meant for the worker's group stops us gracefully.
        signal.signal(signal.SIGTERM, lambda signum, frame: _request_stop())
    threads = [
        threading.Thread(
            target=target, args=(d,), name=f"fanout-drain-{run_id}-{slot}-{i + 1}", daemon=True
        )
        for i, d in enumerate(drains)
    ]
    checked = [0.0]
    # A lost job's slot must free itself before its items' leases run out, so that idle
    # workers are sent to reclaim them.
    alive_ttl = max(1, min(ALIVE_TTL, int(definition.lease_seconds)))
    # The job's first beat (in drain_job) gave the key ALIVE_TTL, and holds off the loop's
    # beat below for a while: cut it to alive_ttl now, before any item is claimed, or a worker
    # that dies in its first moments holds the slot for ALIVE_TTL, past its items' leases.
    _heartbeat(job, key, alive_ttl, force=True)
    stopping_since: float | None = None
    _running.add(stop)
    keeper.start()
    try:
        for thread in threads:
            thread.start()
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
                released = release(keeper.held())
                logger.warning(
                    "run %s: worker stopping; released %d unfinished items", run_id, released
                )
                return "stopped: items released"
    except BaseException:
        # The worker is being shut down hard: give back what we hold before leaving. Items
        # whose handlers finished are recorded by their threads within moments; the rest are
        # released (no attempt used), and a late record of them is refused by the fence.
        stop.set()
        for thread in threads:
            thread.join(1.0)
        release(keeper.held())
        raise
    finally:
        _running.discard(stop)
        keeper.stop()
    result = "; ".join(sorted(set(outcomes))) or "crashed"
    if "time budget spent" in outcomes and not stop.is_set():
        # Yield the RQ worker to other queued runs, and come back behind them.
        try:
            job.connection.delete(key)
            _enqueue_slot(get_queue(definition), run_id, slot)
        except (RedisError, FanoutError) as exc:
            logger.warning("run %s: could not re-enqueue slot %s: %s", run_id, slot, exc)
    return result


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
