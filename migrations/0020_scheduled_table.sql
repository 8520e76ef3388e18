-- Scheduled rows not yet due leave the outbox: they wait in outbox_scheduled, and come
-- back into the outbox under their ids when due (let in, promoted_at set), as dead
-- letters went to outbox_dead (0018). The outbox then holds only rows that may go now
-- or are settling, so a walk of it in id order meets no row waiting for a later time,
-- however large the schedule.
--
-- A row moves out only after the rollout of this release: the function that moves rows
-- out, outbox_park_scheduled, parks nothing until migration 0021 (after-rollout-of:
-- 0020) switches parking on (outbox_parking). A relay of an earlier release does not
-- know outbox_scheduled: it would let later rows of a key overtake a row of that key
-- parked there, and never let a parked row in. Until then the relay lets due rows in
-- where they are, as before. outbox_unpark_all switches it off again and moves every
-- parked row back, for a rollback (docs/howto/scheduled-delivery.md).
--
-- The readers of the schedule (the fetch's "an earlier row of my key is scheduled", the
-- lag gauges, the console) read both places. An own table (RELAY_OUTBOX_TABLE) keeps its
-- scheduled rows in place; its view schema has an empty outbox_scheduled of its own
-- (`relay migrate --own-table`).
--
-- Nothing here touches the outbox's rows or takes a lock the app's inserts wait for.
CREATE TABLE outbox_scheduled (
    id                  bigint      PRIMARY KEY,
    message_id          uuid        NOT NULL,
    topic               text        NOT NULL,
    key                 text,
    payload             bytea,
    headers             jsonb,
    created_at          timestamptz NOT NULL,
    available_at        timestamptz NOT NULL,
    attempts            integer     NOT NULL,
    last_error          text,
    extra               jsonb  -- columns the app added to the outbox (as outbox_dead's)
);

COMMENT ON TABLE outbox_scheduled IS
    'Outbox rows scheduled for later (available_at), let back into the outbox by id when due.';

-- The due ones, soonest first, and when the next one is due: one descent.
CREATE INDEX outbox_scheduled_due_idx ON outbox_scheduled (available_at);

-- The fetch's per-row probe "is an earlier row of my key scheduled?".
CREATE INDEX outbox_scheduled_parked_key_idx ON outbox_scheduled (key, id);

-- Whether rows scheduled for later are moved out (outbox_park_scheduled): off until
-- migration 0021, which waits for the rollout, switches it on.
CREATE TABLE outbox_parking (
    single  boolean PRIMARY KEY DEFAULT true CHECK (single),
    enabled boolean NOT NULL
);
INSERT INTO outbox_parking (enabled) VALUES (false);

COMMENT ON TABLE outbox_parking IS
    'Whether the relay moves rows scheduled for later into outbox_scheduled (0021 on).';

-- The moves below tell an error that may pass (a lock wait, a deadlock, a full disk, a
-- cancel) from one the row itself causes (a constraint or trigger of the app's refuses
-- it): the first fails the pass, which the next pass tries again; the second is dealt
-- with row by row and the rest goes on, so no row can stop the drain's lane.
--
-- outbox_park_scheduled: up to max_rows rows of the outbox scheduled for later, soonest
-- due first (outbox_scheduled_idx), moved into outbox_scheduled, skipping rows another
-- session holds (the app's own transaction, say): at most 16 MiB of payload and headers,
-- and no row over 1 MiB (it is let in where it is when due: two copies would cost more
-- than stepping over it). Nothing to move, or parking off: no DELETE at all (a
-- statement trigger of the app's on the outbox would fire for none). The columns the app
-- added go along in `extra`, as a dead letter's do (0018). If the outbox refuses to let
-- any of them go (an app's DELETE trigger raising, a foreign key to a row, say), the
-- pass moves none, with a WARNING: they are then let in where they are when due, as
-- before 0021. How many moved.
CREATE FUNCTION outbox_park_scheduled(max_rows integer)
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
                WHERE o.sent_at IS NULL
                  AND o.dead_lettered_at IS NULL
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

-- outbox_let_in: due rows of outbox_scheduled, soonest due first, of shard `shard` of
-- `shards` (1: all), back into the outbox under their ids, let in (promoted_at now):
-- from then on they are ordinary unsent rows, in their id's place. At most max_rows
-- rows, and 16 MiB of payload and headers (one row at least), so a pass stays short;
-- `more` says it stopped there, and the drain looks again at once. Rows another session
-- holds wait for the next pass. Nothing due: no INSERT at all (a statement trigger on
-- the outbox, the NOTIFY one say, would fire for none). A row leaves outbox_scheduled
-- only once the outbox took it: a row the outbox refuses (a constraint or trigger of
-- the app's) or drops (a BEFORE INSERT trigger returning NULL) goes to outbox_dead
-- with the reason, and the rest go in. The columns the app added come back from
-- `extra` (one added since gets its default). How many went in.
CREATE FUNCTION outbox_let_in(max_rows integer, shards integer, shard integer,
                              OUT let_in bigint, OUT more boolean)
LANGUAGE plpgsql
SECURITY DEFINER
AS $$
DECLARE
    added record;
    ids bigint[];
    chosen_count bigint;
    move text;
    bury text;
    took bigint[] := '{}';
    one_took bigint[];
    one_id bigint;
    refused boolean := false;
BEGIN
    SELECT array_agg(chosen.id ORDER BY chosen.n)
               FILTER (WHERE chosen.bytes <= 16777216 OR chosen.n = 1),
           count(*)
    INTO ids, chosen_count
    FROM (SELECT s.id,
                 sum(s.size) OVER (ORDER BY s.available_at, s.id) AS bytes,
                 row_number() OVER (ORDER BY s.available_at, s.id) AS n
          FROM (SELECT s.id, s.available_at,
                       coalesce(octet_length(s.payload), 0)
                       + coalesce(pg_column_size(s.headers), 0) AS size
                FROM outbox_scheduled AS s
                WHERE s.available_at <= now()
                  AND (shards = 1 OR outbox_shard(s.key, s.id, shards) = shard)
                ORDER BY s.available_at, s.id
                LIMIT max_rows
                FOR UPDATE SKIP LOCKED) AS s) AS chosen;
    SET CONSTRAINTS ALL IMMEDIATE;  -- as in outbox_park_scheduled
    let_in := 0;
    more := ids IS NOT NULL AND (chosen_count >= max_rows OR cardinality(ids) < chosen_count);
    IF ids IS NULL THEN
        RETURN;
    END IF;
    added := outbox_restored_of('back');  -- the catalog read, only with rows to move
    move := format($back$
        WITH back AS (
            SELECT s.* FROM outbox_scheduled AS s WHERE s.id = ANY($1)
        ),
        moved AS (
            INSERT INTO outbox (id, message_id, topic, key, payload, headers, created_at,
                                available_at, promoted_at, attempts, last_error%s)
            OVERRIDING SYSTEM VALUE
            SELECT back.id, back.message_id, back.topic, back.key, back.payload,
                   back.headers, back.created_at, back.available_at, now(),
                   back.attempts, back.last_error%s
            FROM back%s
            RETURNING outbox.id
        ),
        gone AS (
            DELETE FROM outbox_scheduled AS s USING moved WHERE s.id = moved.id
            RETURNING s.id
        )
        SELECT coalesce(array_agg(gone.id), '{}') FROM gone
    $back$, added.columns, added.restored, added.kept);
    bury := $bury$
        WITH gone AS (
            DELETE FROM outbox_scheduled AS s WHERE s.id = ANY($1) RETURNING s.*
        )
        INSERT INTO outbox_dead (id, message_id, topic, key, payload, headers, created_at,
                                 available_at, promoted_at, attempts, last_error,
                                 dead_lettered_at, dead_letter_reason, extra)
        SELECT gone.id, gone.message_id, gone.topic, gone.key, gone.payload, gone.headers,
               gone.created_at, gone.available_at, NULL, gone.attempts, gone.last_error,
               now(), $2, gone.extra
        FROM gone
    $bury$;
    BEGIN
        EXECUTE move INTO took USING ids;
    EXCEPTION
        WHEN transaction_rollback OR lock_not_available OR insufficient_resources
             OR operator_intervention OR system_error THEN
            RAISE;
        WHEN OTHERS THEN
            refused := true;  -- undone; tried one at a time below
    END;
    IF refused THEN
        FOREACH one_id IN ARRAY ids LOOP
            BEGIN
                EXECUTE move INTO one_took USING ARRAY[one_id];
                took := took || one_took;
            EXCEPTION
                WHEN transaction_rollback OR lock_not_available OR insufficient_resources
                     OR operator_intervention OR system_error THEN
                    RAISE;
                WHEN OTHERS THEN
                    EXECUTE bury
                    USING ARRAY[one_id], 'could not be let back into the outbox: ' || SQLERRM;
            END;
        END LOOP;
    END IF;
    IF cardinality(took) < cardinality(ids) THEN
        -- Left without an error: a BEFORE INSERT trigger of the app's dropped them. A row
        -- refused above is in outbox_dead already.
        EXECUTE bury
        USING ARRAY(SELECT unnest(ids) EXCEPT SELECT unnest(took)),
              'could not be let back into the outbox: a BEFORE INSERT trigger on the'
              ' outbox dropped it';
    END IF;
    let_in := cardinality(took);
END
$$;

-- outbox_unpark_all: for a rollback past this release (docs/howto/scheduled-delivery.md):
-- parking off, and every row of outbox_scheduled back into the outbox under its id,
-- unchanged and not let in, so a relay of an earlier release sees it as it always did.
-- A row the outbox drops stays in outbox_scheduled. How many went back. One statement:
-- on a large schedule, a long one.
CREATE FUNCTION outbox_unpark_all()
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
AS $$
DECLARE
    added record := outbox_restored_of('back');
    moved bigint;
BEGIN
    UPDATE outbox_parking SET enabled = false;
    -- Every pass under way done (see outbox_park_scheduled); the move's snapshot, taken
    -- next, sees what they parked, and the passes after read the flag off.
    PERFORM pg_advisory_xact_lock('outbox_parking'::regclass::oid::integer, 0);
    EXECUTE format($back$
        WITH back AS (
            SELECT s.* FROM outbox_scheduled AS s FOR UPDATE
        ),
        moved AS (
            INSERT INTO outbox (id, message_id, topic, key, payload, headers, created_at,
                                available_at, attempts, last_error%s)
            OVERRIDING SYSTEM VALUE
            SELECT back.id, back.message_id, back.topic, back.key, back.payload,
                   back.headers, back.created_at, back.available_at, back.attempts,
                   back.last_error%s
            FROM back%s
            RETURNING outbox.id
        ),
        gone AS (
            DELETE FROM outbox_scheduled AS s USING moved WHERE s.id = moved.id
            RETURNING 1
        )
        SELECT count(*) FROM gone
    $back$, added.columns, added.restored, added.kept)
    INTO moved;
    RETURN moved;
END
$$;

-- As their owner, they resolve names in this schema only (then pg_temp, last), whatever
-- the caller's search_path; and only the roles granted them may run them (grants.sql).
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_park_scheduled(integer)'
                   ' SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION outbox_let_in(integer, integer, integer)'
                   ' SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION outbox_unpark_all()'
                   ' SET search_path = %I, pg_temp', current_schema());
END
$$;
REVOKE EXECUTE ON FUNCTION outbox_park_scheduled(integer) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox_let_in(integer, integer, integer) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox_unpark_all() FROM PUBLIC;

COMMENT ON FUNCTION outbox_park_scheduled(integer) IS
    'Move outbox rows scheduled for later into outbox_scheduled (once outbox_parking is on).';
COMMENT ON FUNCTION outbox_let_in(integer, integer, integer) IS
    'Move due rows of outbox_scheduled back into the outbox, by id, let in.';
COMMENT ON FUNCTION outbox_unpark_all() IS
    'Rollback: parking off, and every row of outbox_scheduled back into the outbox, unchanged.';
