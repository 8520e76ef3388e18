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

-- The audit records replays too (`relay replay`, the console), and pauses and resumes.
ALTER TABLE console_audit
    DROP CONSTRAINT console_audit_action_check,
    ADD CONSTRAINT console_audit_action_check
        CHECK (action IN ('requeue', 'discard', 'replay', 'pause', 'resume'));

COMMENT ON TABLE console_audit IS
    'Requeues and discards made from the operators'' console, and every replay, pause and resume: who, when, what, how many rows.';

-- outbox_replay: the rows of outbox_sent of topic `by_topic` (and key `by_key`; NULL:
-- any) sent from `sent_from` up to `sent_before` (never past now()) back into the
-- outbox as new rows, in their original id order (`relay replay`, the console's
-- replay). It runs as the tables' owner, as outbox_requeue does: the roles that replay
-- need no INSERT on the outbox nor on console_audit, and can put back only rows that
-- were sent. One statement: one snapshot of the history, and the copy and its audit
-- entry commit together or not at all.
--
-- A new row takes the outbox's next id, so it goes after every row of its key already
-- waiting, and its created_at is now(): the created-at header, the lag and the latency
-- count from the replay, not from the first write (the first write's time stays in
-- outbox_sent). It keeps message_id, topic, key, payload and headers, plus the header
-- `relay-replay`, whose value is the replay's id: its console_audit entry's id (any
-- header of that name the row had, in any case, is replaced). available_at, attempts
-- and the rest start afresh; the columns an app added to the outbox (outbox_sent keeps
-- none) get their defaults.
--
-- It copies only if all of these hold, else nothing (and writes no audit entry):
-- outbox_sent keeps rows at all; `sent_from` is not before the oldest row kept (rows
-- sent before it may be gone, and the replay would miss them); between 1 and `max_rows`
-- rows match (0: count only, a dry run); and, when `expected` is given, exactly that
-- many (what a confirmation showed). It returns the history's span, the end of the
-- range as used, how many rows match, and for a replay made its id, how many rows the
-- outbox took (fewer only if a BEFORE INSERT trigger of the app's dropped some), and
-- the first and last new outbox id. outbox_sent has no index: each call reads the whole history once
-- to count, and once more to copy.
CREATE FUNCTION outbox_replay(by_topic text, by_key text, sent_from timestamptz,
                              sent_before timestamptz, max_rows bigint, expected bigint,
                              replayed_by text, via text,
                              OUT kept_since timestamptz, OUT kept_until timestamptz,
                              OUT sent_until timestamptz, OUT matching bigint,
                              OUT replay_id bigint, OUT replayed bigint, OUT first_id bigint,
                              OUT last_id bigint)
LANGUAGE sql
SECURITY DEFINER
AS $$
    WITH history AS (
        SELECT min(s.sent_at) AS since,
               max(s.sent_at) AS until,
               count(*) FILTER (WHERE s.topic = by_topic
                                  AND (by_key IS NULL OR s.key = by_key)
                                  AND s.sent_at >= sent_from
                                  AND s.sent_at < least(sent_before, now())) AS matching
        FROM outbox_sent AS s
    ),
    verdict AS (
        SELECT h.since, h.until, h.matching, least(sent_before, now()) AS sent_until,
               coalesce(sent_from >= h.since, false)
               AND h.matching BETWEEN 1 AND max_rows
               AND h.matching = coalesce(expected, h.matching) AS go
        FROM history AS h
    ),
    entry AS (
        SELECT nextval(pg_get_serial_sequence('console_audit', 'id')) AS id
        FROM verdict AS v
        WHERE v.go
    ),
    copied AS (
        INSERT INTO outbox (message_id, topic, key, payload, headers)
        SELECT s.message_id, s.topic, s.key, s.payload,
               coalesce((SELECT jsonb_object_agg(h.key, h.value)
                         FROM jsonb_each(CASE WHEN jsonb_typeof(s.headers) = 'object'
                                              THEN s.headers END) AS h
                         WHERE lower(h.key) <> 'relay-replay'),
                        '{}'::jsonb)
               || jsonb_build_object('relay-replay', (SELECT e.id::text FROM entry AS e))
        FROM outbox_sent AS s
        WHERE EXISTS (SELECT 1 FROM entry)
          AND s.topic = by_topic
          AND (by_key IS NULL OR s.key = by_key)
          AND s.sent_at >= sent_from
          AND s.sent_at < least(sent_before, now())
        ORDER BY s.id
        RETURNING outbox.id
    ),
    audit AS (
        INSERT INTO console_audit (id, actor, action, target, row_count, first_id, last_id,
                                   row_ids)
        OVERRIDING SYSTEM VALUE
        SELECT e.id, replayed_by, 'replay',
               jsonb_build_object('filter',
                                  jsonb_strip_nulls(jsonb_build_object('topic', by_topic,
                                                                       'key', by_key,
                                                                       'since', sent_from,
                                                                       'until', v.sent_until)),
                                  'via', via),
               count(c.id), min(c.id), max(c.id),
               coalesce(array_agg(c.id ORDER BY c.id) FILTER (WHERE c.id IS NOT NULL), '{}')
        FROM entry AS e
        CROSS JOIN verdict AS v
        LEFT JOIN copied AS c ON true
        GROUP BY e.id, v.sent_until
        RETURNING console_audit.id, console_audit.row_count, console_audit.first_id,
                  console_audit.last_id
    )
    SELECT v.since, v.until, v.sent_until, v.matching, a.id, a.row_count::bigint, a.first_id,
           a.last_id
    FROM verdict AS v
    LEFT JOIN audit AS a ON true
$$;

-- As its owner, it resolves names in this schema only (then pg_temp, last), whatever
-- the caller's search_path; and only the roles granted it may run it (grants.sql,
-- console_grants.sql).
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_replay(text, text, timestamptz, timestamptz,'
                   ' bigint, bigint, text, text) SET search_path = %I, pg_temp',
                   current_schema());
