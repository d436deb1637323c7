"""PostgreSQL: the hand-over in separate statements, so that its lock order is guaranteed.

0003's function was one statement of data-modifying CTEs: it locked the run's row before the
pool's only because of when PostgreSQL evaluated a subquery. Here the finished item, the next
item, the run's row and the pool's row are written by statements that run in that order. The
counters are no longer clamped at zero (the columns' checks refuse a negative), and an item a
reaper gave back after a crash is left to the claim path, which knows the crash budget.
"""

import importlib

from django.db import migrations

CREATE = r"""
CREATE OR REPLACE FUNCTION fanout_hand_over(
    p_pk bigint,
    p_token uuid,
    p_result jsonb,
    p_elapsed double precision,
    p_run_id bigint,
    p_pool text,
    p_owner text,
    p_new_token uuid,
    p_lease double precision
) RETURNS TABLE (
    done bigint,
    next_id bigint,
    next_key text,
    next_index integer,
    next_payload jsonb,
    next_pool text,
    next_attempt integer,
    next_started_at timestamptz
) LANGUAGE plpgsql AS $$
DECLARE
    v_run bigint;
    v_pool text;
BEGIN
    done := 0;
    UPDATE fanout_itemclaim AS i SET
        status = 'succeeded',
        result = p_result,
        error = '',
        error_class = '',
        finished_at = COALESCE(i.started_at, clock_timestamp())
            + p_elapsed * interval '1 second',
        claim_token = NULL,
        lease_expires_at = NULL
    WHERE i.id = p_pk AND i.claim_token = p_token AND i.status = 'running'
    RETURNING i.run_id, i.pool INTO v_run, v_pool;
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
    RETURNING c.id, c.key::text, c.index, c.payload, c.pool::text, c.attempt, c.started_at
    INTO next_id, next_key, next_index, next_payload, next_pool, next_attempt, next_started_at;

    IF next_id IS NULL THEN
        -- The slot is given up: the run's row, then the pool's, one statement each, so that
        -- they are locked in the order every transaction keeps. No clamp at zero: a counter
        -- that would go negative has drifted, and its column's check says so.
        UPDATE fanout_batchrun SET in_flight = in_flight - 1 WHERE id = v_run;
        IF v_pool <> '' THEN
            UPDATE fanout_capacitypool SET in_flight = in_flight - 1 WHERE name = v_pool;
        END IF;
    END IF;
    RETURN NEXT;
END
$$;
"""

# 0003's body, restored when this migration is reversed.
PREVIOUS = importlib.import_module("fanout.migrations.0003_hand_over_function").CREATE


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(PREVIOUS)


class Migration(migrations.Migration):
    dependencies = [("fanout", "0005_hand_over_procedure")]

    operations = [migrations.RunPython(create, restore)]
