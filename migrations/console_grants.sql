-- Least-privilege grants for the operators' console (`relay console`).
--
-- Not a migration (roles are cluster-wide and named by you): run it once per database
-- after `relay migrate`, as the owner of the tables, beside migrations/grants.sql.
-- Replace `relay_console` and `relay_console_viewer` with your roles:
--
--   CREATE ROLE relay_console LOGIN PASSWORD '...';
--   CREATE ROLE relay_console_viewer LOGIN PASSWORD '...';
--
-- relay_console: the console that may requeue and discard. It reads the outbox, the
-- leases, the replicas' heartbeats and its audit; it deletes dead letters (a discard)
-- and requeues them through outbox_requeue, and appends to its audit. It never inserts
-- outbox rows of its own (a replay's come from outbox_replay, which copies only rows
-- that were sent), never changes what the app wrote, never touches a lease. (For an own
-- table, RELAY_OUTBOX_TABLE, the grants on its views are yours: docs/howto/own-tables.md.)
GRANT SELECT ON outbox, leases, lease_groups, replicas, schema_migrations TO relay_console;
GRANT SELECT, INSERT ON console_audit TO relay_console;
-- Dead letters, moved out of the outbox: read, discarded (deleted), and
-- requeued through outbox_requeue, which moves them back only.
GRANT SELECT, DELETE ON outbox_dead TO relay_console;
GRANT SELECT ON outbox_dead_letters TO relay_console;
GRANT EXECUTE ON FUNCTION outbox_requeue(bigint[], text, boolean) TO relay_console;
-- Rows scheduled for later, moved out until due: counted, and shown.
GRANT SELECT ON outbox_scheduled TO relay_console;
-- Replay: rows kept as sent copied back into the outbox as new rows,
-- and the audit entry written, through outbox_replay, which copies only rows that were
-- sent (the console still inserts no outbox row of its own).
GRANT EXECUTE ON FUNCTION outbox_replay(text, text, timestamptz, timestamptz, bigint, bigint,
                                        text, text) TO relay_console;
-- Pause and resume: shown, and changed (with the audit entry) through outbox_pause and
-- outbox_resume, which write outbox_paused_topics and console_audit only.
GRANT SELECT ON outbox_paused_topics, outbox_paused TO relay_console;
GRANT EXECUTE ON FUNCTION outbox_pause(text, text, text, text) TO relay_console;
GRANT EXECUTE ON FUNCTION outbox_resume(text, text, text) TO relay_console;

-- relay_console_viewer: a console run with RELAY_CONSOLE_READ_ONLY=true (people who
-- may look but not requeue). It reads; it cannot change a row even if asked to.
GRANT SELECT ON outbox, leases, lease_groups, replicas, schema_migrations, console_audit,
    outbox_dead, outbox_dead_letters, outbox_scheduled, outbox_paused_topics,
    outbox_paused
    TO relay_console_viewer;
