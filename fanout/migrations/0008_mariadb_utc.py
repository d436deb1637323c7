"""MariaDB/MySQL: the hand-over procedure again, on the UTC clock and the columns' collations.

0005's procedure read CURRENT_TIMESTAMP(6), which is in the session's time zone: Django's MySQL
backend leaves it as the server's, while the DATETIME columns hold UTC, so on a server not on
UTC its leases ended hours off. It reads UTC_TIMESTAMP(6) now, as DbNow does. Its text
parameters named a character set but no collation, so they took the set's default collation,
and comparing them with columns of another one (a database created with utf8mb4_unicode_ci,
MySQL 8's utf8mb4_0900_ai_ci) raised "Illegal mix of collations": they take the collation
of the columns they are compared with or written to, read when the procedure is created.
"""

import importlib
import re

from django.db import migrations

PREVIOUS = importlib.import_module("fanout.migrations.0005_hand_over_procedure")

CREATE = r"""
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
              AND JSON_LENGTH(JSON_REMOVE(p.waiters, CONCAT('$."', p_run_id, '"'))) = 0));

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

DROP = PREVIOUS.DROP

# The text each parameter is compared with or written to: (table, column).
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


def create_sql(connection):
    """The procedure's CREATE statement for this database's columns."""
    types = {name: text_type(connection, *where) for name, where in COLUMNS.items()}
    return CREATE.format(**types)


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "mysql":
        schema_editor.execute(DROP)
        schema_editor.execute(create_sql(schema_editor.connection))


def previous(apps, schema_editor):
    if schema_editor.connection.vendor == "mysql":
        schema_editor.execute(DROP)
        schema_editor.execute(PREVIOUS.CREATE)


class Migration(migrations.Migration):
    dependencies = [("fanout", "0007_counter_audit")]

    # MySQL cannot roll back DDL, and Django refuses to run it inside a transaction there.
    operations = [migrations.RunPython(create, previous, atomic=False)]
