"""The test settings on SQLite with Django's default options: no WAL, no IMMEDIATE, no timeout.

A reusable app cannot choose the host project's SQLite options, so the embedded path is also
tested on what ``django.db.backends.sqlite3`` does when nothing is configured.
"""

from tests.settings import *  # noqa: F403

DATABASES["default"]["OPTIONS"] = {}  # noqa: F405
