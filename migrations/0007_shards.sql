-- Sharded draining (first step): the shard of a row, and leases per shard.
--
-- With N shards, a row belongs to shard outbox_shard(key, id, N): a stable hash of its
-- key (so all rows of a key share a shard and per-key order can hold), or of its id for
-- a NULL key (spread evenly). Nothing is stored in the outbox and apps change nothing:
-- the per-N indexes that let one shard's fetch read only its own rows are expression
-- indexes on this function, created for a given N by `relay migrate --shards N`
-- (see the README's "Sharding" section for the statements, to run by hand instead).
--
-- hashtextextended is what hash partitioning uses, so PostgreSQL keeps it stable across
-- versions (pg_upgrade must not move rows between hash partitions).
CREATE FUNCTION outbox_shard(key text, id bigint, shards integer) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN abs(coalesce(hashtextextended(key, 0), id) % shards)::integer;

COMMENT ON FUNCTION outbox_shard(text, bigint, integer) IS
    'The shard (0..shards-1) of an outbox row: a hash of its key, or of its id without one.';

-- A lease row per shard: `name` stays the row's key (the shard's own name, e.g.
-- `default#3/8`; `default` itself with one shard, as before), `lease_group` the lease
-- it is a shard of (NULL: the row is its own group), `shards` the shard count it was
-- made for and `shard` which one it is.
ALTER TABLE leases
    ADD COLUMN lease_group text,
    ADD COLUMN shards      integer NOT NULL DEFAULT 1 CHECK (shards >= 1),
    ADD COLUMN shard       integer NOT NULL DEFAULT 0 CHECK (shard >= 0 AND shard < shards);

-- One row per lease group: the shard count its replicas drain with now. Every lease
-- acquisition of the group updates this row first, so acquisitions of one group are
-- serialized (under REPEATABLE READ a concurrent one fails with 40001), and the count
-- changes only when no lease of the old count is live; the change fences every lease of
-- the old count (epoch + 1), so a paused holder of one can never settle again. Two
-- shard counts never drain one outbox at once: per-key order survives a change of N.
CREATE TABLE lease_groups (
    name         text        PRIMARY KEY,
    shards       integer     NOT NULL CHECK (shards >= 1),
    switched_at  timestamptz,
    claimed_at   timestamptz
);

COMMENT ON TABLE lease_groups IS
    'Per lease name: the shard count in force; every acquisition passes through its row.';
