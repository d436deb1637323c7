"""A hand-over rolls its pool's budget period on the clock read after it holds the budget.

The roll of 0018 decided whether the period had ended before it waited for the budget's row
(a claim of another run holds it for its whole transaction): PostgreSQL leaves a row that does
not match the roll's condition unlocked, and the add that follows waits instead; MariaDB's
UTC_TIMESTAMP() is the time its statement began. A period that ended during the wait was not
rolled, the call's spend went into the period gone, and the next claim's roll wiped it. Both
routines now lock the pool's budgets first, in the claims' order (by unit), and only then roll
and add: PostgreSQL's fanout_hand_over_spend and MariaDB's procedure of the same name.
"""

import importlib

from django.db import migrations

_BEFORE = importlib.import_module("fanout.migrations.0018_spend_period_roll")
_MARIADB = importlib.import_module("fanout.migrations.0017_mariadb_hand_over_spend")

_LOCKED = """
        -- The pool's budgets are locked first, in the claims' order: the roll below reads the
        -- clock once it holds them, not before a wait for another transaction's lock.
"""

# ------------------------------------------------------------------------------- PostgreSQL

_PG_ROLL = """    IF v_pool <> '' THEN
        -- A period that has ended starts again first"""

_PG_LOCK = (
    "    IF v_pool <> '' THEN"
    + _LOCKED.rstrip("\n")
    + """
        PERFORM 1 FROM fanout_spendaccount AS a WHERE a.pool = v_pool ORDER BY a.unit
            FOR UPDATE;
        -- A period that has ended starts again first"""
)

assert _BEFORE.POSTGRESQL.count(_PG_ROLL) == 1
POSTGRESQL = _BEFORE.POSTGRESQL.replace(_PG_ROLL, _PG_LOCK)

# ---------------------------------------------------------------------------- MariaDB/MySQL

_MY_DECLARE = "    DECLARE v_refused INT DEFAULT 0;\n"
_MY_ROLL = """        IF v_pool <> '' THEN
            -- A period that has ended starts again first"""
_MY_LOCK = (
    "        IF v_pool <> '' THEN"
    + _LOCKED.replace("\n        --", "\n            --").rstrip("\n")
    + """
            -- (UTC_TIMESTAMP() is the time its statement began; the (pool, unit) index
            -- gives the order.)
            SELECT COUNT(*) INTO v_locked FROM fanout_spendaccount
            WHERE pool = v_pool FOR UPDATE;
            -- A period that has ended starts again first"""
)

assert _BEFORE.MARIADB_HAND_OVER_SPEND.count(_MY_ROLL) == 1
assert _BEFORE.MARIADB_HAND_OVER_SPEND.count(_MY_DECLARE) == 1
MARIADB_HAND_OVER_SPEND = _BEFORE.MARIADB_HAND_OVER_SPEND.replace(_MY_ROLL, _MY_LOCK).replace(
    _MY_DECLARE, _MY_DECLARE + "    DECLARE v_locked INT DEFAULT 0;\n"
)


def create(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        schema_editor.execute(POSTGRESQL)
    elif vendor == "mysql":
        _MARIADB.install(schema_editor, MARIADB_HAND_OVER_SPEND)


def restore(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        schema_editor.execute(_BEFORE.POSTGRESQL)
    elif vendor == "mysql":
        _MARIADB.install(schema_editor, _BEFORE.MARIADB_HAND_OVER_SPEND)


class Migration(migrations.Migration):
    dependencies = [("fanout", "0019_run_counts_index")]

    # MySQL cannot roll back DDL, and Django refuses to run it inside a transaction there.
    operations = [migrations.RunPython(create, restore, atomic=False)]
