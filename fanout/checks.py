"""System checks: misconfiguration is reported with a hint, never by a crash at import."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import django_rq
from django.apps import apps
from django.conf import settings
from django.core.checks import Error, Tags, Warning, register
from django.db import DatabaseError, connection, connections
from django.utils.module_loading import import_string
from redis.exceptions import RedisError

from .conf import conf
from .definition import registered
from .errors import FanoutError
from .models import CapacityPool
from .pools import configured_limits, limits_from_config, settings_drift
from .rq import FanoutWorker


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    return [*_pool_config_errors(), *_lease_errors(), *_sample_rate_errors()]


def _pool_config_errors() -> list[Any]:
    pools = conf.POOLS
    if not isinstance(pools, dict):
        return [Error("FANOUT_POOLS must be a dict of pool name to limits", id="fanout.E001")]
    problems: list[Any] = []
    for name, config in pools.items():
        try:
            if not isinstance(config, dict):
                raise FanoutError(f"FANOUT_POOLS[{name!r}] must be a dict")
            limits_from_config(name, config)
        except FanoutError as exc:
            problems.append(
                Error(
                    str(exc), hint='e.g. {"max_concurrency": 10, "rate": "100/m"}', id="fanout.E002"
                )
            )
    return problems


def _lease_errors() -> list[Any]:
    try:
        lease = float(conf.LEASE_SECONDS)
    except (TypeError, ValueError):
        lease = 0.0
    if lease <= 0:
        return [Error("FANOUT_LEASE_SECONDS must be a number > 0", id="fanout.E003")]
    return []


def _sample_rate_errors() -> list[Any]:
    rate = conf.OTEL_ITEM_SAMPLE_RATE
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
        return [
            Error(
                f"FANOUT_OTEL_ITEM_SAMPLE_RATE must be a number from 0 to 1, got {rate!r}",
                hint="a share of items, not a percentage: 0.01 traces one item in a hundred",
                id="fanout.E006",
            )
        ]
    return []


@register("fanout")
def check_rq(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """The RQ executor needs its queue configured; an unreachable Redis is only a warning."""
    return _rq_queue_missing() or _django_rq_missing() or _redis_unreachable()


def _rq_queue_missing() -> list[Any]:
    queues = getattr(settings, "RQ_QUEUES", None)
    if isinstance(queues, dict) and conf.QUEUE in queues:
        return []
    # A warning, not an error: the inline executor works without RQ.
    what = "RQ_QUEUES is not set" if queues is None else f"RQ_QUEUES has no {conf.QUEUE!r} queue"
    return [
        Warning(
            f"{what}: run_fanout --executor rq and start(executor='rq') cannot dispatch",
            hint=f'add "{conf.QUEUE}": {{"URL": "redis://127.0.0.1:6379/0"}} to RQ_QUEUES',
            id="fanout.W001",
        )
    ]


def _django_rq_missing() -> list[Any]:
    if apps.is_installed("django_rq"):
        return []
    # Dispatching works without it, so runs would be made that nothing ever drains.
    return [
        Warning(
            "RQ_QUEUES is set but 'django_rq' is not in INSTALLED_APPS: there is no "
            "manage.py rqworker command to drain --executor rq runs",
            hint='add "django_rq" to INSTALLED_APPS',
            id="fanout.W008",
        )
    ]


def _redis_unreachable() -> list[Any]:
    try:
        redis = django_rq.get_connection(conf.QUEUE)
        redis.connection_pool.connection_kwargs.setdefault("socket_connect_timeout", 0.5)
        redis.ping()
    except RedisError as exc:
        return [
            Warning(
                f"Redis for queue {conf.QUEUE!r} is not reachable now ({exc})",
                hint="the inline executor works without it; --executor rq needs it",
                id="fanout.W002",
            )
        ]
    except Exception as exc:  # a malformed queue config must not crash every command
        return [Warning(f"RQ queue {conf.QUEUE!r} is misconfigured: {exc}", id="fanout.W003")]
    return []


@register(Tags.compatibility)
def check_sqlite(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """Concurrent workers on SQLite need serialised writers that readers do not block."""
    problems: list[Any] = []
    for alias, db in settings.DATABASES.items():
        if db.get("ENGINE") != "django.db.backends.sqlite3":
            continue
        options = db.get("OPTIONS") or {}
        missing = []
        if str(options.get("transaction_mode") or "").upper() != "IMMEDIATE":
            missing.append('"transaction_mode": "IMMEDIATE"')
        if float(options.get("timeout") or 5) < 20:
            missing.append('"timeout": 20')
        init = str(options.get("init_command") or "").lower().replace(" ", "")
        if "journal_mode=wal" not in init:
            missing.append('"init_command": "PRAGMA journal_mode=WAL;"')
        if missing:
            problems.append(
                Warning(
                    f"DATABASES[{alias!r}] is SQLite without the options that fanout's "
                    "concurrent workers need: writers may fail with 'database is locked' "
                    "and stall for seconds",
                    hint="add to its OPTIONS: " + ", ".join(missing),
                    id="fanout.W004",
                )
            )
    return problems


_WORKER_HINT = (
    'set RQ = {"WORKER_CLASS": "fanout.rq.FanoutWorker"}, or start every worker with '
    "--worker-class fanout.rq.FanoutWorker (or --serializer rq.serializers.JSONSerializer)"
)


@register("fanout")
def check_rq_worker(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """Drain jobs are JSON: a worker that reads jobs with pickle fails every one of them."""
    queues = getattr(settings, "RQ_QUEUES", None)
    if not isinstance(queues, dict) or conf.QUEUE not in queues:
        return []  # W001 already says RQ is not set up
    path = (getattr(settings, "RQ", None) or {}).get("WORKER_CLASS")
    try:
        worker_class = import_string(path) if isinstance(path, str) else path
    except ImportError as exc:
        return [
            Warning(
                f"RQ['WORKER_CLASS'] cannot be imported: {exc}", hint=_WORKER_HINT, id="fanout.W005"
            )
        ]
    if isinstance(worker_class, type) and issubclass(worker_class, FanoutWorker):
        return []
    return [
        Warning(
            f"`manage.py rqworker {conf.QUEUE}` starts {path or 'rq.Worker'}, which reads jobs "
            "with pickle: every fanout drain job (JSON) would fail with DeserializationError",
            hint=_WORKER_HINT,
            id="fanout.W005",
        )
    ]


@register(Tags.admin)
def check_admin_needs(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """The admin's item list renders django-filter's widgets from its templates."""
    if not apps.is_installed("django.contrib.admin") or apps.is_installed("django_filters"):
        return []
    return [
        Error(
            "fanout's admin needs django_filters in INSTALLED_APPS: without it the item list "
            "fails with TemplateDoesNotExist: django_filters/widgets/multiwidget.html",
            hint='add "django_filters" to INSTALLED_APPS',
            id="fanout.E004",
        )
    ]


_STRICTER = ("repeatable read", "serializable", "repeatable_read", "repeatable-read")


@register(Tags.database)
def check_isolation(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[Any]:
    """Claims decide limits with conditional UPDATEs that re-read a row after waiting for its
    lock: that needs READ COMMITTED (PostgreSQL's and Django's MySQL default)."""
    problems: list[Any] = []
    for alias in connections:
        level = connections[alias].settings_dict.get("OPTIONS", {}).get("isolation_level")
        if level is None or not any(s in _isolation_name(level) for s in _STRICTER):
            continue
        problems.append(
            Error(
                f"DATABASES[{alias!r}] sets isolation_level {level!r}: fanout's claims need "
                "READ COMMITTED (under a stricter level, concurrent claims fail with "
                "serialization errors instead of waiting their turn)",
                hint=f"remove OPTIONS['isolation_level'] from DATABASES[{alias!r}], or set "
                "it to read committed",
                id="fanout.E005",
            )
        )
    return problems


def _isolation_name(level: Any) -> str:
    """An isolation level's name in lower case, from text or psycopg's IsolationLevel."""
    try:
        from psycopg import IsolationLevel  # PostgreSQL's driver: absent on MariaDB-only hosts

        if isinstance(level, IsolationLevel) or str(level).isdigit():
            return IsolationLevel(int(level)).name.lower().replace("_", " ")
    except (ImportError, ValueError):
        pass
    return str(level).lower()


def pools_named_by(definition: Any) -> set[str]:
    """The pools a definition names by name (a Group's Steps too); per-item pools are not."""
    named = {definition.static_pool} if definition.static_pool else set()
    for member in getattr(definition, "members", {}).values():
        if isinstance(getattr(member, "pool", None), str):
            named.add(member.pool)
    return named


def _pool_rows() -> list[CapacityPool] | None:
    """Every CapacityPool row; [] before migrate made the table; None if unreadable now."""
    try:
        if CapacityPool._meta.db_table not in connection.introspection.table_names():
            return []  # checks run before migrate, too
        return list(CapacityPool.objects.all())
    except (DatabaseError, RuntimeError):  # no database now (or a test that forbids it)
        return None


# Set by a command that says a pool's drift itself, with what it means for what it does next
# (run_fanout's start line): the system check would say it a second time above.
DRIFT_SAID_BY_COMMAND: ContextVar[bool] = ContextVar("fanout_drift_said", default=False)


@register("fanout")
def check_pools(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """A pool that definitions name must exist somewhere; a row that differs from
    FANOUT_POOLS wins, and that must not pass silently."""
    rows = _pool_rows()
    if rows is None or not isinstance(conf.POOLS, dict):
        return []
    return [*_pools_named_nowhere(rows), *_pools_drifted(rows)]


def _pools_named_nowhere(rows: list[CapacityPool]) -> list[Any]:
    problems: list[Any] = []
    existing = {pool.name for pool in rows}
    for name, definition in sorted(registered().items()):
        for pool in sorted(pools_named_by(definition) - existing):
            try:
                if configured_limits(pool) is not None:
                    continue
            except FanoutError:
                continue  # fanout.E002 says what is wrong with its entry
            problems.append(
                Warning(
                    f"fan-out {name!r} names pool {pool!r}, which exists nowhere: neither in "
                    "FANOUT_POOLS nor as a pool row; its runs fail at start",
                    hint=f'add it to FANOUT_POOLS (e.g. "{pool}": {{"max_concurrency": 10}}) '
                    "or create it in the admin",
                    id="fanout.W006",
                )
            )
    return problems


def _pools_drifted(rows: list[CapacityPool]) -> list[Any]:
    if DRIFT_SAID_BY_COMMAND.get():
        return []
    return [
        Warning(
            drift,
            hint="run manage.py fanout_pools --sync to apply FANOUT_POOLS to the row, "
            "or change FANOUT_POOLS to match the row",
            id="fanout.W007",
        )
        for drift in map(settings_drift, sorted(rows, key=lambda p: p.name))
        if drift
    ]
