"""The hand-over's pick gets an index that matches it exactly, and plans that may not sort.

Statistics gathered before a run's items were written say the run has almost no pending items;
PostgreSQL then read every pending row of the run through a lease index and sorted them (3-15 ms
a pick instead of 0.1, from the second run on). With sorting off for the function's statements,
the only plans left walk an index in work-list order; the claim does the same (claim.py).
"""

from django.db import migrations


# A run's pending items of one pool in work-list order: exactly the pick's WHERE and ORDER BY.
# PostgreSQL only: MariaDB/MySQL have no partial indexes (a model index with a condition would
# make Django warn on every check there).
_CREATE = (
    'CREATE INDEX IF NOT EXISTS fanout_item_pending_idx ON fanout_itemclaim (run_id, pool, "index") '
    "WHERE status = 'pending'"
)


def _forward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_CREATE)
        schema_editor.execute("ALTER FUNCTION fanout_hand_over SET enable_sort = off")


def _backward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER FUNCTION fanout_hand_over RESET enable_sort")
        schema_editor.execute("DROP INDEX IF EXISTS fanout_item_pending_idx")


class Migration(migrations.Migration):
    dependencies = [
        ("fanout", "0008_mariadb_utc"),
    ]

    operations = [migrations.RunPython(_forward, _backward)]
