-- after-rollout-of: 0021
--
-- Retire outbox_due_idx (0009), written by every insert of the app: the outbox now holds
-- only rows to send (dead letters moved out by 0018-0019, rows scheduled for later by
-- 0020-0021), so the fetch's walk of the outbox in id order, and the lag's, go by the
-- primary key and step over nothing for good: rows in backoff and in flight, as before,
-- and a row scheduled for later only until the drain's next pass moves it out.
--
-- The header line above makes `relay migrate` apply this file only in a run that found
-- 0021 applied by an earlier run: a relay of an earlier release reads this index, and
-- would walk the primary key past every dead letter and scheduled row it keeps in the
-- outbox; and by then this release's relays have moved the rows scheduled for later out
-- (0021 switched that on), so the ANALYZE at the end sees the outbox the walk will see.
-- Statistics taken while the schedule still sat in the outbox make the planner read
-- the backlog through the key index and sort it rather than walk the primary key. (Two
-- `relay migrate` runs back to back, with no pass of a relay between them, analyze the
-- outbox before the schedule is out; the drain's sessions plan with sorts and bitmap
-- scans off, which keeps the walk in id order anyway, drain.sql walk_indexes_in_order.)
--
-- DROP INDEX takes the table's ACCESS EXCLUSIVE lock for an instant, and must wait for
-- it behind the app's transactions, which queue behind the waiting DROP: give up after
-- a few seconds rather than stall the app (`relay migrate` fails; run it again). On a
-- busy outbox a DBA may prefer to run, outside a transaction and before this file,
--   DROP INDEX CONCURRENTLY IF EXISTS outbox_due_idx;
-- and this then finds nothing to drop. An own table (RELAY_OUTBOX_TABLE) keeps its
-- indexes: its dead letters and scheduled rows stay in it.
--
-- It also waits (SQLSTATE RLW01, relay/migrate.py: rolled back, applied by a later run)
-- while the outbox holds rows marked sent in place by a release from before migration
-- 0013 (retention mode), until the retention purge has deleted them: the walk in id
-- order would step over every one of them. outbox_sent_idx finds one, or none, at once.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox WHERE sent_at IS NOT NULL) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'RLW01',
            MESSAGE = 'the outbox still holds rows a release from before migration 0013'
                      ' marked sent in place; once the retention purge has deleted them'
                      ' (or relay purge --older-than SECONDS), run relay migrate again';
    END IF;
END
$$;

-- Fresh statistics for the walk by primary key (see above); before the DROP, whose lock
-- the app's inserts wait for until commit.
ANALYZE outbox;

SET LOCAL lock_timeout = '5s';

DROP INDEX IF EXISTS outbox_due_idx;
