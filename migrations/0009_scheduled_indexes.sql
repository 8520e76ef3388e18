-- Scheduled delivery's indexes (columns: 0008).
--
-- outbox_due_idx and outbox_due_key_idx are the drain's indexes without the scheduled
-- rows not yet due; the fetch and the lag sample read them. outbox_unsent_idx and
-- outbox_key_idx stay for now: a relay of the previous release, still running during a
-- rolling upgrade (or after a rollback), reads only them, and without them would walk
-- the whole table. A later release drops them.
--
-- CREATE INDEX reads the whole outbox and holds a SHARE lock meanwhile: the app's
-- writes wait, its reads go on (a drained outbox is usually small). On a large, busy one
-- a DBA may prefer to run first, outside a transaction (after 0008, or after adding its
-- two columns by hand with the same ALTER),
--   CREATE INDEX CONCURRENTLY outbox_due_idx ON outbox (id)
--       WHERE sent_at IS NULL AND dead_lettered_at IS NULL
--         AND (available_at IS NULL OR promoted_at IS NOT NULL);
-- and likewise each index below; this then only checks that they are valid.
DO $$
DECLARE
    broken text;
BEGIN
    -- A CONCURRENTLY build that failed leaves an invalid index behind, which IF NOT
    -- EXISTS would take for done and the planner would never use.
    SELECT string_agg(c.relname, ', ') INTO broken
    FROM pg_index AS i
    JOIN pg_class AS c ON c.oid = i.indexrelid
    WHERE i.indrelid = 'outbox'::regclass
      AND NOT i.indisvalid
      AND c.relname IN ('outbox_due_idx', 'outbox_due_key_idx',
                        'outbox_scheduled_idx', 'outbox_scheduled_key_idx');
    IF broken IS NOT NULL THEN
        RAISE EXCEPTION 'invalid index(es) % (a failed CREATE INDEX CONCURRENTLY): drop them and run relay migrate again', broken;
    END IF;
END
$$;

-- Unsent, live rows that are due, in id order: the fetch's head.
CREATE INDEX IF NOT EXISTS outbox_due_idx ON outbox (id)
    WHERE sent_at IS NULL AND dead_lettered_at IS NULL
      AND (available_at IS NULL OR promoted_at IS NOT NULL);

-- ... by key: the fair fetch's walk over keys (what outbox_key_idx was, 0003).
CREATE INDEX IF NOT EXISTS outbox_due_key_idx ON outbox (key, id)
    WHERE sent_at IS NULL AND dead_lettered_at IS NULL
      AND (available_at IS NULL OR promoted_at IS NOT NULL);

-- Scheduled rows not yet let in, by due time: the leader finds the due ones (and when
-- the next one is due) with one descent, however many rows are scheduled. Tiny without
-- a schedule.
CREATE INDEX IF NOT EXISTS outbox_scheduled_idx ON outbox (available_at)
    WHERE sent_at IS NULL AND dead_lettered_at IS NULL
      AND available_at IS NOT NULL AND promoted_at IS NULL;

-- ... by key: the fetch's per-row probe "is an earlier row of my key scheduled?".
CREATE INDEX IF NOT EXISTS outbox_scheduled_key_idx ON outbox (key, id)
    WHERE sent_at IS NULL AND dead_lettered_at IS NULL
      AND available_at IS NOT NULL AND promoted_at IS NULL;
