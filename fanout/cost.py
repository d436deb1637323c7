"""Costs as amounts by unit: parsing, adding, saying them; a definition's ``cost=``.

Nothing here touches the database (definitions import it before Django's apps are ready);
budgets and reservations are ``fanout.spend``'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .errors import FanoutError

if TYPE_CHECKING:
    from .definition import Item

Units = dict[str, float]

# The unit of a cost given as a bare number.
DEFAULT_UNIT = "units"
_UNIT = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,39}$")
_EPSILON = 1e-9


# ------------------------------------------------------------------------------ amounts


def as_units(value: Any, what: str = "cost") -> Units:
    """A cost or budget as {unit: amount}: a number is in DEFAULT_UNIT; amounts are >= 0."""
    if isinstance(value, bool):
        raise FanoutError(f"{what} must be a number or a dict of unit to number, got {value!r}")
    if isinstance(value, int | float):
        value = {DEFAULT_UNIT: value}
    if not isinstance(value, Mapping):
        raise FanoutError(f"{what} must be a number or a dict of unit to number, got {value!r}")
    units: Units = {}
    for unit, amount in value.items():
        if not isinstance(unit, str) or not _UNIT.match(unit):
            raise FanoutError(f"{what}: unit {unit!r} must be a name such as 'usd' or 'tokens'")
        if (
            isinstance(amount, bool)
            or not isinstance(amount, int | float)
            or not _finite(amount)
            or amount < 0
        ):
            raise FanoutError(f"{what}: {unit} must be a finite number >= 0, got {amount!r}")
        units[unit] = float(amount)
    return units


def _finite(amount: float) -> bool:
    """Whether it is a float's finite number (an int may be too large to be one)."""
    try:
        return math.isfinite(amount)
    except OverflowError:
        return False


def add(total: Mapping[str, float] | None, more: Mapping[str, float] | None) -> Units:
    """The sum of two costs, unit by unit."""
    out = dict(total or {})
    for unit, amount in (more or {}).items():
        out[unit] = out.get(unit, 0.0) + amount
    return out


def total(costs: Iterable[Mapping[str, float] | None]) -> Units:
    out: Units = {}
    for cost in costs:
        out = add(out, cost)
    return out


def amount(unit: str, value: float) -> str:
    """An amount as people read it: dollars with cents, other units with their name."""
    if unit.lower() == "usd":
        return f"${value:,.2f}"
    text = f"{value:,.2f}".rstrip("0").rstrip(".")
    return f"{text} {unit}"


def describe(unit: str, spent: float, budget: float, reserved: float) -> str:
    """Why admission stopped: ``budget spent ($49.80 of $50.00, $0.60 reserved)``."""
    if unit.lower() == "usd":
        return (
            f"budget spent ({amount(unit, spent)} of {amount(unit, budget)}, "
            f"{amount(unit, reserved)} reserved)"
        )
    number = amount(unit, spent).rsplit(" ", 1)[0]
    reserved_number = amount(unit, reserved).rsplit(" ", 1)[0]
    return f"budget spent ({number} of {amount(unit, budget)}, {reserved_number} reserved)"


# --------------------------------------------------------------------------- definitions


class Costing:
    """A definition's ``cost=``: a number, a dict of units, or a function of the item."""

    def __init__(self, name: str, cost: Any) -> None:
        self.name = name
        self.fixed: Units | None = None
        self.function: Callable[[Item], Any] | None = None
        if callable(cost):
            self.function = cost
        else:
            self.fixed = as_units(cost, f"fan-out {name!r}: cost")

    def estimate(self, item: Item) -> Units:
        if self.fixed is not None:
            return self.fixed
        assert self.function is not None
        try:
            return as_units(self.function(item), f"fan-out {self.name!r}: cost of {item.key!r}")
        except FanoutError:
            raise
        except Exception as exc:
            raise FanoutError(
                f"fan-out {self.name!r}: cost function raised for item {item.key!r}: {exc}"
            ) from exc


def from_answer(name: str, cost_from: str | Callable[[Any], Any], answer: Any) -> Units | None:
    """What a call cost by its answer (a definition's ``cost_from=``): the value under that
    key of a dict answer, or what the function returns; None when it says nothing (no such
    key, or None). Raises FanoutError when what it says is not a cost."""
    if callable(cost_from):
        try:
            found = cost_from(answer)
        except Exception as exc:
            raise FanoutError(
                f"fan-out {name!r}: cost_from raised for the handler's answer: {exc!r}"
            ) from exc
        what = f"fan-out {name!r}: cost_from's value"
    else:
        found = answer.get(cost_from) if isinstance(answer, Mapping) else None
        what = f"fan-out {name!r}: cost_from={cost_from!r}"
    return None if found is None else as_units(found, what)
