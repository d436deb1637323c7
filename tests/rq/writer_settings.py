"""Settings for a process that writes a work list in small chunks (FANOUT_MATERIALIZE_CHUNK
from the environment), so that a test can stop it between two commits."""

import os

from tests.rq.worker_settings import *  # noqa: F403

if os.environ.get("FANOUT_MATERIALIZE_CHUNK"):
    FANOUT_MATERIALIZE_CHUNK = int(os.environ["FANOUT_MATERIALIZE_CHUNK"])
