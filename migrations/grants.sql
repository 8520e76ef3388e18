-- Least-privilege grants for the relay's runtime role.
--
-- Not a migration (roles are cluster-wide and named by you): run it once per database
-- after `relay migrate`, as the owner of the tables. Replace `relay` with your role.
--
--   CREATE ROLE relay LOGIN PASSWORD '...';
--
-- The relay reads unsent rows, deletes them once sent, and writes its bookkeeping: sent
-- marks (retention), attempts and the next attempt, the last error, dead letters and
-- their requeue (`relay dead-letter requeue`), scheduled rows let in (promoted_at). It
-- never inserts outbox rows, and never changes what the app wrote (topic, key,
-- payload, headers, ids, times): UPDATE reaches the bookkeeping columns only.
-- The REVOKE takes back the table-wide UPDATE that earlier versions of this file gave
-- (it must come first: revoking a table privilege revokes its column grants too).
GRANT SELECT, DELETE ON outbox TO relay;
REVOKE UPDATE ON outbox FROM relay;
GRANT UPDATE (sent_at, attempts, next_attempt_at, last_error, dead_lettered_at,
              dead_letter_reason, promoted_at)
    ON outbox TO relay;

-- Retention mode (migration 0013): a settle moves the acknowledged rows into
-- outbox_sent's current generation; the purge empties the oldest generation whole
-- (TRUNCATE of that partition, no DDL) and records when it began taking rows again.
GRANT SELECT, INSERT ON outbox_sent TO relay;
GRANT TRUNCATE ON outbox_sent_0, outbox_sent_1, outbox_sent_2, outbox_sent_3 TO relay;
GRANT SELECT, UPDATE ON outbox_sent_generations TO relay;

-- The lease row for RELAY_LEASE_NAME (one per shard) is created on first use, hence
-- INSERT; so is its group's row, which every acquisition updates.
GRANT SELECT, INSERT, UPDATE ON leases TO relay;
GRANT SELECT, INSERT, UPDATE ON lease_groups TO relay;

-- Each replica keeps its own heartbeat row (and removes those of replicas long gone).
GRANT SELECT, INSERT, UPDATE, DELETE ON replicas TO relay;

-- `relay check` and `relay status` report the schema version.
GRANT SELECT ON schema_migrations TO relay;
