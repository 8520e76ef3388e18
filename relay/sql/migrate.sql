-- What `relay migrate` runs (relay/admin/migrate.py, and relay/admin/schema_options.py for what it
-- builds on request) beside the migrations/ files themselves.
-- {placeholders} are composed by psycopg.sql (identifiers and literals), never pasted
-- in as text.
-- Parameters are named, %(name)s; nothing here is built by string concatenation.

------------------------------------------------------------------------------------
-- Migrations (relay/admin/migrate.py)
------------------------------------------------------------------------------------

-- name: migrations_no_timeout
-- DDL may queue behind the application's traffic: the hot-path statement timeout
-- must not cut a migration short.
SET statement_timeout = 0;

-- name: migrations_lock
-- Session advisory lock: N replicas running `relay migrate` at once apply each file once.
SELECT pg_advisory_lock(hashtext('relay.schema_migrations'));

-- name: migrations_unlock
SELECT pg_advisory_unlock(hashtext('relay.schema_migrations'));

-- name: migrations_table
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    text        PRIMARY KEY,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: migrations_applied
SELECT version, checksum FROM schema_migrations ORDER BY version;

-- name: migrations_record
INSERT INTO schema_migrations (version, checksum) VALUES (%(version)s, %(checksum)s);

------------------------------------------------------------------------------------
-- Indexes on request (relay/admin/schema_options.py): `relay migrate --shards N`, the key
-- index's `--with-key-index` / `--without-key-index`, `--fairness-group`
------------------------------------------------------------------------------------

-- name: shard_index_unsent
-- `relay migrate --shards N`: with N shards, each shard's fetch reads its own unsent
-- rows in id order from this index. {shards} is N and {index} the index's name, both
-- composed by psycopg.sql (a literal and an identifier), never pasted in as text.
-- CONCURRENTLY: the app's inserts go on while it builds.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {index}
    ON outbox (outbox_shard(key, id, {shards}), id)
    WHERE (available_at IS NULL OR promoted_at IS NOT NULL);

-- name: shard_index_keys
-- ... and walks its keys (the fair fetch, by their hash) from this one.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {index}
    ON outbox (outbox_shard(key, id, {shards}), outbox_key_hash(key), id)
    WHERE (available_at IS NULL OR promoted_at IS NOT NULL);

-- name: fairness_index
-- `relay migrate --fairness-group SPEC [--shards N]`: the round over fairness groups
-- (RELAY_FAIRNESS_GROUP) walks the groups, and each group's rows in id order, from this
-- index. {kind} and {arg} are the grouping's (outbox_fairness_group's), {shards} N (1: no shard
-- column), {index} the name; all composed by psycopg.sql. With one shard the shard
-- column is left out: the fetch's expression then folds to the group alone.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {index}
    ON outbox ({shard_column} outbox_fairness_group(key, headers, {kind}, {arg}), id)
    WHERE (available_at IS NULL OR promoted_at IS NOT NULL);

-- name: fairness_index_comment
COMMENT ON INDEX {index} IS {comment};

-- name: shard_index_state
-- Whether each of these indexes exists and is valid (a CONCURRENTLY build that failed
-- leaves an invalid index behind, which IF NOT EXISTS would then skip).
SELECT c.relname AS name, i.indisvalid AS valid
FROM pg_index AS i
JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE c.relname = ANY(%(names)s::text[])
  AND i.indrelid = 'outbox'::regclass;

-- name: key_index
-- `relay migrate --with-key-index`: the fair fetch's key index as 0100_schema.sql builds
-- it, again (`--without-key-index` drops it, with shard_index_drop). CONCURRENTLY: the
-- app's inserts go on while it builds.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {index}
    ON outbox (outbox_key_hash(key), id)
    WHERE (available_at IS NULL OR promoted_at IS NOT NULL);

-- name: shard_key_indexes
-- Every shard count's key index, for `relay migrate --without-key-index` to drop.
SELECT c.relname AS name
FROM pg_index AS i
JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE i.indrelid = 'outbox'::regclass
  AND c.relname ~ '^outbox_shards_[0-9]+_due_key_hash_idx$';

-- name: shard_index_drop
-- An invalid leftover, dropped before it is built again; or an index no longer wanted.
DROP INDEX CONCURRENTLY IF EXISTS {index};

------------------------------------------------------------------------------------
-- NOTIFY trigger (`relay migrate --notify-trigger`)
------------------------------------------------------------------------------------

-- name: notify_trigger_create
-- `relay migrate --notify-trigger CHANNEL`: one NOTIFY on CHANNEL per INSERT statement
-- into the outbox, for apps that write it with plain SQL (relay.enqueue can NOTIFY by
-- itself). Statement-level: a multi-row INSERT notifies once. {channel} is a literal.
CREATE OR REPLACE FUNCTION relay_outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], '');
    RETURN NULL;
END
$$;
CREATE OR REPLACE TRIGGER outbox_notify
    AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION relay_outbox_notify({channel});

-- name: notify_trigger_drop
-- `relay migrate --drop-notify-trigger`.
DROP TRIGGER IF EXISTS outbox_notify ON outbox;
DROP FUNCTION IF EXISTS relay_outbox_notify();
