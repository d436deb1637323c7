"""The operator's console: how far along a run is, what failed and why, why an item waits,
which pool is saturated, and the actions that retry, cancel, release and re-dispatch.

One module per model (runs, items, pools); every page reads what it shows in a fixed number of
queries, and actions narrow their queryset to eligible rows and delegate to actions/dispatch.
Fields written by workers are read-only: an item's status changes only through the actions.
"""

from .items import ItemClaimAdmin
from .pools import CapacityPoolAdmin
from .runs import BatchRunAdmin
from .spend import SpendAccountAdmin

__all__ = ["BatchRunAdmin", "CapacityPoolAdmin", "ItemClaimAdmin", "SpendAccountAdmin"]
