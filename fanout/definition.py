"""FanOut definitions, the registry they join when constructed, and the Item a handler gets."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .conf import conf
from .cost import Costing, Units, add, as_units
from .errors import DefinitionNotFound, FanoutError
from .launch import start_run
from .options import (
    CALLABLE,
    COMPENSATE_ORDER,
    COST_FROM,
    COUNT,
    FAILURE_POLICY,
    JOIN_MODE,
    NAME,
    NON_NEGATIVE,
    PARAMS,
    POOL,
    RATE,
    SECONDS,
    Option,
)

if TYPE_CHECKING:
    from .models import BatchRun

EXECUTORS = ("inline", "rq")
_IDEMPOTENCY_NAMESPACE = uuid.UUID("6f1c1d2e-5b9a-4c36-9a52-7c0e7a1f0b11")
_MISSING = object()


@dataclass(frozen=True)
class Item:
    """What a handler gets: one item of the work list and where it stands."""

    key: str
    index: int
    payload: Any
    attempt: int
    run_id: int
    pool: str = ""
    params: Mapping[str, Any] = field(default_factory=dict)
    # What the call does: "forward" (the handler, ``do``) or "compensation" (``compensate``).
    phase: str = "forward"
    # What the handler reported its call cost, {unit: amount} (see report_cost).
    reported: dict[str, float] = field(default_factory=dict, compare=False, repr=False)

    def report_cost(self, **units: float) -> None:
        """Say what this call cost, e.g. ``item.report_cost(tokens=812, usd=0.0041)``.

        It replaces the item's reserved estimate when the outcome is recorded (several calls
        add up). A success that reports nothing cost its estimate; a failure, nothing.
        """
        self.reported.update(add(self.reported, as_units(units, f"item {self.key!r}: cost")))

    @property
    def idempotency_key(self) -> str:
        """Stable across attempts and workers: hand it to the provider to deduplicate.

        A compensation has a key of its own: the refund must not be taken by the provider for
        a repeat of the charge it undoes."""
        name = f"{self.run_id}:{self.key}"
        if self.phase != "forward":
            name = f"{name}:{self.phase}"
        return str(uuid.uuid5(_IDEMPOTENCY_NAMESPACE, name))

    def spawn(self, definition: FanOut | str, params: Mapping[str, Any] | None = None) -> Spawn:
        """Hand this item to a child run of ``definition``; return what the handler returns.

        The item then waits for the child run: it succeeds with the child's join result, or
        fails naming the child run. The child's run key comes from this run and this item's
        key, so spawning again (after a crash, a retry) finds the same child.
        """
        name = definition.name if isinstance(definition, FanOut) else definition
        get_definition(name)  # only registered definitions run
        return Spawn(name, dict(params or {}))


@dataclass(frozen=True)
class Spawn:
    """A handler's answer that hands its item to a child run (see ``Item.spawn``)."""

    definition: str
    params: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    """One item's final state, as the join sees it."""

    key: str
    index: int
    status: str
    result: Any
    error: str
    attempt: int
    # What the item's calls cost, {unit: amount} (None: nothing counted; see docs/budgets.md).
    cost: dict[str, float] | None = None

    @property
    def succeeded(self) -> bool:
        return self.status == "succeeded"


_registry: dict[str, FanOut] = {}


def registered() -> dict[str, FanOut]:
    return dict(sorted(_registry.items()))


def get_definition(name: str) -> FanOut:
    try:
        return _registry[name]
    except KeyError:
        known = ", ".join(sorted(_registry)) or "none"
        raise DefinitionNotFound(
            f"unknown fan-out {name!r}; registered definitions: {known} "
            "(definitions live in an installed app's fanouts.py)"
        ) from None


def unknown_here(name: str, host: str) -> str:
    """Why a worker cannot run a run of ``name``: its process has never heard of it.

    Said on the run, where an operator reads it beside a `run_fanout --list` of the new deploy
    that does list the definition: the usual cause is workers started before that deploy.
    """
    return (
        f"no worker could run {name!r}: unknown fan-out on host {host} (workers started "
        "before it was deployed? restart them)"
    )


def _checked_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        raise FanoutError(
            f"a fan-out name must be a non-empty string of at most 200 characters, got {name!r}"
        )
    return name


