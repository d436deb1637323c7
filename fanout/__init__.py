"""Durable, capacity-bounded fan-out of a work list for Django."""

from .definition import FanOut, Item, Outcome
from .errors import FanoutError, PermanentError, Throttled
from .group import Group, Step

__all__ = [
    "FanOut",
    "FanoutError",
    "Group",
    "Item",
    "Outcome",
    "PermanentError",
    "Step",
    "Throttled",
]
__version__ = "0.1.0"
