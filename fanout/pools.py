"""Capacity pools: their configuration, creation on demand, and the admission arithmetic."""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Q

from .clock import CALENDAR_PERIODS, db_now_plus
from .conf import conf
from .cost import Units, as_units
from .errors import FanoutError
from .models import CapacityPool
from .spend import open_pool_budget

_PERIODS = {
    "s": 1.0,
    "sec": 1.0,
    "second": 1.0,
    "m": 60.0,
    "min": 60.0,
    "minute": 60.0,
    "h": 3600.0,
    "hour": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
}
_RATE = re.compile(
    r"^\s*(\d+)\s*([a-z_][a-z0-9_.-]*)?\s*/\s*(\d*\.?\d*)\s*([a-z]+)\s*$", re.IGNORECASE
)


def parse_rate(text: str) -> tuple[int, float]:
    """Parse "100/m", "20/s", "5/10s" into (count, period seconds)."""
    count, period, unit = parse_unit_rate(text)
    if unit:
        raise FanoutError(f"rate {text!r} counts calls here: give it without a unit ('100/m')")
    return count, period


def parse_unit_rate(text: str) -> tuple[int, float, str]:
    """Parse "100/m" (calls) or "90000 tokens/m" (a unit of the items' estimates) into
    (count, period seconds, unit or "")."""
    match = _RATE.match(str(text))
    if not match or match.group(4).lower() not in _PERIODS:
        raise FanoutError(
            f"rate {text!r} is not of the form N/s, N/m, N/h or N/d (e.g. '100/m'), "
            "or N unit/period (e.g. '90000 tokens/m')"
        )
    count = int(match.group(1))
    multiple = float(match.group(3)) if match.group(3) else 1.0
    if count < 1 or multiple <= 0:
        raise FanoutError(f"rate {text!r} must admit at least 1 item per period")
    return count, multiple * _PERIODS[match.group(4).lower()], match.group(2) or ""


_PERIOD = re.compile(r"^\s*(\d*\.?\d*)\s*([a-z]+)\s*$")


def parse_period(text: Any) -> float:
    """Parse "30d", "1h", "90s" (or a number of seconds) into seconds."""
    if isinstance(text, int | float) and not isinstance(text, bool) and text > 0:
        return float(text)
    match = _PERIOD.match(str(text).lower())
    if not match or match.group(2) not in _PERIODS:
        raise FanoutError(f"period {text!r} is not of the form N s, m, h or d (e.g. '30d')")
    multiple = float(match.group(1)) if match.group(1) else 1.0
    if multiple <= 0:
        raise FanoutError(f"period {text!r} must be longer than zero")
    return multiple * _PERIODS[match.group(2)]


def parse_budget(name: str, config: Any) -> tuple[Units, float | str | None]:
    """A pool's ``budget={"usd": 50, "period": "30d"}`` as (units, period): seconds for a
    rolling period, the name of a calendar one ("day", "week", "month", "year")."""
    if not isinstance(config, Mapping):
        raise FanoutError(
            f"FANOUT_POOLS[{name!r}]: budget must be a dict such as {{'usd': 50, 'period': '30d'}}"
        )
    config = dict(config)
    period = config.pop("period", None)
    seconds: float | str | None = None
    if isinstance(period, str) and period.strip().lower() in CALENDAR_PERIODS:
        seconds = period.strip().lower()
    elif period is not None:
        try:
            seconds = parse_period(period)
        except FanoutError as exc:
            raise FanoutError(
                f"FANOUT_POOLS[{name!r}]: budget {exc}, or a calendar period: "
                f"{', '.join(CALENDAR_PERIODS[:-1])} or {CALENDAR_PERIODS[-1]}"
            ) from None
    units = as_units(config, f"FANOUT_POOLS[{name!r}]: budget")
    if not units:
        raise FanoutError(f"FANOUT_POOLS[{name!r}]: budget names no unit")
    return units, seconds


