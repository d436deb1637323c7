"""System checks: misconfiguration is reported with a hint, never by a crash at import."""

from __future__ import annotations

from typing import Any

from django.core.checks import Error, Tags, Warning, register

from .conf import conf
from .errors import FanoutError


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    from .pools import limits_from_config

    problems: list[Any] = []
    pools = conf.POOLS
    if not isinstance(pools, dict):
        return [Error("FANOUT_POOLS must be a dict of pool name to limits", id="fanout.E001")]
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
    try:
        lease = float(conf.LEASE_SECONDS)
    except (TypeError, ValueError):
        lease = 0.0
    if lease <= 0:
        problems.append(Error("FANOUT_LEASE_SECONDS must be a number > 0", id="fanout.E003"))
    return problems


@register("fanout")
def check_rq(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """The RQ executor needs its queue configured; an unreachable Redis is only a warning."""
    from django.conf import settings

    queues = getattr(settings, "RQ_QUEUES", None)
    if queues is None:
        return []  # the inline executor needs no RQ
    if not isinstance(queues, dict) or conf.QUEUE not in queues:
        return [
            Warning(
                f"RQ_QUEUES has no {conf.QUEUE!r} queue: run_fanout --executor rq cannot dispatch",
                hint=f'add "{conf.QUEUE}": {{"URL": REDIS_URL}} to RQ_QUEUES',
                id="fanout.W001",
            )
        ]
    try:
        import django_rq
        from redis.exceptions import RedisError

        connection = django_rq.get_connection(conf.QUEUE)
        connection.connection_pool.connection_kwargs.setdefault("socket_connect_timeout", 0.5)
        connection.ping()
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
    from django.conf import settings

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
