"""An item whose calls cost nothing by any unit has no cost (NULL), whichever path wrote it.

The record path and Python's hand-over write an item's cost only when its call cost something
in some unit; the hand-over routines wrote fanout_add_units(cost, actual), which made a NULL
cost plus an empty one '{}'. The join then saw ``{}`` for an item handed over and ``None`` for
the same item recorded. Here fanout_add_units (PostgreSQL's and MariaDB's) returns NULL for a
sum without units, so both hand-over routines leave such an item's cost NULL.
"""

import importlib

from django.db import migrations

_0013 = importlib.import_module("fanout.migrations.0013_spend")
_0017 = importlib.import_module("fanout.migrations.0017_mariadb_hand_over_spend")

POSTGRESQL = r"""
CREATE OR REPLACE FUNCTION fanout_add_units(a jsonb, b jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_object_agg(
        k, COALESCE((a ->> k)::float8, 0) + COALESCE((b ->> k)::float8, 0))
    FROM jsonb_object_keys(COALESCE(a, '{}'::jsonb) || COALESCE(b, '{}'::jsonb)) AS k
$$;
"""

_POSTGRESQL_BEFORE = _0013.CREATE.split("CREATE OR REPLACE FUNCTION fanout_hand_over_spend")[0]

_MY_RETURN = "    RETURN v_out;\n"
_MY_RETURN_NULL = "    RETURN IF(JSON_LENGTH(v_out) = 0, NULL, v_out);\n"
assert _0017.ADD_UNITS.count(_MY_RETURN) == 1
MARIADB = _0017.ADD_UNITS.replace(_MY_RETURN, _MY_RETURN_NULL)


def _install(schema_editor, postgresql, mariadb):
    connection = schema_editor.connection
    if connection.vendor == "postgresql":
        schema_editor.execute(postgresql)
    elif connection.vendor == "mysql":
        types = {name: _0017.text_type(connection, *where) for name, where in _0017.COLUMNS.items()}
        schema_editor.execute("DROP FUNCTION IF EXISTS fanout_add_units")
        schema_editor.execute(mariadb.format(**types))


def create(apps, schema_editor):
    _install(schema_editor, POSTGRESQL, MARIADB)


def restore(apps, schema_editor):
    _install(schema_editor, _POSTGRESQL_BEFORE, _0017.ADD_UNITS)


class Migration(migrations.Migration):
    dependencies = [("fanout", "0020_spend_roll_after_lock")]

    # MySQL cannot roll back DDL, and Django refuses to run it inside a transaction there.
    operations = [migrations.RunPython(create, restore, atomic=False)]
