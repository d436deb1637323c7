"""A FanoutWorker that dies the moment RQ has marked its first job started, before the job's
code runs: the worst instant for a drain slot, which no heartbeat has touched yet."""

from __future__ import annotations

import os
from typing import Any

from fanout.rq import FanoutWorker


class DiesOnDequeue(FanoutWorker):
    def prepare_job_execution(self, job: Any, *args: Any, **kwargs: Any) -> None:
        super().prepare_job_execution(job, *args, **kwargs)
        os._exit(9)
