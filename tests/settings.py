"""Settings for the test suite: the example project's, on PostgreSQL unless DATABASE_URL says."""

import os

os.environ.setdefault("DATABASE_URL", "postgres://root@127.0.0.1:5432/test")

from project.settings import *  # noqa: E402, F403

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]  # noqa: F405
