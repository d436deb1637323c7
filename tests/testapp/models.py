"""Test-only tables: a ledger of handler executions, so duplicates are counted, not guessed."""

from django.db import models


class Execution(models.Model):
    """One row per handler call, written when the handler starts and when it ends."""

    run_id = models.BigIntegerField(db_index=True)
    key = models.CharField(max_length=255)
    attempt = models.PositiveIntegerField()
    pool = models.CharField(max_length=200, blank=True, default="")
    worker = models.CharField(max_length=200)
    started = models.FloatField()  # time.time() at handler start
    ended = models.FloatField(null=True)  # time.time() at handler end; null if it never ended

    def __str__(self) -> str:
        return f"{self.key} attempt {self.attempt} by {self.worker}"


class Widget(models.Model):
    """Rows of a work list given as a queryset."""

    batch = models.CharField(max_length=50, db_index=True)
    name = models.CharField(max_length=100)
    rank = models.IntegerField()

    def __str__(self) -> str:
        return self.name


class Observation(models.Model):
    """Something a handler or a join saw while it ran (e.g. whether it ran in a transaction)."""

    run_id = models.BigIntegerField(null=True, db_index=True)
    key = models.CharField(max_length=255, blank=True, default="")
    name = models.CharField(max_length=100)
    value = models.JSONField(null=True)

    def __str__(self) -> str:
        return f"{self.name}={self.value!r}"