END
$$;
REVOKE EXECUTE ON FUNCTION outbox_replay(text, text, timestamptz, timestamptz, bigint,
                                         bigint, text, text) FROM PUBLIC;

COMMENT ON FUNCTION outbox_replay(text, text, timestamptz, timestamptz, bigint, bigint,
                                  text, text) IS
    'Copy sent rows of a topic (and key) sent in a range from outbox_sent back into the outbox as new rows, in id order, recorded in console_audit.';

-- outbox_paused_topics: the topics an operator paused (`relay pause`, the console, its
-- API). A paused topic's rows wait, unsent, spending no attempt: a relay that meets
-- them at the head of the outbox moves them into outbox_paused (below), or parks one
-- in place (next_attempt_at 'infinity', relay/sql/drain.sql, park_paused: an own
-- table's, or one too large to move), and the fetch's probes then hold every later row
-- of their keys behind them, whatever their topic, so order per key holds across the
-- pause. Every replica reads this table at least once a second; once a topic's row is
-- gone, the next relay to notice lets its rows go (outbox_release_paused,
-- unpark_resumed).
CREATE TABLE outbox_paused_topics (
    topic      text        PRIMARY KEY,
    paused_by  text        NOT NULL,
    paused_at  timestamptz NOT NULL DEFAULT now(),
    reason     text
);

COMMENT ON TABLE outbox_paused_topics IS
    'Topics whose rows the relay holds in the outbox until resumed (relay pause / resume).';

-- outbox_pause: pause `pause_topic` (if it is not paused already) and record it in
-- console_audit, as one statement; whether it was paused now, and since when it is.
-- It runs as the tables' owner: the roles that pause need no write on either table.
CREATE FUNCTION outbox_pause(pause_topic text, actor text, why text, via text,
                             OUT paused_now boolean, OUT paused_since timestamptz,
                             OUT audit_id bigint)
LANGUAGE sql
SECURITY DEFINER
AS $$
    WITH added AS (
        INSERT INTO outbox_paused_topics (topic, paused_by, reason)
        VALUES (pause_topic, actor, why)
        ON CONFLICT (topic) DO NOTHING
        RETURNING paused_at
    ),
    audit AS (
        INSERT INTO console_audit (actor, action, target, row_count, note)
        SELECT actor, 'pause', jsonb_build_object('topic', pause_topic, 'via', via), 0, why
        FROM added
        RETURNING console_audit.id
    )
    SELECT EXISTS (SELECT 1 FROM added),
           coalesce((SELECT a.paused_at FROM added AS a),
                    (SELECT p.paused_at FROM outbox_paused_topics AS p
                      WHERE p.topic = pause_topic)),
           (SELECT a.id FROM audit AS a)
$$;

-- outbox_resume: resume `resume_topic` (if it is paused) and record it; whether it was
-- paused, and since when. It first takes the topic's pause lock exclusively: a settle
-- parking rows of the topic holds it shared (park_paused), and so does a move into
-- outbox_paused, so either committed before the resume, and the relay that notices the
-- resume lets its rows go, or sees the topic no longer paused and holds nothing.
CREATE FUNCTION outbox_resume(resume_topic text, actor text, via text,
                              OUT resumed boolean, OUT paused_since timestamptz,
                              OUT audit_id bigint)
LANGUAGE plpgsql
SECURITY DEFINER
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock('outbox_paused_topics'::regclass::oid::integer,
                                  hashtext(resume_topic));
    DELETE FROM outbox_paused_topics AS p WHERE p.topic = resume_topic
        RETURNING p.paused_at INTO paused_since;
    resumed := FOUND;
    IF resumed THEN
        INSERT INTO console_audit (actor, action, target, row_count)
        VALUES (actor, 'resume', jsonb_build_object('topic', resume_topic, 'via', via), 0)
        RETURNING console_audit.id INTO audit_id;
    END IF;
END
$$;

-- As their owner, they resolve names in this schema only (then pg_temp, last), whatever
-- the caller's search_path; and only the roles granted them may run them (grants.sql,
-- console_grants.sql).
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_pause(text, text, text, text)'
                   ' SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION outbox_resume(text, text, text)'
                   ' SET search_path = %I, pg_temp', current_schema());
