-- 1.0, the first of two steps from the schema of migrations 0001-0022 to the one
-- 0100_schema.sql builds on a fresh database: what this release reads, beside what a
-- relay of the previous release still reads during a rolling upgrade. 0024 retires the
-- rest once the rollout is done.
--
-- This release's drain reads only rows still to send: no row marked sent or
-- dead-lettered in place. So this step also makes sure none is left or made:
-- - outbox_dead_letter moves every row it is given (it left rows over 16 MiB in place,
--   which a relay of the previous release then marked there);
-- - the dead letters the previous release marked in place go into outbox_dead;
-- - a row marked sent in place is deleted (migration 0022 waited until none was left;
--   none of the previous release's relays marks one since).
--
-- The two CREATE INDEX take the outbox's SHARE lock: they wait for every transaction
-- writing it, a previous release's settle among them, and hold the app's writes back
-- until this commits (a few seconds on an outbox that is being drained). The moves after
-- them then see every row such a settle marked.

CREATE INDEX outbox_key_hash_idx ON outbox (outbox_key_hash(key), id)
    WHERE available_at IS NULL OR promoted_at IS NOT NULL;

CREATE INDEX outbox_waiting_idx ON outbox (key, id)
    WHERE next_attempt_at IS NOT NULL OR (available_at IS NOT NULL AND promoted_at IS NULL);

-- The indexes `relay migrate --shards N` and `--fairness-group` built, again under their
-- names with the drain's predicate; the previous release's under a name of its own
-- (outbox_pre10_*) until 0024 drops them.
DO $$
DECLARE
    ix record;
BEGIN
    FOR ix IN
        SELECT c.relname AS name, pg_get_indexdef(i.indexrelid) AS def,
               obj_description(i.indexrelid, 'pg_class') AS comment
        FROM pg_index AS i
        JOIN pg_class AS c ON c.oid = i.indexrelid
        WHERE i.indrelid = 'outbox'::regclass
          AND (c.relname LIKE 'outbox\_shards\_%' OR c.relname LIKE 'outbox\_fair\_%')
    LOOP
        EXECUTE format('ALTER INDEX %I RENAME TO %I', ix.name,
                       'outbox_pre10_' || md5(ix.name));
        EXECUTE regexp_replace(ix.def, ' WHERE .*$', '')
                || ' WHERE ((available_at IS NULL) OR (promoted_at IS NOT NULL))';
        IF ix.comment IS NOT NULL THEN
            EXECUTE format('COMMENT ON INDEX %I IS %L', ix.name, ix.comment);
        END IF;
    END LOOP;
END
$$;

-- outbox_dead_letter as 0100_schema.sql has it: it moves every row it is given.
CREATE OR REPLACE FUNCTION outbox_dead_letter(ids bigint[], attempted integer[], reasons text[])
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
AS $$
DECLARE
    moved bigint;
BEGIN
    EXECUTE format($move$
        WITH gone AS (
            DELETE FROM outbox AS o
            USING unnest($1, $2, $3) AS f (id, attempted, reason)
            WHERE o.id = f.id
            RETURNING o.*, f.attempted, f.reason
        ),
        moved AS (
            INSERT INTO outbox_dead (id, message_id, topic, key, payload, headers,
                                     created_at, available_at, promoted_at, attempts,
                                     last_error, dead_lettered_at, dead_letter_reason,
                                     extra)
            SELECT gone.id, gone.message_id, gone.topic, gone.key, gone.payload,
                   gone.headers, gone.created_at, gone.available_at, gone.promoted_at,
                   gone.attempts + gone.attempted, gone.reason, now(), gone.reason, %s
            FROM gone
            RETURNING 1
        )
        SELECT count(*) FROM moved
    $move$, outbox_extra_of('gone'))
    INTO moved
    USING ids, attempted, reasons;
    RETURN moved;
END
$$;

-- CREATE OR REPLACE reset what it runs with: names in this schema only, as 0100_schema.sql.
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_dead_letter(bigint[], integer[], text[])'
                   ' SET search_path = %I, pg_temp', current_schema());
END
$$;

-- The dead letters marked in place, into outbox_dead with the columns the app added.
DO $$
BEGIN
    EXECUTE format($move$
        WITH gone AS (
            DELETE FROM outbox AS o WHERE o.dead_lettered_at IS NOT NULL RETURNING o.*
        )
        INSERT INTO outbox_dead (id, message_id, topic, key, payload, headers, created_at,
                                 available_at, promoted_at, attempts, last_error,
                                 dead_lettered_at, dead_letter_reason, extra)
        SELECT gone.id, gone.message_id, gone.topic, gone.key, gone.payload, gone.headers,
               gone.created_at, gone.available_at, gone.promoted_at, gone.attempts,
               gone.last_error, gone.dead_lettered_at, gone.dead_letter_reason, %s
        FROM gone
    $move$, outbox_extra_of('gone'));
END
$$;

DELETE FROM outbox WHERE sent_at IS NOT NULL;
