-- Every statement the relay runs, by name. Python asks for them as QUERIES.<name>.
-- Parameters are named: %(name)s. Nothing here is built by string concatenation.

-- name: set_session_timeouts
-- Bound every statement, lock wait and idle transaction of a relay session, so a stuck
-- relay can never hold a lock on the lease row or the outbox for long.
SELECT set_config('statement_timeout', %(statement_timeout)s, false),
       set_config('lock_timeout', %(lock_timeout)s, false),
       set_config('idle_in_transaction_session_timeout', %(idle_timeout)s, false),
       set_config('application_name', %(application_name)s, false);

-- name: set_synchronous_commit
-- RELAY_DATABASE_SYNCHRONOUS_COMMIT, for the daemon's sessions: with asynchronous
-- replication a failover can lose acknowledged lease writes and marks; `remote_apply`
-- (or `on` with synchronous standbys) makes them wait for a standby.
SELECT set_config('synchronous_commit', %(synchronous_commit)s, false);

------------------------------------------------------------------------------------
-- Lease (see relay/lease.py for the protocol)
------------------------------------------------------------------------------------

-- name: lease_ensure
-- Create the lease row on first use, expired and unheld, epoch 0; and its group's row
-- (migration 0007), in force with this replica's shard count if it is the first.
WITH grp AS (
    INSERT INTO lease_groups (name, shards) VALUES (%(group)s, %(shards)s)
    ON CONFLICT (name) DO NOTHING
)
INSERT INTO leases (name, lease_group, shards, shard)
VALUES (%(name)s, CASE WHEN %(shards)s::integer > 1 THEN %(group)s END, %(shards)s, %(shard)s)
ON CONFLICT (name) DO NOTHING;

-- name: lease_group_claim
-- The first statement of every acquisition, under REPEATABLE READ: pass through the
-- group's row, so acquisitions of one lease group are serialized (a concurrent one
-- fails with 40001: a lost race). The group's shard count becomes ours only if no
-- lease of another count is live (held, not released, not expired); a change of count
-- fences every lease of the old one (epoch + 1, holder cleared), so its holders'
-- renewals and settles match nothing. `claimed` is 0 while another count drains.
WITH live_other AS (
    SELECT l.name
    FROM leases AS l
    WHERE coalesce(l.lease_group, l.name) = %(group)s
      AND l.shards <> %(shards)s
      AND l.holder IS NOT NULL
      AND l.released_at IS NULL
      AND l.expires_at > now()
), claimed AS (
    UPDATE lease_groups AS g
    SET shards      = %(shards)s,
        switched_at = CASE WHEN g.shards <> %(shards)s THEN now() ELSE g.switched_at END,
        claimed_at  = now()
    WHERE g.name = %(group)s
      AND (g.shards = %(shards)s OR NOT EXISTS (SELECT 1 FROM live_other))
    RETURNING g.name
), fenced AS (
    UPDATE leases AS l
    SET epoch       = l.epoch + 1,
        holder      = NULL,
        expires_at  = least(l.expires_at, now()),
        released_at = now(),
        updated_at  = now()
    WHERE coalesce(l.lease_group, l.name) = %(group)s
      AND l.shards <> %(shards)s
      AND l.holder IS NOT NULL
      AND EXISTS (SELECT 1 FROM claimed)
)
SELECT (SELECT count(*) FROM claimed) AS claimed,
       (SELECT min(name) FROM live_other) AS live_other;

-- name: lease_read
-- First half of the compare-and-swap, under REPEATABLE READ. Time is the database's.
SELECT holder, epoch, expires_at > now() AS live
FROM leases
WHERE name = %(name)s;

-- name: lease_take
-- Second half of the CAS: succeeds only if nobody changed the epoch since lease_read.
-- Under REPEATABLE READ a concurrent winner makes this fail with SQLSTATE 40001 or
-- update zero rows; the caller treats both as a lost race. `at` is read while we hold
-- the lease row's lock, so acquisitions and settles (lease_renew) are ordered by it on
-- one clock, the database's: logged, it lets a history checker prove fencing held.
UPDATE leases
SET holder      = %(holder)s,
    epoch       = epoch + 1,
    expires_at  = now() + make_interval(secs => %(ttl)s),
    acquired_at = now(),
    renewed_at  = now(),
    released_at = NULL,
    updated_at  = now()
WHERE name = %(name)s
  AND epoch = %(seen_epoch)s
RETURNING epoch, clock_timestamp() AS at;

-- name: lease_renew
-- Extend the lease we hold; matches no row once someone else took it (fencing). The
-- elector renews with it, and it is the first statement of every transaction that
-- settles rows: zero rows there means a newer holder exists, so the settle rolls back.
-- `at` is read under the lease row's lock: settles and acquisitions are ordered by it.
-- A released lease is never extended again (lease_take clears released_at).
UPDATE leases
SET expires_at = now() + make_interval(secs => %(ttl)s),
    renewed_at = now(),
    updated_at = now()
WHERE name = %(name)s
  AND holder = %(holder)s
  AND epoch = %(epoch)s
  AND released_at IS NULL
RETURNING epoch, clock_timestamp() AS at;

-- name: lease_release
-- Expire our lease now so a standby takes over at its next poll, not after a whole ttl.
UPDATE leases
SET expires_at  = now(),
    released_at = now(),
    updated_at  = now()
WHERE name = %(name)s
  AND holder = %(holder)s
  AND epoch = %(epoch)s;

-- name: lease_status
-- All lease rows with the database's view of their expiry.
SELECT name, coalesce(lease_group, name) AS lease_group, shards, shard,
       holder, epoch, expires_at, expires_at > now() AS live,
       extract(epoch FROM expires_at - now())::float8 AS seconds_to_expiry,
       acquired_at, renewed_at, released_at
FROM leases
ORDER BY name;

-- name: replica_beat
-- This replica is alive and can (or cannot) reach the sink; in the same round trip,
-- how many OTHER replicas of the lease were seen within %(live)s seconds, and how many
-- of them said they can reach the sink. Rows silent for %(forget)s seconds go.
WITH forgotten AS (
    DELETE FROM replicas
    WHERE lease_name = %(lease)s
      AND replica_id <> %(replica)s
      AND seen_at < now() - make_interval(secs => %(forget)s)
), beat AS (
    INSERT INTO replicas AS r (lease_name, replica_id, sink_ok, sink_error)
    VALUES (%(lease)s, %(replica)s, %(sink_ok)s, %(sink_error)s)
    ON CONFLICT (lease_name, replica_id) DO UPDATE
    SET started_at = CASE WHEN %(first)s THEN now() ELSE r.started_at END,
        seen_at = now(),
        sink_ok = excluded.sink_ok,
        sink_error = excluded.sink_error
)
SELECT count(*) AS live_peers,
       count(*) FILTER (WHERE sink_ok) AS able_peers
