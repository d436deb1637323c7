"""PostgreSQL: the hand-over as a PL/pgSQL function, so that its plan is made once per session.

A finished item records its outcome and hands its slot to the next pending item in one
statement (fanout.transitions.hand_over). Planning that statement cost more than running it;
inside a function the plan is cached. Other databases take the portable path and get nothing.
"""

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
BEGIN
    RETURN QUERY
    WITH finished AS (
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
        RETURNING i.run_id, i.pool
    ),
    open_slot AS (
        -- Read, not locked: a hand-over never adds to a counter, so a stale read cannot push a
        -- limit over. A limit shrunk below the count, a pause or other waiting runs refuse it.
        SELECT 1 FROM finished AS f
        JOIN fanout_batchrun AS r ON r.id = f.run_id
        LEFT JOIN fanout_capacitypool AS p ON p.name = f.pool
        WHERE r.status = 'running' AND r.in_flight <= r.max_parallel
          AND (f.pool = '' OR (
              NOT p.paused AND p.in_flight <= p.max_concurrency AND p.rate_count IS NULL
              AND (p.backoff_until IS NULL OR p.backoff_until <= clock_timestamp())
              AND (p.waiters - p_run_id::text) = '{}'::jsonb))
    ),
    pick AS (
        SELECT c.id FROM fanout_itemclaim AS c
        WHERE c.run_id = p_run_id AND c.status = 'pending' AND c.pool = p_pool
          AND c.next_attempt_at <= clock_timestamp() AND EXISTS (SELECT 1 FROM open_slot)
        ORDER BY c.index
        LIMIT 1
        FOR UPDATE SKIP LOCKED
    ),
    took AS (
        UPDATE fanout_itemclaim AS c SET
            status = 'running',
            owner = p_owner,
            claim_token = p_new_token,
            lease_expires_at = clock_timestamp() + p_lease * interval '1 second',
            claimed_at = clock_timestamp(),
            started_at = clock_timestamp(),
            finished_at = NULL
        FROM pick WHERE c.id = pick.id
        RETURNING c.id, c.key, c.index, c.payload, c.pool, c.attempt, c.started_at
    ),
    left_run AS (
        UPDATE fanout_batchrun SET in_flight = GREATEST(in_flight - 1, 0)
        WHERE id = (SELECT f.run_id FROM finished AS f) AND NOT EXISTS (SELECT 1 FROM took)
        RETURNING 1
    ),
    left_pool AS (
        -- Reading left_run makes the run's row be locked before the pool's, as everywhere.
        UPDATE fanout_capacitypool SET in_flight = GREATEST(in_flight - 1, 0)
        WHERE name = (SELECT f.pool FROM finished AS f) AND name <> ''
          AND NOT EXISTS (SELECT 1 FROM took) AND (SELECT count(*) FROM left_run) >= 0
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM finished) + 0 * (SELECT count(*) FROM left_pool),
           t.id, t.key::text, t.index, t.payload, t.pool::text, t.attempt, t.started_at
    FROM (SELECT 1) AS one LEFT JOIN took AS t ON true;
END
$$;
"""

DROP = "DROP FUNCTION IF EXISTS fanout_hand_over(bigint, uuid, jsonb, double precision, " \
    "bigint, text, text, uuid, double precision)"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("fanout", "0002_slots_supervision_composition")]

    operations = [migrations.RunPython(create, drop)]
