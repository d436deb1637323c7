"""RQ queues and drain slots: enqueue a run's drain jobs, and free the slots of dead ones.

Each run has ``slots`` drain slots; a slot is taken with an atomic ``SET NX`` on a Redis key
that a live drain job keeps fresh (fanout.rq, where the jobs run), so two parents dispatching
at once enqueue one job per slot, and a slot whose job was lost (Redis flushed, worker killed)
frees itself when the key expires and is filled again by the next dispatch.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from redis.exceptions import RedisError
from rq.serializers import JSONSerializer

from .conf import conf
from .definition import FanOut
from .errors import FanoutError
from .models import BatchRun

logger = logging.getLogger("fanout")

MAX_SLOTS = 64
ALIVE_TTL = 10  # seconds a running drain job's slot key lives without renewal
QUEUED_TTL = 600  # seconds a slot stays taken by a job that waits in the queue


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
    except ImproperlyConfigured:
        raise FanoutError(
            f"RQ_QUEUES is not set, so fan-out {definition.name!r} has no queue "
            f'{definition.queue!r}: add RQ_QUEUES = {{"{definition.queue}": {{"URL": REDIS_URL}}}} '
            "to the settings, or use --executor inline"
        ) from None
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
            enqueued += enqueue_slot(queue, run.pk, slot)
    except RedisError as exc:
        raise FanoutError(
            f"Redis is not reachable for queue {definition.queue!r} ({exc}); "
            f"run {run.pk} is saved: "
            f"start Redis and resume it with run_fanout --resume {run.pk}, or use --executor inline"
        ) from None
    return enqueued


def enqueue_slot(queue: Any, run_id: int, slot: int) -> int:
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
            # RQ's log line puts the queue's name ("fanout:") before it.
            description=f"drain run {run_id} (slot {slot})",
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
