"""The hand-over's pick gets an index that matches it exactly, and plans that may not sort.

Statistics gathered before a run's items were written say the run has almost no pending items;
PostgreSQL then read every pending row of the run through a lease index and sorted them (3-15 ms
a pick instead of 0.1, from the second run on). With sorting off for the function's statements,
the only plans left walk an index in work-list order; the claim does the same (claim.py).
"""

from django.db import migrations, models


def _no_sort(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER FUNCTION fanout_hand_over SET enable_sort = off")


def _sort(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER FUNCTION fanout_hand_over RESET enable_sort")


class Migration(migrations.Migration):
    dependencies = [
        ("fanout", "0008_mariadb_utc"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="itemclaim",
            index=models.Index(
                condition=models.Q(("status", "pending")),
                fields=["run", "pool", "index"],
                name="fanout_item_pending_idx",
            ),
        ),
        migrations.RunPython(_no_sort, _sort),
    ]
