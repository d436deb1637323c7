"""A definition's options: what each must be and the words used when it is not, said once.

FanOut declares its options, and a Group's Step the few a member may set for itself, as
``Option`` descriptors over the same rules: setting one checks it, so a value one of them
refuses the other refuses with the same message.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, overload

from .conf import conf
from .errors import FanoutError


@dataclass(frozen=True)
class Rule:
    """What an option's value must be, in the words its error says it."""

    says: str
    holds: Callable[[Any], bool]


def _integer(minimum: int) -> Rule:
    return Rule(
        f"an integer >= {minimum}",
        lambda v: not isinstance(v, bool) and isinstance(v, int) and v >= minimum,
    )


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and not math.isnan(value)


def _name(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 200


def _one_of(*choices: str) -> Rule:
    return Rule(f"one of {', '.join(choices)}", lambda v: v in choices)


CALLABLE = Rule("callable", callable)
COUNT = _integer(1)
NON_NEGATIVE = _integer(0)
SECONDS = Rule("a number > 0", lambda v: _number(v) and v > 0)
RATE = Rule(
    "a number from 0 to below 1 (0.05 = 5% of all items)", lambda v: _number(v) and 0 <= v < 1
)
POOL_NAME = Rule("a pool name (1 to 200 characters)", _name)
POOL = Rule("a pool name or a function of the item", lambda v: callable(v) or _name(v))
NAME = Rule("a name (1 to 200 characters)", _name)
FAILURE_POLICIES = ("fail_fast", "collect", "tolerate")
JOIN_MODES = ("all", "any")
FAILURE_POLICY = _one_of(*FAILURE_POLICIES)
JOIN_MODE = _one_of(*JOIN_MODES)
PARAMS = Rule("a mapping of name to type", lambda v: isinstance(v, Mapping))
COST_FROM = Rule(
    "a key of the handler's answer (a dict) or a function of the answer",
    lambda v: callable(v) or _name(v),
)
COMPENSATE_ORDER = Rule("'reverse' or 'parallel'", lambda v: v in ("reverse", "parallel"))


class Option[T]:
    """An option of a definition: checked by its rule when set; None reads ``setting`` if any.

    The owner says who is speaking in an error through its ``speaker`` attribute
    ("fan-out 'x': ", "Step ").
    """

    def __init__(
        self,
        rule: Rule,
        *,
        optional: bool = False,
        label: str = "",
        setting: str = "",
        convert: Callable[[Any], Any] | None = None,
    ) -> None:
        self.rule = rule
        self.optional = optional or bool(setting)
        self.label = label
        self.setting = setting
        self.convert = convert

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.label = self.label or name

    @overload
    def __get__(self, instance: None, owner: type) -> Option[T]: ...
    @overload
    def __get__(self, instance: object, owner: type) -> T: ...
    def __get__(self, instance: object | None, owner: type) -> Option[T] | T:
        if instance is None:
            return self
        value = instance.__dict__[self.name]
        if value is None and self.setting:
            value = getattr(conf, self.setting)
        return self.convert(value) if self.convert and value is not None else value

    def __set__(self, instance: object, value: Any) -> None:
        if not (value is None and self.optional) and not self.rule.holds(value):
            speaker = getattr(instance, "speaker", "")
            raise FanoutError(f"{speaker}{self.label} must be {self.rule.says}, got {value!r}")
        instance.__dict__[self.name] = value

    def given(self, instance: object) -> T | None:
        """The value as the definition gave it, None where it left the setting's default."""
        return instance.__dict__[self.name]  # type: ignore[no-any-return]
