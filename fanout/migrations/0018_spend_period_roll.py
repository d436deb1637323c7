"""A pool budget's period that has ended starts again before a hand-over's spend lands in it.

Settling added a call's spend to the period that had ended, and the next claim's roll (the
only one there was) set spent back to zero: the new period never counted the calls that
finished in it before that claim, which a busy pool's hand-overs can put off for hours. The
record path rolls the period first (fanout.spend); here both hand-over routines do the same,
rolling and calendar periods alike, on the database's clock, after the run's accounts and
before the pool's (the lock order): PostgreSQL's fanout_hand_over_spend and MariaDB's
procedure of the same name.
"""

import importlib

from django.db import migrations

_BEFORE = importlib.import_module("fanout.migrations.0015_hand_over_live_waiters").POSTGRESQL
_MARIADB = importlib.import_module("fanout.migrations.0017_mariadb_hand_over_spend")

# ------------------------------------------------------------------------------- PostgreSQL

_POOL_ACCOUNTS = """    IF v_pool <> '' THEN
        UPDATE fanout_spendaccount AS a SET
"""

# The start of the calendar period that holds now, in UTC (date_trunc's week starts Monday).
_PG_CALENDAR_START = (
    "date_trunc(a.calendar, clock_timestamp() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'"
)

_ROLL = f"""    IF v_pool <> '' THEN
        -- A period that has ended starts again first, as a claim rolls it: what the call
        -- spent counts in the period it settles in.
        UPDATE fanout_spendaccount AS a SET
            spent = 0,
            period_started_at = CASE WHEN a.calendar <> '' THEN {_PG_CALENDAR_START}
                ELSE a.period_started_at + floor(
                    extract(epoch FROM clock_timestamp() - a.period_started_at) / a.period
                ) * a.period * interval '1 second' END
        WHERE a.pool = v_pool AND a.period_started_at IS NOT NULL
          AND ((a.calendar <> '' AND a.period_started_at < {_PG_CALENDAR_START})
               OR (a.calendar = '' AND a.period IS NOT NULL
                   AND clock_timestamp() >= a.period_started_at + a.period * interval '1 second'));
        UPDATE fanout_spendaccount AS a SET
"""

assert _BEFORE.count(_POOL_ACCOUNTS) == 1
POSTGRESQL = _BEFORE.replace(_POOL_ACCOUNTS, _ROLL)

# ---------------------------------------------------------------------------- MariaDB/MySQL

_MY_POOL_ACCOUNTS = """        IF v_pool <> '' THEN
            UPDATE fanout_spendaccount SET
                spent = spent + {actual_unit},
"""

# The start of the calendar period that holds now, in UTC (columns hold UTC; no '%' in the
# text, which the driver would take for a parameter).
_MY_NOW = "UTC_TIMESTAMP(6)"
_MY_CALENDAR_START = (
    f"CAST(CASE calendar WHEN 'week' THEN DATE({_MY_NOW}) - INTERVAL WEEKDAY({_MY_NOW}) DAY"
    f" WHEN 'month' THEN DATE({_MY_NOW}) - INTERVAL (DAYOFMONTH({_MY_NOW}) - 1) DAY"
    f" WHEN 'year' THEN DATE({_MY_NOW}) - INTERVAL (DAYOFYEAR({_MY_NOW}) - 1) DAY"
    f" ELSE DATE({_MY_NOW}) END AS DATETIME(6))"
)
_MY_ELAPSED = f"TIMESTAMPDIFF(MICROSECOND, period_started_at, {_MY_NOW})"

_MY_ROLL = f"""        IF v_pool <> '' THEN
            -- A period that has ended starts again first, as a claim rolls it: what the
            -- call spent counts in the period it settles in.
            UPDATE fanout_spendaccount SET
                spent = 0,
                period_started_at = CASE WHEN calendar <> '' THEN {_MY_CALENDAR_START}
                    ELSE period_started_at + INTERVAL ROUND(
                        FLOOR({_MY_ELAPSED} / (period * 1000000)) * period * 1000000
                    ) MICROSECOND END
            WHERE pool = v_pool AND period_started_at IS NOT NULL
              AND ((calendar <> '' AND period_started_at < {_MY_CALENDAR_START})
                   OR (calendar = '' AND period IS NOT NULL
                       AND {_MY_ELAPSED} >= period * 1000000));
            UPDATE fanout_spendaccount SET
                spent = spent + {{actual_unit}},
"""

assert _MARIADB.HAND_OVER_SPEND.count(_MY_POOL_ACCOUNTS) == 1
MARIADB_HAND_OVER_SPEND = _MARIADB.HAND_OVER_SPEND.replace(_MY_POOL_ACCOUNTS, _MY_ROLL)


def create(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        schema_editor.execute(POSTGRESQL)
    elif vendor == "mysql":
        _MARIADB.install(schema_editor, MARIADB_HAND_OVER_SPEND)


def restore(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        schema_editor.execute(_BEFORE)
    elif vendor == "mysql":
        _MARIADB.install(schema_editor, _MARIADB.HAND_OVER_SPEND)


class Migration(migrations.Migration):
    dependencies = [("fanout", "0017_mariadb_hand_over_spend")]

    # MySQL cannot roll back DDL, and Django refuses to run it inside a transaction there.
    operations = [migrations.RunPython(create, restore, atomic=False)]
