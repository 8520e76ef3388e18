-- What only `relay migrate --own-table` runs (relay/store/own_table.py).
--
-- The relay reads an existing table (RELAY_OUTBOX_TABLE) through a view named outbox in
-- a schema of its own, relay_<schema>_<table>, that renames its columns to the relay's
-- (RELAY_OUTBOX_COLUMNS) and holds the rows still to send, as the relay's own outbox
-- does; the relay's sessions put that schema first on their search_path (session.sql),
-- so every statement of the other files runs unchanged against it. The table keeps its
-- sent rows (retention) and dead letters, marked: outbox_marked, a view of all its rows,
-- is what the statements that read those marks go through. The views are simple, so
-- PostgreSQL plans through them to the table's own partial indexes, and the relay's
-- UPDATEs and DELETEs reach the table's rows. The app's columns are never changed: the
-- relay's bookkeeping lives in columns of its own, relay_*. {placeholders} are composed by psycopg.sql (identifiers and the column
-- expressions the mapping names).
-- Parameters are named, %(name)s; nothing here is built by string concatenation.

-- name: own_table_columns
-- The table's columns, their types, whether an index leads with each (the settle finds
-- rows by id), and whether it is declared NOT NULL.
SELECT a.attname AS name, format_type(a.atttypid, NULL) AS type, a.attnotnull AS not_null,
       EXISTS (SELECT 1 FROM pg_index AS i
               WHERE i.indrelid = a.attrelid AND i.indkey[0] = a.attnum) AS indexed
FROM pg_attribute AS a
WHERE a.attrelid = to_regclass(%(table)s)
  AND a.attnum > 0
  AND NOT a.attisdropped
ORDER BY a.attnum;

-- name: own_table_indexes
-- The indexes an earlier run made (their names carry a digest of their definition):
-- those the current mapping does not make any more are dropped.
SELECT c.relname AS name
FROM pg_index AS i
JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE i.indrelid = to_regclass(%(table)s)
  AND c.relname LIKE %(prefix)s;

