"""Groups: a fixed set of different members, run at once, joined by name.

A ``Group`` is a definition like any other (``run_fanout NAME``, ``.start()``, the admin): its
work list is its members' names. Each member gets an Item whose key is its name and whose
payload is the group's params. A member is a ``Step`` (a callable with its own attempts, pool,
timeout and compensation), a plain callable, or a ``FanOut``, which runs as a child run with the
group's params (see ``Item.spawn``).

A group whose Steps give ``compensate=`` compensates like any FanOut: when it fails (or an
operator cancels it with compensation), each member that succeeded and has a compensation is
undone once, latest finished first (``compensate_order`` and the rest are the group's options).
A member with no compensation has nothing to undo. A FanOut member's own items are its own
definition's affair: give that definition ``compensate=`` and its run undoes them when it fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .definition import FanOut, Item, Outcome
from .errors import FanoutError
from .options import CALLABLE, COUNT, NAME, POOL_NAME, SECONDS, Option


class Step:
    """One member of a Group with options of its own (None: the group's)."""

    # The same checks and words as FanOut's options of these names.
    speaker = "Step "
    do: Option[Callable[[Item], Any]] = Option(CALLABLE, label="do (the item handler)")
    max_attempts: Option[int | None] = Option(COUNT, optional=True)
    pool: Option[str | None] = Option(POOL_NAME, optional=True)
    timeout: Option[float | None] = Option(SECONDS, optional=True)
    requires: Option[str | None] = Option(NAME, optional=True)
    compensate: Option[Callable[[Item, Any], Any] | None] = Option(CALLABLE, optional=True)

    def __init__(
        self,
        do: Callable[[Item], Any],
        *,
        max_attempts: int | None = None,
        pool: str | None = None,
        timeout: float | None = None,
        requires: str | None = None,
        compensate: Callable[[Item, Any], Any] | None = None,
    ) -> None:
        self.do = do
        self.max_attempts = max_attempts
        self.pool = pool
        self.timeout = timeout
        self.requires = requires
        self.compensate = compensate


class Group(FanOut):
    """Run ``steps`` at once; the join receives their outcomes, keyed by member name."""

    def __init__(
        self,
        name: str,
        *,
        steps: Mapping[str, Step | FanOut | Callable[[Item], Any]],
        failure_policy: str = "collect",
        join: Callable[[Iterable[Outcome]], Any] | None = None,
        join_mode: str = "all",
        params: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        members = _members(name, steps, options.get("requires"))
        self.members = members
        options.setdefault("max_parallel", len(members))  # members start together
        if any(isinstance(m, Step) and m.compensate for m in members.values()):
            if options.get("compensate") is not None:
                raise FanoutError(
                    f"group {name!r}: give compensate= on its Steps, not on the group"
                )
            options["compensate"] = self._compensate_member
        super().__init__(
            name,
            over=lambda params: list(members),
            key=str,
            payload=lambda member: None,
            do=self._run_member,
            pool=self._member_pool if any(_pool(m) for m in members.values()) else None,
            failure_policy=failure_policy,
            join=join,
            join_mode=join_mode,
            params=params,
            **options,
        )

    @property
    def module(self) -> str:
        return next(
            (
                getattr(m.do, "__module__", "?")
                for m in self.members.values()
                if isinstance(m, Step)
            ),
            "?",
        )

    def _run_member(self, item: Item) -> Any:
        member = self.members[item.key]
        if isinstance(member, FanOut):
            return item.spawn(member, params=dict(item.params))
        return member.do(dataclasses.replace(item, payload=dict(item.params)))

    def _compensate_member(self, item: Item, result: Any) -> None:
        member = self.members[item.key]
        if isinstance(member, Step) and member.compensate is not None:
            member.compensate(dataclasses.replace(item, payload=dict(item.params)), result)

    def _member_pool(self, item: Item) -> str:
        return _pool(self.members[item.key]) or ""

    def pool_for(self, item: Item) -> str:
        return self._member_pool(item)

    def attempts_for(self, key: str) -> int:
        member = self.members.get(key)
        if isinstance(member, Step) and member.max_attempts is not None:
            return member.max_attempts
        return self.max_attempts

    def timeout_for(self, key: str) -> float | None:
        member = self.members.get(key)
        if isinstance(member, Step) and member.timeout is not None:
            return member.timeout
        return self.timeout


def _members(name: str, steps: Any, requires: str | None) -> dict[str, Step | FanOut]:
    """A group's members by name, each a Step or a FanOut (a callable becomes a Step)."""
    if not isinstance(steps, Mapping) or not steps:
        raise FanoutError(f"group {name!r}: steps must be a non-empty mapping of name to step")
    members: dict[str, Step | FanOut] = {}
    for key, step in steps.items():
        if not isinstance(key, str) or not key or len(key) > 255:
            raise FanoutError(f"group {name!r}: a member name must be 1 to 255 characters")
        if isinstance(step, Step | FanOut):
            members[key] = step
        elif callable(step):
            members[key] = Step(step)
        else:
            raise FanoutError(
                f"group {name!r}: member {key!r} must be a Step, a FanOut or a callable, "
                f"got {step!r}"
            )
        if isinstance(step, Step) and step.requires not in (None, requires):
            raise FanoutError(
                f"group {name!r}: member {key!r} requires {step.requires!r}, but a group's "
                "members share its drain jobs: give the group requires=, or make the member "
                "a FanOut (it runs as a child run on its own queue)"
            )
    return members


def _pool(member: Step | FanOut) -> str | None:
    return member.pool if isinstance(member, Step) else None
