-- after-rollout-of: 0018
--
-- Move the dead letters still marked in the outbox into outbox_dead (migration 0018):
-- those an earlier release marked in place, before the upgrade and, during a rolling
-- upgrade, while its replicas still held the lease. Each keeps its id, time, reason,
-- attempts and every column (outbox_dead_letter, given no attempt and no reason, keeps
-- a marked row's own); outbox_dead_letters shows the same rows before and after, so the
-- console, `relay dead-letter` and the lag gauges see no change.
--
-- The header line above makes `relay migrate` apply this file only in a run that found
-- 0018 applied by an earlier run: once every replica runs a release that moves dead
-- letters itself, none is marked in place after this. The first run after an upgrade
-- stops before this file (and says so); run `relay migrate` again once every replica
-- runs this release (a pipeline that migrates before each deploy does it at the next
-- one). A relay of the earlier release, once rolled back to, sees none of them.
--
-- One statement; it locks only the rows it moves (outbox_dead_letter_idx finds them),
-- never the table, so the app's inserts go on; a requeue of one of them meanwhile waits
-- for it, then finds the row no longer marked. An own table (RELAY_OUTBOX_TABLE) is
-- another table, left as it is: its dead letters stay marked in place.
SELECT outbox_dead_letter(coalesce(array_agg(marked.id), '{}'),
                          coalesce(array_agg(0), '{}'),
                          coalesce(array_agg(NULL::text), '{}'))
FROM (SELECT id
      FROM outbox
      WHERE dead_lettered_at IS NOT NULL
      FOR UPDATE) AS marked;
