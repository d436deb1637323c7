"""A pool's budget may count a calendar period ("month"): spent restarts from zero at each of
its boundaries in UTC, not a fixed length after the period's first use."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('fanout', '0015_hand_over_live_waiters'),
    ]

    operations = [
        migrations.AddField(
            model_name='spendaccount',
            name='calendar',
            field=models.CharField(blank=True, choices=[('day', 'day'), ('week', 'week'), ('month', 'month'), ('year', 'year')], default='', max_length=8),
        ),
    ]