def limits_from_config(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """Turn one FANOUT_POOLS entry into CapacityPool field values, or raise a clear error."""
    unknown = sorted(set(config) - {"max_concurrency", "rate", "burst", "paused", "budget"})
    if unknown:
        raise FanoutError(f"FANOUT_POOLS[{name!r}] has unknown keys: {', '.join(unknown)}")
    limits: dict[str, Any] = {
        "rate_count": None,
        "rate_period": 1.0,
        "rate_unit": "",
        "burst": None,
    }
    concurrency = config.get("max_concurrency", 10)
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 0:
        raise FanoutError(f"FANOUT_POOLS[{name!r}]: max_concurrency must be an integer >= 0")
    limits["max_concurrency"] = concurrency
    if config.get("rate") is not None:
        try:
            rate = parse_unit_rate(config["rate"])
            limits["rate_count"], limits["rate_period"], limits["rate_unit"] = rate
        except FanoutError as exc:
            raise FanoutError(f"FANOUT_POOLS[{name!r}]: {exc}") from None
    burst = config.get("burst")
    if burst is not None:
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise FanoutError(f"FANOUT_POOLS[{name!r}]: burst must be an integer >= 1")
        if limits["rate_count"] is None:
            raise FanoutError(f"FANOUT_POOLS[{name!r}]: burst needs a rate")
        limits["burst"] = burst
    limits["paused"] = bool(config.get("paused", False))
    if config.get("budget") is not None:
        parse_budget(name, config["budget"])  # refused here, with the pool's other limits
    return limits


def configured_budget(name: str) -> tuple[dict[str, float], float | None] | None:
    """The budget FANOUT_POOLS gives ``name`` (its entry or first matching template), if any."""
    pools = conf.POOLS
    entry = pools.get(name)
    if entry is None:
        for pattern, config in pools.items():
            if any(ch in pattern for ch in "*?[") and fnmatch.fnmatchcase(name, pattern):
                entry = config
                break
    if not entry or entry.get("budget") is None:
        return None
    return parse_budget(name, entry["budget"])


def _open_budgets(names: Iterable[str]) -> None:
    for name in names:
        budget = configured_budget(name)
        if budget is not None:
            open_pool_budget(name, *budget)


def configured_limits(name: str) -> dict[str, Any] | None:
    """Limits for ``name`` from FANOUT_POOLS: its own entry, else the first matching template."""
    pools = conf.POOLS
    if name in pools:
        return limits_from_config(name, pools[name])
    for pattern, config in pools.items():
        if any(ch in pattern for ch in "*?[") and fnmatch.fnmatchcase(name, pattern):
            return limits_from_config(pattern, config)
    return None


def ensure_pools(names: Iterable[str]) -> None:
    """Create the named pools that are missing, from FANOUT_POOLS; raise for unknown ones."""
    wanted = {n for n in names if n}
    if not wanted:
        return
    existing = set(CapacityPool.objects.filter(name__in=wanted).values_list("name", flat=True))
    missing = wanted - existing
    rows = []
    for name in sorted(missing):
        limits = configured_limits(name)
        if limits is None:
            raise FanoutError(
                f"pool {name!r} does not exist: add it to FANOUT_POOLS (or a template such as "
                f"'{name.split('-')[0]}-*') or create it in the admin"
            )
        rows.append(CapacityPool(name=name, **limits))
    if rows:
        try:
            with transaction.atomic():
                CapacityPool.objects.bulk_create(rows, ignore_conflicts=True)
        except IntegrityError:  # pragma: no cover - ignore_conflicts covers races
            pass
        _open_budgets(r.name for r in rows)


def sync_pools(overwrite: bool = False) -> tuple[list[str], list[str]]:
    """Create pools named in FANOUT_POOLS; with ``overwrite`` also reset existing limits."""
    created, updated = [], []
    for name, config in conf.POOLS.items():
        if any(ch in name for ch in "*?["):
            continue
        limits = limits_from_config(name, config)
        pool, was_created = CapacityPool.objects.get_or_create(name=name, defaults=limits)
        _open_budgets([name])
        if was_created:
            created.append(name)
        elif overwrite:
            changed = [f for f, v in limits.items() if getattr(pool, f) != v]
            if changed:
                for f in changed:
                    setattr(pool, f, limits[f])
                pool.save(update_fields=[*changed, "updated_at"])
                updated.append(name)
    return created, updated


@dataclass
class Headroom:
    """How many items a pool admits now, and if none, why and until when."""

    count: int
    reason: str = ""
    until: datetime | None = None
    full: bool = False  # refused because every slot is taken (not paused, rate, backoff)


def refill(pool: CapacityPool, now: datetime) -> None:
    """Bring the token bucket up to ``now``; its clock never moves backwards."""
    capacity = pool.capacity
    if capacity is None or pool.rate_count is None:
        return
    if pool.tokens is None or pool.tokens_at is None:
        pool.tokens, pool.tokens_at = float(capacity), now
        return
    elapsed = max(0.0, (now - pool.tokens_at).total_seconds())
    pool.tokens = min(float(capacity), pool.tokens + elapsed * pool.rate_count / pool.rate_period)
    pool.tokens_at = max(pool.tokens_at, now)


@dataclass(frozen=True)
class PoolState:
    """A pool's admission inputs as plain values: its row (the bucket brought up to now by
    refill) and the slots each run holds in it."""

    max_concurrency: int
    in_flight: int
    paused: bool = False
    backoff_until: datetime | None = None
    rate_count: int | None = None
    rate_period: float = 1.0
    rate_unit: str = ""
    tokens: float | None = None
    waiters: Mapping[str, float] = field(default_factory=dict)  # run id: until (epoch s)
    holders: Mapping[int, int] = field(default_factory=dict)  # run id: slots it holds

    @classmethod
    def of(cls, pool: CapacityPool, holders: Mapping[int, int] | None = None) -> PoolState:
        return cls(
            max_concurrency=pool.max_concurrency,
            in_flight=pool.in_flight,
            paused=pool.paused,
            backoff_until=pool.backoff_until,
            rate_count=pool.rate_count,
            rate_period=pool.rate_period,
            rate_unit=pool.rate_unit,
            tokens=pool.tokens,
            waiters=dict(pool.waiters or {}),
            holders=dict(holders or {}),
        )


@dataclass(frozen=True)
class RunState:
    """A run's admission inputs as plain values."""

    status: str
    max_parallel: int
    in_flight: int


@dataclass(frozen=True)
class ItemState:
    """What decides whether an item may take a slot, and in which order."""

    pk: int
    index: int
    pool: str
    status: str
    crashes: int
    next_attempt_at: datetime


def headroom(pool: CapacityPool | PoolState, in_flight: int, now: datetime) -> Headroom:
    """Admissions the pool allows now, given its live leases; call refill() first."""
    if pool.paused:
        return Headroom(0, "pool paused")
    if pool.backoff_until and pool.backoff_until > now:
        return Headroom(0, f"throttled until {pool.backoff_until:%H:%M:%S}", pool.backoff_until)
    free = pool.max_concurrency - in_flight
    if free <= 0:
        return Headroom(0, f"pool full ({in_flight}/{pool.max_concurrency})", full=True)
    if pool.tokens is not None and pool.rate_count is not None and pool.rate_unit:
        # Each admission takes its item's estimate: the claim decides item by item.
        if pool.tokens < 1e-9:
            wait = (1.0 - pool.tokens) * pool.rate_period / pool.rate_count
            until = now + timedelta(seconds=wait)
            return Headroom(0, f"rate limited until {until:%H:%M:%S.%f}"[:-3], until)
        return Headroom(free)
    if pool.tokens is not None and pool.rate_count is not None:
        tokens = math.floor(pool.tokens + 1e-9)
        if tokens < 1:
            wait = (1.0 - pool.tokens) * pool.rate_period / pool.rate_count
            until = now + timedelta(seconds=wait)
            return Headroom(0, f"rate limited until {until:%H:%M:%S.%f}"[:-3], until)
        free = min(free, tokens)
    return Headroom(free)


def waiting_runs(waiters: Mapping[str, float] | None, now: datetime) -> set[int]:
    """The runs registered as waiting for a pool whose registration has not run out."""
    stamp = now.timestamp()
    return {int(run) for run, until in (waiters or {}).items() if until > stamp}


def share_of(pool: PoolState, run_id: int, now: datetime) -> tuple[int, int]:
    """(slots the run holds, its fair share): ceil(max_concurrency / contending runs), where
    runs holding slots, runs waiting and this run contend."""
    holding = {run for run, n in pool.holders.items() if n > 0}
    contenders = holding | waiting_runs(pool.waiters, now) | {run_id}
    return pool.holders.get(run_id, 0), -(-pool.max_concurrency // len(contenders))


def fair_room(pool: PoolState, run_id: int, now: datetime) -> Headroom:
    """The pool's headroom for this run: while other runs wait for the pool, no run grows
    past its fair share. The claim admits by this rule."""
    room = headroom(pool, pool.in_flight, now)
    if room.count <= 0:
        return room
    mine, share = share_of(pool, run_id, now)
    if waiting_runs(pool.waiters, now) - {run_id} and mine + room.count > share:
        allowed = max(0, share - mine)
        if allowed < room.count:
            return Headroom(allowed, f"fair share ({mine}/{share}) while other runs wait")
    return room


RUNNING = "running"  # RunStatus.RUNNING, as the SQL routines spell it


def hands_over(
    run: RunState, pool_name: str, pool: PoolState | None, run_id: int, now: datetime
) -> Headroom:
    """Whether a finished item's slot passes straight to its run's next item of its pool.

    The claim's rule once the finished item's slot is given back, narrowed to what one
    statement may decide without the run's and the pool's locks: a pool with a rate limit
    spends a token only under its lock (a claim's), and while another run waits for the pool
    the slot goes back for that run to take. The hand-over routines (fanout_hand_over and
    fanout_hand_over_spend on PostgreSQL, the fanout_hand_over procedure on MariaDB/MySQL)
    implement this rule; tests/test_admission_agreement.py holds them to it.
    """
    if run.status != RUNNING:
        return Headroom(0, f"run {run.status}")
    if run.in_flight - 1 >= run.max_parallel:
        return Headroom(0, f"run at max_parallel ({run.in_flight - 1}/{run.max_parallel})")
    if not pool_name:
        return Headroom(1)
    if pool is None:
        return Headroom(0, f"pool {pool_name} unavailable")
    mine = pool.holders.get(run_id, 0)
    freed = replace(
        pool, in_flight=pool.in_flight - 1, holders={**pool.holders, run_id: max(0, mine - 1)}
    )
    room = fair_room(freed, run_id, now)
    if room.count <= 0:
        return room
    if pool.rate_count is not None:
        return Headroom(0, "rate limited: a token is spent under the pool's lock, by a claim")
    if waiting_runs(pool.waiters, now) - {run_id}:
        return Headroom(0, "other runs wait for the pool: the slot goes back for them")
    return Headroom(1)


def next_in_slot(items: Iterable[ItemState], pool_name: str, now: datetime) -> ItemState | None:
    """The item a handed-over slot goes to: the run's first pending item of the same pool in
    work-list order whose retry is due. Not one a reaper gave back after its owner died
    (``crashes``): that is the claim's, which knows the run's crash budget."""
    due = [
        item
        for item in items
        if item.status == "pending"
        and item.pool == pool_name
        and item.crashes == 0
        and item.next_attempt_at <= now
    ]
    return min(due, key=lambda item: item.index, default=None)


_DRIFT_FIELDS = ("max_concurrency", "rate_count", "rate_period", "burst", "rate_unit")


def settings_drift(pool: CapacityPool) -> str:
    """Say how the pool's row differs from its FANOUT_POOLS entry, or "" when it does not.

    The row wins (an operator's edit in the admin persists); this only makes the difference
    visible in `check`, in run_fanout and on the pool's admin page.
    """
    try:
        limits = configured_limits(pool.name)
    except FanoutError:
        return ""  # a malformed entry is check's fanout.E002
    if limits is None:
        return ""
    wanted = CapacityPool(name=pool.name, **limits)
    differs = []
    if pool.max_concurrency != wanted.max_concurrency:
        differs.append(
            f"max_concurrency {pool.max_concurrency} (FANOUT_POOLS: {wanted.max_concurrency})"
        )
    if any(getattr(pool, f) != getattr(wanted, f) for f in _DRIFT_FIELDS[1:]):
        differs.append(f"rate {pool.describe_rate()} (FANOUT_POOLS: {wanted.describe_rate()})")
    if not differs:
        return ""
    return (
        f"pool {pool.name!r} differs from FANOUT_POOLS: {', '.join(differs)}; the pool's row wins"
    )


def throttle_pool(name: str, retry_after: float) -> None:
    """The provider said to wait (Throttled): the whole pool admits nothing until then.

    Only ever later: an earlier deadline does not shorten a wait another call was told."""
    until = db_now_plus(retry_after)
    CapacityPool.objects.filter(name=name).filter(
        Q(backoff_until__isnull=True) | Q(backoff_until__lt=until)
    ).update(backoff_until=until)
