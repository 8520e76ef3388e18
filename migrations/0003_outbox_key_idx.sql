-- Unsent rows by key, then id: lets the drain look past a key with a large backlog in
-- front (a bulk import of one customer, or a key waiting out a retry backoff with many
-- rows behind it) straight to the first rows of the other keys, one index descent per
-- key, instead of walking that backlog (README "Fetching: fair and bounded").
--
-- On a large, busy outbox a DBA may prefer to create it first, outside a transaction,
-- with CREATE INDEX CONCURRENTLY and the same definition; this then does nothing.
CREATE INDEX IF NOT EXISTS outbox_key_idx ON outbox (key, id)
    WHERE sent_at IS NULL AND dead_lettered_at IS NULL;
