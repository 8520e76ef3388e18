-- after-rollout-of: 0015
--
-- Retire outbox_due_key_idx (0009), and the shard indexes on whole keys
-- (outbox_shards_N_due_key_idx): this release's fetch walks keys by their hash
-- (outbox_due_key_hash_idx, 0015, and `relay migrate --shards N`'s
-- outbox_shards_N_due_key_hash_idx). They were kept, and written by every insert of
-- the app, only so that a relay of the earlier release still running during a rolling
-- upgrade would not walk the whole table.
--
-- The header line above makes `relay migrate` apply this file only in a run that found
-- 0015 applied by an earlier run: the first run after an upgrade stops before this file
-- (and says so); run `relay migrate` again once every replica runs this release (a
-- pipeline that migrates before each deploy does it at the next one).
--
-- DROP INDEX takes the table's ACCESS EXCLUSIVE lock for an instant, and must wait for
-- it behind the app's transactions, which queue behind the waiting DROP: give up after
-- a few seconds rather than stall the app (`relay migrate` fails; run it again). On a
-- busy outbox a DBA may prefer to run, outside a transaction and before this file,
--   DROP INDEX CONCURRENTLY IF EXISTS outbox_due_key_idx;
-- (and likewise each outbox_shards_N_due_key_idx): this then finds nothing to drop.
SET LOCAL lock_timeout = '5s';

DROP INDEX IF EXISTS outbox_due_key_idx;

DO $$
DECLARE
    legacy text;
BEGIN
    FOR legacy IN
        SELECT quote_ident(indexname) FROM pg_indexes
        WHERE schemaname = current_schema()
          AND tablename = 'outbox'
          AND indexname ~ '^outbox_shards_[0-9]+_due_key_idx$'
    LOOP
        EXECUTE 'DROP INDEX ' || legacy;
    END LOOP;
END
$$;
