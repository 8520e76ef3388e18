-- What an app runs inside its own transaction, through the producer helper
-- (relay.enqueue, relay/producer.py), or as plain SQL from any stack (README, "Write
-- to the outbox").
-- Parameters are named, %(name)s; nothing here is built by string concatenation.

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
-- database-wide lock (docs/howto/wake-up.md, "Why it is off by default", has the measured cost).
WITH added AS (
    INSERT INTO outbox (topic, key, payload, headers)
    VALUES (%(topic)s, %(key)s, %(payload)s, %(headers)s)
    RETURNING id, message_id
)
SELECT added.id, added.message_id, pg_notify(%(channel)s, '')
FROM added;

-- name: enqueue_scheduled
-- enqueue with a delivery time (relay.enqueue(available_at=... or delay=...)): the row
-- is not published before it, by the database clock. `delay` counts
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

-- name: cancel
-- relay.cancel: take back a row scheduled for later that the drain has not let in yet,
-- wherever it waits: moved out into outbox_scheduled, or still in the
-- outbox (available_at set, promoted_at NULL: no fetch reads it). Such a row is never
-- published once this commits. A row let in, or never scheduled, may be on its way to
-- the sink already: it is left alone. The ids taken back.
-- A row the relay moved from one table to the other while this waited for its lock is
-- missed (this statement's snapshot predates the move): the helper runs it once more.
WITH parked AS (
    DELETE FROM outbox_scheduled AS s
    WHERE s.id = ANY(%(ids)s::bigint[])
    RETURNING s.id
),
waiting AS (
    DELETE FROM outbox AS o
    WHERE o.id = ANY(%(ids)s::bigint[])
      AND o.available_at IS NOT NULL
      AND o.promoted_at IS NULL
    RETURNING o.id
)
SELECT parked.id FROM parked
UNION ALL
SELECT waiting.id FROM waiting;
