"""Hand-overs of several threads of one worker process in one statement (group commit).

fanout_hand_over_group(...) takes one array element per finished item of one run and runs
fanout_hand_over (0015) for each in array order, inside the one statement and so the one
commit: each outcome is fenced by its own claim token, each next item is picked for its own
thread. The caller orders the elements by pool, then id: slots given up lock the run's row
first and then the pools' in name order, the order every transaction keeps.
PostgreSQL only: MariaDB/MySQL hand over one item per call.
"""

from django.db import migrations

POSTGRESQL = r"""
CREATE OR REPLACE FUNCTION fanout_hand_over_group(
    p_pks bigint[],
    p_tokens uuid[],
    p_results text[],
    p_elapsed double precision[],
    p_run_id bigint,
    p_pools text[],
    p_owners text[],
    p_new_tokens uuid[],
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
    FOR n IN 1 .. coalesce(array_length(p_pks, 1), 0) LOOP
        RETURN QUERY SELECT * FROM fanout_hand_over(
            p_pks[n], p_tokens[n], p_results[n]::jsonb, p_elapsed[n], p_run_id, p_pools[n],
            p_owners[n], p_new_tokens[n], p_lease);
    END LOOP;
END
$$;
"""

DROP = (
    "DROP FUNCTION IF EXISTS fanout_hand_over_group(bigint[], uuid[], text[], "
    "double precision[], bigint, text[], text[], uuid[], double precision)"
)


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(POSTGRESQL)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [
        ("fanout", "0023_pool_samples"),
    ]

    operations = [migrations.RunPython(create, drop)]