FROM replicas
WHERE lease_name = %(lease)s
  AND replica_id <> %(replica)s
  AND seen_at > now() - make_interval(secs => %(live)s);

-- name: replica_leave
-- On a clean stop: this replica no longer counts as a live peer.
DELETE FROM replicas
WHERE lease_name = %(lease)s
  AND replica_id = %(replica)s;

-- name: replica_status
-- Every replica's last heartbeat, for `relay status`.
SELECT lease_name, replica_id, started_at, seen_at, sink_ok, sink_error,
       extract(epoch FROM now() - seen_at)::float8 AS seconds_since_seen
FROM replicas
ORDER BY lease_name, replica_id;

------------------------------------------------------------------------------------
-- Draining
------------------------------------------------------------------------------------

-- name: force_custom_plans
-- For the drain and lag sessions: plan with the actual parameters, so the in-flight
-- exclusion is a hashed lookup, the key cursor and the shard count constants (the
-- shard indexes match); and no JIT: compiling a millisecond query would cost more
-- than it saves, on every execution.
SELECT set_config('plan_cache_mode', 'force_custom_plan', false),
       set_config('jit', 'off', false);

-- name: walk_shard_indexes_in_order
-- For a shard's drain session (RELAY_SHARDS > 1): no bitmap scans. outbox_shards_N_due_idx
-- leads with the shard hash, which has no correlation with the table's order, so the
-- planner prices the ordered walk of one shard's rows as random reads and, once a
-- batch is a percent or so of the shard's backlog, would rather read ALL of the
-- shard's unsent rows through a bitmap and sort them: a fetch whose cost grows with
-- the backlog. Every statement of this session is meant as an ordered, LIMITed index
-- walk; the ordered walk stops at the batch.
SELECT set_config('enable_bitmapscan', 'off', false);

