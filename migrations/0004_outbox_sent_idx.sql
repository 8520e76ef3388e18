-- Sent rows kept for retention (RELAY_RETENTION_SECONDS > 0), oldest first: the purge
-- finds the rows past their retention, and learns that there are none, with one index
-- descent, however many sent rows are kept. Empty in the default (delete) mode.
--
-- On a large, busy outbox a DBA may prefer to create it first, outside a transaction,
-- with CREATE INDEX CONCURRENTLY and the same definition; this then does nothing.
CREATE INDEX IF NOT EXISTS outbox_sent_idx ON outbox (sent_at)
    WHERE sent_at IS NOT NULL;
