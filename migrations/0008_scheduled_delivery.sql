-- Scheduled delivery: a row is not published before its available_at (database clock).
--
-- available_at is the app's column: NULL (the default) means now. A row written with
-- one is "scheduled": it stays out of the drain indexes until the leader finds it due
-- and sets promoted_at (relay bookkeeping, like sent_at), so a large schedule costs the
-- fetch nothing, and a scheduled row is not lag until it is due. Until then it holds
-- back the later rows of its key, as a row waiting out a retry backoff does (per-key
-- order: README "Scheduled delivery"). The app's available_at is never changed.
ALTER TABLE outbox
    ADD COLUMN available_at timestamptz,
    ADD COLUMN promoted_at  timestamptz;

COMMENT ON COLUMN outbox.available_at IS
    'Not published before this time (database clock); NULL means now. Written by the app.';
COMMENT ON COLUMN outbox.promoted_at IS
    'When the relay found this scheduled row due and let it into the drain (bookkeeping).';

-- Scheduled rows not yet due, by due time: the leader finds the due ones (and when the
-- next one is due) with one index descent, however many rows are scheduled.
CREATE INDEX outbox_scheduled_idx ON outbox (available_at)
    WHERE sent_at IS NULL AND dead_lettered_at IS NULL
      AND available_at IS NOT NULL AND promoted_at IS NULL;

-- ... and by key: the fetch's per-row probe "is an earlier row of my key scheduled?".
CREATE INDEX outbox_scheduled_key_idx ON outbox (key, id)
    WHERE sent_at IS NULL AND dead_lettered_at IS NULL
      AND available_at IS NOT NULL AND promoted_at IS NULL;

-- The drain indexes again, without the rows not yet due. Built under a new name, then
-- the old one is dropped and the new one takes its name (dropping first would hold an
-- exclusive lock on the outbox for the whole build; the build takes a SHARE lock: the
-- app's writes wait, its reads go on).
--
-- On a large, busy outbox a DBA may prefer to run first, outside a transaction,
--   CREATE INDEX CONCURRENTLY outbox_unsent_v2_idx ON outbox (id)
--       WHERE sent_at IS NULL AND dead_lettered_at IS NULL
--         AND (available_at IS NULL OR promoted_at IS NOT NULL);
--   CREATE INDEX CONCURRENTLY outbox_key_v2_idx ON outbox (key, id)
--       WHERE sent_at IS NULL AND dead_lettered_at IS NULL
--         AND (available_at IS NULL OR promoted_at IS NOT NULL);
-- and the same, named <name>_v2, for each outbox_shards_N_idx / outbox_shards_N_key_idx
-- below; this then only drops and renames.
CREATE INDEX IF NOT EXISTS outbox_unsent_v2_idx ON outbox (id)
    WHERE sent_at IS NULL AND dead_lettered_at IS NULL
      AND (available_at IS NULL OR promoted_at IS NOT NULL);
DROP INDEX outbox_unsent_idx;
ALTER INDEX outbox_unsent_v2_idx RENAME TO outbox_unsent_idx;

CREATE INDEX IF NOT EXISTS outbox_key_v2_idx ON outbox (key, id)
    WHERE sent_at IS NULL AND dead_lettered_at IS NULL
      AND (available_at IS NULL OR promoted_at IS NOT NULL);
DROP INDEX IF EXISTS outbox_key_idx;
ALTER INDEX outbox_key_v2_idx RENAME TO outbox_key_idx;

-- The per-shard-count indexes `relay migrate --shards N` built, likewise, under their
-- own names (it builds new ones with this predicate).
DO $$
DECLARE
    found record;
    shards integer;
BEGIN
    FOR found IN
        SELECT c.relname AS name, substring(c.relname FROM '^outbox_shards_(\d+)_') AS n,
               c.relname LIKE '%\_key\_idx' AS keyed
        FROM pg_index AS i
        JOIN pg_class AS c ON c.oid = i.indexrelid
        WHERE i.indrelid = 'outbox'::regclass
          AND c.relname ~ '^outbox_shards_\d+_(key_)?idx$'
    LOOP
        shards := found.n::integer;
        IF found.keyed THEN
            EXECUTE format(
                'CREATE INDEX IF NOT EXISTS %I ON outbox (outbox_shard(key, id, %s), key, id)'
                ' WHERE sent_at IS NULL AND dead_lettered_at IS NULL'
                ' AND (available_at IS NULL OR promoted_at IS NOT NULL)',
                found.name || '_v2', shards);
        ELSE
            EXECUTE format(
                'CREATE INDEX IF NOT EXISTS %I ON outbox (outbox_shard(key, id, %s), id)'
                ' WHERE sent_at IS NULL AND dead_lettered_at IS NULL'
                ' AND (available_at IS NULL OR promoted_at IS NOT NULL)',
                found.name || '_v2', shards);
        END IF;
        EXECUTE format('DROP INDEX %I', found.name);
        EXECUTE format('ALTER INDEX %I RENAME TO %I', found.name || '_v2', found.name);
    END LOOP;
END
$$;
