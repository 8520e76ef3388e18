-- What the elector and the presence heartbeat run (relay/lease/protocol.py, relay/store/presence.py):
-- the lease, its group, and the replicas of a lease. `relay status` reads these tables
-- with operations.sql; the drain's settles renew the lease through drain.sql.
-- Parameters are named, %(name)s; nothing here is built by string concatenation.

------------------------------------------------------------------------------------
-- Lease (see relay/lease/protocol.py for the protocol)
------------------------------------------------------------------------------------

-- name: lease_ensure
-- Create the lease row on first use, expired and unheld, epoch 0; and its group's row
-- (lease_groups), in force with this replica's shard count if it is the first.
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

------------------------------------------------------------------------------------
-- Replicas (relay/store/presence.py)
------------------------------------------------------------------------------------

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
