"""The hand-over counts a run as waiting for a pool only until its registration runs out.

A run refused by a full pool registers on the pool's row as waiting until a time two seconds
ahead (fanout.claim.fair_share); the claim, and the admission rule (fanout.pools.hands_over),
count only registrations that have not run out. The hand-over routines counted every entry:
once another run's registration had run out (that run finished, or was served), each finished
item gave its slot up instead of handing it on, until some claim of the pool cleared the entry.
Here fanout_hand_over and fanout_hand_over_spend (PostgreSQL) and the fanout_hand_over
procedure (MariaDB/MySQL) read the registrations' times, on the database's clock.

Both functions plan without sorts, as 0009 made fanout_hand_over do (CREATE OR REPLACE resets
a function's settings): their picks walk fanout_item_pending_idx in work-list order even for a
run that statistics have not seen yet.
"""

import re

from django.db import migrations

POSTGRESQL = r"""
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
) LANGUAGE plpgsql
-- CREATE OR REPLACE drops what ALTER FUNCTION set (0009): the pick's plans must not sort.
SET enable_sort = off AS $$
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
              -- No other run waits: none is registered, or every registration has run out.
              AND ((p.waiters - p_run_id::text) = '{}'::jsonb
                   OR NOT jsonb_path_exists(p.waiters - p_run_id::text, '$.* ? (@ > $now)',
                       jsonb_build_object('now', extract(epoch FROM clock_timestamp()))))))
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
) LANGUAGE plpgsql
-- CREATE OR REPLACE drops what ALTER FUNCTION set (0009): the pick's plans must not sort.
SET enable_sort = off AS $$
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
              -- No other run waits: none is registered, or every registration has run out.
              AND ((p.waiters - p_run_id::text) = '{}'::jsonb
                   OR NOT jsonb_path_exists(p.waiters - p_run_id::text, '$.* ? (@ > $now)',
                       jsonb_build_object('now', extract(epoch FROM clock_timestamp()))))))
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

MYSQL = r"""
CREATE PROCEDURE fanout_hand_over(
    IN p_pk BIGINT,
    IN p_token VARCHAR(36) {token},
    IN p_result LONGTEXT {result},
    IN p_elapsed DOUBLE,
    IN p_run_id BIGINT,
    IN p_pool VARCHAR(200) {pool},
    IN p_owner VARCHAR(200) {owner},
    IN p_new_token VARCHAR(36) {token},
    IN p_lease DOUBLE
)
MODIFIES SQL DATA
BEGIN
    -- Under autocommit each statement of a procedure would commit on its own: make it one
    -- transaction, unless the caller's is already open (then it commits or rolls back).
    DECLARE v_own BOOLEAN DEFAULT @@autocommit = 1;
    DECLARE v_done INT DEFAULT 0;
    DECLARE v_open INT DEFAULT 0;
    DECLARE v_run BIGINT DEFAULT NULL;
    DECLARE v_pool VARCHAR(200) {pool_name} DEFAULT NULL;
    DECLARE v_next BIGINT DEFAULT NULL;
    DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_next = NULL;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        IF v_own THEN
            ROLLBACK;
        END IF;
        RESIGNAL;
    END;

    IF v_own THEN
        START TRANSACTION;
    END IF;

    UPDATE fanout_itemclaim SET
        status = 'succeeded',
        result = p_result,
        error = '',
        error_class = '',
        finished_at = COALESCE(started_at, UTC_TIMESTAMP(6))
            + INTERVAL ROUND(p_elapsed * 1000000) MICROSECOND,
        claim_token = NULL,
        lease_expires_at = NULL
    WHERE id = p_pk AND claim_token = p_token AND status = 'running';
    SET v_done = ROW_COUNT();

    IF v_done > 0 THEN
        SELECT run_id, pool INTO v_run, v_pool FROM fanout_itemclaim WHERE id = p_pk;

        -- Read, not locked: a hand-over never adds to a counter, so a stale read cannot push a
        -- limit over. A limit shrunk below the count, a pause or other waiting runs refuse it.
        SELECT COUNT(*) INTO v_open
        FROM fanout_batchrun AS r
        LEFT JOIN fanout_capacitypool AS p ON p.name = v_pool
        WHERE r.id = v_run AND r.status = 'running' AND r.in_flight <= r.max_parallel
          AND (v_pool = '' OR (
              NOT p.paused AND p.in_flight <= p.max_concurrency AND p.rate_count IS NULL
              AND (p.backoff_until IS NULL OR p.backoff_until <= UTC_TIMESTAMP(6))
              AND NOT EXISTS (
                  -- Another run waits: its registration runs out at a time still ahead.
                  SELECT 1 FROM JSON_TABLE(
                      JSON_REMOVE(p.waiters, CONCAT('$."', p_run_id, '"')), '$.*'
                      COLUMNS (until DOUBLE PATH '$')) AS w
                  WHERE w.until
                      > TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6)) / 1e6)));

        IF v_open > 0 THEN
            SELECT c.id INTO v_next FROM fanout_itemclaim AS c
            WHERE c.run_id = p_run_id AND c.status = 'pending' AND c.pool = p_pool
              AND c.crashes = 0 -- a crashed item is the claim's: it knows the crash budget
              AND c.next_attempt_at <= UTC_TIMESTAMP(6)
            ORDER BY c.`index`
            LIMIT 1
            FOR UPDATE SKIP LOCKED;
        END IF;

        IF v_next IS NOT NULL THEN
            UPDATE fanout_itemclaim SET
                status = 'running',
                owner = p_owner,
                claim_token = p_new_token,
                lease_expires_at = UTC_TIMESTAMP(6)
                    + INTERVAL ROUND(p_lease * 1000000) MICROSECOND,
                claimed_at = UTC_TIMESTAMP(6),
                started_at = UTC_TIMESTAMP(6),
                finished_at = NULL
            WHERE id = v_next;
        ELSE
            -- The slot is given up: the run's row, then the pool's, as everywhere.
            UPDATE fanout_batchrun SET in_flight = in_flight - 1
            WHERE id = v_run;
            UPDATE fanout_capacitypool SET in_flight = in_flight - 1
            WHERE name = v_pool AND name <> '';
        END IF;
    END IF;

    IF v_own THEN
        COMMIT;
    END IF;

    SELECT v_done AS done, c.id AS next_id, c.`key` AS next_key, c.`index` AS next_index,
           c.payload AS next_payload, c.pool AS next_pool, c.attempt AS next_attempt,
           c.started_at AS next_started_at
    FROM (SELECT 1) AS one LEFT JOIN fanout_itemclaim AS c ON c.id = v_next;
