"""The durable state of fan-outs: runs, one claim row per item, and capacity pools."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db import models
from django.db.models import Q
from django.utils import timezone

from .clock import CALENDAR_PERIODS, DbNow


class RunStatus(models.TextChoices):
    PENDING = "pending"  # created; its items are being written
    RUNNING = "running"  # items written; workers claim and run them
    JOINING = "joining"  # every item is terminal; the join is running
    SUCCEEDED = "succeeded"  # joined, and the failure policy and join mode call it a success
    FAILED = "failed"  # joined (or the join raised), and it is not a success
    CANCELLED = "cancelled"  # stopped by an operator; pending items were cancelled
    COMPENSATING = "compensating"  # failed (or cancelled to compensate): undoing what succeeded
    COMPENSATED = "compensated"  # every succeeded item was compensated
    COMPENSATION_FAILED = "compensation_failed"  # some compensation used up its attempts


class ItemStatus(models.TextChoices):
    PENDING = "pending"  # waiting to be claimed (possibly not before next_attempt_at)
    RUNNING = "running"  # claimed: owner holds claim_token until lease_expires_at
    WAITING = "waiting"  # handed to a child run (Item.spawn): holds a run slot, no lease or pool
    SUCCEEDED = "succeeded"  # the handler returned; result holds its value
    FAILED = "failed"  # permanent error, attempts used up, or crash budget spent
    CANCELLED = "cancelled"  # the run was cancelled or failed fast before it was claimed
    COMPENSATING = "compensating"  # succeeded; its compensation is due, running or retried
    COMPENSATED = "compensated"  # succeeded, then undone by its compensation
    COMPENSATION_FAILED = "compensation_failed"  # its compensation used up its attempts


TERMINAL_ITEM_STATUSES = (
    ItemStatus.SUCCEEDED,
    ItemStatus.FAILED,
    ItemStatus.CANCELLED,
    ItemStatus.COMPENSATING,
    ItemStatus.COMPENSATED,
    ItemStatus.COMPENSATION_FAILED,
)
TERMINAL_RUN_STATUSES = (
    RunStatus.SUCCEEDED,
    RunStatus.FAILED,
    RunStatus.CANCELLED,
    RunStatus.COMPENSATED,
    RunStatus.COMPENSATION_FAILED,
)


class FailurePolicy(models.TextChoices):
    FAIL_FAST = "fail_fast"  # the first failed item fails the run and cancels unclaimed items
    COLLECT = "collect"  # every item runs; the run fails if the join mode is not satisfied
    TOLERATE = "tolerate"  # every item runs; the run succeeds, failures are in the report


class JoinMode(models.TextChoices):
    ALL = "all"  # the run succeeds only if every item succeeded
    ANY = "any"  # the run succeeds if at least one item succeeded


class BatchRun(models.Model):
    definition = models.CharField(max_length=200, db_index=True)
    run_key = models.CharField(max_length=255, unique=True)
    params = models.JSONField(default=dict, blank=True)
    status = models.CharField(
        max_length=24, choices=RunStatus.choices, default=RunStatus.PENDING, db_index=True
    )
    max_parallel = models.PositiveIntegerField()
    failure_policy = models.CharField(max_length=16, choices=FailurePolicy.choices)
    join_mode = models.CharField(max_length=8, choices=JoinMode.choices)
    executor = models.CharField(max_length=16, default="inline")
    total_items = models.PositiveIntegerField(default=0)
    # Items of this run that are running (live or expired lease), kept exact by every item
    # transition: the run's max_parallel is decided from this counter under this row's lock.
    in_flight = models.PositiveIntegerField(default=0, db_default=0)
    # Materialization is resumable: items below this index are committed.
    materialized_upto = models.PositiveIntegerField(default=0)
    materialize_token = models.UUIDField(null=True, blank=True)
    materialize_lease_expires_at = models.DateTimeField(null=True, blank=True)
    # The join has its own lease so a crashed joiner does not strand the run.
    join_token = models.UUIDField(null=True, blank=True)
    join_lease_expires_at = models.DateTimeField(null=True, blank=True)
    join_result = models.JSONField(null=True, blank=True)
    join_runs = models.PositiveIntegerField(
        default=0,
        help_text="Calls of the join function: more than one after a crash, a raise or a retry.",
    )
    # Joins that raised since the run last (re)opened: retried with backoff up to a limit.
    join_failures = models.PositiveIntegerField(default=0, db_default=0)
    # Times the run was reopened after it ended (a retry of failed items or compensations):
    # each end is a span of its own in the run's trace (fanout.telemetry).
    reopened = models.PositiveIntegerField(default=0, db_default=0)
    # Compensations running now (a FanOut's compensate=): their own budget, under this lock.
    compensating = models.PositiveIntegerField(default=0, db_default=0)
    error = models.TextField(blank=True)
    # Its items by status when they were pruned and the run kept (fanout_prune --keep-runs).
    item_counts = models.JSONField(null=True, blank=True)
    # Why no worker could run it (a misconfigured or outdated worker), until one does.
    stalled = models.TextField(blank=True, default="")
    # Supervision: until when one worker has taken it up (the fleet's election).
    tended_until = models.DateTimeField(null=True, blank=True)
    # The supervisor's audit (fanout.audit): times in_flight differed from the rows and was
    # corrected, and when it last was. Anything but 0 is a bug worth reporting.
    counter_drift = models.PositiveIntegerField(default=0, db_default=0)
    drift_noted_at = models.DateTimeField(null=True, blank=True)
    # A child run (Item.spawn): the item it decides. Its outcome becomes that item's.
    parent_item = models.OneToOneField(
        "ItemClaim",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="child_run",
    )
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-pk"]
        permissions = [
            ("retry_run", "Can retry the failed items of a run"),
            ("cancel_run", "Can cancel a run"),
            ("dispatch_run", "Can re-dispatch a run's workers"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(max_parallel__gte=1), name="fanout_run_max_parallel_gte_1"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.definition} #{self.pk} ({self.status})"

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_RUN_STATUSES

    @property
    def duration(self) -> timedelta | None:
        if self.started_at is None:
            return None
        return (self.finished_at or timezone.now()) - self.started_at


def _now(now: datetime | None) -> Any:
    """A given time, or the database's clock read in the statement itself."""
    if now is not None:
        return now
    return DbNow()


