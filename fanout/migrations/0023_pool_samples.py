"""The pool page's last hour from samples of the pool (PoolSample), as a run's page draws its
run from run samples: it read every item the pool ran in the hour (1.3 s at a million items on
MariaDB). Each sample counts the items the pool admitted in its window on an index of (pool,
claim time), which also serves the few seconds after the last sample."""

import django.db.models.deletion
from django.db import migrations, models

INDEX = models.Index(fields=["pool", "claimed_at"], name="fanout_item_pool_claimed_idx")


def _forward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        # Built beside live writers: a plain CREATE INDEX would hold every write of the table
        # back while it reads the whole table (MariaDB's InnoDB builds it online by itself).
        schema_editor.execute(
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS fanout_item_pool_claimed_idx "
            "ON fanout_itemclaim (pool, claimed_at)"
        )
    else:
        schema_editor.add_index(apps.get_model("fanout", "ItemClaim"), INDEX)


def _backward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP INDEX CONCURRENTLY IF EXISTS fanout_item_pool_claimed_idx")
    else:
        schema_editor.remove_index(apps.get_model("fanout", "ItemClaim"), INDEX)


class Migration(migrations.Migration):
    # CREATE INDEX CONCURRENTLY runs outside a transaction, and MariaDB/MySQL cannot roll DDL
    # back (Django refuses it inside a transaction there).
    atomic = False

    dependencies = [
        ("fanout", "0022_sample_budget"),
    ]

    operations = [
        migrations.CreateModel(
            name="PoolSample",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("at", models.DateTimeField()),
                ("in_flight", models.PositiveIntegerField(default=0)),
                ("since", models.DateTimeField()),
                ("upto", models.DateTimeField()),
                ("admitted", models.PositiveIntegerField(default=0)),
                (
                    "pool",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="samples",
                        to="fanout.capacitypool",
                    ),
                ),
            ],
            options={
                "ordering": ["pool_id", "at"],
                "indexes": [
                    models.Index(fields=["pool", "at"], name="fanout_poolsample_pool_at_idx")
                ],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("pool", "since"), name="fanout_poolsample_window"
                    )
                ],
            },
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="itemclaim", index=INDEX)],
            database_operations=[migrations.RunPython(_forward, _backward, atomic=False)],
        ),
    ]