END
"""

# The condition before this migration, put back when it is reversed.
_WAITING = {
    "postgresql": (
        """              -- No other run waits: none is registered, or every registration has run out.
              AND ((p.waiters - p_run_id::text) = '{}'::jsonb
                   OR NOT jsonb_path_exists(p.waiters - p_run_id::text, '$.* ? (@ > $now)',
                       jsonb_build_object('now', extract(epoch FROM clock_timestamp()))))))""",
        """              AND (p.waiters - p_run_id::text) = '{}'::jsonb))""",
    ),
    "mysql": (
        """              AND NOT EXISTS (
                  -- Another run waits: its registration runs out at a time still ahead.
                  SELECT 1 FROM JSON_TABLE(
                      JSON_REMOVE(p.waiters, CONCAT('$."', p_run_id, '"')), '$.*'
                      COLUMNS (until DOUBLE PATH '$')) AS w
                  WHERE w.until
                      > TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6)) / 1e6)));""",
        "              AND JSON_LENGTH(JSON_REMOVE(p.waiters, "
        """CONCAT('$."', p_run_id, '"'))) = 0));""",
    ),
}

DROP = {
    "postgresql": "DROP FUNCTION IF EXISTS fanout_hand_over(bigint, uuid, jsonb, double precision, "
    "bigint, text, text, uuid, double precision)",
    "mysql": "DROP PROCEDURE IF EXISTS fanout_hand_over",
}

# The text each MariaDB/MySQL parameter is compared with or written to: (table, column).
COLUMNS = {
    "token": ("fanout_itemclaim", "claim_token"),
    "result": ("fanout_itemclaim", "result"),
    "pool": ("fanout_itemclaim", "pool"),
    "owner": ("fanout_itemclaim", "owner"),
    "pool_name": ("fanout_capacitypool", "name"),
}
_NAME = re.compile(r"^\w+$")


def text_type(connection, table, column):
    """The column's "CHARACTER SET ... COLLATE ...", for a parameter that meets it."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT character_set_name, collation_name FROM information_schema.columns"
            " WHERE table_schema = DATABASE() AND table_name = %s AND column_name = %s",
            [table, column],
        )
        row = cursor.fetchone()
    if row is None or not row[0] or not _NAME.match(row[0]) or not _NAME.match(row[1] or ""):
        # Not text: MariaDB's UUID type (MySQL's claim token is CHAR(32), text), MySQL's JSON.
        return "" if column == "claim_token" else "CHARACTER SET utf8mb4"
    return f"CHARACTER SET {row[0]} COLLATE {row[1]}"


def _install(schema_editor, live):
    connection = schema_editor.connection
    vendor = connection.vendor
    if vendor not in _WAITING:
        return
    new, old = _WAITING[vendor]
    if vendor == "postgresql":
        schema_editor.execute(POSTGRESQL if live else POSTGRESQL.replace(new, old))
        return
    types = {name: text_type(connection, *where) for name, where in COLUMNS.items()}
    body = MYSQL.format(**types)
    schema_editor.execute(DROP[vendor])
    schema_editor.execute(body if live else body.replace(new, old))


def create(apps, schema_editor):
    _install(schema_editor, live=True)


def restore(apps, schema_editor):
    _install(schema_editor, live=False)


class Migration(migrations.Migration):
    dependencies = [("fanout", "0014_sample_windows")]

    # MySQL cannot roll back DDL, and Django refuses to run it inside a transaction there.
    operations = [migrations.RunPython(create, restore, atomic=False)]
