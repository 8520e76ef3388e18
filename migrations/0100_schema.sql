-- The relay's 1.0 schema, for a fresh database: `relay migrate` applies this file alone.
-- replaces: 0001-0024
--
-- A database migrated before 1.0 (migrations 0001-0022, every one of them applied) is
-- brought to this schema by 0023 and 0024, which `relay migrate` applies instead of this
-- file; one with only some of 0001-0022 applied is refused (docs/howto/upgrades.md).
--
-- In order: the outbox and what its rows are read by (the shard, key hash and fairness
-- group functions); the leases, their groups and the replicas' heartbeats; the history of
-- sent rows; the dead letters; the rows scheduled for later; the console's audit. The
-- runtime role's rights are granted by grants.sql and console_grants.sql, not here.

------------------------------------------------------------------------------------
-- The outbox
------------------------------------------------------------------------------------

-- Applications INSERT (topic, key, payload, headers) inside their own transaction;
-- id, message_id and created_at have defaults. available_at is the app's too: NULL (the
-- default) means now, a later time schedules the row. The remaining columns are the
-- relay's bookkeeping of a row still to send, written only by the relay and its CLI.
-- The outbox holds only rows still to send: a sent row is deleted (or moved into
-- outbox_sent), a dead letter moved into outbox_dead, a row scheduled for later into
-- outbox_scheduled until it is due.
CREATE TABLE outbox (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id          uuid        NOT NULL DEFAULT gen_random_uuid(),
    topic               text        NOT NULL,
    key                 text,
    payload             bytea,
    headers             jsonb,
    created_at          timestamptz NOT NULL DEFAULT now(),
    -- relay bookkeeping
    attempts            integer     NOT NULL DEFAULT 0,
    next_attempt_at     timestamptz,
    last_error          text,
    available_at        timestamptz,  -- the app's: not published before this time
    promoted_at         timestamptz
);

COMMENT ON TABLE outbox IS
    'Transactional outbox: rows written by the application, published by the relay.';
COMMENT ON COLUMN outbox.message_id IS
    'Stable id sent as the message-id header; consumers deduplicate on it.';
COMMENT ON COLUMN outbox.next_attempt_at IS
    'Set after a failed publish; NULL means eligible now.';
COMMENT ON COLUMN outbox.available_at IS
    'Not published before this time (database clock); NULL means now. Written by the app.';
COMMENT ON COLUMN outbox.promoted_at IS
    'When the relay found this scheduled row due and let it into the drain (bookkeeping).';

