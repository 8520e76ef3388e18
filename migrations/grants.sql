-- Least-privilege grants for the relay's runtime role.
--
-- Not a migration (roles are cluster-wide and named by you): run it once per database
-- after `relay migrate`, as the owner of the tables. Replace `relay` with your role.
--
--   CREATE ROLE relay LOGIN PASSWORD '...';
--
-- The relay reads unsent rows, deletes them once sent, and writes its bookkeeping:
-- attempts and the next attempt, the last error, scheduled rows let in (promoted_at).
-- It inserts no outbox row of its own (a requeue puts back, through outbox_requeue, only
-- rows a settle moved out; a replay copies back, through outbox_replay, only rows kept
-- as sent), and never changes what the app wrote (topic, key, payload,
-- headers, ids, times): UPDATE reaches the bookkeeping columns only.
-- The REVOKE takes back the table-wide UPDATE that earlier versions of this file gave
-- (it must come first: revoking a table privilege revokes its column grants too). On a
-- database upgraded from before 1.0, run this file once `relay migrate` has applied
-- 0024: until then relays of the previous release may still run, and they update
-- columns this file no longer names.
GRANT SELECT, DELETE ON outbox TO relay;
REVOKE UPDATE ON outbox FROM relay;
GRANT UPDATE (attempts, next_attempt_at, last_error, promoted_at) ON outbox TO relay;

-- Retention mode: a settle moves the acknowledged rows into
-- outbox_sent's current generation; the purge empties the oldest generation whole
-- (TRUNCATE of that partition, no DDL) and records when it began taking rows again.
GRANT SELECT, INSERT ON outbox_sent TO relay;
GRANT TRUNCATE ON outbox_sent_0, outbox_sent_1, outbox_sent_2, outbox_sent_3 TO relay;
GRANT SELECT, UPDATE ON outbox_sent_generations TO relay;

-- Dead letters: a settle moves the rows it gives up on into
-- outbox_dead through outbox_dead_letter, and `relay dead-letter requeue` moves them
-- back through outbox_requeue. Both run as the tables' owner and move rows only: the
-- role inserts no row of its own into either table. `relay dead-letter list` and the
-- lag gauges read outbox_dead_letters.
GRANT SELECT ON outbox_dead, outbox_dead_letters TO relay;
GRANT EXECUTE ON FUNCTION outbox_dead_letter(bigint[], integer[], text[]) TO relay;
GRANT EXECUTE ON FUNCTION outbox_requeue(bigint[], text, boolean) TO relay;

-- Replay: `relay replay` copies rows kept in outbox_sent back into the outbox as new
-- rows, and records it in console_audit, through outbox_replay, which runs as the
-- tables' owner and copies only rows that were sent: the role inserts no outbox row of
-- its own, and writes console_audit only through it.
GRANT EXECUTE ON FUNCTION outbox_replay(text, text, timestamptz, timestamptz, bigint, bigint,
                                        text, text) TO relay;

-- Paused topics: every drain reads them at least once a second, and holds their rows
-- in outbox_paused (through functions that move rows only, and that the fetch reads)
-- or parks one in place (an UPDATE of next_attempt_at); `relay pause` and `relay
-- resume` change them, and record it in console_audit, through outbox_pause and
-- outbox_resume.
GRANT SELECT ON outbox_paused_topics, outbox_paused TO relay;
GRANT EXECUTE ON FUNCTION outbox_hold_paused(text[], bigint, integer, bigint[],
                                             int8multirange, integer, integer) TO relay;
GRANT EXECUTE ON FUNCTION outbox_release_paused(integer) TO relay;
GRANT EXECUTE ON FUNCTION outbox_pause(text, text, text, text) TO relay;
GRANT EXECUTE ON FUNCTION outbox_resume(text, text, text) TO relay;

-- Scheduled rows: rows scheduled for later wait in outbox_scheduled,
-- moved out and let back in through functions that move rows only; the fetch and the
-- lag gauges read it.
GRANT SELECT ON outbox_scheduled TO relay;
GRANT EXECUTE ON FUNCTION outbox_park_scheduled(integer) TO relay;
GRANT EXECUTE ON FUNCTION outbox_let_in(integer, integer, integer) TO relay;

-- The lease row for RELAY_LEASE_NAME (one per shard) is created on first use, hence
-- INSERT; so is its group's row, which every acquisition updates.
GRANT SELECT, INSERT, UPDATE ON leases TO relay;
GRANT SELECT, INSERT, UPDATE ON lease_groups TO relay;

-- Each replica keeps its own heartbeat row (and removes those of replicas long gone).
GRANT SELECT, INSERT, UPDATE, DELETE ON replicas TO relay;

-- `relay check` and `relay status` report the schema version.
GRANT SELECT ON schema_migrations TO relay;
