"""Transitions: every status change of an item (``items``) and of a run (``runs``), each a
named function that keeps the counters right. Nothing else in fanout writes a status
(tests/test_shape.py checks it).

The names of ``items`` are importable from here too (``fanout.transitions.hand_over``), as
they were when this was one module.
"""

from . import items as items
from . import runs as runs
from .items import *  # noqa: F403
