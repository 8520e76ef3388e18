-- Every statement the relay runs, by name. Python asks for them as QUERIES.<name>.
-- Parameters are named: %(name)s. Nothing here is built by string concatenation.

-- name: disable_jit
-- For the lag sampler's session: JIT compiling a millisecond query costs more than it saves.
SELECT set_config('jit', 'off', false);

-- name: set_session_timeouts
-- Bound every statement, lock wait and idle transaction of a relay session, so a stuck
-- relay can never hold a lock on the lease row or the outbox for long.
SELECT set_config('statement_timeout', %(statement_timeout)s, false),
       set_config('lock_timeout', %(lock_timeout)s, false),
       set_config('idle_in_transaction_session_timeout', %(idle_timeout)s, false),
       set_config('application_name', %(application_name)s, false);

------------------------------------------------------------------------------------
-- Lease (see relay/lease.py for the protocol)
------------------------------------------------------------------------------------

-- name: lease_ensure
-- Create the lease row on first use; expired and unheld, epoch 0.
INSERT INTO leases (name) VALUES (%(name)s)
ON CONFLICT (name) DO NOTHING;

-- name: lease_read
-- First half of the compare-and-swap, under REPEATABLE READ. Time is the database's.
SELECT holder, epoch, expires_at > now() AS live
FROM leases
WHERE name = %(name)s;

-- name: lease_take
-- Second half of the CAS: succeeds only if nobody changed the epoch since lease_read.
-- Under REPEATABLE READ a concurrent winner makes this fail with SQLSTATE 40001 or
-- update zero rows; the caller treats both as a lost race. `at` is read while we hold
-- the lease row's lock, so acquisitions and settles (lease_fence) are ordered by it on
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
-- Extend the lease we hold. Matches no row once someone else took it (fencing).
UPDATE leases
SET expires_at = now() + make_interval(secs => %(ttl)s),
    renewed_at = now(),
    updated_at = now()
WHERE name = %(name)s
  AND holder = %(holder)s
  AND epoch = %(epoch)s
RETURNING epoch;

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
SELECT name, holder, epoch, expires_at, expires_at > now() AS live,
       extract(epoch FROM expires_at - now())::float8 AS seconds_to_expiry,
       acquired_at, renewed_at, released_at
FROM leases
ORDER BY name;

------------------------------------------------------------------------------------
-- Draining
------------------------------------------------------------------------------------

-- name: force_custom_plans
-- For the drain session: plan fetch_batch with its actual in-flight ids, so the
-- exclusion is a hashed lookup, not a scan of the array for every row.
SELECT set_config('plan_cache_mode', 'force_custom_plan', false);

-- name: fetch_batch
-- The next unsent rows in id order, through outbox_unsent_idx. No "id > last seen"
-- cursor: a row that commits late with a lower id is still found. A row of a key whose
-- earlier row is waiting out a retry backoff is skipped, so that key keeps its order
-- while other keys flow. The message id and the created-at header come as text made
-- here, in C, rather than as Python uuid and datetime objects the relay would only turn
-- back into text (a fifth of the relay's per-row work); created-at is RFC 3339 in UTC
-- whatever the session's TimeZone.
SELECT o.id,
       o.message_id::text,
       o.topic,
       o.key,
       o.payload,
       o.headers,
       to_char(o.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') AS created_at,
       extract(epoch FROM o.created_at)::float8 AS created_epoch,
       o.attempts
FROM outbox AS o
WHERE o.sent_at IS NULL
  AND o.dead_lettered_at IS NULL
  AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= now())
  -- The batch published just before, still being settled on another session. The
  -- parameter is sent untyped, so the cast makes it a bigint[] constant of the custom
  -- plan and the test is a hash lookup; typed as text it could not be folded.
  AND o.id <> ALL(%(in_flight)s::bigint[])
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
ORDER BY o.id
LIMIT %(limit)s;

-- name: lease_fence
-- First statement of every transaction that settles rows: renews our lease only if we
-- still hold it at our epoch. Zero rows means a newer holder exists: roll back.
UPDATE leases
SET expires_at = now() + make_interval(secs => %(ttl)s),
    renewed_at = now(),
    updated_at = now()
WHERE name = %(name)s
  AND holder = %(holder)s
  AND epoch = %(epoch)s
RETURNING epoch, clock_timestamp() AS at;

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
-- Retention: delete one small batch of rows sent before the cutoff. Small batches keep
-- locks and WAL bursts short; call repeatedly until it deletes nothing.
DELETE FROM outbox
WHERE id IN (
    SELECT id
    FROM outbox
    WHERE sent_at IS NOT NULL
      AND sent_at < now() - make_interval(secs => %(older_than)s)
    ORDER BY id
    LIMIT %(limit)s
);

------------------------------------------------------------------------------------
-- Operations (status, dead letters)
------------------------------------------------------------------------------------

-- name: lag_sample
-- Backlog and lag for the gauges and `relay status`, bounded so it stays cheap on a huge
-- outbox (README "Lag metrics: cost"): counts stop at the cap; the oldest unsent row is
-- the lowest id in outbox_unsent_idx (one index probe); "blocked" counts, among at most
-- cap unsent rows from the first failing one (one probe of outbox_failing_idx), the
-- rows that have failed (next_attempt_at set) and the later rows of their key, which
-- wait behind them: at most cap probes of outbox_backoff_idx, however many rows fail.
SELECT
    (SELECT count(*)
       FROM (SELECT 1 FROM outbox
              WHERE sent_at IS NULL AND dead_lettered_at IS NULL
              LIMIT %(cap)s) AS unsent_rows)
        AS unsent,
    (SELECT greatest(0, extract(epoch FROM now() - min(created_at)))::float8
       FROM (SELECT created_at FROM outbox
              WHERE sent_at IS NULL AND dead_lettered_at IS NULL
              ORDER BY id
              LIMIT 1) AS oldest)
        AS oldest_unsent_age_seconds,
    (SELECT count(*)
       FROM (SELECT o.id, o.key, o.next_attempt_at
               FROM outbox AS o
              WHERE o.sent_at IS NULL AND o.dead_lettered_at IS NULL
                AND o.id >= (SELECT f.id FROM outbox AS f
                              WHERE f.sent_at IS NULL AND f.dead_lettered_at IS NULL
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
        AS dead_lettered;

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
-- Migrations (relay/migrate.py)
------------------------------------------------------------------------------------

-- name: migrations_no_timeout
-- DDL may queue behind the application's traffic: the hot-path statement timeout
-- must not cut a migration short.
SET statement_timeout = 0;

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
