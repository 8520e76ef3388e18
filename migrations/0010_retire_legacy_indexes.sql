-- after-rollout-of: 0009
--
-- Retire the indexes only relays from before scheduled delivery (0009) read:
-- outbox_unsent_idx (0001), outbox_key_idx (0003), and the shard indexes of that
-- release (outbox_shards_N_idx, outbox_shards_N_key_idx). This release's drain reads
-- outbox_due_idx and outbox_due_key_idx (0009); the two it drops here were kept, and
-- written by every insert of the app, only so that a relay of the earlier release
-- still running during a rolling upgrade would not walk the whole table.
--
-- The header line above makes `relay migrate` apply this file only in a run that found
-- 0009 applied by an earlier run: upgrading from before 0009, the first run stops
-- before this file (and says so); run `relay migrate` again once every replica runs
-- this release (a pipeline that migrates before each deploy does it at the next one).
--
-- DROP INDEX takes the table's ACCESS EXCLUSIVE lock for an instant, and must wait
-- for it behind the app's transactions, which queue behind the waiting DROP: give up
-- after a few seconds rather than stall the app (`relay migrate` fails; run it again).
-- On a busy outbox a DBA may prefer to run, outside a transaction and before this file,
--   DROP INDEX CONCURRENTLY IF EXISTS outbox_unsent_idx;
--   DROP INDEX CONCURRENTLY IF EXISTS outbox_key_idx;
-- (and likewise each outbox_shards_N_idx and outbox_shards_N_key_idx): this then only
-- finds nothing left to drop.
SET LOCAL lock_timeout = '5s';

DROP INDEX IF EXISTS outbox_unsent_idx;
DROP INDEX IF EXISTS outbox_key_idx;

DO $$
DECLARE
    legacy text;
BEGIN
    FOR legacy IN
        SELECT quote_ident(indexname) FROM pg_indexes
        WHERE schemaname = current_schema()
          AND tablename = 'outbox'
          AND indexname ~ '^outbox_shards_[0-9]+_(key_)?idx$'
    LOOP
        EXECUTE 'DROP INDEX ' || legacy;
    END LOOP;
END
$$;
