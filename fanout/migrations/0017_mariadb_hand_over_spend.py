"""MariaDB/MySQL: the hand-over of an item that counts cost in one round trip, as PostgreSQL's
fanout_hand_over_spend (0013, 0015) does it; before, MariaDB ran the plain procedure and then
settled the spend with seven more statements in the same transaction.

fanout_hand_over_spend is the fanout_hand_over procedure of 0015 whose write of the finished
item also writes its cost (what the call reported, or its estimate), whose pick reads the next
item's estimate, and which then moves the pool's token bucket and the budgets (the run's
accounts, then the pool's: the order every transaction keeps) and says whether a budget refuses
the next item. fanout_add_units adds two costs unit by unit, as fanout.cost.add does.
"""

import importlib

from django.db import migrations

ADD_UNITS = r"""
CREATE FUNCTION fanout_add_units(p_a LONGTEXT {cost}, p_b LONGTEXT {cost})
RETURNS LONGTEXT {cost}
DETERMINISTIC
BEGIN
    DECLARE v_out LONGTEXT {cost} DEFAULT COALESCE(p_a, '{{}}');
    DECLARE v_keys LONGTEXT {cost} DEFAULT JSON_KEYS(COALESCE(p_b, '{{}}'));
    DECLARE v_i INT DEFAULT 0;
    DECLARE v_path VARCHAR(64);
    WHILE v_i < JSON_LENGTH(v_keys) DO
        SET v_path = CONCAT('$."', JSON_UNQUOTE(JSON_EXTRACT(v_keys, CONCAT('$[', v_i, ']'))), '"');
        SET v_out = JSON_SET(v_out, v_path,
            COALESCE(JSON_VALUE(v_out, v_path), 0) + JSON_VALUE(p_b, v_path) + 0e0);
        SET v_i = v_i + 1;
    END WHILE;
    RETURN v_out;
END
"""

# An amount of a unit in a cost (JSON text), 0 where the cost is NULL or lacks the unit.
_UNIT = "COALESCE(JSON_VALUE({cost}, CONCAT('$.\"', {unit}, '\"')), 0)"


def _of(cost, unit):
    return _UNIT.format(cost=cost, unit=unit)


