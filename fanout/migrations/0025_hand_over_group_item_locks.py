"""A grouped hand-over locks its items before any counter row.

fanout_hand_over_group (0024) ran each item's hand-over in turn: the first item whose slot was
given up locked the run's row and its pool's, and only then did the next item's write lock that
item. Every other writer of held items (a record, a release, a stopping worker's record of what
finished) locks the items and then the run's row, so a record of one of the group's later items
held that item and waited for the run's row the group held: deadlock. Here the group locks all
of its items first, in id order, then runs the hand-overs in the caller's order (by pool, then
id), so items come before the run's row and the pools, as everywhere else.
"""

import importlib

from django.db import migrations

_0024 = importlib.import_module("fanout.migrations.0024_hand_over_group")

_BEGIN = "LANGUAGE plpgsql AS $$\nBEGIN\n"
_ITEMS_FIRST = (
    "    -- The items first, in id order, before any hand-over locks a counter row.\n"
    "    PERFORM 1 FROM fanout_itemclaim WHERE id = ANY(p_pks) ORDER BY id FOR NO KEY UPDATE;\n"
)
assert _0024.POSTGRESQL.count(_BEGIN) == 1
POSTGRESQL = _0024.POSTGRESQL.replace(_BEGIN, _BEGIN + _ITEMS_FIRST)
PREVIOUS = _0024.POSTGRESQL  # what the reverse puts back


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(POSTGRESQL)


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(PREVIOUS)


class Migration(migrations.Migration):
    dependencies = [
        ("fanout", "0024_hand_over_group"),
    ]

    operations = [migrations.RunPython(create, restore)]
