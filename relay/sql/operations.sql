-- What operators see and do, through the CLI or the daemon's side threads: `relay
-- status` and `relay check`, the lag gauges (relay/observe/lag.py), `relay dead-letter`, and the
-- retention purge (relay/store/purge.py, `relay purge`).
-- Parameters are named, %(name)s; nothing here is built by string concatenation.

------------------------------------------------------------------------------------
-- Lag
------------------------------------------------------------------------------------

-- name: lag_sample
-- Backlog and lag for the gauges and `relay status`, bounded so it stays cheap on a huge
-- outbox (docs/howto/tuning.md, "Lag sampling"): counts stop at the cap, each walking its
-- index in order; the oldest unsent row is found among the first age_window rows of the
-- primary key (the outbox holds only rows to send); "blocked" counts, up to the cap,
-- the rows that have failed (next_attempt_at set: at most cap of them, walked in
-- outbox_waiting_idx's order) and the later rows of their keys, which wait behind them
-- (a walk of outbox_key_hash_idx per key): however many rows fail, at most cap rows of
-- each kind are read.
-- Scheduled rows are not lag until due: "unsent" and the oldest age count the rows due,
-- let in or not yet (an age counts from available_at, if later than created_at); rows
-- not due yet are counted apart, with when the next one is due. The scheduled rows
-- still in the outbox (few, and only until the drain's next pass) are those among the
-- first cap entries of outbox_waiting_idx, those moved out into outbox_scheduled are
-- read through its index on available_at (an own table's outbox_scheduled is an empty
-- stand-in): counts stop at the cap. Once let in, a scheduled row sits in
-- its id's place, so the lowest id is no longer always the longest wait: the oldest age
-- is the longest wait among the first %(age_window)s rows (a few heap reads, not a walk
-- of the backlog); a longer wait hidden behind more rows let in than that is missed.
-- Ages are differences of epochs, not of timestamps: a row the app stamped 'infinity'
-- or '-infinity' gives an age of 0 or +Infinity instead of failing every sample.
-- A paused topic's rows are no lag: the oldest age leaves them out of its window (they
-- are counted as `paused`, the rows held in outbox_paused and those parked in place,
-- and each paused topic is listed with how long it has been paused).
WITH waiting AS MATERIALIZED (
    -- Up to %(cap)s rows that hold their key back, in outbox_waiting_idx's order (its
    -- predicate word for word): failing, or scheduled and not let in yet.
    SELECT w.key, w.id, w.next_attempt_at, w.available_at, w.promoted_at
      FROM outbox AS w
     WHERE w.next_attempt_at IS NOT NULL
        OR (w.available_at IS NOT NULL AND w.promoted_at IS NULL)
     ORDER BY w.key, w.id
     LIMIT %(cap)s
),
failing AS (
    SELECT f.key, f.id, f.next_attempt_at FROM waiting AS f WHERE f.next_attempt_at IS NOT NULL
),
scheduled_here AS (
    -- Scheduled rows still in the outbox (until the drain's next pass moves them out).
    SELECT s.available_at FROM waiting AS s
     WHERE s.available_at IS NOT NULL AND s.promoted_at IS NULL
)
SELECT
    least(%(cap)s,
          (SELECT count(*)
             FROM (SELECT 1 FROM outbox
                    WHERE (available_at IS NULL OR promoted_at IS NOT NULL)
                    ORDER BY id  -- a walk of the primary key that stops at the cap
                    LIMIT %(cap)s) AS unsent_rows)
          + (SELECT count(*)  -- due, not let in yet (no leader, or between its passes)
               FROM scheduled_here WHERE available_at <= now())
          + (SELECT count(*)  -- due, still moved out
               FROM (SELECT 1 FROM outbox_scheduled
                      WHERE available_at <= now()
                      ORDER BY available_at  -- by its index, also with stale statistics
                      LIMIT %(cap)s) AS overdue_parked_rows))
        AS unsent,
    greatest(0,
             (SELECT extract(epoch FROM now()) - extract(epoch FROM min(greatest(head.created_at, head.available_at)))
                FROM (SELECT created_at, available_at, topic
                        FROM outbox
                       WHERE (available_at IS NULL OR promoted_at IS NOT NULL)
                       ORDER BY id
                       LIMIT %(age_window)s) AS head
               WHERE NOT EXISTS (SELECT 1 FROM outbox_paused_topics AS p
                                  WHERE p.topic = head.topic)),
             (SELECT extract(epoch FROM now()) - extract(epoch FROM min(available_at))
                FROM scheduled_here),
             (SELECT extract(epoch FROM now()) - extract(epoch FROM min(available_at))
                FROM outbox_scheduled))::float8
        AS oldest_unsent_age_seconds,
    (SELECT count(*)
       FROM ((SELECT 1  -- the failing rows
                FROM failing)
             UNION ALL
             (SELECT 1  -- the rows waiting behind the first failing row of their key
                FROM (SELECT DISTINCT ON (h.key) h.key, h.id FROM failing AS h
                       WHERE h.key IS NOT NULL
                       ORDER BY h.key, h.id) AS head
                CROSS JOIN LATERAL (
                    SELECT 1
                      FROM outbox AS w
                     WHERE outbox_key_hash(w.key) >= outbox_key_hash(head.key)
                       AND outbox_key_hash(w.key) <= outbox_key_hash(head.key)
                       AND w.key = head.key
                       AND w.id > head.id
                       AND (w.available_at IS NULL OR w.promoted_at IS NOT NULL)
                       AND w.next_attempt_at IS NULL
                     ORDER BY outbox_key_hash(w.key), w.id
                     LIMIT %(cap)s) AS behind)
             LIMIT %(cap)s) AS blocked_rows)
        AS blocked,
    (SELECT count(*)
       FROM (SELECT 1 FROM outbox_dead_letters
              LIMIT %(cap)s) AS dead_rows)
        AS dead_lettered,
    least(%(cap)s,
          (SELECT count(*) FROM scheduled_here WHERE available_at > now())
          + (SELECT count(*)
               FROM (SELECT 1 FROM outbox_scheduled
                      WHERE available_at > now()
                      ORDER BY available_at  -- by its index, whatever the statistics
                      LIMIT %(cap)s) AS parked_rows))
        AS scheduled,
    least((SELECT (extract(epoch FROM min(available_at)) - extract(epoch FROM now()))::float8
             FROM scheduled_here
            WHERE available_at > now()),
          (SELECT (extract(epoch FROM min(available_at)) - extract(epoch FROM now()))::float8
             FROM outbox_scheduled
            WHERE available_at > now()))
        AS next_due_in_seconds,
    least(%(cap)s,
          (SELECT count(*) FROM failing WHERE next_attempt_at = 'infinity')
          + (SELECT count(*)  -- held out of the outbox, walked by its primary key
               FROM (SELECT 1 FROM outbox_paused ORDER BY id LIMIT %(cap)s) AS held_rows))
        AS paused,
    (SELECT coalesce(jsonb_object_agg(p.topic, extract(epoch FROM now())
                                               - extract(epoch FROM p.paused_at)), '{}')
       FROM outbox_paused_topics AS p)
        AS paused_topics;

-- name: lag_sample_shards
-- The backlog and oldest unsent age of each of %(shards)s shards (RELAY_SHARDS > 1):
-- one walk of that count's outbox_shards_N_due_idx per shard, each count stopping at
-- %(cap)s (the cap divided among the shards, so a sample costs what it did without
-- shards). Needs a custom plan (shard count a constant) to match the index expression.
-- The oldest age is lag_sample's: the longest wait among the shard's first
-- %(age_window)s rows (its part of lag_sample's window), a paused topic's rows left out.
SELECT s.shard,
    least(%(cap)s,
          (SELECT count(*)
             FROM (SELECT 1 FROM outbox AS o
                    WHERE (o.available_at IS NULL OR o.promoted_at IS NOT NULL)
                      AND outbox_shard(o.key, o.id, %(shards)s::integer) = s.shard
                    ORDER BY o.id  -- the shard index's order under its shard
                    LIMIT %(cap)s) AS unsent_rows)
          + (SELECT count(*)  -- due, not let in yet (as in lag_sample)
               FROM (SELECT 1 FROM outbox AS o
                      WHERE o.available_at IS NOT NULL AND o.promoted_at IS NULL
                        AND o.available_at <= now()
                        AND outbox_shard(o.key, o.id, %(shards)s::integer) = s.shard
                      ORDER BY o.available_at
                      LIMIT %(cap)s) AS overdue_rows)
          + (SELECT count(*)  -- due, still moved out
               FROM (SELECT 1 FROM outbox_scheduled AS p
                      WHERE p.available_at <= now()
                        AND outbox_shard(p.key, p.id, %(shards)s::integer) = s.shard
                      ORDER BY p.available_at
                      LIMIT %(cap)s) AS overdue_parked_rows))
        AS unsent,
    coalesce(
        greatest(0,
                 (SELECT extract(epoch FROM now())
                         - extract(epoch FROM min(greatest(head.created_at, head.available_at)))
                    FROM (SELECT o.created_at, o.available_at, o.topic
                            FROM outbox AS o
                           WHERE (o.available_at IS NULL OR o.promoted_at IS NOT NULL)
                             AND outbox_shard(o.key, o.id, %(shards)s::integer) = s.shard
                           ORDER BY o.id
                           LIMIT %(age_window)s) AS head
                   WHERE NOT EXISTS (SELECT 1 FROM outbox_paused_topics AS p
                                      WHERE p.topic = head.topic)),
                 (SELECT extract(epoch FROM now()) - extract(epoch FROM o.available_at)
                    FROM outbox AS o
                   WHERE o.available_at IS NOT NULL AND o.promoted_at IS NULL
                     AND o.available_at <= now()
                     AND outbox_shard(o.key, o.id, %(shards)s::integer) = s.shard
                   ORDER BY o.available_at
                   LIMIT 1),
                 (SELECT extract(epoch FROM now()) - extract(epoch FROM p.available_at)
                    FROM outbox_scheduled AS p
                   WHERE p.available_at <= now()
                     AND outbox_shard(p.key, p.id, %(shards)s::integer) = s.shard
                   ORDER BY p.available_at
                   LIMIT 1))::float8,
        0) AS oldest_unsent_age_seconds
FROM generate_series(0, %(shards)s::integer - 1) AS s(shard)
ORDER BY s.shard;

------------------------------------------------------------------------------------
-- Status
------------------------------------------------------------------------------------

-- name: lease_status
-- All lease rows with the database's view of their expiry.
SELECT name, coalesce(lease_group, name) AS lease_group, shards, shard,
       holder, epoch, expires_at, expires_at > now() AS live,
       extract(epoch FROM expires_at - now())::float8 AS seconds_to_expiry,
       acquired_at, renewed_at, released_at
FROM leases
ORDER BY name;

-- name: replica_status
-- Every replica's last heartbeat, for `relay status`.
SELECT lease_name, replica_id, started_at, seen_at, sink_ok, sink_error,
       extract(epoch FROM now() - seen_at)::float8 AS seconds_since_seen
FROM replicas
ORDER BY lease_name, replica_id;

-- name: lease_group_shards
-- The shard count in force for each lease group (lease_groups), for status.
SELECT name, shards FROM lease_groups ORDER BY name;

------------------------------------------------------------------------------------
-- Dead letters
------------------------------------------------------------------------------------

-- name: dead_letter_access
-- The runtime role's grants to move rows out of the outbox and back (grants.sql): the
-- rows a settle gives up on into outbox_dead, without which every settle with a dead
-- letter in it fails and the drain publishes that batch again and again; rows
-- scheduled for later into outbox_scheduled and back when due, without which every
-- pass of the schedule fails; a paused topic's rows into outbox_paused and back, and
-- the fetch's read of it, without which every fetch fails. NULL: a function is missing.
SELECT has_function_privilege(
           to_regprocedure('outbox_dead_letter(bigint[], integer[], text[])'), 'EXECUTE')
       AND has_function_privilege(
           to_regprocedure('outbox_park_scheduled(integer)'), 'EXECUTE')
       AND has_function_privilege(
           to_regprocedure('outbox_let_in(integer, integer, integer)'), 'EXECUTE')
       AND has_table_privilege(to_regclass('outbox_scheduled'), 'SELECT')
       AND has_function_privilege(
           to_regprocedure('outbox_hold_paused(text[], bigint, integer, bigint[],'
                           ' int8multirange, integer, integer)'), 'EXECUTE')
       AND has_function_privilege(
           to_regprocedure('outbox_release_paused(integer)'), 'EXECUTE')
       AND has_table_privilege(to_regclass('outbox_paused'), 'SELECT')
       AS can_move;

-- name: dead_letter_list
-- Dead-lettered rows, oldest first, optionally for one topic or key, as
-- outbox_dead_letters holds them: moved out of the outbox, or an own table's marked in
-- place.
SELECT id, message_id, topic, key, attempts, dead_lettered_at, dead_letter_reason
FROM outbox_dead_letters
WHERE (%(topic)s::text IS NULL OR topic = %(topic)s::text)
  AND (%(key)s::text IS NULL OR key = %(key)s::text)
ORDER BY id
LIMIT %(limit)s;

-- name: dead_letter_requeue_in_place
-- Put an own table's dead letters (RELAY_OUTBOX_TABLE), all marked in place, back in the
-- drain with fresh attempts, under the same id: through the view of all its rows,
-- outbox_marked (`relay migrate --own-table`).
UPDATE outbox_marked
SET dead_lettered_at   = NULL,
    dead_letter_reason = NULL,
    attempts           = 0,
    next_attempt_at    = NULL
WHERE dead_lettered_at IS NOT NULL
  AND (%(all)s OR id = ANY(%(ids)s::bigint[]) OR key = %(key)s::text)
RETURNING id;

-- name: dead_letter_requeue
-- Put dead letters back in the drain with fresh attempts: moved from outbox_dead back
-- into the outbox under their ids, by outbox_requeue. They keep their id, so they are
-- sent in their original order relative to each other.
SELECT requeued AS id
FROM outbox_requeue(%(ids)s::bigint[], %(key)s::text, %(all)s) AS requeued;

-- name: dead_letters_left_behind
-- Keys of just-requeued rows that still have an earlier dead letter: the requeued rows
-- will be delivered before it, out of per-key order (relay dead-letter requeue warns).
SELECT DISTINCT r.key
FROM outbox AS r
WHERE r.id = ANY(%(ids)s::bigint[])
  AND r.key IS NOT NULL
  AND EXISTS (
      SELECT 1
      FROM outbox_dead_letters AS d
      WHERE d.key = r.key
        AND d.id < r.id
  )
ORDER BY r.key;

------------------------------------------------------------------------------------
-- Retention
------------------------------------------------------------------------------------

-- name: sent_history_access
-- Retention mode needs outbox_sent and the runtime role's grants on
-- it (grants.sql): without them every settle fails, and the drain would publish the
-- same batch again and again. NULL: the table is missing.
SELECT has_table_privilege(to_regclass('outbox_sent'), 'INSERT') AS can_keep,
       has_table_privilege(to_regclass('outbox_sent_generations'), 'SELECT')
           AS can_read_generations;

-- name: sent_generation_due
-- Retention mode: the generation of outbox_sent to empty and make the
-- current one, if it is time. It is the one after the current, once the current has
-- taken rows for a (%(generations)s - 1)th of the retention, and only if every row in
-- it is older than the retention: its rows were all sent before the generation after
-- it began. The generations' rows stay locked until the transaction ends, so two
-- purges (one per shard's leader) never rotate at once. No row: not yet.
WITH generations AS (
    SELECT g.generation, g.started_at
    FROM outbox_sent_generations AS g
    FOR UPDATE
),
current AS (
    SELECT c.generation, c.started_at
    FROM generations AS c
    ORDER BY c.started_at DESC
    LIMIT 1
)
SELECT (c.generation + 1) %% %(generations)s AS generation
FROM current AS c
WHERE c.started_at
        <= now() - make_interval(secs => %(retention)s / (%(generations)s - 1))
  AND (SELECT after.started_at
       FROM generations AS after
       WHERE after.generation = (c.generation + 2) %% %(generations)s)
        <= now() - make_interval(secs => %(retention)s);

-- name: sent_generation_empty
-- Its rows go all at once: {partition} is outbox_sent_N, an identifier composed by
-- psycopg.sql. TRUNCATE takes that partition's lock for an instant; a reader of the
-- history holding it makes the purge give up (lock_timeout) and try at its next run.
TRUNCATE {partition};

-- name: sent_generations_older_than
-- `relay purge --older-than`: the generations of outbox_sent, but the current one,
-- whose every row was sent more than %(older_than)s seconds ago: the generation after
-- each (the next to begin, in turn) began after it, and that long ago. Locked as in
-- sent_generation_due.
WITH generations AS (
    SELECT g.generation, g.started_at
    FROM outbox_sent_generations AS g
    FOR UPDATE
)
SELECT g.generation
FROM generations AS g
JOIN generations AS after ON after.generation = (g.generation + 1) %% %(generations)s
WHERE after.started_at > g.started_at
  AND after.started_at <= now() - make_interval(secs => %(older_than)s)
ORDER BY g.generation;

-- name: sent_generation_begin
-- ... and it takes the rows sent from now on: from the clock's time after the TRUNCATE
-- (not the transaction's start), since settles that came meanwhile still went into the
-- generation before, and all of its rows must be older than this one's start.
UPDATE outbox_sent_generations
SET started_at = clock_timestamp()
WHERE generation = %(generation)s;

-- name: purge_sent
-- Retention for an own table, whose sent rows stay in it, marked: delete one small batch
-- of rows sent before the cutoff, oldest sent first, through the view of all its rows
-- (outbox_marked) and its index on relay_sent_at: finding them (or that there are none)
-- is one index descent, however many sent rows are kept. Small batches keep locks and
-- WAL bursts short; call repeatedly until it deletes fewer than the limit. Rows another
-- session has locked are skipped, not waited for.
DELETE FROM outbox_marked
WHERE id IN (
    SELECT id
    FROM outbox_marked
    WHERE sent_at IS NOT NULL
      AND sent_at < now() - make_interval(secs => %(older_than)s)
    ORDER BY sent_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
);