class ItemClaimQuerySet(models.QuerySet["ItemClaim"]):
    """Each status filter, named once. Without ``now`` they read the database's clock."""

    def pending_due(self, now: datetime | None = None) -> ItemClaimQuerySet:
        return self.filter(status=ItemStatus.PENDING, next_attempt_at__lte=_now(now))

    def expired(self, now: datetime | None = None) -> ItemClaimQuerySet:
        return self.filter(status=ItemStatus.RUNNING, lease_expires_at__lte=_now(now))

    def claimable(self, now: datetime | None = None) -> ItemClaimQuerySet:
        at = _now(now)
        return self.filter(
            Q(status=ItemStatus.PENDING, next_attempt_at__lte=at)
            | Q(status=ItemStatus.RUNNING, lease_expires_at__lte=at)
        )

    def in_flight(self, now: datetime | None = None) -> ItemClaimQuerySet:
        """Items whose lease is live."""
        return self.filter(status=ItemStatus.RUNNING, lease_expires_at__gt=_now(now))

    def running(self) -> ItemClaimQuerySet:
        """Items that hold a slot of their pool (and of their run): running ones."""
        return self.filter(status=ItemStatus.RUNNING)

    def holding_pool_slots(self) -> ItemClaimQuerySet:
        """What a pool's in_flight counts: running items, and compensations under way
        (claimed and not yet recorded: a takeover keeps the slot its dead worker held)."""
        return self.filter(
            Q(status=ItemStatus.RUNNING)
            | Q(status=ItemStatus.COMPENSATING, claim_token__isnull=False)
        )

    def leased(self, now: datetime | None = None) -> ItemClaimQuerySet:
        """Items or compensations whose lease is live: what a lease keeper renews."""
        return self.filter(
            status__in=(ItemStatus.RUNNING, ItemStatus.COMPENSATING),
            lease_expires_at__gt=_now(now),
        )

    def holding_run_slots(self) -> ItemClaimQuerySet:
        """What a run's in_flight counts: running items, and items waiting on a child run."""
        return self.filter(status__in=(ItemStatus.RUNNING, ItemStatus.WAITING))

    def held(self, token: Any) -> ItemClaimQuerySet:
        """Items still held under ``token``: the fence of every write by an owner."""
        return self.filter(claim_token=token, status=ItemStatus.RUNNING)

    def terminal(self) -> ItemClaimQuerySet:
        return self.filter(status__in=TERMINAL_ITEM_STATUSES)

    def unfinished(self) -> ItemClaimQuerySet:
        return self.filter(status__in=(ItemStatus.PENDING, ItemStatus.RUNNING, ItemStatus.WAITING))


