-- Dead letters leave the outbox: the settle that gives up on a row moves it into
-- outbox_dead (outbox_dead_letter, below), in its fenced transaction, as the retention
-- mode moves sent rows into outbox_sent (0013). The outbox then holds only rows still to
-- send, so a walk of it in id order meets no row it must step over for good, however
-- many dead letters pile up (but for rows over 16 MiB, below).
--
-- A dead letter keeps its id: `relay dead-letter requeue` and the console's requeue move
-- it back into the outbox under that id (outbox_requeue, below), so requeued rows are
-- sent in their original order relative to each other. It keeps every column: the
-- outbox's own as columns here, and any the app added to the outbox in `extra` (as
-- JSON, built from those columns alone), from which a requeue restores them.
--
-- Rows marked dead in place (by an earlier release, or by one still running during a
-- rolling upgrade) stay where they are until migration 0019 moves them: every listing,
-- count, requeue and discard reads or handles both places (outbox_dead_letters shows
-- both). An own table (RELAY_OUTBOX_TABLE) keeps marking its dead letters in place.
--
-- outbox_dead's ids are the outbox's: never restart the outbox's identity while dead
-- letters are kept (a new row could then take a dead letter's id, and its move here
-- would fail on the primary key).
--
-- Nothing here touches the outbox's rows or takes a lock the app's inserts wait for.
CREATE TABLE outbox_dead (
    id                  bigint      PRIMARY KEY,
    message_id          uuid        NOT NULL,
    topic               text        NOT NULL,
    key                 text,
    payload             bytea,
    headers             jsonb,
    created_at          timestamptz NOT NULL,
    available_at        timestamptz,
    promoted_at         timestamptz,
    attempts            integer     NOT NULL,
    last_error          text,
    dead_lettered_at    timestamptz NOT NULL,
    dead_letter_reason  text,
    extra               jsonb  -- columns the app added to the outbox; NULL: none
);

COMMENT ON TABLE outbox_dead IS
    'Outbox rows the relay gave up on, with the reason; requeued back into the outbox by id.';

-- A requeue by key, and its check for an earlier dead letter of a requeued row's key.
CREATE INDEX outbox_dead_key_idx ON outbox_dead (key, id);

-- Every dead letter, wherever it is kept: moved out, and marked in place.
CREATE VIEW outbox_dead_letters AS
SELECT id, message_id, topic, key, payload, headers, created_at, available_at,
       promoted_at, attempts, last_error, dead_lettered_at, dead_letter_reason
FROM outbox_dead
UNION ALL
SELECT id, message_id, topic, key, payload, headers, created_at, available_at,
       promoted_at, attempts, last_error, dead_lettered_at, dead_letter_reason
FROM outbox
WHERE dead_lettered_at IS NOT NULL;

COMMENT ON VIEW outbox_dead_letters IS
    'Every dead letter: moved to outbox_dead, or marked in the outbox by an earlier release.';

-- The two ways in and out of outbox_dead are functions that run as their owner, so the
-- roles that use them need neither INSERT on outbox_dead nor INSERT on the outbox: a
-- role can move into outbox_dead only rows of the outbox, and back only what was there.
--
-- The columns the app added to the outbox, if any: those a dead letter keeps in
-- `extra`. Read from the catalog at each move, so a column added later is kept too.
-- Never the whole row as JSON: a payload of hundreds of MB would not fit one jsonb. A
-- generated column is left out: it is computed again when the row comes back.
CREATE FUNCTION outbox_added_columns()
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
                                  'created_at', 'sent_at', 'attempts', 'next_attempt_at',
                                  'last_error', 'dead_lettered_at', 'dead_letter_reason',
                                  'available_at', 'promoted_at'])
$$;

-- outbox_extra_of: the SQL expression of the added columns of the outbox row `source`
-- (an alias in the statement it goes into) as one jsonb object, built 50 columns at a
-- time (jsonb_build_object takes at most 100 arguments); 'NULL::jsonb' with none.
CREATE FUNCTION outbox_extra_of(source text)
RETURNS text
LANGUAGE sql
STABLE
AS $$
    SELECT coalesce(string_agg(piece.sql, ' || ' ORDER BY piece.part), 'NULL::jsonb')
    FROM (SELECT (added.n - 1) / 50 AS part,
                 'jsonb_build_object('
                 || string_agg(quote_literal(added.c) || ', ' || source || '.'
                               || quote_ident(added.c), ', ' ORDER BY added.n)
                 || ')' AS sql
          FROM unnest(outbox_added_columns()) WITH ORDINALITY AS added (c, n)
          GROUP BY 1) AS piece
$$;

-- outbox_restored_of: for an INSERT into the outbox of a row `source` that kept the added
-- columns in `extra`: their names (', a, b'), the SQL of their values (', ..., ...'),
-- and the join that reads them (`kept`: one jsonb_to_record a row, the columns typed by
-- their base types, so a domain is checked once, on the INSERT). Each value is the one
-- kept, or for a column added since the row left (no key in `extra`) what an INSERT that
-- leaves the column out writes: the column's default, its domain's, or its identity's
-- next value (NULL without any).
CREATE FUNCTION outbox_restored_of(source text, OUT columns text, OUT restored text,
                                   OUT kept text)
