"""The host limit's lock: a claimer that cannot take it claims nothing, and says why."""

from __future__ import annotations

import pytest
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection, connections  # noqa: F401 (skipif)

import fanout.claim
from fanout.backends.mysql import MySQL
from fanout.claim import claim
from fanout.conf import host_name
from fanout.errors import is_transient
from fanout.models import ItemClaim, ItemStatus
from tests.conftest import prepare

pytestmark = [
    pytest.mark.skipif("connection.vendor != 'mysql'", reason="MariaDB/MySQL's GET_LOCK"),
    pytest.mark.django_db,
]


def test_a_claim_that_cannot_take_its_hosts_lock_claims_nothing_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Waiting a minute for the lock is what a worker does; this test waits a second.
    monkeypatch.setattr(fanout.claim, "HOST_LOCK_WAIT_SECONDS", 1, raising=False)
    run = prepare("t_ledger", {"n": 3})
    other = connections.create_connection(DEFAULT_DB_ALIAS)
    try:
        # Another claimer on this host holds the definition's host lock (a stuck session).
        with other.cursor() as cursor:
            name = MySQL.lock_name(f"fanout-host:t_ledger:{host_name()}")
            cursor.execute("SELECT GET_LOCK(%s, 0)", [name])
            assert cursor.fetchone()[0] == 1
        with pytest.raises(DatabaseError, match="host lock") as refused:
            claim(run.pk, "owner", 1, 30, 3, None, host_limit=("t_ledger", 1))
        # A worker's drain tries again, as after a lock wait timeout.
        assert is_transient(refused.value)
        assert not ItemClaim.objects.filter(run=run, status=ItemStatus.RUNNING).exists()
    finally:
        other.close()  # its session's locks go with it

    taken = claim(run.pk, "owner", 1, 30, 3, None, host_limit=("t_ledger", 1))
    assert [i.key for i in taken.items] == ["k00000"]


def test_two_host_locks_whose_names_begin_alike_for_64_characters_are_two_locks() -> None:
    """GET_LOCK keeps 64 characters of a name: two long definition names (or host names) that
    begin alike must not make their claimers wait on each other."""
    alike = "fanout-host:" + "thumbnails-for-the-catalogue-of-the-eu-west-1-store-" * 2
    other = connections.create_connection(DEFAULT_DB_ALIAS)
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT GET_LOCK(%s, 0)", [MySQL.lock_name(alike + "a:host-1")])
            assert cursor.fetchone()[0] == 1
        with MySQL().session_lock(alike + "b:host-1", 0) as taken:
            assert taken
        with MySQL().session_lock(alike + "a:host-1", 0) as taken:
            assert not taken
    finally:
        other.close()


def test_a_host_lock_belongs_to_its_database_not_to_the_whole_server() -> None:
    """GET_LOCK's locks are the server's: two projects (or test sessions) on one server, each
    with its own database, have host locks of their own."""
    name = MySQL.lock_name("fanout-host:t_ledger:host-1")

    assert name.startswith(f"{connection.settings_dict['NAME']}:")
    assert len(MySQL.lock_name("x" * 200)) == 64
