"""A run sample counts the items that ended in its window, so that the run page sums a few
hundred samples instead of reading a million items; an index finds a window's items."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('fanout', '0013_spend'),
    ]

    operations = [
        migrations.AddField(
            model_name='runsample',
            name='attempts',
            field=models.JSONField(blank=True, default=dict),
        ),
        migrations.AddField(
            model_name='runsample',
            name='durations',
            field=models.JSONField(blank=True, default=list),
        ),
        migrations.AddField(
            model_name='runsample',
            name='failed',
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AddField(
            model_name='runsample',
            name='finished',
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AddField(
            model_name='runsample',
            name='reopened',
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AddField(
            model_name='runsample',
            name='upto',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddIndex(
            model_name='itemclaim',
            index=models.Index(fields=['run', 'finished_at'], name='fanout_item_run_finished_idx'),
        ),
    ]
