-- outbox_failing_idx again, under a predicate the drain's backoff probe cannot use.
--
-- The probe ("is an earlier row of this key waiting out a backoff?") is meant for
-- outbox_backoff_idx (key, id). outbox_failing_idx (id) had the probe's own predicate,
-- so with statistics taken while few rows were failing the planner chose it and, for
-- every row it checked, read every failing row with a lower id: 30,000 rows in backoff
-- made one fetch take 3 s. `attempts > 0` holds for exactly the same rows (a row gets a
-- next_attempt_at only with an attempt, and loses it only when sent, dead-lettered or
-- requeued with attempts = 0), but the probe does not say it, so the planner cannot
-- pick this index for it. The lag sampler, which finds the first failing row here,
-- says it.
--
-- Tiny (failing rows only), but CREATE INDEX reads the whole table: on a large, busy
-- outbox a DBA may prefer to run, outside a transaction and before this file,
--   CREATE INDEX CONCURRENTLY outbox_failing_rows_idx ON outbox (id)
--       WHERE sent_at IS NULL AND dead_lettered_at IS NULL AND attempts > 0;
-- this then only drops the old index.
-- Created before the old one is dropped: the build takes only a SHARE lock (the app's
-- writes wait, its reads go on); dropping first would hold an exclusive lock on the
-- outbox for the whole scan. Rows an operator edited by hand to next_attempt_at set
-- with attempts = 0 drain as before but are not counted by the "blocked" gauge.
CREATE INDEX IF NOT EXISTS outbox_failing_rows_idx ON outbox (id)
    WHERE sent_at IS NULL AND dead_lettered_at IS NULL AND attempts > 0;
DROP INDEX IF EXISTS outbox_failing_idx;
