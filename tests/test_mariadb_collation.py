"""MariaDB/MySQL: the hand-over procedure works on a database whose collation is not the
character set's default (utf8mb4_unicode_ci here; MySQL 8's utf8mb4_0900_ai_ci, say).

Django creates the tables in the database's collation. A procedure parameter declared with a
character set alone takes the set's default collation instead (utf8mb4_general_ci), and
comparing the two raises "Illegal mix of collations".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import MySQLdb
import pytest
from django.db import connection

from tests.procs import child_env, database_url_of, manage

pytestmark = [
    pytest.mark.skipif("connection.vendor != 'mysql'", reason="MariaDB/MySQL's collations"),
    pytest.mark.django_db(transaction=True),
]

COLLATION = "utf8mb4_unicode_ci"


def server(database: str | None = None) -> Any:
    """A connection of our own to the test's server (the test's database is not this one)."""
    s = connection.settings_dict
    kwargs = {"host": s["HOST"] or "127.0.0.1", "user": s["USER"], "password": s["PASSWORD"]}
    if s["PORT"]:
        kwargs["port"] = int(s["PORT"])
    if database:
        kwargs["database"] = database
    return MySQLdb.connect(**kwargs, autocommit=True)


@pytest.fixture
def other_collation() -> Iterator[str]:
    """A database created in COLLATION and migrated: the URL of it; dropped at the end."""
    name = f"{connection.settings_dict['NAME']}_collation"
    with server() as admin, admin.cursor() as cursor:
        cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
        cursor.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE {COLLATION}")
    url = database_url_of({**connection.settings_dict, "NAME": name})
    assert url is not None
    try:
        migrated = manage(["migrate", "--noinput", "-v0"], child_env(url), timeout=300)
        assert migrated.returncode == 0, migrated.stderr
        yield url
    finally:
        with server() as admin, admin.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")


def test_a_run_hands_over_on_a_database_whose_tables_are_not_in_the_default_collation(
    other_collation: str,
) -> None:
    name = other_collation.rsplit("/", 1)[1]
    with server(name) as db, db.cursor() as cursor:
        cursor.execute(
            "SELECT DISTINCT collation_name FROM information_schema.columns"
            " WHERE table_schema = DATABASE() AND table_name = 'fanout_itemclaim'"
            " AND column_name IN ('key', 'pool', 'owner')"
        )
        assert cursor.fetchall() == ((COLLATION,),)

    command = ["run_fanout", "t_ledger", "--param", "n=30", "--workers", "3"]
    done = manage(command, child_env(other_collation), timeout=120)

    assert done.returncode == 0, done.stdout + done.stderr
    with server(name) as db, db.cursor() as cursor:
        cursor.execute("SELECT status, count(*) FROM fanout_itemclaim GROUP BY status")
        assert cursor.fetchall() == (("succeeded", 30),)
        cursor.execute("SELECT count(*), count(DISTINCT `key`) FROM testapp_execution")
        assert cursor.fetchone() == (30, 30)
