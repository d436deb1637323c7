"""A sample counts the due items a budget holds (their pool's or their run's) in a column of
its own: they were counted as held by their pool's rate."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("fanout", "0021_spend_no_cost_is_null"),
    ]

    operations = [
        migrations.AddField(
            model_name="runsample",
            name="budget",
            field=models.PositiveIntegerField(db_default=0, default=0),
        ),
    ]
