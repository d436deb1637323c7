"""A grouped hand-over locks its items before any counter row.

fanout_hand_over_group (0024) ran each item's hand-over in turn: the first item whose slot was
given up locked the run's row and its pool's, and only then did the next item's write lock that
item. Every other writer of held items (a record, a release, a stopping worker's record of what
finished) locks the items and then the run's row, so a record of one of the group's later items
held that item and waited for the run's row the group held: deadlock. Here the group locks all
of its items first, in id order, then runs the hand-overs in the caller's order (by pool, then
id), so items come before the run's row and the pools, as everywhere else.
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
    -- The items first, in id order, before any hand-over locks a counter row.
    PERFORM 1 FROM fanout_itemclaim WHERE id = ANY(p_pks) ORDER BY id FOR NO KEY UPDATE;
    FOR n IN 1 .. coalesce(array_length(p_pks, 1), 0) LOOP
        RETURN QUERY SELECT * FROM fanout_hand_over(
            p_pks[n], p_tokens[n], p_results[n]::jsonb, p_elapsed[n], p_run_id, p_pools[n],
            p_owners[n], p_new_tokens[n], p_lease);
    END LOOP;
END
$$;
"""

# 0024's function, which the reverse puts back.
PREVIOUS = POSTGRESQL.replace(
    "    -- The items first, in id order, before any hand-over locks a counter row.\n"
    "    PERFORM 1 FROM fanout_itemclaim WHERE id = ANY(p_pks) ORDER BY id FOR NO KEY UPDATE;\n",
    "",
)


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(POSTGRESQL)


def restore(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(PREVIOUS)


class Migration(migrations.Migration):
    dependencies = [
        ("fanout", "0024_hand_over_group"),
    ]

    operations = [migrations.RunPython(create, restore)]
