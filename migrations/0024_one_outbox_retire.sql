-- after-rollout-of: 0023
--
-- 1.0, the second step (0023 is the first): what only relays of the previous release
-- read, retired once every replica runs this release. After it the outbox is
-- 0100_schema.sql's: the columns of rows marked sent or dead-lettered in place and the
-- indexes of those states are gone, and the functions and views that named them read
-- only what is left.
--
-- The header line above makes `relay migrate` apply this file only in a run that found
-- 0023 applied by an earlier run: a relay of the previous release still marks rows in
-- place and reads the indexes dropped here.
--
-- DROP INDEX and DROP COLUMN take the table's ACCESS EXCLUSIVE lock for an instant, and
-- must wait for it behind the app's transactions, which queue behind the waiting lock:
-- give up after a few seconds rather than stall the app (`relay migrate` fails; run it
-- again). DROP COLUMN rewrites nothing: the columns' space is reused as rows change.

SET LOCAL lock_timeout = '5s';

-- A dead letter a relay of the previous release marked in place after 0023 (one that
-- outlived the rollout), into outbox_dead as 0023 moved the others.
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

DROP INDEX IF EXISTS outbox_due_key_hash_idx;
DROP INDEX IF EXISTS outbox_backoff_idx;
DROP INDEX IF EXISTS outbox_failing_rows_idx;
DROP INDEX IF EXISTS outbox_dead_letter_idx;
DROP INDEX IF EXISTS outbox_sent_idx;
DROP INDEX IF EXISTS outbox_scheduled_idx;
DROP INDEX IF EXISTS outbox_scheduled_key_idx;

-- The previous release's shard and fairness indexes (0023 renamed them).
DO $$
DECLARE
    name text;
BEGIN
    FOR name IN
        SELECT c.relname
        FROM pg_index AS i
        JOIN pg_class AS c ON c.oid = i.indexrelid
        WHERE i.indrelid = 'outbox'::regclass AND c.relname LIKE 'outbox\_pre10\_%'
    LOOP
        EXECUTE format('DROP INDEX %I', name);
    END LOOP;
END
$$;

-- The view and functions that named the columns dropped below, as 0100_schema.sql
-- has them.
CREATE OR REPLACE VIEW outbox_dead_letters AS
SELECT id, message_id, topic, key, payload, headers, created_at, available_at,
       promoted_at, attempts, last_error, dead_lettered_at, dead_letter_reason
FROM outbox_dead;

COMMENT ON VIEW outbox_dead_letters IS
    'Every dead letter of the outbox: the rows of outbox_dead.';

CREATE OR REPLACE FUNCTION outbox_added_columns()
RETURNS text[]
LANGUAGE sql
STABLE
AS $$
    SELECT coalesce(array_agg(a.attname::text ORDER BY a.attnum), '{}')
    FROM pg_attribute AS a
    WHERE a.attrelid = 'outbox'::regclass
      AND a.attnum > 0
      AND NOT a.attisdropped
      AND a.attgenerated = ''
      AND a.attname <> ALL (ARRAY['id', 'message_id', 'topic', 'key', 'payload', 'headers',
                                  'created_at', 'attempts', 'next_attempt_at', 'last_error',
                                  'available_at', 'promoted_at'])
$$;

CREATE OR REPLACE FUNCTION outbox_park_scheduled(max_rows integer)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
AS $$
DECLARE
    ids bigint[];
    parked bigint;
BEGIN
    -- A rollback's outbox_unpark_all switching parking off waits for a pass under way
    -- (it takes this advisory lock, keyed by outbox_parking's oid, exclusive), and a
    -- pass that starts meanwhile waits for it, then reads the flag off; else a pass
    -- could park rows the rollback's snapshot no longer sees. An advisory lock writes
    -- nothing: a row lock on the flag made every idle pass a commit to flush.
    PERFORM pg_advisory_xact_lock_shared('outbox_parking'::regclass::oid::integer, 0);
    IF NOT (SELECT p.enabled FROM outbox_parking AS p) THEN
        RETURN 0;
    END IF;
    -- A deferred constraint of the app's is checked here, not at commit: its error is
    -- the move's, dealt with below, never one that fails every pass.
    SET CONSTRAINTS ALL IMMEDIATE;
    SELECT array_agg(chosen.id)
    INTO ids
    FROM (SELECT later.id,
                 sum(later.size) OVER (ORDER BY later.available_at, later.id) AS bytes,
                 row_number() OVER (ORDER BY later.available_at, later.id) AS n
          FROM (SELECT o.id, o.available_at,
                       coalesce(octet_length(o.payload), 0)
                       + coalesce(pg_column_size(o.headers), 0) AS size
                FROM outbox AS o
                WHERE (o.next_attempt_at IS NOT NULL
                       OR (o.available_at IS NOT NULL AND o.promoted_at IS NULL))
                  AND o.available_at IS NOT NULL
                  AND o.promoted_at IS NULL
                  AND o.available_at > now()
                  AND coalesce(octet_length(o.payload), 0)
                      + coalesce(pg_column_size(o.headers), 0) <= 1048576
                ORDER BY o.available_at
                LIMIT max_rows
                FOR UPDATE SKIP LOCKED) AS later) AS chosen
    WHERE chosen.bytes <= 16777216 OR chosen.n = 1;
    IF ids IS NULL THEN
        RETURN 0;
    END IF;
    BEGIN
        EXECUTE format($park$
            WITH gone AS (
                DELETE FROM outbox AS o WHERE o.id = ANY($1) RETURNING o.*
            ),
            parked AS (
                INSERT INTO outbox_scheduled (id, message_id, topic, key, payload, headers,
                                              created_at, available_at, attempts,
                                              last_error, extra)
                SELECT gone.id, gone.message_id, gone.topic, gone.key, gone.payload,
                       gone.headers, gone.created_at, gone.available_at, gone.attempts,
                       gone.last_error, %s
                FROM gone
                RETURNING 1
            )
            SELECT count(*) FROM parked
        $park$, outbox_extra_of('gone'))
        INTO parked
        USING ids;
    EXCEPTION
        WHEN transaction_rollback OR lock_not_available OR insufficient_resources
             OR operator_intervention OR system_error THEN
            RAISE;
        WHEN OTHERS THEN
            RAISE WARNING 'rows scheduled for later stay in the outbox: %', SQLERRM;
            RETURN 0;
    END;
    RETURN parked;
END
$$;

-- CREATE OR REPLACE reset what they run with: names in this schema only, as
-- 0100_schema.sql.
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_added_columns()'
                   ' SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION outbox_park_scheduled(integer)'
                   ' SET search_path = %I, pg_temp', current_schema());
END
$$;

ALTER TABLE outbox
    DROP COLUMN sent_at,
    DROP COLUMN dead_lettered_at,
    DROP COLUMN dead_letter_reason;