HAND_OVER_SPEND = r"""
CREATE PROCEDURE fanout_hand_over_spend(
    IN p_pk BIGINT,
    IN p_token VARCHAR(36) {token},
    IN p_result LONGTEXT {result},
    IN p_elapsed DOUBLE,
    IN p_run_id BIGINT,
    IN p_pool VARCHAR(200) {pool},
    IN p_owner VARCHAR(200) {owner},
    IN p_new_token VARCHAR(36) {token},
    IN p_lease DOUBLE,
    IN p_cost LONGTEXT {cost},
    IN p_run_budget BOOLEAN
)
MODIFIES SQL DATA
BEGIN
    -- Under autocommit each statement of a procedure would commit on its own: make it one
    -- transaction, unless the caller's is already open (then it commits or rolls back).
    DECLARE v_own BOOLEAN DEFAULT @@autocommit = 1;
    DECLARE v_done INT DEFAULT 0;
    DECLARE v_open INT DEFAULT 0;
    DECLARE v_refused INT DEFAULT 0;
    DECLARE v_run BIGINT DEFAULT NULL;
    DECLARE v_pool VARCHAR(200) {pool_name} DEFAULT NULL;
    DECLARE v_next BIGINT DEFAULT NULL;
    DECLARE v_estimate LONGTEXT {cost} DEFAULT NULL;
    DECLARE v_actual LONGTEXT {cost} DEFAULT NULL;
    DECLARE v_reserve LONGTEXT {cost} DEFAULT NULL;
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
        lease_expires_at = NULL,
        -- What the call reported; a success that reported nothing cost its estimate.
        cost = CASE WHEN COALESCE(p_cost, estimate) IS NULL THEN cost
                    ELSE fanout_add_units(cost, COALESCE(p_cost, estimate)) END
    WHERE id = p_pk AND claim_token = p_token AND status = 'running';
    SET v_done = ROW_COUNT();

    IF v_done > 0 THEN
        SELECT run_id, pool, estimate, COALESCE(p_cost, estimate)
        INTO v_run, v_pool, v_estimate, v_actual
        FROM fanout_itemclaim WHERE id = p_pk;

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
            SELECT c.id, c.estimate INTO v_next, v_reserve FROM fanout_itemclaim AS c
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
            SET v_reserve = NULL;
            -- The slot is given up: the run's row, then the pool's, as everywhere.
            UPDATE fanout_batchrun SET in_flight = in_flight - 1
            WHERE id = v_run;
            UPDATE fanout_capacitypool SET in_flight = in_flight - 1
            WHERE name = v_pool AND name <> '';
        END IF;

        -- A pool whose rate counts a unit took the estimate from its bucket: what the call
        -- cost beyond (or below) it is taken (or given back) now.
        IF v_pool <> '' AND NOT (v_actual <=> v_estimate) THEN
            UPDATE fanout_capacitypool SET
                tokens = tokens - {actual_rate} + {estimate_rate}
            WHERE name = v_pool AND rate_unit <> '' AND tokens IS NOT NULL;
        END IF;

        -- Budgets: the run's accounts, then the pool's (the order every transaction keeps).
        IF p_run_budget THEN
            UPDATE fanout_spendaccount SET
                spent = spent + {actual_unit},
                reserved = reserved - {estimate_unit} + {reserve_unit}
            WHERE run_id = v_run;
        END IF;
        IF v_pool <> '' THEN
            UPDATE fanout_spendaccount SET
                spent = spent + {actual_unit},
                reserved = reserved - {estimate_unit} + {reserve_unit}
            WHERE pool = v_pool;
        END IF;
        IF v_next IS NOT NULL AND (p_run_budget OR v_pool <> '') THEN
            -- The next item's reservation is taken: a budget it passes (or that was reached
            -- already) refuses it, and the worker records it released, unrun.
            SELECT COUNT(*) INTO v_refused FROM fanout_spendaccount
            WHERE ((p_run_budget AND run_id = v_run) OR (v_pool <> '' AND pool = v_pool))
              AND (spent + reserved > budget + 1e-9
                   OR ({reserve_unit} = 0 AND spent + reserved >= budget));
        END IF;
    END IF;

    IF v_own THEN
        COMMIT;
    END IF;

    SELECT v_done AS done, c.id AS next_id, c.`key` AS next_key, c.`index` AS next_index,
           c.payload AS next_payload, c.pool AS next_pool, c.attempt AS next_attempt,
           c.started_at AS next_started_at, v_refused > 0 AS refused
    FROM (SELECT 1) AS one LEFT JOIN fanout_itemclaim AS c ON c.id = v_next;
END
"""

DROP = (
    "DROP PROCEDURE IF EXISTS fanout_hand_over_spend",
    "DROP FUNCTION IF EXISTS fanout_add_units",
)

# The text each parameter is compared with or written to (0008's, and the cost's), read as
# 0008 reads it.
_UTC = importlib.import_module("fanout.migrations.0008_mariadb_utc")
COLUMNS = {**_UTC.COLUMNS, "cost": ("fanout_itemclaim", "cost")}
text_type = _UTC.text_type


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "mysql":
        install(schema_editor, HAND_OVER_SPEND)


def install(schema_editor, hand_over_spend):
    """The function and this text of the procedure (a later migration gives its own)."""
    connection = schema_editor.connection
    types = {name: text_type(connection, *where) for name, where in COLUMNS.items()}
    amounts = {
        "actual_rate": _of("v_actual", "rate_unit"),
        "estimate_rate": _of("v_estimate", "rate_unit"),
        "actual_unit": _of("v_actual", "unit"),
        "estimate_unit": _of("v_estimate", "unit"),
        "reserve_unit": _of("v_reserve", "unit"),
    }
    for statement in DROP:
        schema_editor.execute(statement)
    schema_editor.execute(ADD_UNITS.format(**types))
    schema_editor.execute(hand_over_spend.format(**types, **amounts))


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "mysql":
        for statement in DROP:
            schema_editor.execute(statement)


class Migration(migrations.Migration):
    dependencies = [("fanout", "0016_spend_calendar_periods")]

    # MySQL cannot roll back DDL, and Django refuses to run it inside a transaction there.
    operations = [migrations.RunPython(create, drop, atomic=False)]
