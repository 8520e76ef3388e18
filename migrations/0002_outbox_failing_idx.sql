-- Rows waiting out a retry backoff, by id: lets the lag sampler find the first failing
-- row with one index probe instead of walking the unsent backlog up to it. Tiny: only
-- failing rows are in it, and a healthy outbox has none.
--
-- On a large, busy outbox a DBA may prefer to create it first, outside a transaction,
-- with CREATE INDEX CONCURRENTLY and the same definition; this then does nothing.
CREATE INDEX IF NOT EXISTS outbox_failing_idx ON outbox (id)
    WHERE sent_at IS NULL AND dead_lettered_at IS NULL AND next_attempt_at IS NOT NULL;
