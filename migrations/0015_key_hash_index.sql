-- The fair fetch's walk over keys, on a hash of the key (the write path, issue 36).
--
-- outbox_due_key_idx (0009) holds each drainable row's whole key, compared by the
-- database's collation: of the outbox's indexes, the one an app's insert pays most
-- for (uuid keys, one run: the outbox's COPY at 0.61 of a table with only a primary
-- key with it, 0.71 with this one instead). The walk needs only to find each key's
-- rows in id order, one descent per key, and never the keys' order: a 64-bit hash
-- does that in a fixed 8 bytes, compared as an integer. Two keys with one hash (a
-- chance of about 3 in 10^8 that any two of a million keys do) are walked as one:
-- their rows still go in id order, each key's prefix kept; one may wait while the
-- other has its share in a full head.
--
-- The fetch of this release reads outbox_due_key_hash_idx; a relay of the previous
-- release, still running during a rolling upgrade, reads outbox_due_key_idx, which
-- 0017 drops once every replica runs this one.
--
-- CREATE INDEX reads the whole outbox and holds a SHARE lock meanwhile: the app's
-- writes wait, its reads go on (a drained outbox is usually small). On a large, busy
-- one a DBA may prefer to run first, outside a transaction (after creating the
-- function below by hand, as written in it),
--   CREATE INDEX CONCURRENTLY outbox_due_key_hash_idx ON outbox (outbox_key_hash(key), id)
--       WHERE sent_at IS NULL AND dead_lettered_at IS NULL
--         AND (available_at IS NULL OR promoted_at IS NOT NULL);
-- this then only checks that it is valid.

-- hashtextextended is what hash partitioning uses, so PostgreSQL keeps it stable across
-- versions; NULL for a NULL key. IMMUTABLE and a plain SQL body: the planner inlines it,
-- so the fetch's outbox_key_hash(o.key) is the index's expression. Made only if absent:
-- a DBA who built the index first made it, as written here, and may be another role.
DO $$
BEGIN
    IF to_regprocedure('outbox_key_hash(text)') IS NULL THEN
        CREATE FUNCTION outbox_key_hash(key text) RETURNS bigint
            LANGUAGE sql IMMUTABLE PARALLEL SAFE
            RETURN hashtextextended(key, 0);
        COMMENT ON FUNCTION outbox_key_hash(text) IS
            'A 64-bit hash of an outbox row''s key: the fair fetch walks keys by it (NULL: no key).';
    END IF;
END
$$;

DO $$
BEGIN
    -- A CONCURRENTLY build that failed leaves an invalid index behind, which IF NOT
    -- EXISTS would take for done and the planner would never use.
    IF EXISTS (SELECT FROM pg_index AS i
               JOIN pg_class AS c ON c.oid = i.indexrelid
               WHERE i.indrelid = 'outbox'::regclass
                 AND NOT i.indisvalid
                 AND c.relname = 'outbox_due_key_hash_idx') THEN
        RAISE EXCEPTION 'invalid index outbox_due_key_hash_idx (a failed CREATE INDEX CONCURRENTLY): drop it and run relay migrate again';
    END IF;
END
$$;

-- Drainable rows by key hash, then id: the fair fetch's round over keys.
CREATE INDEX IF NOT EXISTS outbox_due_key_hash_idx ON outbox (outbox_key_hash(key), id)
    WHERE sent_at IS NULL AND dead_lettered_at IS NULL
      AND (available_at IS NULL OR promoted_at IS NOT NULL);
