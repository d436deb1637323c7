"""Settings of the benchmark: the example project's, plus the bench app, on its own database.

DATABASE_URL  default postgres://root@127.0.0.1:5432/fanout_bench (bench/run.py creates it);
              mysql://... for MariaDB (bench/run.py --database mariadb sets it)
REDIS_URL     default redis://127.0.0.1:6379/6 (the script empties this Redis database)
FANOUT_GROUP_COMMIT  "0" measures per-item hand-overs one statement each (default "1": grouped)
FANOUT_GROUP_COMMIT_LANES  grouped hand-over statements a process keeps in flight (default 2)
"""

import os

os.environ.setdefault("DATABASE_URL", "postgres://root@127.0.0.1:5432/fanout_bench")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/6")
os.environ.setdefault("FANOUT_LOG_LEVEL", "WARNING")
os.environ.setdefault("DEBUG", "0")  # DEBUG would keep every SQL statement in memory

from project.settings import *  # noqa: E402, F403

ALLOWED_HOSTS = ["*"]
FANOUT_GROUP_COMMIT = os.environ.get("FANOUT_GROUP_COMMIT", "1") != "0"
FANOUT_GROUP_COMMIT_LANES = int(os.environ.get("FANOUT_GROUP_COMMIT_LANES", "2"))
INSTALLED_APPS = [*INSTALLED_APPS, "bench"]  # noqa: F405

# Rebuilt from REDIS_URL as read above (project.settings read it too; this keeps them in step).
RQ_QUEUES = {
    "fanout": {
        "URL": REDIS_URL,  # noqa: F405
        "DEFAULT_TIMEOUT": 3600,
        "SERIALIZER": "rq.serializers.JSONSerializer",
    },
    "default": {"URL": REDIS_URL},  # noqa: F405
}

# The pools of the pool-limited runs (bench/fanouts.py). The rate pool has a small burst, so
# "never above the limit" is checked against 50 admissions per second plus a burst of 5.
FANOUT_POOLS = {
    **FANOUT_POOLS,  # noqa: F405
    "bench-conc4": {"max_concurrency": 4},
    "bench-rate50": {"max_concurrency": 1000, "rate": "50/s", "burst": 5},
}