END
$$;
REVOKE EXECUTE ON FUNCTION outbox_pause(text, text, text, text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox_resume(text, text, text) FROM PUBLIC;

COMMENT ON FUNCTION outbox_pause(text, text, text, text) IS
    'Pause a topic: its rows wait in the outbox until outbox_resume; recorded in console_audit.';
COMMENT ON FUNCTION outbox_resume(text, text, text) IS
    'Resume a paused topic: the relay lets its held rows go within a second or two; recorded in console_audit.';

-- outbox_paused: the rows of a paused topic, held out of the outbox until the topic is
-- resumed, as rows scheduled for later wait in outbox_scheduled: a drain that meets
-- them at the head of the outbox moves them here (outbox_hold_paused), so the fetch
-- walks past none of them however large the paused backlog, and the fetch's probe "an
-- earlier row of my key is held" (outbox_paused_key_idx) keeps every later row of
-- their keys waiting, whatever its topic. Once the topic is resumed, a drain moves them
-- back under their ids (outbox_release_paused). The columns the app added go along in
-- `extra`, as a dead letter's do. An own table (RELAY_OUTBOX_TABLE) parks its rows in
-- place instead; its view schema has an empty outbox_paused of its own.
CREATE TABLE outbox_paused (
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
    extra               jsonb
);

COMMENT ON TABLE outbox_paused IS
    'Outbox rows of paused topics, moved back into the outbox by id once resumed.';

-- The fetch's per-row probe "is an earlier row of my key held?".
CREATE INDEX outbox_paused_key_idx ON outbox_paused (key, id);

-- A resumed topic's rows, in id order, and which topics have rows here (one descent
-- each), however many rows another topic still paused holds.
CREATE INDEX outbox_paused_topic_idx ON outbox_paused (topic, id);