-- name: fetch_head
-- The fetch's common case, one cheap statement: the first %(limit)s unsent rows in id
-- order through outbox_due_idx, whatever they are, each with its size and whether
-- it is `ready` (not waiting out a retry backoff, and no earlier row of its key is: one
-- probe of the tiny outbox_backoff_idx; nor of a key in %(held)s, which the relay holds
-- back while an earlier row of it is in flight, say in a sick partition). No "id > last seen" cursor: a row that commits
-- late with a lower id is still found. `within`: the row fits %(max_bytes)s counting
-- the ready rows before it (the first ready row always does); rows past it come
-- without their payload, so a head of large rows never crosses the wire whole. When
-- these rows need no sharing out (the relay
-- decides: see fetch_batch, step 2), the ready ones are the batch; otherwise the relay
-- runs fetch_batch. The projection is fetch_batch's, kept in step (a test pins both to
-- OutboxMessage): the message id and created-at as text made here, in C; headers as one
-- flat text array [name, value, ...] exactly as PostgreSQL prints each value
-- (headers->>'name'), nulls and the relay's own names left out, never parsed by Python
-- (a value Python's json cannot load cannot hurt the relay); header_error says why a
-- row's headers cannot be sent (not an object, or a value that is not a scalar).
-- With %(shards)s > 1 (migration 0007), only rows of shard %(shard)s, read through the
-- per-count indexes `relay migrate --shards N` creates; fetch_batch likewise.
-- Scheduled rows (migration 0008) are left out until promote_due lets them in, and hold
-- back the later rows of their key meanwhile (one probe of the tiny
-- outbox_scheduled_key_idx); due_epoch is when the row became due, for the latency
-- histogram: its available_at if it had one, else its created_at.
SELECT h.id,
       coalesce(h.message_id::text, '') AS message_id,
       coalesce(h.topic, '') AS topic,
       h.key,
       CASE WHEN h.within AND h.size <= %(message_max)s::bigint THEN h.payload END AS payload,
       CASE WHEN h.within AND h.size <= %(message_max)s::bigint AND jsonb_typeof(h.headers) = 'object' THEN
           (SELECT array_agg(pair.text ORDER BY header.n, pair.n)
            FROM jsonb_each_text(h.headers) WITH ORDINALITY AS header (key, value, n)
            CROSS JOIN LATERAL (VALUES (1, header.key), (2, header.value)) AS pair (n, text)
            WHERE header.value IS NOT NULL
              AND lower(header.key) NOT IN ('message-id', 'created-at'))
       END AS headers,
       -- Why the row cannot be sent as it is (it is dead-lettered with this reason): too
       -- large to load, a column an own table left NULL, or headers that are no object
       -- of scalars.
       CASE WHEN h.size > %(message_max)s::bigint THEN
                'the row holds ' || h.size || ' bytes of payload, headers and key, over'
                || ' RELAY_MESSAGE_MAX_BYTES (' || %(message_max)s::bigint || ')'
            WHEN h.topic IS NULL THEN 'topic is NULL'
            WHEN h.message_id IS NULL THEN
                'message_id is NULL, or no id a header can carry (1-255 visible ASCII'
                || ' characters)'
            WHEN h.created_at IS NULL THEN 'created_at is NULL'
            WHEN h.headers IS NULL OR jsonb_typeof(h.headers) = 'null' THEN NULL
            WHEN jsonb_typeof(h.headers) = 'string' THEN
                'headers must be a JSON object, got string: ' || left(h.headers #>> '{}', 200)
            WHEN jsonb_typeof(h.headers) <> 'object' THEN
                'headers must be a JSON object, got ' || jsonb_typeof(h.headers)
            ELSE (SELECT 'header ' || to_jsonb(header.key)::text
                         || ' must be a string or scalar, got ' || jsonb_typeof(header.value)
                  FROM jsonb_each(h.headers) AS header
                  WHERE jsonb_typeof(header.value) IN ('object', 'array')
                  LIMIT 1)
       END AS header_error,
       coalesce(to_char(h.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'), '')
           AS created_at,
       coalesce(extract(epoch FROM greatest(h.created_at, h.available_at)),
                extract(epoch FROM now()))::float8 AS due_epoch,
       h.attempts,
       h.ready,
       h.within
FROM (SELECT head.*,
             head.ready
             AND (sum(CASE WHEN head.ready AND head.size <= %(message_max)s::bigint
                           THEN head.size ELSE 0 END)
                      OVER (ORDER BY head.id) <= %(max_bytes)s
                  OR count(*) FILTER (WHERE head.ready)
                      OVER (ORDER BY head.id) = 1) AS within
      FROM (SELECT o.*,
                   coalesce(octet_length(o.payload), 0) + coalesce(octet_length(o.headers::text), 0)
                   + coalesce(octet_length(o.key), 0) AS size,
                   (o.next_attempt_at IS NULL OR o.next_attempt_at <= now())
                   AND (o.key IS NULL OR o.key <> ALL(%(held)s::text[]))
                   AND NOT EXISTS (
                       SELECT 1
                       FROM outbox AS blocker
                       WHERE blocker.key = o.key
                         AND blocker.id < o.id
                         AND blocker.sent_at IS NULL
                         AND blocker.dead_lettered_at IS NULL
                         AND blocker.next_attempt_at IS NOT NULL
                         AND blocker.next_attempt_at > now()
                   )
                   AND NOT EXISTS (
                       SELECT 1
                       FROM outbox AS scheduled
                       WHERE scheduled.key = o.key
                         AND scheduled.id < o.id
                         AND scheduled.sent_at IS NULL
                         AND scheduled.dead_lettered_at IS NULL
                         AND scheduled.available_at IS NOT NULL
                         AND scheduled.promoted_at IS NULL
                   ) AS ready
            FROM outbox AS o
            WHERE o.sent_at IS NULL
              AND o.dead_lettered_at IS NULL
              -- Not scheduled, or due and promoted (promote_due): outbox_due_idx.
              AND (o.available_at IS NULL OR o.promoted_at IS NOT NULL)
              -- The batches published and not yet settled. The parameter is sent
              -- untyped, so the cast makes it a bigint[] constant of the custom plan:
              -- a hash lookup.
              AND o.id <> ALL(%(in_flight)s::bigint[])
              -- With RELAY_SHARDS > 1, this shard's rows only, through its index
              -- (outbox_shards_N_due_idx); with one shard the test folds away.
              AND (%(shards)s::integer = 1 OR outbox_shard(o.key, o.id, %(shards)s::integer) = %(shard)s::integer)
            ORDER BY o.id
            LIMIT %(limit)s) AS head) AS h
ORDER BY h.id;

-- name: fetch_batch
-- The fetch when the head needs sharing out (the relay runs fetch_head first): fair
-- across keys, bounded in rows and bytes, at a cost that does not grow with any key's
-- backlog (README "Fetching: fair and bounded").
--
-- 1. head: fetch_head's rows again (the first %(limit)s unsent rows in id order).
-- 2. crowded: the head is full and holds rows it may not send, or more ready rows of
--    one key than %(key_cap)s. Only then does the fetch look further (the relay runs
--    this statement when either holds, or when a key passes the cap in a head that is
--    not full):
-- 3. keys: up to %(limit)s keys with unsent rows, in key order from just after
--    %(after_key)s, wrapping around once (a loose index scan of outbox_due_key_idx: one
--    descent per key), leaving out keys that already have their share in a head full
--    of ready rows; beyond: each key's next rows after the head, an equal share of the
--    batch each, and the next rows without a key.
-- 4. chosen: every key's first %(key_cap)s ready rows come first, in id order; the
--    batch is then filled, in id order, with the further rows of busy keys (only if
--    %(fill)s: a sink that sends a key's rows one at a time gains nothing from them);
--    cut at %(limit)s rows, then at %(max_bytes)s bytes in (place, id) order (at least
--    one row). Each key gets a prefix of its rows, so per-key order holds.
--
-- Cost: at most %(limit)s head rows, plus, when crowded, %(limit)s key descents and
-- 2 x %(limit)s rows beyond the head. Rows come in id order, in fetch_head's projection
-- plus walked_to, NULL on every row but a last one that carries where the round over
-- keys stopped.
WITH RECURSIVE head AS MATERIALIZED (
    SELECT o.id, o.message_id, o.topic, o.key, o.payload, o.headers, o.created_at,
           o.available_at, o.attempts,
           coalesce(octet_length(o.payload), 0) + coalesce(octet_length(o.headers::text), 0)
           + coalesce(octet_length(o.key), 0) AS size,
           (o.next_attempt_at IS NULL OR o.next_attempt_at <= now())
           AND (o.key IS NULL OR o.key <> ALL(%(held)s::text[]))
           AND NOT EXISTS (
               SELECT 1
               FROM outbox AS blocker
               WHERE blocker.key = o.key
                 AND blocker.id < o.id
                 AND blocker.sent_at IS NULL
                 AND blocker.dead_lettered_at IS NULL
                 AND blocker.next_attempt_at IS NOT NULL
                 AND blocker.next_attempt_at > now()
           )
           AND NOT EXISTS (
               SELECT 1
               FROM outbox AS scheduled
               WHERE scheduled.key = o.key
                 AND scheduled.id < o.id
                 AND scheduled.sent_at IS NULL
                 AND scheduled.dead_lettered_at IS NULL
                 AND scheduled.available_at IS NOT NULL
                 AND scheduled.promoted_at IS NULL
           ) AS ready
    FROM outbox AS o
    WHERE o.sent_at IS NULL
      AND o.dead_lettered_at IS NULL
      AND (o.available_at IS NULL OR o.promoted_at IS NOT NULL)  -- outbox_due_idx
      -- The batches published and not yet settled. The parameter is sent untyped, so
      -- the cast makes it a bigint[] constant of the custom plan: a hash lookup.
      AND o.id <> ALL(%(in_flight)s::bigint[])
      AND (%(shards)s::integer = 1 OR outbox_shard(o.key, o.id, %(shards)s::integer) = %(shard)s::integer)  -- this shard's rows only
    ORDER BY o.id
    LIMIT %(limit)s
),
head_keys AS (
    -- Ready rows per key in the head.
    SELECT h.key, count(*) AS n
    FROM head AS h
    WHERE h.ready AND h.key IS NOT NULL
    GROUP BY h.key
),
crowded AS (
    SELECT count(*) = %(limit)s
           AND (bool_or(NOT h.ready)
                OR EXISTS (SELECT 1 FROM head_keys WHERE n > %(key_cap)s)) AS yes,
           -- Full of ready rows: a key with its share in the head gets nothing beyond
           -- it (those rows could never outrank a head row).
           count(*) = %(limit)s AND bool_and(h.ready) AS filled,
           max(h.id) AS last_id
    FROM head AS h
),
keys_after (key) AS (
    SELECT s.key
    FROM (SELECT min(o.key) AS key
          FROM outbox AS o
          WHERE o.sent_at IS NULL AND o.dead_lettered_at IS NULL
            AND (o.available_at IS NULL OR o.promoted_at IS NOT NULL)
            AND (%(shards)s::integer = 1 OR outbox_shard(o.key, o.id, %(shards)s::integer) = %(shard)s::integer)
            AND (%(after_key)s::text IS NULL OR o.key > %(after_key)s::text)) AS s
    WHERE s.key IS NOT NULL AND (SELECT yes FROM crowded)
    UNION ALL
    SELECT (SELECT min(o.key)
            FROM outbox AS o
            WHERE o.sent_at IS NULL AND o.dead_lettered_at IS NULL
              AND (o.available_at IS NULL OR o.promoted_at IS NOT NULL)
              AND o.key > k.key
              AND (%(shards)s::integer = 1 OR outbox_shard(o.key, o.id, %(shards)s::integer) = %(shard)s::integer))
    FROM keys_after AS k
    WHERE k.key IS NOT NULL
),
keys_before (key) AS (
    SELECT s.key
    FROM (SELECT min(o.key) AS key
          FROM outbox AS o
          WHERE o.sent_at IS NULL AND o.dead_lettered_at IS NULL
            AND (o.available_at IS NULL OR o.promoted_at IS NOT NULL)
            AND (%(shards)s::integer = 1 OR outbox_shard(o.key, o.id, %(shards)s::integer) = %(shard)s::integer)) AS s
    WHERE s.key <= %(after_key)s::text AND (SELECT yes FROM crowded)
    UNION ALL
    SELECT (SELECT min(o.key)
            FROM outbox AS o
            WHERE o.sent_at IS NULL AND o.dead_lettered_at IS NULL
              AND (o.available_at IS NULL OR o.promoted_at IS NOT NULL)
              AND o.key > k.key
              AND (%(shards)s::integer = 1 OR outbox_shard(o.key, o.id, %(shards)s::integer) = %(shard)s::integer))
    FROM keys_before AS k
    WHERE k.key < %(after_key)s::text
),
keys AS MATERIALIZED (
    SELECT u.key, row_number() OVER () AS walk
    FROM (SELECT key FROM keys_after WHERE key IS NOT NULL
          UNION ALL
          SELECT key FROM keys_before WHERE key <= %(after_key)s::text) AS u
    WHERE NOT ((SELECT filled FROM crowded)
               AND EXISTS (SELECT 1 FROM head_keys AS hk
                           WHERE hk.key = u.key AND hk.n >= %(key_cap)s))
    LIMIT %(limit)s
),
beyond AS (
    SELECT p.*
    FROM keys AS k
    CROSS JOIN LATERAL (
        SELECT o.id, o.message_id, o.topic, o.key, o.payload, o.headers, o.created_at,
               o.available_at, o.attempts,
               coalesce(octet_length(o.payload), 0) + coalesce(octet_length(o.headers::text), 0)
           + coalesce(octet_length(o.key), 0) AS size,
               (o.next_attempt_at IS NULL OR o.next_attempt_at <= now())
               AND (o.key IS NULL OR o.key <> ALL(%(held)s::text[]))
               AND NOT EXISTS (
                   SELECT 1
                   FROM outbox AS blocker
                   WHERE blocker.key = o.key
                     AND blocker.id < o.id
                     AND blocker.sent_at IS NULL
                     AND blocker.dead_lettered_at IS NULL
                     AND blocker.next_attempt_at IS NOT NULL
                     AND blocker.next_attempt_at > now()
               )
               AND NOT EXISTS (
                   SELECT 1
                   FROM outbox AS scheduled
                   WHERE scheduled.key = o.key
                     AND scheduled.id < o.id
                     AND scheduled.sent_at IS NULL
                     AND scheduled.dead_lettered_at IS NULL
                     AND scheduled.available_at IS NOT NULL
                     AND scheduled.promoted_at IS NULL
               ) AS ready
        FROM outbox AS o
        -- The key's rows after the head: "key >= k AND key <= k", ordered by (key, id),
        -- and not "key = k" ordered by id. With equality the planner may walk
        -- outbox_due_idx in id order and filter on the key (it did, when the
        -- statistics saw one key), reading a hot key's whole backlog to find a rare
        -- key's rows. This way only outbox_due_key_idx yields the order without reading
        -- every candidate row first; "id > last head id" is checked in the index.
        WHERE o.key >= k.key
          AND o.key <= k.key
          AND o.id > (SELECT last_id FROM crowded)
          AND o.sent_at IS NULL
          AND o.dead_lettered_at IS NULL
          AND (o.available_at IS NULL OR o.promoted_at IS NOT NULL)
          AND o.id <> ALL(%(in_flight)s::bigint[])
        ORDER BY o.key, o.id
        LIMIT (SELECT greatest(1, %(limit)s / count(*)) FROM keys)
    ) AS p
    UNION ALL
    (SELECT o.id, o.message_id, o.topic, o.key, o.payload, o.headers, o.created_at,
            o.available_at, o.attempts,
            coalesce(octet_length(o.payload), 0) + coalesce(octet_length(o.headers::text), 0)
            + coalesce(octet_length(o.key), 0),
            o.next_attempt_at IS NULL OR o.next_attempt_at <= now()
     FROM outbox AS o
     WHERE (SELECT yes FROM crowded)
       AND o.key IS NULL
       AND o.id > (SELECT last_id FROM crowded)
       AND o.sent_at IS NULL
       AND o.dead_lettered_at IS NULL
       AND (o.available_at IS NULL OR o.promoted_at IS NOT NULL)
       AND o.id <> ALL(%(in_flight)s::bigint[])
       AND (%(shards)s::integer = 1 OR outbox_shard(o.key, o.id, %(shards)s::integer) = %(shard)s::integer)
     ORDER BY o.key, o.id  -- the (key, id) order of outbox_due_key_idx: see above
     LIMIT %(limit)s)
),
ranked AS (
    -- place: 1 for a key's first ready row, 2 for its second, ...; rows without a key
    -- have no order to keep and are each their own first.
    SELECT pool.*,
           CASE WHEN pool.key IS NULL THEN 1
                ELSE row_number() OVER (PARTITION BY pool.key COLLATE "C" ORDER BY pool.id)
           END AS place
    FROM (SELECT * FROM head WHERE ready
          UNION ALL
          SELECT * FROM beyond WHERE ready) AS pool
),
chosen AS (
    SELECT r.*
    FROM ranked AS r
    WHERE %(fill)s OR r.place <= %(key_cap)s
    ORDER BY r.place > %(key_cap)s, r.id
    LIMIT %(limit)s
),
kept AS (
    -- The byte bound cuts in (place, id) order: every key's first row before any key's
    -- second, so one key's large rows cannot take the whole budget; each key still
    -- keeps a prefix of its rows. The first row goes even if larger.
    SELECT w.*
    FROM (SELECT c.*, sum(c.carried) OVER (ORDER BY c.place, c.id) AS bytes
          FROM (SELECT chosen.*,
                       CASE WHEN chosen.size > %(message_max)s::bigint THEN 0
                            ELSE chosen.size END AS carried
                FROM chosen) AS c) AS w
    WHERE w.bytes <= %(max_bytes)s OR w.bytes = w.carried
)
SELECT c.id,
       coalesce(c.message_id::text, '') AS message_id,
       coalesce(c.topic, '') AS topic,
       c.key,
       CASE WHEN c.size <= %(message_max)s::bigint THEN c.payload END AS payload,
       CASE WHEN c.size <= %(message_max)s::bigint AND jsonb_typeof(c.headers) = 'object' THEN
           (SELECT array_agg(pair.text ORDER BY header.n, pair.n)
            FROM jsonb_each_text(c.headers) WITH ORDINALITY AS header (key, value, n)
            CROSS JOIN LATERAL (VALUES (1, header.key), (2, header.value)) AS pair (n, text)
            WHERE header.value IS NOT NULL
              AND lower(header.key) NOT IN ('message-id', 'created-at'))
       END AS headers,
       -- Why the row cannot be sent as it is (it is dead-lettered with this reason): too
       -- large to load, a column an own table left NULL, or headers that are no object
       -- of scalars.
       CASE WHEN c.size > %(message_max)s::bigint THEN
                'the row holds ' || c.size || ' bytes of payload, headers and key, over'
                || ' RELAY_MESSAGE_MAX_BYTES (' || %(message_max)s::bigint || ')'
            WHEN c.topic IS NULL THEN 'topic is NULL'
            WHEN c.message_id IS NULL THEN
                'message_id is NULL, or no id a header can carry (1-255 visible ASCII'
                || ' characters)'
            WHEN c.created_at IS NULL THEN 'created_at is NULL'
            WHEN c.headers IS NULL OR jsonb_typeof(c.headers) = 'null' THEN NULL
            WHEN jsonb_typeof(c.headers) = 'string' THEN
                'headers must be a JSON object, got string: ' || left(c.headers #>> '{}', 200)
            WHEN jsonb_typeof(c.headers) <> 'object' THEN
                'headers must be a JSON object, got ' || jsonb_typeof(c.headers)
            ELSE (SELECT 'header ' || to_jsonb(header.key)::text
                         || ' must be a string or scalar, got ' || jsonb_typeof(header.value)
                  FROM jsonb_each(c.headers) AS header
                  WHERE jsonb_typeof(header.value) IN ('object', 'array')
                  LIMIT 1)
       END AS header_error,
       coalesce(to_char(c.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'), '')
           AS created_at,
       coalesce(extract(epoch FROM greatest(c.created_at, c.available_at)),
                extract(epoch FROM now()))::float8 AS due_epoch,
       c.attempts,
       true AS ready,
       true AS within,
       NULL::text AS walked_to
FROM kept AS c
UNION ALL
-- Last, a row of its own: where the next fetch's round over keys starts (%(after_key)s):
-- after the last key of this round that got rows, so keys it reached but had no room
-- for come first next time; after the whole round if none got rows (all held back); or
-- NULL, from the start, when this round went all the way round.
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       CASE WHEN (SELECT count(*) FROM keys) = %(limit)s
            THEN coalesce((SELECT k.key
                           FROM keys AS k
                           WHERE EXISTS (SELECT 1 FROM kept AS c WHERE c.key = k.key)
                           ORDER BY k.walk DESC
                           LIMIT 1),
                          (SELECT k.key FROM keys AS k ORDER BY k.walk DESC LIMIT 1))
       END
ORDER BY id NULLS LAST;

-- name: promote_due
-- Scheduled delivery (migration 0008): let up to %(limit)s scheduled rows whose
-- available_at has passed (database clock) into the drain, soonest due first, by
-- setting promoted_at: from then on they are ordinary unsent rows, in their id's place.
-- One descent of outbox_scheduled_idx finds them, or that there are none. Rows another
-- session has locked wait for the next pass. Needs no fence: letting a due row in is
-- right whoever does it, and a deposed leader's promotion only saves the next one the
-- work. With shards, this shard's rows only. Also returns in how many seconds the next
-- scheduled row is due (NULL: none), so the loop knows when to look again: of any shard,
-- one probe (filtering on this shard would walk every other shard's schedule, a cost
-- that grows with it); at worst a cheap pass that finds nothing. The wait is a
-- difference of epochs: a row scheduled at 'infinity' is never due, and fails nothing.
WITH due AS (
    SELECT o.id
    FROM outbox AS o
    WHERE o.sent_at IS NULL
      AND o.dead_lettered_at IS NULL
      AND o.available_at IS NOT NULL
      AND o.promoted_at IS NULL
      AND o.available_at <= now()
      AND (%(shards)s::integer = 1 OR outbox_shard(o.key, o.id, %(shards)s::integer) = %(shard)s::integer)
    ORDER BY o.available_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
promoted AS (
    UPDATE outbox AS o
    SET promoted_at = now()
    FROM due
    WHERE o.id = due.id
    RETURNING o.id
)
SELECT (SELECT count(*) FROM promoted) AS promoted,
       (SELECT (extract(epoch FROM o.available_at) - extract(epoch FROM now()))::float8
          FROM outbox AS o
         WHERE o.sent_at IS NULL
           AND o.dead_lettered_at IS NULL
           AND o.available_at IS NOT NULL
           AND o.promoted_at IS NULL
           AND o.available_at > now()
         ORDER BY o.available_at
         LIMIT 1) AS next_due_in_seconds;

-- name: settle_delete_sent
-- The usual settle, every row of the batch acknowledged: lease_renew then delete_sent,
-- as ONE statement: one round trip, no transaction left open between them. The rows
-- are touched only if the fence held (the EXISTS runs the fence first, once); no row
-- back means a newer holder exists and nothing was written. The fence is lease_renew's
-- UPDATE, word for word. (Two statements, not one with a switch: a DELETE anywhere in
-- it would need the DELETE privilege in retention mode too.)
WITH fence AS (
    UPDATE leases
    SET expires_at = now() + make_interval(secs => %(ttl)s),
        renewed_at = now(),
        updated_at = now()
    WHERE name = %(name)s
      AND holder = %(holder)s
      AND epoch = %(epoch)s
      AND released_at IS NULL
    RETURNING epoch, clock_timestamp() AS at
),
settled AS (
    DELETE FROM outbox
    WHERE id = ANY(%(ids)s::bigint[])
      AND EXISTS (SELECT FROM fence)
)
SELECT epoch, at FROM fence;

-- name: settle_mark_sent
-- settle_delete_sent for retention mode: lease_renew then mark_sent, as one statement.
WITH fence AS (
    UPDATE leases
    SET expires_at = now() + make_interval(secs => %(ttl)s),
        renewed_at = now(),
        updated_at = now()
    WHERE name = %(name)s
      AND holder = %(holder)s
      AND epoch = %(epoch)s
      AND released_at IS NULL
    RETURNING epoch, clock_timestamp() AS at
),
settled AS (
    UPDATE outbox
    SET sent_at = now(),
        next_attempt_at = NULL
    WHERE id = ANY(%(ids)s::bigint[])
      AND sent_at IS NULL
      AND EXISTS (SELECT FROM fence)
)
SELECT epoch, at FROM fence;

-- name: mark_sent
-- Acknowledged rows, kept for RELAY_RETENTION_SECONDS (retention mode).
UPDATE outbox
SET sent_at = now(),
    next_attempt_at = NULL
WHERE id = ANY(%(ids)s::bigint[])
  AND sent_at IS NULL;

-- name: delete_sent
-- Acknowledged rows, deleted at once (default: no history to bloat).
DELETE FROM outbox
WHERE id = ANY(%(ids)s::bigint[]);

-- name: record_failures
-- Transient failures: count the attempt and schedule the next one.
UPDATE outbox AS o
SET attempts        = o.attempts + 1,
    next_attempt_at = now() + make_interval(secs => f.delay),
    last_error      = f.error
FROM unnest(%(ids)s::bigint[], %(delays)s::float8[], %(errors)s::text[]) AS f (id, delay, error)
WHERE o.id = f.id;

-- name: dead_letter
-- Permanent failures and rows out of attempts: out of the drain, kept with the reason.
UPDATE outbox AS o
SET attempts           = o.attempts + f.attempted,
    dead_lettered_at   = now(),
    dead_letter_reason = f.reason,
    last_error         = f.reason,
    next_attempt_at    = NULL
FROM unnest(%(ids)s::bigint[], %(attempted)s::int[], %(reasons)s::text[]) AS f (id, attempted, reason)
WHERE o.id = f.id;

-- name: purge_sent
-- Retention: delete one small batch of rows sent before the cutoff, oldest sent first,
-- through outbox_sent_idx: finding them (or that there are none) is one index descent,
-- however many sent rows are kept. Small batches keep locks and WAL bursts short; call
-- repeatedly until it deletes fewer than the limit. Rows another session has locked
-- are skipped, not waited for.
DELETE FROM outbox
WHERE id IN (
    SELECT id
    FROM outbox
    WHERE sent_at IS NOT NULL
      AND sent_at < now() - make_interval(secs => %(older_than)s)
    ORDER BY sent_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
);

------------------------------------------------------------------------------------
-- Operations (status, dead letters)
------------------------------------------------------------------------------------

-- name: lag_sample
-- Backlog and lag for the gauges and `relay status`, bounded so it stays cheap on a huge
-- outbox (README "Lag metrics: cost"): counts stop at the cap; the oldest unsent row is
-- the lowest id in outbox_due_idx (one index probe); "blocked" counts, among at most
-- cap unsent rows from the first failing one (one probe of outbox_failing_rows_idx), the
-- rows that have failed (next_attempt_at set) and the later rows of their key, which
-- wait behind them: at most cap probes of outbox_backoff_idx, however many rows fail.
-- Scheduled rows (migration 0008) are not lag until due: "unsent" and the oldest age
-- count the rows due, let in or not yet (an age counts from available_at, if later than
-- created_at); rows not due yet are counted apart, with when the next one is due. The
-- scheduled rows are read through outbox_scheduled_idx: counts stop at the cap, the
-- oldest and next due are one probe each. Once promoted, a scheduled row sits in its
-- id's place, so the lowest id is no longer always the longest wait: the oldest age is
-- the longest wait among the first %(age_window)s rows (a few heap reads, not a walk of
-- the backlog); a longer wait hidden behind more promoted rows than that is missed.
-- Ages are differences of epochs, not of timestamps: a row the app stamped 'infinity'
-- or '-infinity' gives an age of 0 or +Infinity instead of failing every sample.
SELECT
    least(%(cap)s,
          (SELECT count(*)
             FROM (SELECT 1 FROM outbox
                    WHERE sent_at IS NULL AND dead_lettered_at IS NULL
                      AND (available_at IS NULL OR promoted_at IS NOT NULL)
                    LIMIT %(cap)s) AS unsent_rows)
          + (SELECT count(*)  -- due, not let in yet (no leader, or between its passes)
               FROM (SELECT 1 FROM outbox
                      WHERE sent_at IS NULL AND dead_lettered_at IS NULL
                        AND available_at IS NOT NULL AND promoted_at IS NULL
                        AND available_at <= now()
                      LIMIT %(cap)s) AS overdue_rows))
        AS unsent,
    greatest(0,
             (SELECT extract(epoch FROM now()) - extract(epoch FROM min(greatest(head.created_at, head.available_at)))
                FROM (SELECT created_at, available_at
                        FROM outbox
                       WHERE sent_at IS NULL AND dead_lettered_at IS NULL
                         AND (available_at IS NULL OR promoted_at IS NOT NULL)
                       ORDER BY id
                       LIMIT %(age_window)s) AS head),
             (SELECT extract(epoch FROM now()) - extract(epoch FROM min(available_at))
                FROM outbox
               WHERE sent_at IS NULL AND dead_lettered_at IS NULL
                 AND available_at IS NOT NULL AND promoted_at IS NULL))::float8
        AS oldest_unsent_age_seconds,
    (SELECT count(*)
       FROM (SELECT o.id, o.key, o.next_attempt_at
               FROM outbox AS o
              WHERE o.sent_at IS NULL AND o.dead_lettered_at IS NULL
                AND (o.available_at IS NULL OR o.promoted_at IS NOT NULL)
                AND o.id >= (SELECT f.id FROM outbox AS f
                              WHERE f.sent_at IS NULL AND f.dead_lettered_at IS NULL
                                AND f.attempts > 0  -- outbox_failing_rows_idx
                                AND f.next_attempt_at IS NOT NULL
                              ORDER BY f.id
                              LIMIT 1)
              ORDER BY o.id
              LIMIT %(cap)s) AS w
      WHERE w.next_attempt_at IS NOT NULL
         OR EXISTS (SELECT 1 FROM outbox AS f
                     WHERE f.key = w.key
                       AND f.id < w.id
                       AND f.sent_at IS NULL AND f.dead_lettered_at IS NULL
                       AND f.next_attempt_at IS NOT NULL))
        AS blocked,
    (SELECT count(*)
       FROM (SELECT 1 FROM outbox
              WHERE dead_lettered_at IS NOT NULL
              LIMIT %(cap)s) AS dead_rows)
        AS dead_lettered,
    (SELECT count(*)
       FROM (SELECT 1 FROM outbox
              WHERE sent_at IS NULL AND dead_lettered_at IS NULL
                AND available_at IS NOT NULL AND promoted_at IS NULL
                AND available_at > now()
              LIMIT %(cap)s) AS scheduled_rows)
        AS scheduled,
    (SELECT (extract(epoch FROM min(available_at)) - extract(epoch FROM now()))::float8
       FROM outbox
      WHERE sent_at IS NULL AND dead_lettered_at IS NULL
        AND available_at IS NOT NULL AND promoted_at IS NULL
        AND available_at > now())
        AS next_due_in_seconds;

-- name: lag_sample_shards
-- The backlog and oldest unsent age of each of %(shards)s shards (RELAY_SHARDS > 1):
-- one walk of that count's outbox_shards_N_due_idx per shard, each count stopping at
-- %(cap)s (the cap divided among the shards, so a sample costs what it did without
-- shards). Needs a custom plan (shard count a constant) to match the index expression.
SELECT s.shard,
    least(%(cap)s,
          (SELECT count(*)
             FROM (SELECT 1 FROM outbox AS o
                    WHERE o.sent_at IS NULL AND o.dead_lettered_at IS NULL
                      AND (o.available_at IS NULL OR o.promoted_at IS NOT NULL)
                      AND outbox_shard(o.key, o.id, %(shards)s::integer) = s.shard
                    LIMIT %(cap)s) AS unsent_rows)
          + (SELECT count(*)  -- due, not let in yet (as in lag_sample)
               FROM (SELECT 1 FROM outbox AS o
                      WHERE o.sent_at IS NULL AND o.dead_lettered_at IS NULL
                        AND o.available_at IS NOT NULL AND o.promoted_at IS NULL
                        AND o.available_at <= now()
                        AND outbox_shard(o.key, o.id, %(shards)s::integer) = s.shard
                      LIMIT %(cap)s) AS overdue_rows))
        AS unsent,
    coalesce(
        greatest(0,
                 (SELECT extract(epoch FROM now()) - extract(epoch FROM greatest(o.created_at, o.available_at))
                    FROM outbox AS o
                   WHERE o.sent_at IS NULL AND o.dead_lettered_at IS NULL
                     AND (o.available_at IS NULL OR o.promoted_at IS NOT NULL)
                     AND outbox_shard(o.key, o.id, %(shards)s::integer) = s.shard
                   ORDER BY o.id
                   LIMIT 1),
                 (SELECT extract(epoch FROM now()) - extract(epoch FROM o.available_at)
                    FROM outbox AS o
                   WHERE o.sent_at IS NULL AND o.dead_lettered_at IS NULL
                     AND o.available_at IS NOT NULL AND o.promoted_at IS NULL
                     AND o.available_at <= now()
                     AND outbox_shard(o.key, o.id, %(shards)s::integer) = s.shard
                   ORDER BY o.available_at
                   LIMIT 1))::float8,
        0) AS oldest_unsent_age_seconds
FROM generate_series(0, %(shards)s::integer - 1) AS s(shard)
ORDER BY s.shard;

-- name: lease_group_shards
-- The shard count in force for each lease group (migration 0007's table), for status.
SELECT name, shards FROM lease_groups ORDER BY name;

-- name: dead_letter_list
-- Dead-lettered rows, oldest first, optionally for one topic or key.
SELECT id, message_id, topic, key, attempts, dead_lettered_at, dead_letter_reason
FROM outbox
WHERE dead_lettered_at IS NOT NULL
  AND (%(topic)s::text IS NULL OR topic = %(topic)s::text)
  AND (%(key)s::text IS NULL OR key = %(key)s::text)
ORDER BY id
LIMIT %(limit)s;

-- name: dead_letter_requeue
-- Put dead letters back in the drain with fresh attempts. They keep their id, so they
-- are sent in their original order relative to each other.
UPDATE outbox
SET dead_lettered_at   = NULL,
    dead_letter_reason = NULL,
    attempts           = 0,
    next_attempt_at    = NULL
WHERE dead_lettered_at IS NOT NULL
  AND (%(all)s OR id = ANY(%(ids)s::bigint[]) OR key = %(key)s::text)
RETURNING id;

-- name: enqueue
-- The producer helper (relay.enqueue): what an app runs inside its own transaction.
-- id, message_id and created_at come from the column defaults.
INSERT INTO outbox (topic, key, payload, headers)
VALUES (%(topic)s, %(key)s, %(payload)s, %(headers)s)
RETURNING id, message_id;

-- name: enqueue_notify
-- enqueue, plus a NOTIFY on %(channel)s (relay.enqueue(notify=...)): delivered to the
-- listening relays when the app's transaction commits, never if it rolls back; several
-- in one transaction arrive as one. NOTIFY serialises committing transactions on a
-- database-wide lock (README "Instant wake-up" has the measured cost).
WITH added AS (
    INSERT INTO outbox (topic, key, payload, headers)
    VALUES (%(topic)s, %(key)s, %(payload)s, %(headers)s)
    RETURNING id, message_id
)
SELECT added.id, added.message_id, pg_notify(%(channel)s, '')
FROM added;

-- name: enqueue_scheduled
-- enqueue with a delivery time (relay.enqueue(available_at=... or delay=...)): the row
-- is not published before it, by the database clock (migration 0008). `delay` counts
-- from the app's transaction's start, now(). With %(channel)s, a NOTIFY as in
-- enqueue_notify (it wakes the relays at commit; the row still waits for its time).
WITH added AS (
    INSERT INTO outbox (topic, key, payload, headers, available_at)
    VALUES (%(topic)s, %(key)s, %(payload)s, %(headers)s,
            coalesce(%(available_at)s::timestamptz,
                     now() + make_interval(secs => %(delay)s::float8)))
    RETURNING id, message_id
)
SELECT added.id, added.message_id,
       CASE WHEN %(channel)s::text IS NOT NULL THEN pg_notify(%(channel)s::text, '') END
FROM added;

-- name: notify_trigger_create
-- `relay migrate --notify-trigger CHANNEL`: one NOTIFY on CHANNEL per INSERT statement
-- into the outbox, for apps that write it with plain SQL (relay.enqueue can NOTIFY by
-- itself). Statement-level: a multi-row INSERT notifies once. {channel} is a literal.
CREATE OR REPLACE FUNCTION relay_outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], '');
    RETURN NULL;
END
$$;
CREATE OR REPLACE TRIGGER outbox_notify
    AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION relay_outbox_notify({channel});

-- name: notify_trigger_drop
-- `relay migrate --drop-notify-trigger`.
DROP TRIGGER IF EXISTS outbox_notify ON outbox;
DROP FUNCTION IF EXISTS relay_outbox_notify();

-- name: dead_letters_left_behind
-- Keys of just-requeued rows that still have an earlier dead letter: the requeued rows
-- will be delivered before it, out of per-key order (relay dead-letter requeue warns).
SELECT DISTINCT r.key
FROM outbox AS r
WHERE r.id = ANY(%(ids)s::bigint[])
  AND r.key IS NOT NULL
  AND EXISTS (
      SELECT 1
      FROM outbox AS d
      WHERE d.key = r.key
        AND d.id < r.id
        AND d.dead_lettered_at IS NOT NULL
  )
ORDER BY r.key;

-- name: schema_version
-- Latest applied migration, for `relay check` and `relay status`.
SELECT max(version) AS version FROM schema_migrations;

------------------------------------------------------------------------------------
-- Bring your own outbox table (relay/own_table.py, `relay migrate --own-table`)
--
-- The relay reads an existing table (RELAY_OUTBOX_TABLE) through a view named outbox in
-- a schema of its own, relay_<schema>_<table>, that renames its columns to the relay's
-- (RELAY_OUTBOX_COLUMNS); the relay's sessions put that schema first on their
-- search_path, so every statement above runs unchanged against it. The view is simple,
-- so PostgreSQL plans through it to the table's own partial indexes, and the relay's
-- UPDATEs and DELETEs reach the table's rows. The app's columns are never changed: the
-- relay's bookkeeping lives in columns of its own, relay_*. {placeholders} are
-- composed by psycopg.sql (identifiers and the column expressions the mapping names).
------------------------------------------------------------------------------------

-- name: own_table_session
-- A daemon session with RELAY_OUTBOX_TABLE: read the table's view first (then
-- own_table_view_check).
SELECT set_config('search_path',
                  quote_ident(%(schema)s) || ', ' || current_setting('search_path'),
                  false);

-- name: own_table_view_check
-- Whether the view exists, and whether it reads this table (`relay_a_b.c` and `relay_a.b_c`
-- would share a view schema). The relay refuses to start otherwise: it would find the
-- relay's own outbox further down the search_path, or another table's rows.
SELECT to_regclass(quote_ident(%(schema)s) || '.outbox') IS NOT NULL AS view_exists,
       EXISTS (SELECT 1
               FROM pg_rewrite AS r
               JOIN pg_depend AS d ON d.classid = 'pg_rewrite'::regclass AND d.objid = r.oid
               WHERE r.ev_class = to_regclass(quote_ident(%(schema)s) || '.outbox')
                 AND d.refclassid = 'pg_class'::regclass
                 AND d.refobjid = (SELECT c.oid  -- by name: no rights on its schema needed
                                   FROM pg_class AS c
                                   JOIN pg_namespace AS n ON n.oid = c.relnamespace
                                   WHERE n.nspname = split_part(%(table)s, '.', 1)
                                     AND c.relname = split_part(%(table)s, '.', 2)))
           AS view_reads_table;

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

-- name: own_table_index_drop
DROP INDEX IF EXISTS {index}

-- name: own_table_view
-- The table in the relay's layout. Columns the mapping does not name are NULL. OR
-- REPLACE keeps the grants on it; its columns keep their types whatever the mapping (the
-- message id as text), except an integer id changed for one of another width.
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

-- name: own_table_index_id
-- The rows by id, for the settle, the failures and the purge, when no index leads with
-- the id column (relay_id, say).
CREATE INDEX IF NOT EXISTS {index} ON {table} ({id})

-- name: own_table_index_unsent
-- The drain indexes of migrations 0001-0008, on the table's own columns: unsent rows
-- that are due, in id order ({due} is `true` without an available_at column).
CREATE INDEX IF NOT EXISTS {index} ON {table} ({id})
    WHERE relay_sent_at IS NULL AND relay_dead_lettered_at IS NULL AND {due}

-- name: own_table_index_key
CREATE INDEX IF NOT EXISTS {index} ON {table} ({key}, {id})
    WHERE relay_sent_at IS NULL AND relay_dead_lettered_at IS NULL AND {due}

-- name: own_table_index_backoff
CREATE INDEX IF NOT EXISTS {index} ON {table} ({key}, {id})
    WHERE relay_sent_at IS NULL AND relay_dead_lettered_at IS NULL
      AND relay_next_attempt_at IS NOT NULL

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

-- name: own_table_index_scheduled_key
CREATE INDEX IF NOT EXISTS {index} ON {table} ({key}, {id})
    WHERE relay_sent_at IS NULL AND relay_dead_lettered_at IS NULL
      AND {available_at} IS NOT NULL AND relay_promoted_at IS NULL

------------------------------------------------------------------------------------
-- Migrations (relay/migrate.py)
------------------------------------------------------------------------------------

-- name: migrations_no_timeout
-- DDL may queue behind the application's traffic: the hot-path statement timeout
-- must not cut a migration short.
SET statement_timeout = 0;

-- name: shard_index_unsent
-- `relay migrate --shards N`: with N shards, each shard's fetch reads its own unsent
-- rows in id order from this index. {shards} is N and {index} the index's name, both
-- composed by psycopg.sql (a literal and an identifier), never pasted in as text.
-- CONCURRENTLY: the app's inserts go on while it builds.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {index}
    ON outbox (outbox_shard(key, id, {shards}), id)
    WHERE sent_at IS NULL AND dead_lettered_at IS NULL
      AND (available_at IS NULL OR promoted_at IS NOT NULL);

-- name: shard_index_keys
-- ... and walks its keys (the fair fetch) from this one.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {index}
    ON outbox (outbox_shard(key, id, {shards}), key, id)
    WHERE sent_at IS NULL AND dead_lettered_at IS NULL
      AND (available_at IS NULL OR promoted_at IS NOT NULL);

-- name: shard_index_state
-- Whether each of these indexes exists and is valid (a CONCURRENTLY build that failed
-- leaves an invalid index behind, which IF NOT EXISTS would then skip).
SELECT c.relname AS name, i.indisvalid AS valid
FROM pg_index AS i
JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE c.relname = ANY(%(names)s::text[])
  AND i.indrelid = 'outbox'::regclass;

-- name: shard_index_drop
-- An invalid leftover, dropped before it is built again.
DROP INDEX CONCURRENTLY IF EXISTS {index};

-- name: migrations_lock
-- Session advisory lock: N replicas running `relay migrate` at once apply each file once.
SELECT pg_advisory_lock(hashtext('relay.schema_migrations'));

-- name: migrations_unlock
SELECT pg_advisory_unlock(hashtext('relay.schema_migrations'));

-- name: migrations_table
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    text        PRIMARY KEY,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: migrations_applied
SELECT version, checksum FROM schema_migrations ORDER BY version;

-- name: migrations_record
INSERT INTO schema_migrations (version, checksum) VALUES (%(version)s, %(checksum)s);
