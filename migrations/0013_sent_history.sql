-- Retention without a per-row DELETE: the history of sent rows (RELAY_RETENTION_SECONDS).
--
-- In retention mode the relay settles a batch by moving its rows out of the outbox into
-- outbox_sent, in the same fenced statement (a DELETE ... RETURNING feeding an INSERT):
-- the outbox keeps only rows still to send and dead letters, as in delete mode, and its
-- indexes never see a sent row. outbox_sent has no index at all, so keeping a row costs
-- one heap insert; and it is never purged row by row. It is split into four fixed
-- generations (LIST partitions): one takes the rows sent now; the relay's purge empties
-- the oldest with one TRUNCATE and makes it the current one, once a third of the
-- retention has passed and every row in it is older than RELAY_RETENTION_SECONDS
-- (outbox_sent_generations says when each began). A row is kept for at least the
-- retention and at most about 4/3 of it. The runtime role needs INSERT on the table,
-- TRUNCATE on the generations and UPDATE on their start times (grants.sql), never DDL.
--
-- Rows of an own table (RELAY_OUTBOX_TABLE) are marked sent in that table as before,
-- and so are those a relay of an earlier release marks during a rolling upgrade; the
-- purge deletes such rows in batches (purge_sent) as before.
CREATE TABLE outbox_sent (
    generation          smallint    NOT NULL,
    id                  bigint      NOT NULL,
    message_id          uuid        NOT NULL,
    topic               text        NOT NULL,
    key                 text,
    payload             bytea,
    headers             jsonb,
    created_at          timestamptz NOT NULL,
    available_at        timestamptz,
    attempts            integer     NOT NULL,
    last_error          text,
    sent_at             timestamptz NOT NULL
) PARTITION BY LIST (generation);

CREATE TABLE outbox_sent_0 PARTITION OF outbox_sent FOR VALUES IN (0);
CREATE TABLE outbox_sent_1 PARTITION OF outbox_sent FOR VALUES IN (1);
CREATE TABLE outbox_sent_2 PARTITION OF outbox_sent FOR VALUES IN (2);
CREATE TABLE outbox_sent_3 PARTITION OF outbox_sent FOR VALUES IN (3);

COMMENT ON TABLE outbox_sent IS
    'Sent outbox rows kept for RELAY_RETENTION_SECONDS; each generation is emptied whole.';

-- When each generation began taking rows: the current one is the latest. A generation
-- that never did begins at -infinity (so the first rotations need not wait).
CREATE TABLE outbox_sent_generations (
    generation  smallint    PRIMARY KEY CHECK (generation >= 0 AND generation < 4),
    started_at  timestamptz NOT NULL
);

INSERT INTO outbox_sent_generations (generation, started_at)
VALUES (0, now()), (1, '-infinity'), (2, '-infinity'), (3, '-infinity');

COMMENT ON TABLE outbox_sent_generations IS
    'When each generation of outbox_sent began taking sent rows (the latest is current).';
