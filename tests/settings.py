"""Settings for the test suite: the example project's, on PostgreSQL unless DATABASE_URL says."""

import os

os.environ.setdefault("DATABASE_URL", "postgres://root@127.0.0.1:5432/test")

from project.settings import *  # noqa: E402, F403

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]  # noqa: F405

# Each test session gets its own database, so that sessions running side by side (and the
# worker processes they start, which are given its name explicitly) never drop each other's.
DATABASES["default"]["TEST"] = {  # noqa: F405
    "NAME": os.environ.get("FANOUT_TEST_DATABASE_NAME") or f"test_fanout_{os.getpid()}"
}

# The test app's definitions name pools that their tests create (with the limits each test
# needs) and drop again: a check that they exist nowhere would warn on every `check` a test runs.
SILENCED_SYSTEM_CHECKS = ["fanout.W006"]

# The example project's LLM sweep pools (token rates, budgets) are the demo's: the suite's
# pools are those its tests make.
FANOUT_POOLS = {n: p for n, p in FANOUT_POOLS.items() if not n.startswith("llm-")}  # noqa: F405