-- Three indexes: the primary key (the settle finds rows by id, and the fetch walks them
-- in id order), the key hash index (the fair fetch's walk over keys) and the waiting
-- index (rows that hold their key back). An app's insert writes the first two only: a
-- new row waits for nothing.

-- hashtextextended is what hash partitioning uses, so PostgreSQL keeps it stable across
-- versions; NULL for a NULL key. IMMUTABLE and a plain SQL body: the planner inlines it,
-- so the fetch's outbox_key_hash(o.key) is the index's expression.
CREATE FUNCTION outbox_key_hash(key text) RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN hashtextextended(key, 0);
COMMENT ON FUNCTION outbox_key_hash(text) IS
    'A 64-bit hash of an outbox row''s key: the fair fetch walks keys by it (NULL: no key).';

-- The fair fetch's walk over keys, one descent per key, on a 64-bit hash of the key: the
-- walk needs only each key's rows in id order, never the keys' order, and 8 bytes
-- compared as an integer cost an app's insert less than its whole key under a
-- collation. Two keys with one hash (about 3 in 10^8 that any two of a million keys do)
-- are walked as one: their rows still go in id order, each key's prefix kept. Its
-- predicate is the drain's (relay/sql/drain.sql, fragment drainable): a row not
-- scheduled for later, or let in.
CREATE INDEX outbox_key_hash_idx ON outbox (outbox_key_hash(key), id)
    WHERE available_at IS NULL OR promoted_at IS NOT NULL;

-- Rows that hold back the later rows of their key: waiting out a retry backoff, or
-- scheduled and not yet let in (until the drain's next pass moves them into
-- outbox_scheduled). There are few of them, so the fetch's per-row probe "is an earlier
-- row of my key waiting?" hits a tiny index; the promotion of due rows and the lag
-- sampler's first failing row read it whole.
CREATE INDEX outbox_waiting_idx ON outbox (key, id)
    WHERE next_attempt_at IS NOT NULL OR (available_at IS NOT NULL AND promoted_at IS NULL);

-- With N shards, a row belongs to shard outbox_shard(key, id, N): a stable hash of its
-- key (so all rows of a key share a shard and per-key order can hold), or of its id for
-- a NULL key (spread evenly). Nothing is stored in the outbox and apps change nothing:
-- the per-N indexes that let one shard's fetch read only its own rows are expression
-- indexes on this function, created for a given N by `relay migrate --shards N`
-- (docs/howto/sharding.md).
CREATE FUNCTION outbox_shard(key text, id bigint, shards integer) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN abs(coalesce(hashtextextended(key, 0), id) % shards)::integer;

COMMENT ON FUNCTION outbox_shard(text, bigint, integer) IS
    'The shard (0..shards-1) of an outbox row: a hash of its key, or of its id without one.';

-- A group is what the operator calls a tenant: the key up to the first delimiter
-- (`key-prefix`, e.g. `tenant-42` of `tenant-42:order-7`; a key without the delimiter
-- is its own group) or the value of one header (`header`). A row with neither (no key,
-- no such header, headers that are no object) is in the group ''. Nothing is stored in
-- the outbox and apps change nothing: the fetch walks the groups through an expression
-- index on this function, created for one grouping by
-- `relay migrate --fairness-group SPEC` (docs/concepts/fairness.md).
-- IMMUTABLE and a plain SQL body: the planner inlines it and folds `kind` away, so the
-- fetch's expression, with the grouping's constants, is the index's expression.
CREATE FUNCTION outbox_fairness_group(key text, headers jsonb, kind text, arg text)
    RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN coalesce(CASE kind
                        WHEN 'key-prefix' THEN split_part(key, arg, 1)
                        WHEN 'header' THEN CASE WHEN jsonb_typeof(headers) = 'object'
                                                THEN headers ->> arg END
                    END, '');

COMMENT ON FUNCTION outbox_fairness_group(text, jsonb, text, text) IS
    'The fairness group (tenant) of an outbox row: a key prefix or a header''s value; '''' for none.';

-- What the fetch reads from a row's headers, in one walk of them (relay/sql/drain.sql,
-- fragment header_facts): their size, why they cannot be sent if so, and the pairs to
-- send. A named type, so that one scalar subquery hands all three on, and a row
-- without headers skips it (a lateral join would run, and cost, for every row).
-- Nothing is stored: it only types a value of the fetch.
CREATE TYPE outbox_header_facts AS (
    bytes   bigint,  -- names and values, as row_size counts them
    refused text,    -- why the first header whose value is an object or array cannot go
    pairs   text[]   -- [name, value] pairs to send
);

------------------------------------------------------------------------------------
-- Leases, their groups, and the replicas
------------------------------------------------------------------------------------

-- A lease row per drained outbox, or per shard: `name` is the row's key (the shard's
-- own name, e.g. `default#3/8`; `default` itself with one shard), `lease_group` the
-- lease it is a shard of (NULL: the row is its own group), `shards` the shard count it
-- was made for and `shard` which one it is.
CREATE TABLE leases (
    name         text        PRIMARY KEY,
    holder       text,
    epoch        bigint      NOT NULL DEFAULT 0,
    expires_at   timestamptz NOT NULL DEFAULT now(),  -- born expired
    acquired_at  timestamptz,
    renewed_at   timestamptz,
    released_at  timestamptz,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    lease_group  text,
    shards       integer     NOT NULL DEFAULT 1 CHECK (shards >= 1),
    shard        integer     NOT NULL DEFAULT 0 CHECK (shard >= 0 AND shard < shards)
);

COMMENT ON TABLE leases IS
    'One row per drained outbox: who may publish, until when, and the fencing epoch.';
COMMENT ON COLUMN leases.epoch IS
    'Fencing token: incremented on every acquisition; marks are conditioned on it.';

-- One row per lease group: the shard count its replicas drain with now. Every lease
-- acquisition of the group updates this row first, so acquisitions of one group are
-- serialized (under REPEATABLE READ a concurrent one fails with 40001), and the count
-- changes only when no lease of the old count is live; the change fences every lease of
-- the old count (epoch + 1), so a paused holder of one can never settle again. Two
-- shard counts never drain one outbox at once: per-key order survives a change of N.
CREATE TABLE lease_groups (
    name         text        PRIMARY KEY,
    shards       integer     NOT NULL CHECK (shards >= 1),
    switched_at  timestamptz,
    claimed_at   timestamptz
);

COMMENT ON TABLE lease_groups IS
    'Per lease name: the shard count in force; every acquisition passes through its row.';

-- Every running replica, as it last reported itself: alive, and able to reach the sink.
--
-- A leader cut off from the broker (or the endpoint) but not from PostgreSQL would
-- otherwise renew its lease forever while a standby that can deliver waits. Each replica
-- writes its row every RELAY_HEARTBEAT_SECONDS; a standby says whether its own probe of
-- the sink succeeded. A leader that has delivered nothing for RELAY_GIVE_WAY_SECONDS
-- while rows wait hands the lease over only if some live replica here says it can
-- reach the sink. Rows of replicas gone for an hour are removed by the others.
--
-- Tiny (one row per replica) and written only by the relay.
CREATE TABLE replicas (
    lease_name  text        NOT NULL,
    replica_id  text        NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    seen_at     timestamptz NOT NULL DEFAULT now(),  -- database clock
    sink_ok     boolean     NOT NULL,
    sink_error  text,
    PRIMARY KEY (lease_name, replica_id)
);

COMMENT ON TABLE replicas IS
    'Relay replicas per lease: last heartbeat (database clock) and whether each reaches the sink.';

------------------------------------------------------------------------------------
-- The history of sent rows (RELAY_RETENTION_SECONDS)
------------------------------------------------------------------------------------

-- In retention mode the relay settles a batch by moving its rows out of the outbox into
-- outbox_sent, in the same fenced statement (a DELETE ... RETURNING feeding an INSERT):
-- the outbox keeps only rows still to send and dead letters, as in delete mode, and its
-- indexes never see a sent row. outbox_sent has no index at all, so keeping a row costs
-- one heap insert; and it is never purged row by row. It is split into four fixed
-- generations (LIST partitions): one takes the rows sent now; the relay's purge empties
-- the oldest with one TRUNCATE and makes it the current one, once a third of the
-- retention has passed and every row in it is older than RELAY_RETENTION_SECONDS
-- (outbox_sent_generations says when each began). A row is kept for at least the
-- retention and at most about 4/3 of it. The runtime role needs INSERT on the table,
-- TRUNCATE on the generations and UPDATE on their start times (grants.sql), never DDL.
CREATE TABLE outbox_sent (
    generation          smallint    NOT NULL,
    id                  bigint      NOT NULL,
    message_id          uuid        NOT NULL,
    topic               text        NOT NULL,
    key                 text,
    payload             bytea,
    headers             jsonb,
    created_at          timestamptz NOT NULL,
    available_at        timestamptz,
    attempts            integer     NOT NULL,
    last_error          text,
    sent_at             timestamptz NOT NULL
) PARTITION BY LIST (generation);

CREATE TABLE outbox_sent_0 PARTITION OF outbox_sent FOR VALUES IN (0);
CREATE TABLE outbox_sent_1 PARTITION OF outbox_sent FOR VALUES IN (1);
CREATE TABLE outbox_sent_2 PARTITION OF outbox_sent FOR VALUES IN (2);
CREATE TABLE outbox_sent_3 PARTITION OF outbox_sent FOR VALUES IN (3);

COMMENT ON TABLE outbox_sent IS
    'Sent outbox rows kept for RELAY_RETENTION_SECONDS; each generation is emptied whole.';

-- When each generation began taking rows: the current one is the latest. A generation
-- that never did begins at -infinity (so the first rotations need not wait).
CREATE TABLE outbox_sent_generations (
    generation  smallint    PRIMARY KEY CHECK (generation >= 0 AND generation < 4),
    started_at  timestamptz NOT NULL
);

INSERT INTO outbox_sent_generations (generation, started_at)
VALUES (0, now()), (1, '-infinity'), (2, '-infinity'), (3, '-infinity');

COMMENT ON TABLE outbox_sent_generations IS
    'When each generation of outbox_sent began taking sent rows (the latest is current).';

------------------------------------------------------------------------------------
-- Dead letters
------------------------------------------------------------------------------------

-- Dead letters leave the outbox: the settle that gives up on a row moves it into
-- outbox_dead (outbox_dead_letter, below), in its fenced transaction, as the retention
-- mode moves sent rows into outbox_sent. The outbox then holds only rows still to
-- send, so a walk of it in id order meets no row it must step over for good, however
-- many dead letters pile up.
--
-- A dead letter keeps its id: `relay dead-letter requeue` and the console's requeue move
-- it back into the outbox under that id (outbox_requeue, below), so requeued rows are
-- sent in their original order relative to each other. It keeps every column: the
-- outbox's own as columns here, and any the app added to the outbox in `extra` (as
-- JSON, built from those columns alone), from which a requeue restores them. An own
-- table (RELAY_OUTBOX_TABLE) marks its dead letters in place instead.
--
-- outbox_dead's ids are the outbox's: never restart the outbox's identity while dead
-- letters are kept (a new row could then take a dead letter's id, and its move here
-- would fail on the primary key).
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

-- Every dead letter, as the console, `relay dead-letter` and the lag gauges read them
-- (an own table's view schema has a view of this name over its rows marked in place).
CREATE VIEW outbox_dead_letters AS
SELECT id, message_id, topic, key, payload, headers, created_at, available_at,
       promoted_at, attempts, last_error, dead_lettered_at, dead_letter_reason
FROM outbox_dead;

COMMENT ON VIEW outbox_dead_letters IS
    'Every dead letter of the outbox: the rows of outbox_dead.';

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
                                  'created_at', 'attempts', 'next_attempt_at', 'last_error',
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

-- outbox_dead_letter: the settle's dead path (relay/sql/drain.sql, dead_letter_move):
-- the rows given up on, out of the outbox into outbox_dead with the attempts they spent
-- and the reason. The settle moves the rows of up to 16 MiB of payload and headers in
-- its fenced transaction, and the larger ones after it, in a fenced transaction of
-- their own without a statement timeout: copying hundreds of MB could outlast the
-- settle's, and the settle would fail again and again. Returns how many it moved.
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

-- outbox_requeue: the dead letters named (by id, by key, or all) back into the outbox
-- under their ids, with fresh attempts and the columns the app added restored
-- (`relay dead-letter requeue`, the console). Returns their ids.
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

------------------------------------------------------------------------------------
-- Rows scheduled for later
------------------------------------------------------------------------------------

-- Scheduled rows not yet due leave the outbox: they wait in outbox_scheduled, and come
-- back into the outbox under their ids when due (let in, promoted_at set), as dead
-- letters go to outbox_dead. The outbox then holds only rows that may go now or are
-- settling, so a walk of it in id order meets no row waiting for a later time, however
-- large the schedule.
--
-- outbox_unpark_all moves every parked row back and stops parking (outbox_parking), for
-- a rollback to a relay that does not read outbox_scheduled
-- (docs/howto/scheduled-delivery.md).
--
-- The readers of the schedule (the fetch's "an earlier row of my key is scheduled", the
-- lag gauges, the console) read both places. An own table (RELAY_OUTBOX_TABLE) keeps its
-- scheduled rows in place; its view schema has an empty outbox_scheduled of its own
-- (`relay migrate --own-table`).
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

-- Whether rows scheduled for later are moved out (outbox_park_scheduled): on, until
-- outbox_unpark_all switches it off.
CREATE TABLE outbox_parking (
    single  boolean PRIMARY KEY DEFAULT true CHECK (single),
    enabled boolean NOT NULL
);
INSERT INTO outbox_parking (enabled) VALUES (true);

COMMENT ON TABLE outbox_parking IS
    'Whether the relay moves rows scheduled for later into outbox_scheduled (0021 on).';

-- The moves below tell an error that may pass (a lock wait, a deadlock, a full disk, a
-- cancel) from one the row itself causes (a constraint or trigger of the app's refuses
-- it): the first fails the pass, which the next pass tries again; the second is dealt
-- with row by row and the rest goes on, so no row can stop the drain's lane.
--
-- outbox_park_scheduled: up to max_rows rows of the outbox scheduled for later, soonest
-- due first (outbox_waiting_idx), moved into outbox_scheduled, skipping rows another
-- session holds (the app's own transaction, say): at most 16 MiB of payload and headers,
-- and no row over 1 MiB (it is let in where it is when due: two copies would cost more
-- than stepping over it). Nothing to move, or parking off: no DELETE at all (a
-- statement trigger of the app's on the outbox would fire for none). The columns the app
-- added go along in `extra`, as a dead letter's do. If the outbox refuses to let
-- any of them go (an app's DELETE trigger raising, a foreign key to a row, say), the
-- pass moves none, with a WARNING: they are then let in where they are when due.
-- How many moved.
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

------------------------------------------------------------------------------------
-- The console's audit
------------------------------------------------------------------------------------

-- Every requeue and discard the console (or its API) makes writes one row here, in the
-- same transaction as the change itself: who (the login: "token", or the user an
-- authenticating proxy named), when (database clock), what (the row ids chosen, or the
-- filter matched), and how many rows it changed; so does every replay, from the console
-- or `relay replay` (outbox_replay, below). The console reads it back on its Audit
-- page. `relay dead-letter requeue` is an operator's shell, which keeps its own trail.
--
-- A discard deletes rows for good, and a discard by search records the search, which
-- matches other rows (or none) afterwards: without the ids, which rows went could not
-- be told. `row_ids` holds every outbox id the requeue or discard changed, in id order
-- (as many as row_count); the console writes it with the entry, in the change's
-- transaction.
CREATE TABLE console_audit (
    id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at         timestamptz NOT NULL DEFAULT now(),
    actor      text        NOT NULL,
    action     text        NOT NULL
               CHECK (action IN ('requeue', 'discard', 'replay', 'pause', 'resume')),
    target     jsonb       NOT NULL,  -- {"ids": [...]} or {"filter": {...}}
    row_count  integer     NOT NULL CHECK (row_count >= 0),
    first_id   bigint,                -- the lowest and highest id it changed
    last_id    bigint,
    note       text,                  -- e.g. the per-key order warning shown
    row_ids    bigint[]    CHECK (row_ids IS NULL OR cardinality(row_ids) = row_count)
);

COMMENT ON TABLE console_audit IS
    'Requeues and discards made from the operators'' console, and every replay, pause and resume: who, when, what, how many rows.';
COMMENT ON COLUMN console_audit.row_ids IS
    'Every outbox id the change requeued or discarded, in id order (NULL: recorded before migration 0014).';

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
