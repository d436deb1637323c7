"""Spend: items' estimates and costs, and budgets (a run's max_spend, a pool's per period)."""

import django.db.models.deletion
from django.db import migrations, models

# PostgreSQL: the hand-over of an item whose definition counts cost, in one round trip, as
# fanout.spend.after_hand_over does it in Python elsewhere: 0006's fanout_hand_over, whose
# writes of the finished and the next item also write the cost and read the estimate (a second
# update of the item would write its row twice), then the budgets: the finished item's
# reservation becomes what it cost, the next item reserves its estimate, and ``refused`` says a
# budget does not admit it (the worker then records it released, unrun).
CREATE = r"""
CREATE OR REPLACE FUNCTION fanout_add_units(a jsonb, b jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT COALESCE(jsonb_object_agg(
        k, COALESCE((a ->> k)::float8, 0) + COALESCE((b ->> k)::float8, 0)), '{}'::jsonb)
    FROM jsonb_object_keys(COALESCE(a, '{}'::jsonb) || COALESCE(b, '{}'::jsonb)) AS k
$$;

CREATE OR REPLACE FUNCTION fanout_hand_over_spend(
    p_pk bigint,
    p_token uuid,
    p_result jsonb,
    p_elapsed double precision,
    p_run_id bigint,
    p_pool text,
    p_owner text,
    p_new_token uuid,
    p_lease double precision,
    p_cost jsonb,
    p_run_budget boolean
) RETURNS TABLE (
    done bigint,
    next_id bigint,
    next_key text,
    next_index integer,
    next_payload jsonb,
    next_pool text,
    next_attempt integer,
    next_started_at timestamptz,
    refused boolean
) LANGUAGE plpgsql AS $$
DECLARE
    v_run bigint;
    v_pool text;
    v_estimate jsonb;
    v_actual jsonb;
    v_next jsonb;
BEGIN
    done := 0;
    refused := false;
    UPDATE fanout_itemclaim AS i SET
        status = 'succeeded',
        result = p_result,
        error = '',
        error_class = '',
        finished_at = COALESCE(i.started_at, clock_timestamp())
            + p_elapsed * interval '1 second',
        claim_token = NULL,
        lease_expires_at = NULL,
        -- What the call reported; a success that reported nothing cost its estimate.
        cost = CASE WHEN COALESCE(p_cost, i.estimate) IS NULL THEN i.cost
                    ELSE fanout_add_units(i.cost, COALESCE(p_cost, i.estimate)) END
    WHERE i.id = p_pk AND i.claim_token = p_token AND i.status = 'running'
    RETURNING i.run_id, i.pool, i.estimate, COALESCE(p_cost, i.estimate)
    INTO v_run, v_pool, v_estimate, v_actual;
    IF NOT FOUND THEN
        -- This worker had lost the item: nothing is written, no slot moves.
        RETURN NEXT;
        RETURN;
    END IF;
    done := 1;

    WITH open_slot AS (
        -- Read, not locked: a hand-over never adds to a counter, so a stale read cannot push a
        -- limit over. A limit shrunk below the count, a pause or other waiting runs refuse it.
        SELECT 1 FROM fanout_batchrun AS r
        LEFT JOIN fanout_capacitypool AS p ON p.name = v_pool
        WHERE r.id = v_run AND r.status = 'running' AND r.in_flight <= r.max_parallel
          AND (v_pool = '' OR (
              NOT p.paused AND p.in_flight <= p.max_concurrency AND p.rate_count IS NULL
              AND (p.backoff_until IS NULL OR p.backoff_until <= clock_timestamp())
              AND (p.waiters - p_run_id::text) = '{}'::jsonb))
    ),
    pick AS (
        -- An item a reaper gave back after a crash (crashes > 0) is the claim path's: it alone
        -- knows the run's crash budget, and fails the item once it is spent.
        SELECT c.id FROM fanout_itemclaim AS c
        WHERE c.run_id = p_run_id AND c.status = 'pending' AND c.pool = p_pool
          AND c.crashes = 0
          AND c.next_attempt_at <= clock_timestamp() AND EXISTS (SELECT 1 FROM open_slot)
        ORDER BY c.index
        LIMIT 1
        FOR UPDATE SKIP LOCKED
    )
    UPDATE fanout_itemclaim AS c SET
        status = 'running',
        owner = p_owner,
        claim_token = p_new_token,
        lease_expires_at = clock_timestamp() + p_lease * interval '1 second',
        claimed_at = clock_timestamp(),
        started_at = clock_timestamp(),
        finished_at = NULL
    FROM pick WHERE c.id = pick.id
    RETURNING c.id, c.key::text, c.index, c.payload, c.pool::text, c.attempt, c.started_at,
        c.estimate
    INTO next_id, next_key, next_index, next_payload, next_pool, next_attempt, next_started_at,
        v_next;

    IF next_id IS NULL THEN
        -- The slot is given up: the run's row, then the pool's, one statement each, so that
        -- they are locked in the order every transaction keeps. No clamp at zero: a counter
        -- that would go negative has drifted, and its column's check says so.
        UPDATE fanout_batchrun SET in_flight = in_flight - 1 WHERE id = v_run;
        IF v_pool <> '' THEN
            UPDATE fanout_capacitypool SET in_flight = in_flight - 1 WHERE name = v_pool;
        END IF;
    END IF;

    -- A pool whose rate counts a unit took the estimate from its bucket: what the call cost
    -- beyond (or below) it is taken (or given back) now.
    IF v_pool <> '' AND v_actual IS DISTINCT FROM v_estimate THEN
        UPDATE fanout_capacitypool AS p SET
            tokens = p.tokens - COALESCE((v_actual ->> p.rate_unit)::float8, 0)
                + COALESCE((v_estimate ->> p.rate_unit)::float8, 0)
        WHERE p.name = v_pool AND p.rate_unit <> '' AND p.tokens IS NOT NULL;
    END IF;

    -- Budgets: the run's accounts, then the pool's (the order every transaction keeps).
    IF p_run_budget THEN
        UPDATE fanout_spendaccount AS a SET
            spent = a.spent + COALESCE((v_actual ->> a.unit)::float8, 0),
            reserved = a.reserved - COALESCE((v_estimate ->> a.unit)::float8, 0)
                + COALESCE((v_next ->> a.unit)::float8, 0)
        WHERE a.run_id = v_run;
    END IF;
    IF v_pool <> '' THEN
        UPDATE fanout_spendaccount AS a SET
            spent = a.spent + COALESCE((v_actual ->> a.unit)::float8, 0),
            reserved = a.reserved - COALESCE((v_estimate ->> a.unit)::float8, 0)
                + COALESCE((v_next ->> a.unit)::float8, 0)
        WHERE a.pool = v_pool;
    END IF;
    IF next_id IS NOT NULL AND (p_run_budget OR v_pool <> '') THEN
        -- The next item's reservation is taken: a budget it passes (or that was reached
        -- already) refuses it, and the worker records it released, unrun.
        SELECT EXISTS (
            SELECT 1 FROM fanout_spendaccount AS a
            WHERE ((p_run_budget AND a.run_id = v_run) OR (v_pool <> '' AND a.pool = v_pool))
              AND (a.spent + a.reserved > a.budget + 1e-9
                   OR (COALESCE((v_next ->> a.unit)::float8, 0) = 0
                       AND a.spent + a.reserved >= a.budget))
        ) INTO refused;
    END IF;
    RETURN NEXT;
END
$$;
"""

DROP = """
DROP FUNCTION IF EXISTS fanout_hand_over_spend(bigint, uuid, jsonb, double precision, bigint,
    text, text, uuid, double precision, jsonb, boolean);
DROP FUNCTION IF EXISTS fanout_add_units(jsonb, jsonb);
"""


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [
        ("fanout", "0012_run_samples"),
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
        migrations.AddField(
            model_name="capacitypool",
            name="rate_unit",
            field=models.CharField(
                blank=True,
                default="",
                help_text="What the rate counts: empty for calls, else a unit of the items' "
                "estimates (e.g. tokens: each admission takes its estimate, corrected by what the "
                "call cost).",
                max_length=40,
            ),
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
        migrations.RunPython(create, drop),
    ]