LANGUAGE sql
STABLE
AS $$
    SELECT coalesce(', ' || string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum), ''),
           coalesce(', ' || string_agg(
               format('CASE WHEN %1$s.extra ? %2$L THEN kept.%3$I::%4$s ELSE (%5$s)::%4$s END',
                      source, a.attname, a.attname, format_type(a.atttypid, a.atttypmod),
                      CASE WHEN a.attidentity <> '' THEN
                               format('nextval(%L)',
                                      pg_get_serial_sequence(format('%I.outbox',
                                                                    current_schema()),
                                                             a.attname))
                           ELSE coalesce(pg_get_expr(d.adbin, d.adrelid), t.typdefault,
                                         'NULL')
                      END),
               ', ' ORDER BY a.attnum), ''),
           CASE WHEN count(*) = 0 THEN ''
                ELSE format(' CROSS JOIN LATERAL jsonb_to_record(coalesce(%s.extra, %L))'
                            ' AS kept (%s)',
                            source, '{}',
                            string_agg(quote_ident(a.attname) || ' '
                                       || format_type(CASE WHEN t.typtype = 'd'
                                                           THEN t.typbasetype
                                                           ELSE a.atttypid END,
                                                      CASE WHEN t.typtype = 'd'
                                                           THEN t.typtypmod
                                                           ELSE a.atttypmod END),
                                       ', ' ORDER BY a.attnum))
           END
    FROM pg_attribute AS a
    JOIN pg_type AS t ON t.oid = a.atttypid
    LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    WHERE a.attrelid = 'outbox'::regclass
      AND a.attname = ANY (outbox_added_columns())
$$;

-- outbox_dead_letter: the settle's dead path (relay/sql/drain.sql, dead_letter_move), in
-- its fenced transaction: the rows given up on, out of the outbox into outbox_dead with
-- the attempts they spent and the reason. A row marked in place already (an earlier
-- release's: migration 0019) keeps its time and reason. A row over 16 MiB of payload
-- and headers stays where it is (the settle then marks it in place, with drain.sql's
-- dead_letter): copying hundreds of MB could outlast the settle's statement timeout,
-- and the settle would fail again and again. Returns how many it moved.
CREATE FUNCTION outbox_dead_letter(ids bigint[], attempted integer[], reasons text[])
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
              AND coalesce(octet_length(o.payload), 0)
                  + coalesce(pg_column_size(o.headers), 0) <= 16777216
            RETURNING o.*, f.attempted, f.reason
        ),
        moved AS (
            INSERT INTO outbox_dead (id, message_id, topic, key, payload, headers,
                                     created_at, available_at, promoted_at, attempts,
                                     last_error, dead_lettered_at, dead_letter_reason,
                                     extra)
            SELECT gone.id, gone.message_id, gone.topic, gone.key, gone.payload,
                   gone.headers, gone.created_at, gone.available_at, gone.promoted_at,
                   gone.attempts + gone.attempted,
                   CASE WHEN gone.dead_lettered_at IS NULL THEN gone.reason
                        ELSE gone.last_error END,
                   coalesce(gone.dead_lettered_at, now()),
                   CASE WHEN gone.dead_lettered_at IS NULL THEN gone.reason
                        ELSE gone.dead_letter_reason END,
                   %s
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

-- outbox_requeue: the dead letters named (by id, by key, or all) back into the outbox
-- under their ids, with fresh attempts and the columns the app added restored
-- (`relay dead-letter requeue`, the console). Rows marked in place are requeued by an
-- UPDATE, as before (relay/sql/operations.sql, dead_letter_requeue). Returns their ids.
-- A row leaves outbox_dead only once the outbox took it: one an app's BEFORE INSERT
-- trigger drops stays a dead letter. Locked first, so a concurrent requeue of the same
-- rows waits, then finds them gone. Planned for the arguments given (EXECUTE): a
-- requeue of a few ids or of one key reads those by outbox_dead's indexes.
CREATE FUNCTION outbox_requeue(ids bigint[], by_key text, everything boolean)
RETURNS SETOF bigint
LANGUAGE plpgsql
SECURITY DEFINER
AS $$
DECLARE
    added record := outbox_restored_of('back');
BEGIN
    RETURN QUERY EXECUTE format($back$
        WITH back AS (
            SELECT d.*
            FROM outbox_dead AS d
            WHERE $3 OR d.id = ANY($1) OR d.key = $2
            FOR UPDATE
        ),
        moved AS (
            INSERT INTO outbox (id, message_id, topic, key, payload, headers, created_at,
                                available_at, promoted_at, attempts, last_error%s)
            OVERRIDING SYSTEM VALUE
            SELECT back.id, back.message_id, back.topic, back.key, back.payload,
                   back.headers, back.created_at, back.available_at, back.promoted_at, 0,
                   back.last_error%s
            FROM back%s
            RETURNING outbox.id
        ),
        gone AS (
            DELETE FROM outbox_dead AS d
            USING moved
            WHERE d.id = moved.id
            RETURNING d.id
        )
        SELECT gone.id FROM gone
    $back$, added.columns, added.restored, added.kept)
    USING ids, by_key, everything;
END
$$;

-- As their owner, they resolve names in this schema only (then pg_temp, last), whatever
-- the caller's search_path; and only the roles granted them may run them (grants.sql,
-- console_grants.sql), not PUBLIC as a function's default.
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_added_columns()'
                   ' SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION outbox_extra_of(text)'
                   ' SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION outbox_restored_of(text)'
                   ' SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION outbox_dead_letter(bigint[], integer[], text[])'
                   ' SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION outbox_requeue(bigint[], text, boolean)'
                   ' SET search_path = %I, pg_temp', current_schema());
END
$$;
REVOKE EXECUTE ON FUNCTION outbox_dead_letter(bigint[], integer[], text[]) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox_requeue(bigint[], text, boolean) FROM PUBLIC;

COMMENT ON FUNCTION outbox_dead_letter(bigint[], integer[], text[]) IS
    'Move outbox rows the relay gave up on into outbox_dead, with attempts spent and reason.';
COMMENT ON FUNCTION outbox_requeue(bigint[], text, boolean) IS
    'Move dead letters (by id, by key, or all) from outbox_dead back into the outbox, by id.';