class FanOut:
    """A named fan-out: a work list, a handler per item, limits, a failure policy and a join.

    Constructing one registers it; only registered definitions can be run.
    """

    # Each option's check and error message (fanout.options); setting one checks it. Those
    # with a setting read it when used, so override_settings reaches them.
    over: Option[Callable[[dict[str, Any]], Iterable[Any]]] = Option(CALLABLE)
    do: Option[Callable[[Item], Any]] = Option(CALLABLE, label="do (the item handler)")
    key: Option[Callable[[Any], Any]] = Option(CALLABLE, optional=True)
    payload: Option[Callable[[Any], Any] | None] = Option(CALLABLE, optional=True)
    pool: Option[str | Callable[[Item], str] | None] = Option(POOL, optional=True)
    max_parallel: Option[int] = Option(COUNT)
    max_attempts: Option[int] = Option(COUNT)
    failure_policy: Option[str] = Option(FAILURE_POLICY)
    join: Option[Callable[[Iterable[Outcome]], Any] | None] = Option(CALLABLE, optional=True)
    join_mode: Option[str] = Option(JOIN_MODE)
    params: Option[dict[str, Any] | None] = Option(PARAMS, optional=True)
    lease_seconds: Option[float] = Option(SECONDS, setting="LEASE_SECONDS", convert=float)
    timeout: Option[float | None] = Option(SECONDS, optional=True)
    batch_size: Option[int] = Option(COUNT, setting="BATCH_SIZE", convert=int)
    crash_budget: Option[int] = Option(NON_NEGATIVE, setting="CRASH_BUDGET", convert=int)
    retry_backoff: Option[float] = Option(SECONDS, setting="RETRY_BACKOFF", convert=float)
    requires: Option[str | None] = Option(NAME, optional=True)
    _queue: Option[str | None] = Option(NAME, optional=True, label="queue")  # see .queue
    max_failures: Option[int | None] = Option(NON_NEGATIVE, optional=True)
    max_failure_rate: Option[float | None] = Option(RATE, optional=True)
    compensate: Option[Callable[[Item, Any], Any] | None] = Option(CALLABLE, optional=True)
    compensate_order: Option[str] = Option(COMPENSATE_ORDER)
    compensate_max_parallel: Option[int | None] = Option(COUNT, optional=True)
    host_max_parallel: Option[int | None] = Option(COUNT, optional=True)
    # Where a call's cost is read from its answer when the handler did not report it.
    cost_from: Option[str | Callable[[Any], Any] | None] = Option(COST_FROM, optional=True)

    def __init__(
        self,
        name: str,
        *,
        over: Callable[[dict[str, Any]], Iterable[Any]],
        do: Callable[[Item], Any],
        key: Callable[[Any], Any] | None = None,
        payload: Callable[[Any], Any] | None = None,
        pool: str | Callable[[Item], str] | None = None,
        max_parallel: int = 4,
        max_attempts: int = 3,
        failure_policy: str = "collect",
        join: Callable[[Iterable[Outcome]], Any] | None = None,
        join_mode: str = "all",
        params: Mapping[str, Any] | None = None,
        lease_seconds: float | None = None,
        timeout: float | None = None,
        batch_size: int | None = None,
        crash_budget: int | None = None,
        retry_backoff: float | None = None,
        queue: str | None = None,
        requires: str | None = None,
        max_failures: int | None = None,
        max_failure_rate: float | None = None,
        compensate: Callable[[Item, Any], Any] | None = None,
        compensate_order: str = "reverse",
        compensate_max_parallel: int | None = None,
        host_max_parallel: int | None = None,
        allow_empty: bool = True,
        cost: Any = None,
        max_spend: Any = None,
        cost_from: str | Callable[[Any], Any] | None = None,
    ) -> None:
        self.name = _checked_name(name)
        given = locals()  # the keywords, each checked as its Option above is set
        for option in _OPTIONS:
            setattr(self, option, given[option])
        self.key = key or str
        self.params = dict(params) if params is not None else None
        self._queue = queue
        # Spend (fanout.spend): each item's estimate, and each run's budget by default.
        self.costing = Costing(name, cost) if cost is not None else None
        self.max_spend = as_units(max_spend, f"fan-out {name!r}: max_spend") if max_spend else None
        # False: a work list that comes out empty (a mistyped param, say) is an error, not a
        # run that succeeds having done nothing.
        self.allow_empty = bool(allow_empty)
        self._register()

    @property
    def speaker(self) -> str:
        return f"fan-out {self.name!r}: "

    def _register(self) -> None:
        previous = _registry.get(self.name)
        if previous is not None and previous.module != self.module:
            raise FanoutError(
                f"fan-out {self.name!r} is defined twice: in {previous.module} and in {self.module}"
            )
        _registry[self.name] = self

    @property
    def module(self) -> str:
        return getattr(self.do, "__module__", "?")

    @property
    def queue(self) -> str:
        if self._queue:
            return self._queue
        return f"{conf.QUEUE}-{self.requires}" if self.requires else conf.QUEUE

    @property
    def static_pool(self) -> str | None:
        """The pool every item uses, or None when there is none or it is chosen per item."""
        return self.pool if isinstance(self.pool, str) else None

    def attempts_for(self, key: str) -> int:
        """Attempts the item ``key`` may use (a Group's member may have its own)."""
        return self.max_attempts

    def timeout_for(self, key: str) -> float | None:
        """Seconds a call of the item ``key`` may take (a Group's member may have its own)."""
        return self.timeout

    @property
    def has_thresholds(self) -> bool:
        return self.max_failures is not None or self.max_failure_rate is not None

    def threshold_crossed(self, failed: int, total: int) -> str:
        """Why ``failed`` of ``total`` items fail the run by its thresholds, or ""."""
        if self.max_failures is not None and failed > self.max_failures:
            return f"{failed} items failed, more than max_failures={self.max_failures}"
        rate = self.max_failure_rate
        if rate is not None and total and failed > rate * total:
            return (
                f"{failed} of {total} items failed ({failed / total:.1%}), "
                f"more than max_failure_rate={rate:g}"
            )
        return ""

    @property
    def accounted(self) -> bool:
        """Whether its items' costs are counted (it declares cost=, cost_from= or a budget)."""
        return self.costing is not None or self.max_spend is not None or self.cost_from is not None

    def estimate_for(self, item: Item) -> Units | None:
        """What one call of ``item`` is expected to cost, or None without cost=."""
        return self.costing.estimate(item) if self.costing is not None else None

    def pool_for(self, item: Item) -> str:
        if self.pool is None:
            return ""
        if isinstance(self.pool, str):
            return self.pool
        name = self.pool(item)
        if not isinstance(name, str) or not name or len(name) > 200:
            raise FanoutError(
                f"fan-out {self.name!r}: pool function returned {name!r} for item {item.key!r}; "
                "it must return a pool name of 1 to 200 characters"
            )
        return name

    def payload_for(self, element: Any) -> Any:
        return element if self.payload is None else self.payload(element)

    def key_for(self, element: Any) -> str:
        value = self.key(element)
        key = value if isinstance(value, str) else str(value)
        if not key or len(key) > 255:
            raise FanoutError(
                f"fan-out {self.name!r}: an item key must be 1 to 255 characters, got {key[:80]!r}"
            )
        return key

    def clean_params(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Check and convert run params against the declared ones; return JSON-safe params."""
        given = dict(params or {})
        if self.params is not None:
            unknown = sorted(set(given) - set(self.params))
            if unknown:
                raise FanoutError(
                    f"fan-out {self.name!r} has no param {', '.join(map(repr, unknown))}; "
                    f"it takes: {', '.join(self.params) or 'none'}"
                )
            for pname, spec in self.params.items():
                convert, default = spec if isinstance(spec, tuple) else (spec, _MISSING)
                if pname not in given:
                    if default is _MISSING:
                        raise FanoutError(f"fan-out {self.name!r} needs param {pname!r}")
                    given[pname] = default
                    continue
                try:
                    given[pname] = convert(given[pname])
                except (TypeError, ValueError) as exc:
                    raise FanoutError(
                        f"fan-out {self.name!r}: param {pname!r}={given[pname]!r} "
                        f"is not valid: {exc}"
                    ) from None
        try:
            return json.loads(json.dumps(given))
        except (TypeError, ValueError) as exc:
            raise FanoutError(f"fan-out {self.name!r}: params must be JSON: {exc}") from None

    def default_run_key(self, params: Mapping[str, Any]) -> str:
        text = json.dumps(params, sort_keys=True, separators=(",", ":"))
        key = f"{self.name}:{text}"
        if len(key) <= 255:
            return key
        return f"{self.name}:sha256:{hashlib.sha256(text.encode()).hexdigest()}"

    def start(
        self,
        params: Mapping[str, Any] | None = None,
        run_key: str | None = None,
        *,
        executor: str = "inline",
        workers: int | None = None,
        max_parallel: int | None = None,
        wait: bool = True,
        max_spend: Mapping[str, float] | float | None = None,
    ) -> BatchRun:
        """Create (or find) the run, write its items and dispatch it; return the BatchRun.

        With the inline executor and ``wait=True`` the items run in this process and the
        run returned is finished; otherwise workers run it and the run returned is live.
        ``max_spend`` (e.g. ``{"usd": 20}``) is the run's budget, in place of the definition's.
        """
        return start_run(
            self,
            params,
            run_key,
            executor=executor,
            workers=workers,
            max_parallel=max_parallel,
            wait=wait,
            max_spend=max_spend,
        )

    def __repr__(self) -> str:
        return f"<FanOut {self.name!r}>"


# Set from FanOut's keywords in this order (an error names the first bad one).
_OPTIONS = [
    name for name, value in vars(FanOut).items() if isinstance(value, Option) and name[0] != "_"
]
