"""Settings of a writer the harness kills or cuts off mid-work-list: the workers' settings, with
items written in small chunks, so that writing a work list lasts long enough to be interrupted."""

from tests.rq.worker_settings import *  # noqa: F403

FANOUT_MATERIALIZE_CHUNK = 10