class ItemClaim(models.Model):
    run = models.ForeignKey(BatchRun, on_delete=models.CASCADE, related_name="items")
    key = models.CharField(max_length=255)
    index = models.PositiveIntegerField()
    payload = models.JSONField(null=True, blank=True)
    pool = models.CharField(max_length=200, blank=True, default="")
    status = models.CharField(max_length=24, choices=ItemStatus.choices, default=ItemStatus.PENDING)
    owner = models.CharField(max_length=200, blank=True, default="")
    claim_token = models.UUIDField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    # attempt is the number the handler sees; only handler exceptions advance it.
    attempt = models.PositiveIntegerField(default=1)
    # Claims that ended with the owner gone (lease expired while running).
    crashes = models.PositiveIntegerField(default=0)
    # Attempts of its compensation (a FanOut's compensate=), once it succeeded and its run
    # failed; the compensation's own lease uses claim_token and lease_expires_at.
    compensation_attempt = models.PositiveIntegerField(default=0, db_default=0)
    next_attempt_at = models.DateTimeField(default=timezone.now)
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    error_class = models.CharField(max_length=200, blank=True, default="")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # What one call is expected to cost, {unit: amount}, from the definition's cost= when the
    # item was written; held against budgets while the item runs (fanout.spend).
    estimate = models.JSONField(null=True, blank=True)
    # What its calls cost, {unit: amount}: reported ones, and the estimates of calls cut off by
    # a crash (nobody knows what those spent).
    cost = models.JSONField(null=True, blank=True)

    objects = ItemClaimQuerySet.as_manager()

    class Meta:
        ordering = ["run_id", "index"]
        permissions = [
            ("retry_item", "Can retry failed items"),
            ("cancel_item", "Can cancel pending items"),
            ("force_release_item", "Can take an item's lease away from its holder"),
        ]
        constraints = [
            models.UniqueConstraint(fields=["run", "key"], name="fanout_item_unique_run_key"),
            models.UniqueConstraint(fields=["run", "index"], name="fanout_item_unique_run_index"),
        ]
        indexes = [
            # Plain composite indexes (no partial ones: MariaDB and MySQL have none).
            # The claim: a run's pending items in index order, and its expired leases.
            models.Index(fields=["run", "status", "index"], name="fanout_item_claim_idx"),
            models.Index(
                fields=["run", "status", "lease_expires_at"], name="fanout_item_run_lease_idx"
            ),
            # The hand-over's pick has a partial index of its own on PostgreSQL, made by
            # migration 0009 (MariaDB/MySQL have none, and Django would warn of it there).
            # Live leases per pool: fair share, the admin's gauges, per-host counts.
            models.Index(
                fields=["pool", "status", "lease_expires_at"], name="fanout_item_pool_lease_idx"
            ),
            # The items a run ended in a window of time: its samples and its charts' tail.
            models.Index(fields=["run", "finished_at"], name="fanout_item_run_finished_idx"),
            # The items a pool admitted in a window of time: its samples and its chart's tail.
            models.Index(fields=["pool", "claimed_at"], name="fanout_item_pool_claimed_idx"),
            # A run page's counts by status and pool and of its failures by error class have
            # indexes of their own that differ by database, made by migration 0019.
        ]

    def __str__(self) -> str:
        return f"{self.key} ({self.status})"

    @property
    def duration(self) -> timedelta | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at


class ItemAttempt(models.Model):
    """One attempt of an item that did not succeed: its history survives retries.

    Written only for failed attempts (a handler's exception, a lost worker), so the hot path of
    succeeding items writes nothing here.
    """

    item = models.ForeignKey(ItemClaim, on_delete=models.CASCADE, related_name="attempts")
    attempt = models.PositiveIntegerField()
    owner = models.CharField(max_length=200, blank=True, default="")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    error_class = models.CharField(max_length=200, blank=True, default="")
    error = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["item_id", "pk"]

    def __str__(self) -> str:
        return f"{self.item_id} attempt {self.attempt}: {self.error_class}"

    @property
    def duration(self) -> timedelta | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at


