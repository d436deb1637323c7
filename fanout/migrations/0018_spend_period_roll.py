"""A pool budget's period that has ended starts again before a hand-over's spend lands in it.

Settling added a call's spend to the period that had ended, and the next claim's roll (the
only one there was) set spent back to zero: the new period never counted the calls that
finished in it before that claim, which a busy pool's hand-overs can put off for hours. The
record path rolls the period first (fanout.spend); here fanout_hand_over_spend does the same,
on the database's clock, after the run's accounts and before the pool's (the lock order).
"""

import importlib

from django.db import migrations

_BEFORE = importlib.import_module("fanout.migrations.0015_hand_over_live_waiters").POSTGRESQL

_POOL_ACCOUNTS = """    IF v_pool <> '' THEN
        UPDATE fanout_spendaccount AS a SET
"""

_ROLL = """    IF v_pool <> '' THEN
        -- A period that has ended starts again first, as a claim rolls it: what the call
        -- spent counts in the period it settles in.
        UPDATE fanout_spendaccount AS a SET
            spent = 0,
            period_started_at = a.period_started_at + floor(
                extract(epoch FROM clock_timestamp() - a.period_started_at) / a.period
            ) * a.period * interval '1 second'
        WHERE a.pool = v_pool AND a.period IS NOT NULL AND a.period_started_at IS NOT NULL
          AND clock_timestamp() >= a.period_started_at + a.period * interval '1 second';
        UPDATE fanout_spendaccount AS a SET
"""

assert _BEFORE.count(_POOL_ACCOUNTS) == 1
POSTGRESQL = _BEFORE.replace(_POOL_ACCOUNTS, _ROLL)


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(POSTGRESQL)


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_BEFORE)


class Migration(migrations.Migration):
    dependencies = [("fanout", "0017_mariadb_hand_over_spend")]

    operations = [migrations.RunPython(create, restore)]
