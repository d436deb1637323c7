"""Durable, capacity-bounded fan-out of a work list for Django."""

from .definition import FanOut, Item, Outcome
from .errors import FanoutError, PermanentError, Throttled

__all__ = ["FanOut", "FanoutError", "Item", "Outcome", "PermanentError", "Throttled"]
__version__ = "0.1.0"
