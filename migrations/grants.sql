-- Least-privilege grants for the relay's runtime role.
--
-- Not a migration (roles are cluster-wide and named by you): run it once per database
-- after `relay migrate`, as the owner of the tables. Replace `relay` with your role.
--
--   CREATE ROLE relay LOGIN PASSWORD '...';
--
-- The relay reads unsent rows, marks them sent (UPDATE) or deletes them, and records
-- retry/dead-letter bookkeeping (UPDATE). It never inserts outbox rows.
GRANT SELECT, UPDATE, DELETE ON outbox TO relay;

-- The lease row for RELAY_LEASE_NAME (one per shard) is created on first use, hence
-- INSERT; so is its group's row, which every acquisition updates.
GRANT SELECT, INSERT, UPDATE ON leases TO relay;
GRANT SELECT, INSERT, UPDATE ON lease_groups TO relay;

-- Each replica keeps its own heartbeat row (and removes those of replicas long gone).
GRANT SELECT, INSERT, UPDATE, DELETE ON replicas TO relay;

-- `relay check` and `relay status` report the schema version.
GRANT SELECT ON schema_migrations TO relay;
