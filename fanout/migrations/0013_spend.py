"""Spend: items' estimates and costs, and budgets (a run's max_spend, a pool's per period)."""

import django.db.models.deletion
from django.db import migrations, models

# PostgreSQL: the hand-over of an item whose definition counts cost, in one round trip, as
# fanout.spend.after_hand_over does it in Python elsewhere: the finished item's reservation
# becomes what it cost, the next item reserves its estimate, and ``refused`` says a budget
# does not admit it (the worker then records it released, unrun).
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
    v_estimate jsonb;
    v_cost jsonb;
    v_actual jsonb;
    v_next jsonb;
BEGIN
    refused := false;
    SELECT h.done, h.next_id, h.next_key, h.next_index, h.next_payload, h.next_pool,
           h.next_attempt, h.next_started_at
    INTO done, next_id, next_key, next_index, next_payload, next_pool, next_attempt,
         next_started_at
    FROM fanout_hand_over(p_pk, p_token, p_result, p_elapsed, p_run_id, p_pool, p_owner,
                          p_new_token, p_lease) AS h;
    IF done = 0 THEN
        RETURN NEXT;
        RETURN;
    END IF;
    SELECT i.estimate, i.cost INTO v_estimate, v_cost FROM fanout_itemclaim AS i
    WHERE i.id = p_pk;
    -- A success that reported nothing cost its estimate.
    v_actual := COALESCE(p_cost, v_estimate, '{}'::jsonb);
    IF v_actual <> '{}'::jsonb THEN
        UPDATE fanout_itemclaim SET cost = fanout_add_units(v_cost, v_actual) WHERE id = p_pk;
    END IF;
    IF next_id IS NOT NULL THEN
        SELECT i.estimate INTO v_next FROM fanout_itemclaim AS i WHERE i.id = next_id;
    END IF;
    -- The run's accounts, then the pool's: the order every transaction keeps.
    IF p_run_budget THEN
        UPDATE fanout_spendaccount AS a SET
            spent = a.spent + COALESCE((v_actual ->> a.unit)::float8, 0),
            reserved = a.reserved - COALESCE((v_estimate ->> a.unit)::float8, 0)
                + COALESCE((v_next ->> a.unit)::float8, 0)
        WHERE a.run_id = p_run_id;
    END IF;
    IF p_pool <> '' THEN
        UPDATE fanout_spendaccount AS a SET
            spent = a.spent + COALESCE((v_actual ->> a.unit)::float8, 0),
            reserved = a.reserved - COALESCE((v_estimate ->> a.unit)::float8, 0)
                + COALESCE((v_next ->> a.unit)::float8, 0)
        WHERE a.pool = p_pool;
    END IF;
    IF next_id IS NOT NULL THEN
        SELECT EXISTS (
            SELECT 1 FROM fanout_spendaccount AS a
            WHERE ((p_run_budget AND a.run_id = p_run_id) OR (p_pool <> '' AND a.pool = p_pool))
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
        migrations.RunPython(create, drop),
    ]