-- outbox_hold_paused: the rows of the paused topics among `topics` in the first
-- `walk` rows the drain may take from id `from_id` on (the fetch's head and what comes
-- next, in id order: relay/store/fetch.py), moved into outbox_paused, leaving out the
-- rows in flight (`in_flight`, `in_flight_ranges`, as the fetch does), those of other
-- shards (`shards`, `shard`), and rows another session holds. At most 16 MiB of payload
-- and headers, and no row over 1 MiB (such a row is parked in place instead, as an own
-- table's are: relay/sql/drain.sql, park_paused). Under each topic's pause lock, shared,
-- as park_paused: a resume waits for the move, and a move after it finds the topic no
-- longer paused and moves nothing. If the outbox refuses to let a row go (an app's
-- DELETE trigger raising, a foreign key to it), the pass moves none, with a WARNING,
-- and the drain parks them in place. How many moved.
CREATE FUNCTION outbox_hold_paused(topics text[], from_id bigint, walk integer,
                                   in_flight bigint[], in_flight_ranges int8multirange,
                                   shards integer, shard integer)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
AS $$
DECLARE
    ids bigint[];
    held bigint;
BEGIN
    PERFORM count(pg_advisory_xact_lock_shared('outbox_paused_topics'::regclass::oid::integer,
                                               hashtext(t.topic)))
    FROM (SELECT DISTINCT unnest(topics) AS topic ORDER BY 1) AS t;
    SET CONSTRAINTS ALL IMMEDIATE;  -- as in outbox_park_scheduled
    -- Planned for the arguments given (EXECUTE): the walk is one of the primary key.
    EXECUTE $walk$
        SELECT array_agg(chosen.id)
        FROM (SELECT locked.id, sum(locked.size) OVER (ORDER BY locked.id) AS bytes
              FROM (SELECT o.id,
                           coalesce(octet_length(o.payload), 0)
                           + coalesce(pg_column_size(o.headers), 0) AS size
                    FROM outbox AS o
                    WHERE o.id = ANY(ARRAY(
                              SELECT w.id
                              FROM (SELECT o.id, o.topic
                                    FROM outbox AS o
                                    WHERE o.id >= $2
                                      AND (o.available_at IS NULL
                                           OR o.promoted_at IS NOT NULL)
                                      AND o.id <> ALL($4)
                                      AND NOT (o.id <@ $5)
                                      AND ($6 = 1 OR outbox_shard(o.key, o.id, $6) = $7)
                                    ORDER BY o.id
                                    LIMIT $3) AS w
                              WHERE w.topic = ANY($1)
                                AND EXISTS (SELECT 1 FROM outbox_paused_topics AS p
                                            WHERE p.topic = w.topic)))
                      AND coalesce(octet_length(o.payload), 0)
                          + coalesce(pg_column_size(o.headers), 0) <= 1048576
                    ORDER BY o.id
                    FOR UPDATE SKIP LOCKED) AS locked) AS chosen
        WHERE chosen.bytes <= 16777216
    $walk$
    INTO ids
    USING topics, from_id, walk, in_flight, in_flight_ranges, shards, shard;
    IF ids IS NULL THEN
        RETURN 0;
    END IF;
    BEGIN
        EXECUTE format($hold$
            WITH gone AS (
                DELETE FROM outbox AS o WHERE o.id = ANY($1) RETURNING o.*
            ),
            held AS (
                INSERT INTO outbox_paused (id, message_id, topic, key, payload, headers,
                                           created_at, available_at, promoted_at, attempts,
                                           last_error, extra)
                SELECT gone.id, gone.message_id, gone.topic, gone.key, gone.payload,
                       gone.headers, gone.created_at, gone.available_at, gone.promoted_at,
                       gone.attempts, gone.last_error, %s
                FROM gone
                RETURNING 1
            )
            SELECT count(*) FROM held
        $hold$, outbox_extra_of('gone'))
        INTO held
        USING ids;
    EXCEPTION
        WHEN transaction_rollback OR lock_not_available OR insufficient_resources
             OR operator_intervention OR system_error THEN
            RAISE;
        WHEN OTHERS THEN
            RAISE WARNING 'rows of a paused topic stay in the outbox: %', SQLERRM;
            RETURN 0;
    END;
    RETURN held;
END
$$;

-- outbox_release_paused: the held rows of topics no longer paused back into the
-- outbox under their ids, unchanged (a row in a retry backoff when it was held is tried
-- again at once), lowest ids first, at most max_rows rows and 16 MiB of payload and
-- headers (one row at least) a pass; `more` says it stopped there. Any replica may run
-- it: the first drain to see a topic resumed does. Order per key holds whatever part
-- goes back first: a row back in the outbox still waits behind an earlier row of its key
-- held here. A row the outbox refuses (a constraint or trigger of the app's) or drops
-- goes to outbox_dead with the reason, as outbox_let_in's do. How many went back.
CREATE FUNCTION outbox_release_paused(max_rows integer, OUT released bigint,
                                      OUT more boolean)
LANGUAGE plpgsql
SECURITY DEFINER
AS $$
DECLARE
    added record;
    ids bigint[];
    chosen_count bigint;
    move text;
    took bigint[] := '{}';
    one_took bigint[];
    one_id bigint;
    refused boolean := false;
BEGIN
    -- The topics with rows here, one descent of outbox_paused_topic_idx each, and of
    -- those no longer paused, the first rows by id.
    WITH RECURSIVE held_topics (topic) AS (
        SELECT min(h.topic) FROM outbox_paused AS h
        UNION ALL
        SELECT (SELECT min(h.topic) FROM outbox_paused AS h WHERE h.topic > t.topic)
        FROM held_topics AS t
        WHERE t.topic IS NOT NULL
    )
    SELECT array_agg(chosen.id ORDER BY chosen.n)
               FILTER (WHERE chosen.bytes <= 16777216 OR chosen.n = 1),
           count(*)
    INTO ids, chosen_count
    FROM (SELECT r.id,
                 sum(r.size) OVER (ORDER BY r.id) AS bytes,
                 row_number() OVER (ORDER BY r.id) AS n
          FROM (SELECT h.id,
                       coalesce(octet_length(h.payload), 0)
                       + coalesce(pg_column_size(h.headers), 0) AS size
                FROM outbox_paused AS h
                WHERE h.topic = ANY(ARRAY(
                          SELECT t.topic FROM held_topics AS t
                          WHERE t.topic IS NOT NULL
                            AND NOT EXISTS (SELECT 1 FROM outbox_paused_topics AS p
                                            WHERE p.topic = t.topic)))
                ORDER BY h.id
                LIMIT max_rows
                FOR UPDATE SKIP LOCKED) AS r) AS chosen;
    SET CONSTRAINTS ALL IMMEDIATE;  -- as in outbox_park_scheduled
    released := 0;
    more := ids IS NOT NULL AND (chosen_count >= max_rows OR cardinality(ids) < chosen_count);
    IF ids IS NULL THEN
        RETURN;
    END IF;
    added := outbox_restored_of('back');
    move := format($back$
        WITH back AS (
            SELECT h.* FROM outbox_paused AS h WHERE h.id = ANY($1)
        ),
        moved AS (
            INSERT INTO outbox (id, message_id, topic, key, payload, headers, created_at,
                                available_at, promoted_at, attempts, last_error%s)
            OVERRIDING SYSTEM VALUE
            SELECT back.id, back.message_id, back.topic, back.key, back.payload,
                   back.headers, back.created_at, back.available_at, back.promoted_at,
                   back.attempts, back.last_error%s
            FROM back%s
            RETURNING outbox.id
        ),
        gone AS (
            DELETE FROM outbox_paused AS h USING moved WHERE h.id = moved.id
            RETURNING h.id
        )
        SELECT coalesce(array_agg(gone.id), '{}') FROM gone
    $back$, added.columns, added.restored, added.kept);
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
                    PERFORM outbox_bury_paused(ARRAY[one_id],
                                               'could not be let back into the outbox: '
                                               || SQLERRM);
            END;
        END LOOP;
    END IF;
    IF cardinality(took) < cardinality(ids) THEN
        PERFORM outbox_bury_paused(
            ARRAY(SELECT unnest(ids) EXCEPT SELECT unnest(took)),
            'could not be let back into the outbox: a BEFORE INSERT trigger on the outbox'
            ' dropped it');
    END IF;
    released := cardinality(took);
END
$$;

-- outbox_bury_paused: held rows the outbox would not take back, into outbox_dead with
-- the reason (outbox_release_paused's).
CREATE FUNCTION outbox_bury_paused(ids bigint[], reason text)
RETURNS void
LANGUAGE sql
SECURITY DEFINER
AS $$
    WITH gone AS (
        DELETE FROM outbox_paused AS h WHERE h.id = ANY(ids) RETURNING h.*
    )
    INSERT INTO outbox_dead (id, message_id, topic, key, payload, headers, created_at,
                             available_at, promoted_at, attempts, last_error,
                             dead_lettered_at, dead_letter_reason, extra)
    SELECT gone.id, gone.message_id, gone.topic, gone.key, gone.payload, gone.headers,
           gone.created_at, gone.available_at, gone.promoted_at, gone.attempts,
           gone.last_error, now(), reason, gone.extra
    FROM gone
$$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION outbox_hold_paused(text[], bigint, integer, bigint[],'
                   ' int8multirange, integer, integer) SET search_path = %I, pg_temp',
                   current_schema());
    EXECUTE format('ALTER FUNCTION outbox_release_paused(integer)'
                   ' SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION outbox_bury_paused(bigint[], text)'
                   ' SET search_path = %I, pg_temp', current_schema());
END
$$;
REVOKE EXECUTE ON FUNCTION outbox_hold_paused(text[], bigint, integer, bigint[],
                                              int8multirange, integer, integer) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox_release_paused(integer) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox_bury_paused(bigint[], text) FROM PUBLIC;

COMMENT ON FUNCTION outbox_hold_paused(text[], bigint, integer, bigint[], int8multirange,
                                       integer, integer) IS
    'Move the rows of paused topics at the head of the outbox into outbox_paused.';
COMMENT ON FUNCTION outbox_release_paused(integer) IS
    'Move the held rows of resumed topics back into the outbox, by id.';
COMMENT ON FUNCTION outbox_bury_paused(bigint[], text) IS
    'Held rows the outbox would not take back, into outbox_dead with the reason.';
