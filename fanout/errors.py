"""Exceptions a handler raises to steer its item, and errors fanout reports."""

from __future__ import annotations


class PermanentError(Exception):
    """Raised by a handler: fail this item now, without further attempts."""


class Throttled(Exception):  # noqa: N818 - the name a handler author reads in the provider's terms
    """Raised by a handler when the provider says "slow down".

    The item goes back to pending without using an attempt and the item's pool
    admits nothing until ``retry_after`` seconds have passed.
    """

    def __init__(self, retry_after: float = 1.0, message: str = "") -> None:
        if retry_after < 0:
            raise ValueError("retry_after must be >= 0")
        self.retry_after = float(retry_after)
        super().__init__(message or f"throttled: retry after {self.retry_after:g}s")


class FanoutError(Exception):
    """A usage or configuration error, reported to the user as is."""


class DefinitionNotFound(FanoutError):
    pass


class MaterializeError(FanoutError):
    """The work list could not be turned into items; nothing was run."""


class EmptyWorkList(MaterializeError):
    """The work list was empty and its definition refuses that (``allow_empty=False``)."""
