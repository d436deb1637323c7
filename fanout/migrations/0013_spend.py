"""Spend: items' estimates and costs, and budgets (a run's max_spend, a pool's per period)."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("fanout", "0010_run_item_counts"),
    ]

    operations = [
        migrations.AddField(
            model_name="itemclaim",
            name="cost",
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="itemclaim",
            name="estimate",
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.CreateModel(
            name="SpendAccount",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("pool", models.CharField(blank=True, max_length=200, null=True)),
                ("unit", models.CharField(max_length=40)),
                (
                    "budget",
                    models.FloatField(
                        help_text="Most that may be spent (in the period, for a pool)."
                    ),
                ),
                ("spent", models.FloatField(default=0.0)),
                ("reserved", models.FloatField(default=0.0)),
                ("period", models.FloatField(blank=True, null=True)),
                ("period_started_at", models.DateTimeField(blank=True, null=True)),
                (
                    "run",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="budgets",
                        to="fanout.batchrun",
                    ),
                ),
            ],
            options={
                "ordering": ["run_id", "pool", "unit"],
                "constraints": [
                    models.UniqueConstraint(fields=("run", "unit"), name="fanout_spend_run_unit"),
                    models.UniqueConstraint(fields=("pool", "unit"), name="fanout_spend_pool_unit"),
                    models.CheckConstraint(
                        condition=models.Q(
                            ("run__isnull", True), ("pool__isnull", True), _connector="XOR"
                        ),
                        name="fanout_spend_owner",
                    ),
                ],
            },
        ),
    ]