class RunSample(models.Model):
    """What a running run's unfinished items were doing at one moment: the rows keep no
    history of waits, so the supervisor that tends the run writes one of these at most every
    FANOUT_SAMPLE_SECONDS, for the run page's chart of what items waited on."""

    run = models.ForeignKey(BatchRun, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField()
    running = models.PositiveIntegerField(default=0)  # under a lease
    ready = models.PositiveIntegerField(default=0)  # claimable: waiting for a free worker
    max_parallel = models.PositiveIntegerField(default=0)  # claimable, the run at max_parallel
    retry_due = models.PositiveIntegerField(default=0)  # pending until their retry is due
    pool_full = models.PositiveIntegerField(default=0)  # due, their pool has no free slot
    rate_limited = models.PositiveIntegerField(default=0)  # due, their pool's rate holds them
    throttled = models.PositiveIntegerField(default=0)  # due, their pool backs off (Throttled)
    # Due, a budget holds them: their pool's is spent, or their run's (max_spend).
    budget = models.PositiveIntegerField(default=0, db_default=0)
    paused = models.PositiveIntegerField(default=0)  # due, their pool is paused or missing
    child_runs = models.PositiveIntegerField(default=0)  # handed to a child run (Item.spawn)
    # The items that ended in a window of the run's life: (the previous sample's upto, upto].
    # Summed, the samples give the run page's throughput, durations and attempts without
    # reading the items; a sample of an older release has no window (upto is null).
    upto = models.DateTimeField(null=True, blank=True)
    finished = models.PositiveIntegerField(default=0)  # ended in the window
    failed = models.PositiveIntegerField(default=0)  # of them, failed
    durations = models.JSONField(default=list, blank=True)  # counts per charts.DURATION_EDGES
    attempts = models.JSONField(default=dict, blank=True)  # {attempt it ended at: count}
    reopened = models.PositiveIntegerField(default=0)  # the run's reopened count when taken

    class Meta:
        ordering = ["run_id", "at"]
        indexes = [models.Index(fields=["run", "at"], name="fanout_sample_run_at_idx")]

    def __str__(self) -> str:
        return f"run {self.run_id} at {self.at:%H:%M:%S}"


class CapacityPool(models.Model):
    """A named capacity owner (provider, account, workspace) shared by every run."""

    name = models.CharField(max_length=200, unique=True)
    max_concurrency = models.PositiveIntegerField(
        default=10, help_text="Items of this pool in flight at once, across all runs and hosts."
    )
    rate_count = models.PositiveIntegerField(
        null=True, blank=True, help_text="Admissions per period; empty for no rate limit."
    )
    rate_period = models.FloatField(default=1.0, help_text="Seconds in the rate's period.")
    rate_unit = models.CharField(
        max_length=40,
        blank=True,
        default="",
        help_text="What the rate counts: empty for calls, else a unit of the items' estimates "
        "(e.g. tokens: each admission takes its estimate, corrected by what the call cost).",
    )
    burst = models.PositiveIntegerField(
        null=True, blank=True, help_text="Admissions allowed at once; defaults to the rate count."
    )
    paused = models.BooleanField(default=False)
    # Items of this pool that are running (live or expired lease), across every run; kept exact
    # by every item transition and decided under this row's lock.
    in_flight = models.PositiveIntegerField(default=0, db_default=0)
    # Token bucket state, written only under this row's lock.
    tokens = models.FloatField(null=True, blank=True)
    tokens_at = models.DateTimeField(null=True, blank=True)
    # Runs refused by this full pool, {run id: until (epoch seconds)}: they get a fair share.
    waiters = models.JSONField(default=dict, blank=True)
    # Set by Throttled(retry_after): nothing is admitted before this time.
    backoff_until = models.DateTimeField(null=True, blank=True)
    # The supervisor's audit (fanout.audit): until when one supervisor has taken the pool up
    # (at most one audit per period), and the times in_flight differed from the rows.
    audited_until = models.DateTimeField(null=True, blank=True)
    counter_drift = models.PositiveIntegerField(default=0, db_default=0)
    drift_noted_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        permissions = [("pause_pool", "Can pause and resume a pool")]
        constraints = [
            models.CheckConstraint(
                condition=Q(rate_count__isnull=True) | Q(rate_count__gte=1),
                name="fanout_pool_rate_count_gte_1",
            ),
            models.CheckConstraint(condition=Q(rate_period__gt=0), name="fanout_pool_period_gt_0"),
            models.CheckConstraint(
                condition=Q(burst__isnull=True) | Q(burst__gte=1), name="fanout_pool_burst_gte_1"
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def capacity(self) -> int | None:
        """The token bucket's size, or None without a rate limit."""
        if self.rate_count is None:
            return None
        return self.burst or self.rate_count

    def describe_rate(self) -> str:
        if self.rate_count is None:
            return "unlimited"
        unit = f" {self.rate_unit}" if self.rate_unit else ""
        return f"{self.rate_count}{unit}/{self.rate_period:g}s (burst {self.capacity}{unit})"


class PoolSample(models.Model):
    """A pool at one moment: its items running, and the items it admitted in a window of time,
    (since, upto]. The supervisor elected to audit the pool writes one at most every
    FANOUT_SAMPLE_SECONDS, each window starting where the last ended, so that the pool page
    draws its last hour from a few hundred of these instead of the items that ran in it.
    A pool keeps its last POOL_SAMPLES_KEPT (fanout.sample) of them."""

    pool = models.ForeignKey(CapacityPool, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField()
    in_flight = models.PositiveIntegerField(default=0)  # its items running at ``at``
    since = models.DateTimeField()
    upto = models.DateTimeField()
    admitted = models.PositiveIntegerField(default=0)  # its items claimed in (since, upto]

    class Meta:
        ordering = ["pool_id", "at"]
        indexes = [models.Index(fields=["pool", "at"], name="fanout_poolsample_pool_at_idx")]
        constraints = [
            # Two supervisors that sampled the pool at once count one window once: the second
            # one's row is refused.
            models.UniqueConstraint(fields=["pool", "since"], name="fanout_poolsample_window"),
        ]

    def __str__(self) -> str:
        return f"pool {self.pool_id} at {self.at:%H:%M:%S}"


class SpendAccount(models.Model):
    """One unit of a budget: a run's (max_spend) or a pool's (over a period).

    ``reserved`` is the sum of the estimates of the items that run against it, ``spent`` what
    settled; admission stops when spent plus reserved would pass the budget. Both move only
    under this row's lock, in the transaction that moves the items (fanout.spend).
    """

    run = models.ForeignKey(
        BatchRun, null=True, blank=True, on_delete=models.CASCADE, related_name="budgets"
    )
    # NULL, not "": a run's accounts and a pool's are told apart, and unique, by which is NULL.
    pool = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001
    unit = models.CharField(max_length=40)
    budget = models.FloatField(help_text="Most that may be spent (in the period, for a pool).")
    spent = models.FloatField(default=0.0)
    reserved = models.FloatField(default=0.0)
    # A pool's period in seconds; when it has passed since period_started_at, spent restarts
    # from zero. None: the budget never rolls over (a run's), unless it has a calendar period.
    period = models.FloatField(null=True, blank=True)
    # A calendar period instead ("day", "week", "month", "year"): spent restarts from zero at
    # each of its boundaries in UTC, by the database's clock.
    calendar = models.CharField(
        max_length=8, blank=True, default="", choices=[(c, c) for c in CALENDAR_PERIODS]
    )
    period_started_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run_id", "pool", "unit"]
        constraints = [
            models.UniqueConstraint(fields=["run", "unit"], name="fanout_spend_run_unit"),
            models.UniqueConstraint(fields=["pool", "unit"], name="fanout_spend_pool_unit"),
            models.CheckConstraint(
                condition=Q(run__isnull=True) ^ Q(pool__isnull=True), name="fanout_spend_owner"
            ),
        ]

    def __str__(self) -> str:
        owner = f"run {self.run_id}" if self.run_id else f"pool {self.pool}"
        return f"{owner}: {self.unit} {self.spent:g}+{self.reserved:g}/{self.budget:g}"
