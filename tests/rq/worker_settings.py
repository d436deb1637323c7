"""Settings for `rqworker` children whose fanout budgets a test shortens through the environment.

The test settings, plus the FANOUT_* budgets below, read from the environment when it sets
them (a worker's settings cannot be overridden from the test process).
"""

import os

from tests.settings import *  # noqa: F403

for _name in (
    "FANOUT_DRAIN_SECONDS",
    "FANOUT_STOP_GRACE_SECONDS",
    "FANOUT_SUPERVISE_SECONDS",
    "FANOUT_JOIN_LEASE_SECONDS",
    "FANOUT_JOIN_RETRY_BACKOFF",
    "FANOUT_WORKER_THREADS",
):
    if os.environ.get(_name):
        globals()[_name] = float(os.environ[_name])
