"""fanout's settings: every ``FANOUT_<NAME>`` read lazily so ``override_settings`` works."""

from __future__ import annotations

from typing import Any

from django.conf import settings as django_settings

DEFAULTS: dict[str, Any] = {
    # Seconds a claim stays valid without renewal; renewed every third of it.
    "LEASE_SECONDS": 30.0,
    # How often a reclaimed-after-crash item may be claimed again before it is failed.
    "CRASH_BUDGET": 3,
    # Items one worker claims in one transaction (1 = commit every item).
    "BATCH_SIZE": 1,
    # Base of the exponential retry backoff, seconds, and its cap.
    "RETRY_BACKOFF": 1.0,
    "RETRY_BACKOFF_MAX": 300.0,
    # Items read from the work list and inserted per transaction.
    "MATERIALIZE_CHUNK": 2000,
    # Pools created on migrate or first use: {"name": {"max_concurrency", "rate", "burst"}}.
    "POOLS": {},
    # Default django-rq queue of drain jobs and the seconds one drain job runs before yielding.
    "QUEUE": "fanout",
    "DRAIN_SECONDS": 60.0,
    # Hand-overs of a worker process's threads that finish items of one run while one is in
    # flight go together, one statement and one commit (PostgreSQL; elsewhere one by one).
    "GROUP_COMMIT": True,
    # Grouped hand-over statements of one run that one worker process keeps in flight at once.
    "GROUP_COMMIT_LANES": 2,
    # Items one RQ drain job (one worker process) runs at once, each on its own thread.
    "WORKER_THREADS": 8,
    # Seconds a stopping worker lets its items finish before releasing them.
    "STOP_GRACE_SECONDS": 10.0,
    # How often each worker process looks for runs to take up (re-dispatch, joins), seconds.
    "SUPERVISE_SECONDS": 5.0,
    # A join that raises is retried with backoff (base seconds) up to this many runs in all.
    "JOIN_ATTEMPTS": 3,
    "JOIN_RETRY_BACKOFF": 2.0,
    # The join's lease: a joiner that dies is replaced this long after its last renewal.
    "JOIN_LEASE_SECONDS": 60.0,
    # This machine's name in owners and host limits (default: socket.gethostname()).
    "HOST_NAME": None,
    # Longest pause of an idle worker between claim attempts.
    "IDLE_MAX_SECONDS": 0.25,
    # Share of items whose attempts get an OpenTelemetry span (0..1, chosen by key); attempts
    # whose handler raised always get one. Needs the otel extra and a configured SDK.
    "OTEL_ITEM_SAMPLE_RATE": 0.01,
    # A bearer token that may read fanout.prometheus.metrics_view besides staff users.
    "METRICS_TOKEN": None,
    # Finished runs the workers' supervisors delete, by status: {"succeeded": "30d"}; off if empty.
    "RETENTION": {},
    # Least seconds between two samples of a running run's waits (the run page's chart).
    "SAMPLE_SECONDS": 10.0,
}


class Settings:
    """Typed, lazy view of the FANOUT_* settings."""

    def __getattr__(self, name: str) -> Any:
        if name not in DEFAULTS:
            raise AttributeError(name)
        return getattr(django_settings, f"FANOUT_{name}", DEFAULTS[name])

    LEASE_SECONDS: float
    CRASH_BUDGET: int
    BATCH_SIZE: int
    RETRY_BACKOFF: float
    RETRY_BACKOFF_MAX: float
    MATERIALIZE_CHUNK: int
    POOLS: dict[str, dict[str, Any]]
    QUEUE: str
    DRAIN_SECONDS: float
    WORKER_THREADS: int
    GROUP_COMMIT: bool
    GROUP_COMMIT_LANES: int
    STOP_GRACE_SECONDS: float
    IDLE_MAX_SECONDS: float
    SUPERVISE_SECONDS: float
    HOST_NAME: str | None
    JOIN_ATTEMPTS: int
    JOIN_RETRY_BACKOFF: float
    JOIN_LEASE_SECONDS: float
    OTEL_ITEM_SAMPLE_RATE: float
    METRICS_TOKEN: str | None
    RETENTION: dict[str, str]
    SAMPLE_SECONDS: float


conf = Settings()


def host_name() -> str:
    """This host's name, as owners and per-host limits see it."""
    import socket

    return str(conf.HOST_NAME or socket.gethostname())