-- name: own_table_key_index_check
-- At start-up: whether `--own-table` built a key index on the table (%(prefix)s: its
-- names' start), and whether one of them is on the key's hash, which
-- the fair fetch walks.
SELECT count(*) > 0 AS keyed,
       count(*) FILTER (WHERE i.indisvalid
                          AND pg_get_indexdef(i.indexrelid) LIKE '%%outbox_key_hash(%%') > 0
           AS hashed
FROM pg_index AS i
JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE i.indrelid = (SELECT t.oid  -- by name: the runtime role has no rights on its schema
                    FROM pg_class AS t
                    JOIN pg_namespace AS n ON n.oid = t.relnamespace
                    WHERE n.nspname = split_part(%(table)s, '.', 1)
                      AND t.relname = split_part(%(table)s, '.', 2))
  AND starts_with(c.relname, %(prefix)s);

-- name: own_table_bookkeeping
-- The relay's columns, added to the app's table (no rewrite: all NULL or a constant).
ALTER TABLE {table}
    ADD COLUMN IF NOT EXISTS relay_sent_at             timestamptz,
    ADD COLUMN IF NOT EXISTS relay_attempts            integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS relay_next_attempt_at     timestamptz,
    ADD COLUMN IF NOT EXISTS relay_last_error          text,
    ADD COLUMN IF NOT EXISTS relay_dead_lettered_at    timestamptz,
    ADD COLUMN IF NOT EXISTS relay_dead_letter_reason  text,
    ADD COLUMN IF NOT EXISTS relay_promoted_at         timestamptz

-- name: own_table_add_id
-- Without an integer id of its own: the relay's order, assigned at insert as the
-- relay's own outbox does. Fills the existing rows: rewrites the table under an
-- exclusive lock (run it at a quiet time on a large table).
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS relay_id bigint GENERATED ALWAYS AS IDENTITY

-- name: own_table_add_message_id
-- Without a message id: a uuid per row (rewrites the table, like relay_id).
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS relay_message_id uuid NOT NULL DEFAULT gen_random_uuid()

-- name: own_table_add_created_at
-- Without a creation time: existing rows get the time of this statement.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS relay_created_at timestamptz NOT NULL DEFAULT now()

-- name: own_table_schema
CREATE SCHEMA IF NOT EXISTS {schema}

-- name: own_table_jsonb
-- A json headers column as jsonb, or, where jsonb cannot hold the value (\u0000, a
-- number past its range, a lone surrogate, a value past its size), a JSON string that
-- says why: the fetch dead-letters such a row with it, where a failed cast would fail
-- every fetch. Runs for the rows a fetch returns only.
CREATE OR REPLACE FUNCTION {function}(value json) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $body$
BEGIN
    RETURN value::jsonb;
EXCEPTION WHEN OTHERS THEN
    RETURN to_jsonb('json headers jsonb cannot hold: ' || left(SQLERRM, 200));
END
$body$

-- name: own_table_view_comment
-- Which layout the view is: the relay refuses a view an earlier release made.
COMMENT ON VIEW {view} IS {layout}

-- name: own_table_index_drop
DROP INDEX IF EXISTS {index}

-- name: own_table_marked_view
-- The table in the relay's layout, every row, with the relay's marks. Columns the
-- mapping does not name are NULL. OR REPLACE keeps the grants on it; its columns keep
-- their types whatever the mapping (the message id as text), except an integer id
-- changed for one of another width.
CREATE OR REPLACE VIEW {view} AS
SELECT {id} AS id,
       {message_id} AS message_id,
       {topic} AS topic,
       {key} AS key,
       {payload} AS payload,
       {headers} AS headers,
       {created_at} AS created_at,
       {available_at} AS available_at,
       t.relay_sent_at AS sent_at,
       t.relay_attempts AS attempts,
       t.relay_next_attempt_at AS next_attempt_at,
       t.relay_last_error AS last_error,
       t.relay_dead_lettered_at AS dead_lettered_at,
       t.relay_dead_letter_reason AS dead_letter_reason,
       t.relay_promoted_at AS promoted_at
FROM {table} AS t

-- name: own_table_view
-- The rows still to send, as the drain reads them: neither sent (retention keeps them
-- marked) nor dead-lettered. Written on the table, not on outbox_marked, so the
-- planner meets the table's partial indexes' predicates, on relay_sent_at and
-- relay_dead_lettered_at, word for word.
CREATE OR REPLACE VIEW {view} AS
SELECT {id} AS id,
       {message_id} AS message_id,
       {topic} AS topic,
       {key} AS key,
       {payload} AS payload,
       {headers} AS headers,
       {created_at} AS created_at,
       {available_at} AS available_at,
       t.relay_sent_at AS sent_at,
       t.relay_attempts AS attempts,
       t.relay_next_attempt_at AS next_attempt_at,
       t.relay_last_error AS last_error,
       t.relay_dead_lettered_at AS dead_lettered_at,
       t.relay_dead_letter_reason AS dead_letter_reason,
       t.relay_promoted_at AS promoted_at
FROM {table} AS t
WHERE t.relay_sent_at IS NULL AND t.relay_dead_lettered_at IS NULL

-- name: own_table_dead_letters_view
-- The table's dead letters, all marked in place, as the console, `relay dead-letter` and
-- the lag gauges read them: the view schema's counterpart of the relay's own
-- outbox_dead_letters, which the session's search_path finds first.
CREATE OR REPLACE VIEW {dead_view} AS
SELECT id, message_id, topic, key, payload, headers, created_at, available_at,
       promoted_at, attempts, last_error, dead_lettered_at, dead_letter_reason
FROM {marked}
WHERE dead_lettered_at IS NOT NULL

-- name: own_table_dead_stand_in
-- An empty outbox_dead for the table, whose dead letters stay in it, marked: where a
-- statement reads the relay's own outbox_dead and the rows marked in place apart (the
-- console's pages), the session's search_path finds this first, never the dead letters
-- of the relay's own outbox.
CREATE OR REPLACE VIEW {stand_in} AS
SELECT id, message_id, topic, key, payload, headers, created_at, available_at,
       promoted_at, attempts, last_error, dead_lettered_at, dead_letter_reason
FROM {view}
WHERE false

-- name: own_table_moved_out_stand_in
-- An empty outbox_scheduled for the table, whose scheduled rows stay in it until due,
-- and an empty outbox_paused, as its paused topics' rows are parked in it: the fetch's
-- probes "an earlier row of my key is moved out", the lag gauges and the pauses' counts
-- read them and find nothing here, never the relay's own outbox's rows.
CREATE OR REPLACE VIEW {stand_in} AS
SELECT id, message_id, topic, key, payload, headers, created_at, available_at,
       attempts, last_error
FROM {view}
WHERE false

-- name: own_table_dead_letters_readers
-- Whoever may read the table's view when this runs may read the views above: the roles
-- an earlier release's grants name need no new grant (grantee 0 is PUBLIC). Grants made
-- on the view later must name them too (docs/howto/own-tables.md).
DO $readers$
DECLARE
    reader oid;
BEGIN
    FOR reader IN
        SELECT DISTINCT a.grantee
        FROM pg_class AS c, aclexplode(c.relacl) AS a
        WHERE c.oid = to_regclass({view_name}) AND a.privilege_type = 'SELECT'
    LOOP
        EXECUTE 'GRANT SELECT ON ' || to_regclass({dead_view_name})::text || ', '
                || to_regclass({marked_name})::text || ', '
                || to_regclass({stand_in_name})::text || ', '
                || to_regclass({scheduled_name})::text || ', '
                || to_regclass({paused_name})::text || ' TO '
                || CASE WHEN reader = 0 THEN 'PUBLIC' ELSE reader::regrole::text END;
    END LOOP;
END
$readers$

------------------------------------------------------------------------------------
-- Indexes: the drain's, on the table's own columns
------------------------------------------------------------------------------------

-- name: own_table_index_id
-- The rows by id, for the settle, the failures and the purge, when no index leads with
-- the id column (relay_id, say).
CREATE INDEX IF NOT EXISTS {index} ON {table} ({id})

-- name: own_table_index_unsent
-- Unsent rows that are due, in id order ({due} is `true` without an available_at column).
CREATE INDEX IF NOT EXISTS {index} ON {table} ({id})
    WHERE relay_sent_at IS NULL AND relay_dead_lettered_at IS NULL AND {due}

-- name: own_table_index_key
-- The fair fetch's round over keys, by their hash (outbox_key_hash).
CREATE INDEX IF NOT EXISTS {index} ON {table} (outbox_key_hash({key}), {id})
    WHERE relay_sent_at IS NULL AND relay_dead_lettered_at IS NULL AND {due}

-- name: own_table_index_waiting
-- Rows that hold back the later rows of their key (the fetch's probe, drain.sql's
-- fragment `waiting`): {waiting} is `relay_next_attempt_at IS NOT NULL`, or with an
-- available_at column also the rows scheduled and not let in.
CREATE INDEX IF NOT EXISTS {index} ON {table} ({key}, {id})
    WHERE relay_sent_at IS NULL AND relay_dead_lettered_at IS NULL AND {waiting}

-- name: own_table_index_failing
CREATE INDEX IF NOT EXISTS {index} ON {table} ({id})
    WHERE relay_sent_at IS NULL AND relay_dead_lettered_at IS NULL AND relay_attempts > 0

-- name: own_table_index_dead_letter
CREATE INDEX IF NOT EXISTS {index} ON {table} ({id})
    WHERE relay_dead_lettered_at IS NOT NULL

-- name: own_table_index_sent
CREATE INDEX IF NOT EXISTS {index} ON {table} (relay_sent_at)
    WHERE relay_sent_at IS NOT NULL

-- name: own_table_index_scheduled
CREATE INDEX IF NOT EXISTS {index} ON {table} ({available_at})
    WHERE relay_sent_at IS NULL AND relay_dead_lettered_at IS NULL
      AND {available_at} IS NOT NULL AND relay_promoted_at IS NULL
